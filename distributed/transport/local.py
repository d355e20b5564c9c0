"""In-process transport for single-host mode (`--stages N`): all stages in one process.

Sending from rank 0 runs the other stages' handlers in ring order, at once;
what the last one returns is what rank 0 receives next.
"""

from collections import deque
from typing import Callable, List, Optional, Tuple

import mlx.core as mx

from .base import Header, Transport

Handler = Callable[[Header, Optional[mx.array]], Optional[Tuple[Header, Optional[mx.array]]]]


class LocalRing(Transport):
    def __init__(self, handlers: List[Handler]):
        self.rank, self.size = 0, len(handlers) + 1
        self.handlers = handlers
        self.inbox: deque = deque()

    def send(self, header: Header, payload: Optional[mx.array] = None) -> None:
        frame = (header, payload)
        for handle in self.handlers:
            frame = handle(*frame)
            if frame is None:
                return
        self.inbox.append(frame)

    def recv(self) -> Tuple[Header, Optional[mx.array]]:
        if not self.inbox:
            raise RuntimeError("in-process ring: nothing to receive (no reply was requested)")
        return self.inbox.popleft()
