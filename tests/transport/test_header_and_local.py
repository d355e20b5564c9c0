import mlx.core as mx

from distributed.transport import Header, Op, Reply
from distributed.transport.local import LocalRing


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
