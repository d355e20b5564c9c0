"""Transport over mx.distributed point-to-point send/recv (ring, MPI, JACCL backends)."""

from typing import Optional, Tuple

import mlx.core as mx

from .base import Header, Transport


class MxPointToPoint(Transport):
    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.next = (self.rank + 1) % self.size
        self.prev = (self.rank - 1) % self.size
        self._header_like = mx.zeros((Header.SIZE,), dtype=mx.int32)

    def send(self, header: Header, payload: Optional[mx.array] = None) -> None:
        sent = mx.distributed.send(header.to_array(), self.next, group=self.group)
        if payload is not None:
            # One evaluation for both; the dependency keeps the header first.
            payload = mx.depends(payload, sent)
            sent = mx.distributed.send(payload, self.next, group=self.group)
        mx.eval(sent)

    def recv(self) -> Tuple[Header, Optional[mx.array]]:
        raw = mx.distributed.recv_like(self._header_like, self.prev, group=self.group)
        header = Header.from_array(raw)
        if not header.has_payload:
            return header, None
        payload = mx.distributed.recv(
            header.payload_shape(), header.payload_dtype(), self.prev, group=self.group
        )
        mx.eval(payload)
        return header, payload
