"""Point-to-point frames emulated with collectives, for backends without
send/recv (MLX's NCCL backend: "Send has no CUDA implementation").

Every call to send or recv is one or more *rounds*: all ranks all_gather a
fixed-size header (a frame for their next rank, or nothing), then, if any
header announces a payload, all_gather the payload bytes padded to the
round's largest. Each rank keeps what its previous rank addressed to it.
Several frames can move in one round (rank 0 sends chunk k+1 while rank 1
sends chunk k on), so ranks stay in lock-step without a central schedule:
a rank that waits in recv simply joins rounds until its frame arrives.
"""

from collections import deque
from typing import Optional, Tuple

import mlx.core as mx

from .base import Header, Op, Transport

_NOTHING = [0] * Header.SIZE


class MxCollective(Transport):
    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.prev = (self.rank - 1) % self.size
        self.inbox: deque = deque()
        self.ring_stopped = False  # the STOP frame came back to rank 0

    def _round(self, header: Optional[Header] = None, payload: Optional[mx.array] = None) -> None:
        row = mx.array(_NOTHING if header is None else header.to_array().tolist(), dtype=mx.int32)
        headers = [Header.from_array(h) for h in mx.distributed.all_gather(row[None], group=self.group)]
        sizes = [h.batch * h.length * h.width * h.payload_dtype().size if h.op else 0 for h in headers]
        incoming = headers[self.prev]
        data = None
        if max(sizes) > 0:
            buf = mx.zeros((max(sizes),), dtype=mx.uint8)
            if payload is not None:
                buf[: sizes[self.rank]] = mx.view(payload, mx.uint8).reshape(-1)
            # Every rank evaluates the gather, sender or not: collectives
            # match by order, so one skipped would pair with the next header.
            gathered = mx.distributed.all_gather(buf[None], group=self.group)
            mx.eval(gathered)
            if sizes[self.prev]:
                raw = gathered[self.prev, : sizes[self.prev]]
                data = mx.view(raw, incoming.payload_dtype()).reshape(incoming.payload_shape())
        if incoming.op:
            self.inbox.append((incoming, data))
        if headers[self.size - 1].op == Op.STOP:
            self.ring_stopped = True

    def send(self, header: Header, payload: Optional[mx.array] = None) -> None:
        self._round(header, payload)

    def recv(self) -> Tuple[Header, Optional[mx.array]]:
        while not self.inbox:
            self._round()
        return self.inbox.popleft()

    def close(self) -> None:
        """Keep joining rounds until STOP has gone all the way round, so no
        rank leaves a collective that the others still need."""
        while not self.ring_stopped:
            self._round()
