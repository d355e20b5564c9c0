"""Point-to-point frames emulated with collectives, for backends without
send/recv (MLX's NCCL backend: "Send has no CUDA implementation").

Every call to send or recv is one or more *rounds*: all ranks all_gather a
fixed-size frame (a header for their next rank, or nothing, with a small
payload inline), then, if any header announces a payload too big to inline,
all_gather the payload bytes padded to the round's largest. Each rank keeps
what its previous rank addressed to it.
Several frames can move in one round (rank 0 sends chunk k+1 while rank 1
sends chunk k on), so ranks stay in lock-step without a central schedule:
a rank that waits in recv simply joins rounds until its frame arrives.
"""

from collections import deque
from typing import Optional, Tuple

import mlx.core as mx

from .base import HEADER_BYTES, INLINE_BYTES, ROUND_TRIP_OPS, Header, Transport, as_payload, pack, payload_bytes

# Payloads up to INLINE_BYTES ride in the same gather as their header (base.py): one
# collective per round for decode steps.


class MxCollective(Transport):
    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.prev = (self.rank - 1) % self.size
        self.inbox: deque = deque()
        # Frames of ROUND_TRIP_OPS (STOP, PARK) this rank sent, and those seen
        # arriving back at rank 0: until they match, the others need our rounds.
        self.round_trips_sent = 0
        self.round_trips_back = 0

    def _round(self, header: Optional[Header] = None, payload: Optional[mx.array] = None) -> None:
        nbytes = 0 if payload is None else payload.nbytes
        if payload is not None:
            # Compute the payload before the first gather: its peers wait in that gather, so
            # a payload computed after it (inside the second gather, for large ones) would
            # serialise the ranks instead of overlapping them (chunk k+1 here, k on rank 1).
            mx.eval(payload)
        frames = mx.distributed.all_gather(pack(header, payload)[None], group=self.group)
        # Every rank evaluates every gather, sender or not: collectives match
        # by order, so one skipped would pair with the next round's.
        mx.eval(frames)
        headers = [Header(*row) for row in mx.view(frames[:, :HEADER_BYTES], mx.int32).tolist()]
        sizes = [payload_bytes(h) for h in headers]
        incoming, size = headers[self.prev], sizes[self.prev]
        data = None
        if max(sizes) > INLINE_BYTES:  # rare (prefill chunks): a second gather, padded to the largest
            buf = mx.zeros((max(sizes),), dtype=mx.uint8)
            if nbytes > INLINE_BYTES:
                buf[:nbytes] = mx.view(payload, mx.uint8).reshape(-1)
            big = mx.distributed.all_gather(buf[None], group=self.group)
            mx.eval(big)
            if size > INLINE_BYTES:
                data = big[self.prev, :size]
        if size and data is None:
            data = frames[self.prev, HEADER_BYTES : HEADER_BYTES + size]
        if data is not None:
            data = as_payload(incoming, data)
        if incoming.op:
            self.inbox.append((incoming, data))
        if headers[self.size - 1].op in ROUND_TRIP_OPS:
            self.round_trips_back += 1

    def send(self, header: Header, payload: Optional[mx.array] = None) -> None:
        if header.op in ROUND_TRIP_OPS:
            self.round_trips_sent += 1
        self._round(header, payload)

    def recv(self) -> Tuple[Header, Optional[mx.array]]:
        while not self.inbox:
            self._round()
        return self.inbox.popleft()

    def settle(self) -> None:
        """Keep joining rounds until the STOP or PARK frame we passed on has
        gone all the way round, so no rank leaves (or parks) while the others
        still need it in a collective."""
        while self.round_trips_back < self.round_trips_sent:
            self._round()

    def close(self) -> None:
        self.settle()
