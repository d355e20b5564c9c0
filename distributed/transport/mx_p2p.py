"""Transport over mx.distributed point-to-point send/recv (ring, MPI, JACCL backends).

Every frame is one message of the fixed size (base.py), a payload too big to ride
inline a second one. The receiver always posts the fixed size, so a decode hop costs
one send and one receive, one wait on the backend each, not a header and then a payload.
"""

import os
from typing import Optional, Tuple

import mlx.core as mx

from .base import (FRAME_BYTES, HEADER_BYTES, INLINE_BYTES, Header, PendingFrame, Transport, inline_payload, pack,
                   payload_bytes, unpack_header)
from .ring_wait import IncomingWait


ARRIVAL_WAIT_MS = 1000  # rank 0's longest wait for a frame received ahead (see _arrival_wait_ms)


class _PendingInline(PendingFrame):
    def __init__(self, frame: mx.array, shape: Tuple[int, int, int], dtype: mx.Dtype, transport):
        self.frame, self._transport = frame, transport
        nbytes = shape[0] * shape[1] * shape[2] * dtype.size
        self.payload = mx.view(frame[HEADER_BYTES:HEADER_BYTES + nbytes], dtype).reshape(shape)

    def header(self, *also: mx.array) -> Header:
        self._transport._await_arrival()  # without spinning, until the frame is there to read
        mx.eval(self.frame, *also)
        return unpack_header(self.frame)

    def payload_as(self, header: Header) -> Optional[mx.array]:
        return self._transport.payload_after(header, self.frame)


class MxPointToPoint(Transport):
    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.next = (self.rank + 1) % self.size
        self.prev = (self.rank - 1) % self.size
        self._frame_like = mx.zeros((FRAME_BYTES,), dtype=mx.uint8)
        # Sends run on their own stream and are not waited for: a rank goes on to its next
        # frame (its receive posted, its graph built ahead) while the send is still going.
        # On rank 0 that is needed: rank 0 blocked in a large send and the last rank blocked
        # sending a reply to rank 0 deadlock under MPI's rendezvous protocol (seen with
        # replies above its ~4 KB eager limit). Sends on one stream finish in order.
        self._send_stream = mx.new_stream(mx.cpu)
        self._last_send: Optional[mx.array] = None
        self._incoming = IncomingWait.for_ring()  # None: a backend whose receive may block
        # A receive queued ahead (recv_ahead) is a graph input that rank 0 builds its next step
        # on before the frame comes. Evaluated at once, it would wait inside MLX, where the ring
        # backend spins a core: beside other work (this test suite's concurrent rings) each
        # spinning rank 0 took a core from them (the suite ran 885 s, not 650). So on the ring
        # the evaluation is held back until the frame is there (_await_arrival, at the next
        # send or header): the graph is built ahead, and nothing spins. Backends without that
        # wait (MPI) receive ahead only where every rank can have a core and one more.
        self.receives_ahead = self._incoming is not None or (
            self.rank == 0 and (os.cpu_count() or 1) >= 2 * self.size)
        self._arriving = False  # a receive posted ahead whose frame has not been waited for
        # Rank 0's code may evaluate such a receive on its own (then the wait would find no bytes
        # coming): bounded there. Other ranks evaluate it only by reading its header: unbounded,
        # as their plain receive, so that a frame that is long in coming never spins a core.
        self._arrival_wait_ms = ARRIVAL_WAIT_MS if self.rank == 0 else -1

    def _await_arrival(self) -> None:
        """Before an evaluation that may run a receive posted ahead: wait until its frame has
        come (MLX would spin for it), once."""
        if self._arriving:
            self._arriving = False
            self._incoming.wait(self._arrival_wait_ms)

    def send(self, header: Header, payload: Optional[mx.array] = None) -> None:
        self._await_arrival()  # the payload may be built on a reply received ahead
        s = self._send_stream
        frame, large = pack(header, payload), payload is not None and payload.nbytes > INLINE_BYTES
        # A large payload goes second, and the frame waits for it: a computation that fails
        # (MLX could not allocate) sends nothing, and the next rank never waits for half a frame.
        sent = mx.distributed.send(mx.depends(frame, payload) if large else frame, self.next, group=self.group,
                                   stream=s)
        if large:  # the dependency keeps the frame first
            sent = mx.distributed.send(mx.depends(payload, sent), self.next, group=self.group, stream=s)
        mx.async_eval(sent)
        self._last_send = sent

    def recv(self) -> Tuple[Header, Optional[mx.array]]:
        self._arriving = False  # this wait covers it
        if self._incoming is not None:
            self._incoming.wait()  # the ring's receive would spin a core until the frame comes
        frame = mx.distributed.recv_like(self._frame_like, self.prev, group=self.group)
        header = unpack_header(frame)  # waits for the frame
        return header, self.payload_after(header, frame)

    def payload_after(self, header: Header, frame: mx.array) -> Optional[mx.array]:
        """The payload of a frame received: inline, or the message that follows it."""
        if not header.has_payload:
            return None
        if payload_bytes(header) <= INLINE_BYTES:
            return inline_payload(header, frame)
        payload = mx.distributed.recv(header.payload_shape(), header.payload_dtype(), self.prev, group=self.group)
        mx.eval(payload)
        return payload

    def recv_ahead(self, shape: Tuple[int, int, int], dtype: mx.Dtype) -> Optional[PendingFrame]:
        if not self.receives_ahead or shape[0] * shape[1] * shape[2] * dtype.size > INLINE_BYTES:
            return None
        self._arriving = self._incoming is not None
        frame = mx.distributed.recv_like(self._frame_like, self.prev, group=self.group)
        return _PendingInline(frame, shape, dtype, self)

    def close(self) -> None:
        if self._last_send is not None:  # sends on one stream finish in order
            mx.eval(self._last_send)
