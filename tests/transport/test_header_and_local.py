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
