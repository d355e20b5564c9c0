"""What every transport shares: the control header, the fixed-size frame it travels in,
the Transport interface, and the in-process ring that implements it for `--stages N`.

The fixed-size frame both byte-moving transports send (mx_p2p.py, collective.py): the
header's bytes, then the payload's when it fits inline (a decode step's hidden states,
every control op's values), then zeros. A bigger payload (a prefill chunk) travels apart,
in a size the header announces.

The in-process ring (LocalRing, `--stages N`: all stages in one process): sending from
rank 0 runs the other stages' handlers in ring order, at once; what the last one returns
is what rank 0 receives next.
"""

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import astuple, dataclass
from enum import IntEnum
from typing import Callable, List, Optional, Tuple

import mlx.core as mx

# Wire codes for payload dtypes; the header carries one.
DTYPES = [mx.float32, mx.float16, mx.bfloat16, mx.int32]


class Op(IntEnum):
    FORWARD = 1  # run the payload (batch, length, hidden) through the stage
    RESET = 2  # drop the caches of `slot` (a request finished, or a new one starts there)
    INFO = 3  # append this rank's row to the int32 payload table
    STOP = 4  # shut down, after passing the frame on
    JOIN = 5  # move the rows of slot `arg` listed in the int32 payload to the end of the batch of slot `slot`
    FILTER = 6  # keep only the batch rows listed in the int32 payload (none: drop the slot)
    PARK = 7  # the ring is idle: after passing this on, block until rank 0 wakes the ring (`arg`: its number)
    # Batched admission (8-15):
    MERGE = 8  # merge the slots listed in the int32 payload (rows in that order) into a batch in slot `slot`
    PREPARE = 9  # before right-padded prompt rows: payload = the rows' lengths, then their right padding
    FINALIZE = 10  # after the padded prompt rows: the padding becomes left padding
    # Prefix cache (16 up; 8-15 are admission's). Rank 0 keeps the index, every rank its
    # layers' slice of each entry; int32 payloads, no reply (the ring keeps them in order).
    SNAPSHOT = 16  # keep rows of `slot` as entries (payload: entry, row pairs)
    RESTORE = 17  # fresh caches for `slot` from entry `entry`, cut to `tokens` (payload: entry, tokens)
    EVICT = 18  # forget the entries listed in the payload
    RECORD = 21  # keep the keys and values `slot`'s prompt brings to sliding layers, unrotated, from entry
    # `entry`'s first `tokens` (payload: entry, tokens; entry -1: from nothing): its entries can then be cut anywhere
    PERSIST = 22  # write entry `entry` to this rank's disk tier (payload: entry, then its tokens)
    LOAD = 23  # read the first `arg` tokens of the disk tier's entry of these tokens as entry `entry`, back to rank 0
    # (payload: entry, whether every rank so far has it, then the tokens; each rank clears the second where it has not)
    # Speculative decoding (runtime/speculation.py):
    TRIM = 19  # drop the newest `arg` positions of `slot` (drafts the target rejected)
    # Recovery (runtime/batching.py Batcher.reset): drop every slot's caches, then back to rank 0,
    # which reads and drops every reply before it; the ring starts clean after a step's error.
    CLEAR = 20
    # Memory (runtime/memory_guard.py):
    NO_MEMORY = 24  # in place of a FORWARD a rank could not run for lack of memory; it reaches rank 0 as
    # that frame's reply (int32 payload: the rank, KiB needed, KiB in use, KiB limit)


# Frames that go all the way round, back to rank 0.
ROUND_TRIP_OPS = (Op.STOP, Op.PARK, Op.CLEAR)


class Reply(IntEnum):
    """What the last rank sends back to rank 0 after a FORWARD."""

    NONE = 0  # nothing (a prefill chunk whose output nobody needs)
    LAST = 1  # the hidden state of the last position only
    ALL = 2  # every position's hidden state
    ACK = 3  # a header only, once the last rank has finished (paces prefill chunks)


