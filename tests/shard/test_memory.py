"""shard/memory.py: --memory-limit's values, what a rank plans with under it and what MLX is held
to; the default --max-batch (sequences whose KV caches fit beside the weights on the tightest rank)
and --max-context auto."""

from argparse import ArgumentTypeError

import mlx.core as mx
import pytest

from distributed.shard.memory import (AUTO, DEFAULT_MARGIN, MAX_BATCH, apply_memory_limit, cache_bound, kv_budget,
                                      limited, longest_context, parse_memory_limit)
from trinity_configs import mini

GIB = 1 << 30
# Trinity-Mini: 4 KV heads x 128 x (k, v) x 2 bytes = 2 KiB per token per layer; 3 sliding layers
# (window 2048) then 1 full one, so layers [0, 16) are 12 sliding and 4 full.
KV_TOKEN = 4 * 128 * 2 * 2


def ranks(*layer_ranges, params=(8 * GIB, 6 * GIB)):
    return [{"layers": list(r), "parameter_bytes": p} for r, p in zip(layer_ranges, params)]


def by_hand(memory, params, sliding, full, context):
    free = int(memory * (1 - DEFAULT_MARGIN)) - params
    return free // (KV_TOKEN * (sliding * min(context, 2048) + full * context))


def test_the_tightest_rank_bounds_the_batch():
    budget = kv_budget(mini(), ranks((0, 16), (16, 32)), [24 * GIB, 12 * GIB], 4096)
    assert budget.tightest_rank == 1
    assert budget.max_batch == by_hand(12 * GIB, 6 * GIB, 12, 4, 4096)
    assert budget.sequence_bytes[0] == budget.sequence_bytes[1] == KV_TOKEN * (12 * 2048 + 4 * 4096)
    assert "rank 1" in budget.describe()


def test_longer_contexts_cost_full_attention_layers_only_past_the_window():
    short = kv_budget(mini(), ranks((0, 16), (16, 32)), [24 * GIB, 24 * GIB], 2048)
    long = kv_budget(mini(), ranks((0, 16), (16, 32)), [24 * GIB, 24 * GIB], 8192)
    assert long.sequence_bytes[0] == KV_TOKEN * (12 * 2048 + 4 * 8192)
    assert short.sequence_bytes[0] == KV_TOKEN * 16 * 2048
    assert long.max_batch == by_hand(24 * GIB, 8 * GIB, 12, 4, 8192) < short.max_batch


def test_bytes_set_aside_come_out_of_every_rank():
    plain = kv_budget(mini(), ranks((0, 16), (16, 32)), [24 * GIB, 24 * GIB], 32768)
    less = kv_budget(mini(), ranks((0, 16), (16, 32)), [24 * GIB, 24 * GIB], 32768, set_aside_bytes=4 * GIB)
    assert [a - b for a, b in zip(plain.free_bytes, less.free_bytes)] == [4 * GIB, 4 * GIB]
    assert less.max_batch < plain.max_batch


def test_at_least_one_and_at_most_the_cap():
    full = kv_budget(mini(), ranks((0, 32), params=(15 * GIB,)), [16 * GIB], 131072)
    assert full.max_batch == 1 and full.free_bytes[0] < full.sequence_bytes[0]
    roomy = kv_budget(mini(), ranks((0, 32), params=(1 * GIB,)), [1024 * GIB], 128)
    assert roomy.max_batch == MAX_BATCH


def by_hand_context(memory, params, sliding, full, batch, limit):
    """The longest context (the cache grows 256 tokens at a time) that `batch` sequences fit in."""
    free = int(memory * (1 - DEFAULT_MARGIN)) - params
    best = 0
    for c in range(1, limit + 1):
        allocated = -(-c // 256) * 256
        if batch * KV_TOKEN * (sliding * min(allocated, 2048) + full * allocated) <= free:
            best = c
    return best


def test_the_longest_context_is_what_the_tightest_rank_holds_for_the_batch():

    for memory, batch in ((9 * GIB, 4), (12 * GIB, 6), (7 * GIB, 2)):
        fit = longest_context(mini(), ranks((0, 16), (16, 32)), [24 * GIB, memory], batch, 131072)
        assert fit.tightest_rank == 1 and fit.batch == batch
        assert fit.context == by_hand_context(memory, 6 * GIB, 12, 4, batch, 131072)
        assert f"{fit.context} tokens for each of {batch}" in fit.describe()
    # Room for more than the model's limit: the limit; for not even the sliding windows: 0.
    assert longest_context(mini(), ranks((0, 16), (16, 32)), [200 * GIB] * 2, 1, 4096).context == 4096
    assert longest_context(mini(), ranks((0, 16), (16, 32)), [24 * GIB, 6.7 * GIB], 64, 131072).context == 0
    # A rank of sliding layers only never runs out past its windows.
    only_sliding = [{"layers": [0, 3], "parameter_bytes": GIB}]
    assert longest_context(mini(), only_sliding, [8 * GIB], 1, 131072).context == 131072


def test_set_aside_bytes_shorten_the_context():
    plain = longest_context(mini(), ranks((0, 16), (16, 32)), [24 * GIB] * 2, 16, 131072)
    less = longest_context(mini(), ranks((0, 16), (16, 32)), [24 * GIB] * 2, 16, 131072, set_aside_bytes=4 * GIB)
    assert plain.context == by_hand_context(24 * GIB, 8 * GIB, 12, 4, 16, 131072)
    assert less.context == by_hand_context(24 * GIB, 12 * GIB, 12, 4, 16, 131072) < plain.context


@pytest.mark.parametrize("text, value", [("auto", AUTO), ("AUTO", AUTO), ("1000", 1000), ("24G", 24 << 30),
                                         ("512m", 512 << 20), ("1.5GiB", 3 << 29), ("2TB", 2 << 40), ("64 K", 64 << 10)])
def test_bytes_with_binary_units_or_auto(text, value):
    assert parse_memory_limit(text) == value


@pytest.mark.parametrize("text", ["", "12X", "-5G", "0", "G", "auto2"])
def test_anything_else_is_refused_naming_it(text):
    with pytest.raises(ArgumentTypeError, match="expected bytes|above 0"):
        parse_memory_limit(text)


def test_explicit_bytes_replace_the_host_share_and_auto_keeps_it():
    assert limited(10 << 30, None) == limited(10 << 30, AUTO) == 10 << 30
    assert limited(10 << 30, 3 << 30) == limited(1 << 30, 3 << 30) == 3 << 30


def test_mlx_is_held_to_the_limit_and_its_cache_to_the_margin():
    before = mx.set_memory_limit(mx.device_info().get("memory_size", 1 << 40))  # returns the previous limit
    cache_before = mx.set_cache_limit(1 << 40)
    try:
        assert apply_memory_limit(None) is None
        assert apply_memory_limit(1 << 30) == {"memory_limit_bytes": 1 << 30, "cache_limit_bytes": cache_bound(1 << 30)}
        # (set_* return the value they replace: setting the same again reads it.)
        assert mx.set_memory_limit(1 << 30) == 1 << 30 and mx.set_cache_limit(cache_bound(1 << 30)) == cache_bound(1 << 30)
        assert 0 < cache_bound(1 << 30) < 1 << 30
        # A freed buffer bigger than the bound is not kept for reuse.
        a = mx.zeros((200 << 20) // 4)
        mx.eval(a)
        del a
        assert mx.get_cache_memory() <= cache_bound(1 << 30)
    finally:
        mx.set_memory_limit(before)
        mx.set_cache_limit(cache_before)
