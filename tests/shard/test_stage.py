"""Stage.mixed: a decode step and a prefill chunk through the layers in one pass give what each
gives through the stage alone, their caches included."""

import mlx.core as mx
import pytest

from distributed.runtime.caches import SlotCaches, is_batch
from distributed.shard.loader import load_stage
from distributed.shard.stage import flatten, unflatten

# Histories of the decode group's rows: shorter than the 16-token window, and past it (wrapped).
HISTORIES = [5, 20, 41]


def tokens(n, seed):
    return mx.array([[(seed * 31 + 7 * i) % 250 + 1 for i in range(n)]], dtype=mx.uint32)


def decode_group(stage):
    """Three rows with histories of different lengths, merged into one batch (left-padded)."""
    caches = SlotCaches(stage)
    for slot, n in enumerate(HISTORIES, start=1):
        stage(stage.embed(tokens(n, slot)), caches.get(slot))
    caches.merge(0, [1, 2, 3])
    assert is_batch(caches.get(0))
    return caches


@pytest.mark.parametrize("layers", [(0, 8), (3, 4), (4, 8)])  # every kind; one full layer alone; the tail
def test_a_mixed_pass_equals_each_part_alone(hf_checkpoint, layers):
    stage = load_stage(hf_checkpoint, *layers, first=True)
    alone, mixed = decode_group(stage), decode_group(stage)
    step = stage.embed(mx.array([[11], [12], [13]], dtype=mx.uint32))
    chunk = stage.embed(mx.concatenate([tokens(7, 5), tokens(7, 6)]))
    for _ in range(3):  # three frames: the chunk's rows grow past the window too
        want = [stage(step, alone.get(0)), stage(chunk, alone.get(9))]
        got = stage.mixed([(step, mixed.get(0)), (chunk, mixed.get(9))])
        for w, g in zip(want, got):
            assert g.shape == w.shape
            assert mx.abs(g - w).max().item() < 1e-5
    for slot in (0, 9):
        for a, m in zip(alone.get(slot), mixed.get(slot)):
            assert mx.array_equal(a.offset, m.offset) if is_batch([a]) else a.offset == m.offset
            assert mx.abs(a.state[0] - m.state[0]).max().item() < 1e-5


def test_flatten_keeps_each_part_in_order():
    parts = [mx.arange(6).reshape(3, 1, 2), mx.arange(6, 30).reshape(2, 6, 2)]
    flat = flatten(parts)
    assert flat.shape == (1, 15, 2)
    assert flat.reshape(-1).tolist() == list(range(30))
    assert [mx.array_equal(a, b).item() for a, b in zip(unflatten(flat, [p.shape for p in parts]), parts)] == [1, 1]