@dataclass
class Header:
    op: int
    reply: int = Reply.NONE
    slot: int = 0
    batch: int = 0
    length: int = 0
    width: int = 0
    dtype: int = 0
    arg: int = 0  # op-specific: JOIN's source slot, PARK's number, a FORWARD's positions to keep (caches.keeping)
    # A FORWARD that also carries a prefill chunk (Pipeline.send_mixed): the chunk's
    # slot, rows and columns. Its tokens follow the decode rows' in the payload.
    chunk_slot: int = 0
    chunk_rows: int = 0
    chunk_length: int = 0
    # A FORWARD or TRIM: the positions of the slot's next frame as rank 0 expects it, one row
    # (0: not known); the other ranks build that frame before it comes (StageWorker.build_ahead).
    next_length: int = 0

    SIZE = 12

    def to_array(self) -> mx.array:
        return mx.array(astuple(self), dtype=mx.int32)

    @classmethod
    def from_array(cls, a: mx.array) -> "Header":
        return cls(*a.tolist())

    @classmethod
    def for_payload(cls, op: int, payload: mx.array, **fields) -> "Header":
        b, l, w = payload.shape
        return cls(op, batch=b, length=l, width=w, dtype=DTYPES.index(payload.dtype), **fields)

    @property
    def has_payload(self) -> bool:
        return self.batch * self.length * self.width > 0

    def payload_shape(self) -> Tuple[int, int, int]:
        return (self.batch, self.length, self.width)

    def payload_dtype(self) -> mx.Dtype:
        return DTYPES[self.dtype]

    @property
    def mixed(self) -> bool:
        """A FORWARD carrying a prefill chunk beside its decode rows."""
        return self.chunk_rows > 0


class Transport(ABC):
    """Point-to-point links of a ring: send to rank+1, receive from rank-1."""

    rank: int
    size: int

    @abstractmethod
    def send(self, header: Header, payload: Optional[mx.array] = None) -> None:
        """Send a frame to the next rank (the last rank's next is rank 0)."""

    @abstractmethod
    def recv(self) -> Tuple[Header, Optional[mx.array]]:
        """Receive the next frame from the previous rank."""

    def recv_ahead(self, shape: Tuple[int, int, int], dtype: mx.Dtype) -> Optional["PendingFrame"]:
        """The next frame as a lazy graph input, before it arrives, when its payload is known
        to be `shape` and `dtype` (the reply to a decode step): rank 0 then builds the next
        step on it while the ring computes. Evaluate what is built on it only by sending it
        (send) or after reading its header (header_of): the transport may hold the
        evaluation until the frame is there. None: this transport receives only at once."""
        return None

    def header_of(self, pending: "PendingFrame", *also: mx.array) -> Header:
        """A frame received ahead: its header, once it has come; `also`: arrays to evaluate
        with it (what was built on it, in one wait)."""
        return pending.header(*also)

    def payload_of(self, pending: "PendingFrame", header: Header) -> Optional[mx.array]:
        """A frame received ahead that is not the one expected: its payload as `header` announces it."""
        return pending.payload_as(header)

    def settle(self) -> None:
        """After passing on a frame of ROUND_TRIP_OPS: return once no rank needs
        this one any more for that frame to reach rank 0."""

    def close(self) -> None:
        """Called by every rank once it has passed STOP on."""


class PendingFrame(ABC):
    """A frame received lazily (Transport.recv_ahead)."""

    payload: mx.array  # lazy: as the caller expected it

    @abstractmethod
    def header(self, *also: mx.array) -> Header:
        """The frame's header: waits for the frame (and evaluates `also` with it). The caller
        checks it is what it expected."""

    @abstractmethod
    def payload_as(self, header: Header) -> Optional[mx.array]:
        """The payload as `header` announces it (a frame other than the one expected)."""


HEADER_BYTES = Header.SIZE * 4
# 16 KiB: four rows of Trinity-Mini's bfloat16 hidden state (2048), one of Trinity-Large's
# float32 one; the link's cost for the zeros is small beside a message's fixed cost.
INLINE_BYTES = 16384
FRAME_BYTES = HEADER_BYTES + INLINE_BYTES


def payload_bytes(header: Header) -> int:
    return header.batch * header.length * header.width * header.payload_dtype().size if header.op else 0


def pack(header: Optional[Header], payload: Optional[mx.array]) -> mx.array:
    """The frame (FRAME_BYTES uint8) for `header` (None: an empty one) and `payload`."""
    parts = [mx.view((header or Header(0)).to_array(), mx.uint8)]
    if payload is not None and payload.nbytes <= INLINE_BYTES:
        parts.append(mx.view(payload, mx.uint8).reshape(-1))
    parts.append(mx.zeros((FRAME_BYTES - sum(p.size for p in parts),), dtype=mx.uint8))
    return mx.concatenate(parts)


def unpack_header(frame: mx.array) -> Header:
    """The frame's header (reading it waits for the frame)."""
    return Header.from_array(mx.view(frame[:HEADER_BYTES], mx.int32))


def as_payload(header: Header, data: mx.array) -> mx.array:
    """Payload bytes (uint8, at least the header's size) as the array the header announces."""
    data = data[:payload_bytes(header)]
    return mx.view(data, header.payload_dtype()).reshape(header.payload_shape())


def inline_payload(header: Header, frame: mx.array) -> mx.array:
    return as_payload(header, frame[HEADER_BYTES:])


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
