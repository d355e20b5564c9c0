"""The fixed-size frame both transports move: the header's bytes, then the payload's
when it fits inline (a decode step's hidden states, every control op's values), then
zeros. A bigger payload (a prefill chunk) travels apart, in a size the header announces."""

from typing import Optional

import mlx.core as mx

from .base import Header

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
