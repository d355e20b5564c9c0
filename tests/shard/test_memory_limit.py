"""--memory-limit's values, and what a rank plans with under it."""

from argparse import ArgumentTypeError

import mlx.core as mx
import pytest

from distributed.shard.memory_limit import AUTO, apply_memory_limit, cache_bound, limited, parse_memory_limit


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
