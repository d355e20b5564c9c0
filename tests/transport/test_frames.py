"""The fixed-size frame (frames.py): header and payload back, inline or announced."""

import mlx.core as mx
import pytest

from distributed.transport import Header, Op, Reply
from distributed.transport.frames import FRAME_BYTES, INLINE_BYTES, inline_payload, pack, payload_bytes, unpack_header


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
