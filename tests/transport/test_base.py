"""transport/base.py: the header round trip, the fixed-size frame (header and payload back,
inline or announced), and the in-process ring."""

import mlx.core as mx
import pytest

from distributed.transport import Header, Op, Reply
from distributed.transport.base import (FRAME_BYTES, INLINE_BYTES, LocalRing, inline_payload, pack, payload_bytes,
                                        unpack_header)


def test_header_round_trip_and_payload_shape():
    h = mx.zeros((2, 5, 64), dtype=mx.bfloat16)
    header = Header.for_payload(Op.FORWARD, h, reply=Reply.LAST, slot=3, arg=17)
    back = Header.from_array(header.to_array())
    assert back == header
    assert back.payload_shape() == (2, 5, 64) and back.payload_dtype() == mx.bfloat16
    assert not Header(Op.RESET).has_payload
    assert not header.mixed


def test_a_mixed_frame_header_carries_its_chunk():
    h = mx.zeros((1, 3 + 2 * 8, 64))  # a 3-row decode step, then a 2 x 8 chunk
    header = Header.for_payload(Op.FORWARD, h, reply=Reply.LAST, slot=1, chunk_slot=9, chunk_rows=2, chunk_length=8)
    back = Header.from_array(header.to_array())
    assert back == header and back.mixed
    assert (back.chunk_slot, back.chunk_rows, back.chunk_length) == (9, 2, 8)


def test_local_ring_chains_handlers_in_order():
    seen = []

    def add(k):
        def handle(header, payload):
            seen.append(k)
            return header, payload + k

        return handle

    ring = LocalRing([add(1), add(10)])
    x = mx.zeros((1, 1, 4))
    ring.send(Header.for_payload(Op.FORWARD, x), x)
    _, out = ring.recv()
    assert seen == [1, 10] and out.tolist() == [[[11.0] * 4]]


def test_local_ring_drops_frames_a_handler_consumes():
    ring = LocalRing([lambda h, p: None])
    ring.send(Header(Op.RESET))
    assert not ring.inbox


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.int32])
def test_an_inline_payload_comes_back_exactly(dtype):
    payload = (mx.arange(2 * 3 * 5) - 7).reshape(2, 3, 5).astype(dtype)
    header = Header.for_payload(Op.FORWARD, payload, reply=Reply.LAST, slot=9, chunk_rows=1)
    frame = pack(header, payload)
    assert frame.shape == (FRAME_BYTES,) and frame.dtype == mx.uint8
    back = unpack_header(frame)
    assert back == header and payload_bytes(back) == payload.nbytes
    out = inline_payload(back, frame)
    assert out.dtype == dtype and out.shape == payload.shape and mx.array_equal(out, payload).item()


def test_a_payload_too_big_to_ride_inline_leaves_only_its_header():
    payload = mx.ones((1, INLINE_BYTES // 4 + 1, 1), dtype=mx.float32)
    frame = pack(Header.for_payload(Op.FORWARD, payload), payload)
    assert frame.shape == (FRAME_BYTES,) and unpack_header(frame).payload_shape() == payload.shape
    assert not frame[Header.SIZE * 4:].any().item()  # zeros: the payload travels apart


def test_no_header_is_an_empty_frame():
    assert not pack(None, None).any().item() and payload_bytes(unpack_header(pack(None, None))) == 0
