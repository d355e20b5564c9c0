import pytest

from distributed import TrinityError
from distributed.shard.plan import even_split, layer_ranges, parse_split


def test_even_split_gives_rank0_the_fewest_layers():
    assert even_split(32, 3) == [10, 11, 11]
    assert even_split(8, 3) == [2, 3, 3]
    assert even_split(8, 4) == [2, 2, 2, 2]


def test_layer_ranges_are_contiguous_and_cover_all_layers():
    for ranks in range(1, 9):
        ranges = layer_ranges(32, ranks)
        assert ranges[0][0] == 0 and ranges[-1][1] == 32
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_explicit_split():
    assert layer_ranges(32, 3, [10, 12, 10]) == [(0, 10), (10, 22), (22, 32)]


@pytest.mark.parametrize(
    "split, message",
    [([10, 22], "2 entries but there are 3 ranks"), ([10, 0, 22], "must be positive"), ([10, 12, 11], "sums to 33")],
)
def test_bad_split_names_the_cause(split, message):
    with pytest.raises(TrinityError, match=message):
        layer_ranges(32, 3, split)


def test_malformed_split_text():
    with pytest.raises(TrinityError, match="malformed"):
        parse_split("10,x,12")


def test_more_ranks_than_layers():
    with pytest.raises(TrinityError, match="at least one layer"):
        even_split(2, 3)
