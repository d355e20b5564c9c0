"""Transport over mx.distributed point-to-point send/recv (ring, MPI, JACCL backends).

Every frame is one message of the fixed size (frames.py), a payload too big to ride
inline a second one. The receiver always posts the fixed size, so a decode hop costs
one send and one receive, one wait on the backend each, not a header and then a payload.
"""

import os
from typing import Optional, Tuple

import mlx.core as mx

from .base import Header, PendingFrame, Transport
from .frames import FRAME_BYTES, HEADER_BYTES, INLINE_BYTES, inline_payload, pack, payload_bytes, unpack_header
from .ring_wait import IncomingWait


class _PendingInline(PendingFrame):
    def __init__(self, frame: mx.array, shape: Tuple[int, int, int], dtype: mx.Dtype):
        self.frame = frame
        nbytes = shape[0] * shape[1] * shape[2] * dtype.size
        self.payload = mx.view(frame[HEADER_BYTES:HEADER_BYTES + nbytes], dtype).reshape(shape)

    def header(self) -> Header:
        return unpack_header(self.frame)

    def payload_as(self, header: Header) -> Optional[mx.array]:
        return inline_payload(header, self.frame) if header.has_payload else None


class MxPointToPoint(Transport):
    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.next = (self.rank + 1) % self.size
        self.prev = (self.rank - 1) % self.size
        self._frame_like = mx.zeros((FRAME_BYTES,), dtype=mx.uint8)
        # Rank 0's sends run on their own stream and are not waited for, so it
        # can post its next recv while a send is still going. Otherwise rank 0
        # blocked in a large send and the last rank blocked sending a reply to
        # rank 0 deadlock under MPI's rendezvous protocol (seen with replies
        # above its ~4 KB eager limit). Other ranks blocking in send is only
        # back-pressure: the cycle needs rank 0.
        self._send_stream = mx.new_stream(mx.cpu) if self.rank == 0 else None
        self._last_send: Optional[mx.array] = None
        self._incoming = IncomingWait.for_ring()  # None: a backend whose receive may block
        # A receive queued ahead (recv_ahead) waits inside MLX, where the ring backend spins
        # a core until the frame comes: only where every rank of the ring can have a core for
        # its computation and one more (a Mac per rank, or a host of many cores). On 2 cores
        # with 2 ranks and nothing else running it still paid (bench_decode.py --quick: ring
        # P=2 0.93x P=1, against 0.70x), but beside other work (this test suite's concurrent
        # rings) each spinning rank 0 took a core from them: the suite ran 885 s, not 650.
        self.receives_ahead = self.rank == 0 and (os.cpu_count() or 1) >= 2 * self.size

    def send(self, header: Header, payload: Optional[mx.array] = None) -> None:
        s = self._send_stream
        frame, large = pack(header, payload), payload is not None and payload.nbytes > INLINE_BYTES
        # A large payload goes second, and the frame waits for it: a computation that fails
        # (MLX could not allocate) sends nothing, and the next rank never waits for half a frame.
        sent = mx.distributed.send(mx.depends(frame, payload) if large else frame, self.next, group=self.group,
                                   stream=s)
        if large:  # the dependency keeps the frame first
            sent = mx.distributed.send(mx.depends(payload, sent), self.next, group=self.group, stream=s)
        if s is None:
            mx.eval(sent)
            return
        mx.async_eval(sent)
        self._last_send = sent

    def recv(self) -> Tuple[Header, Optional[mx.array]]:
        if self._incoming is not None:
            self._incoming.wait()  # the ring's receive would spin a core until the frame comes
        frame = mx.distributed.recv_like(self._frame_like, self.prev, group=self.group)
        header = unpack_header(frame)  # waits for the frame
        if not header.has_payload:
            return header, None
        if payload_bytes(header) <= INLINE_BYTES:
            return header, inline_payload(header, frame)
        payload = mx.distributed.recv(
            header.payload_shape(), header.payload_dtype(), self.prev, group=self.group
        )
        mx.eval(payload)
        return header, payload

    def recv_ahead(self, shape: Tuple[int, int, int], dtype: mx.Dtype) -> Optional[PendingFrame]:
        if not self.receives_ahead or shape[0] * shape[1] * shape[2] * dtype.size > INLINE_BYTES:
            return None
        return _PendingInline(mx.distributed.recv_like(self._frame_like, self.prev, group=self.group), shape, dtype)

    def close(self) -> None:
        if self._last_send is not None:  # sends on one stream finish in order
            mx.eval(self._last_send)
