"""shard/plan.py: even splits and --split; layer plans by memory for Trinity-Mini and Trinity-Nano on 2-4
hosts, equal and unequal memory."""

import itertools
import json

import pytest

from distributed import TrinityError
from distributed.shard.plan import GIB, even_split, layer_ranges, parse_split, plan_layers
from distributed.shard.sizes import model_sizes, quantize_config
from trinity_configs import MINI_BF16, MINI_Q4, NANO_BF16, hand_cache, hand_layer, mini, nano

CONTEXT = 32768
CASES = {  # memory per host in GiB
    "2-equal": [32, 32], "2-unequal": [64, 16],
    "3-equal": [24, 24, 24], "3-unequal": [64, 32, 16],
    "4-equal": [16, 16, 16, 16], "4-unequal": [48, 24, 16, 12],
}
MODELS = {"mini": (mini, MINI_BF16), "nano": (nano, NANO_BF16), "mini-4bit": (lambda: quantize_config(mini(), 4), MINI_Q4)}


def hand_weights(table, start, end):
    return sum(hand_layer(table, l) for l in range(start, end)) + (table["embed_head"] if start == 0 else 0)


def max_ratio(costs, head, bounds, usable):
    loads = [sum(costs[a:b]) + (head if r == 0 else 0) for r, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return max(load / u for load, u in zip(loads, usable))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("model", MODELS)
def test_plan_bytes_match_hand_figures_and_fit(model, case):
    make, table = MODELS[model]
    config = make()
    memories = [g * GIB for g in CASES[case]]
    plan = plan_layers(config, memories, context=CONTEXT, hosts=[f"mac{i}" for i in range(len(memories))])
    assert plan.fits, plan.describe()
    kind = "nano" if model == "nano" else "mini"
    ends = 0
    for r, h in enumerate(plan.hosts):
        assert (h.rank, h.host, h.start) == (r, f"mac{r}", ends) and h.end > h.start
        ends = h.end
        assert h.weight_bytes == hand_weights(table, h.start, h.end)
        assert h.cache_bytes == hand_cache(kind, h.start, h.end, CONTEXT)
        assert h.memory_bytes == memories[r] and h.usable_bytes == int(memories[r] * 0.9)
        assert h.weight_bytes + h.cache_bytes <= h.usable_bytes
        assert h.headroom_bytes == memories[r] - h.weight_bytes - h.cache_bytes
    assert ends == config["num_hidden_layers"]
    assert plan.split == [h.end - h.start for h in plan.hosts]


@pytest.mark.parametrize("model", ["mini", "nano"])
@pytest.mark.parametrize("case", ["2-unequal", "3-equal", "3-unequal"])
def test_plan_is_the_most_even_by_memory(model, case):
    """No other contiguous split has a lower largest load/usable-memory (brute force)."""
    config = MODELS[model][0]()
    memories = [g * GIB for g in CASES[case]]
    usable = [int(m * 0.9) for m in memories]
    plan = plan_layers(config, memories, context=CONTEXT)
    s = model_sizes(config)
    L = config["num_hidden_layers"]
    costs = [s.layer_weight_bytes(l) + s.layer_cache_bytes(l, CONTEXT) for l in range(L)]
    got = max_ratio(costs, s.embed_head, [0] + [h.end for h in plan.hosts], usable)
    best = min(max_ratio(costs, s.embed_head, [0, *cuts, L], usable)
               for cuts in itertools.combinations(range(1, L), len(memories) - 1))
    assert got == pytest.approx(best, rel=1e-12)


def test_equal_hosts_give_rank0_fewer_layer_bytes():
    # Rank 0 pays for the embedding and head with fewer (or, holding the light dense
    # layers, no more) layers, and less layer weight than any other host.
    for config, n in ((mini(), 2), (mini(), 4), (nano(), 3), (nano(), 4)):
        plan = plan_layers(config, [64 * GIB] * n, context=CONTEXT)
        assert plan.split[0] == min(plan.split), plan.split
        layer_bytes = [h.weight_bytes - h.weights["embed_head"] for h in plan.hosts]
        assert layer_bytes[0] < min(layer_bytes[1:]), plan.split
        assert max(plan.split[1:]) - min(plan.split[1:]) <= 1
    assert plan_layers(nano(), [64 * GIB] * 2, context=CONTEXT).split == [27, 29]


def test_unequal_memory_is_proportional():
    # Mini bf16 on a 64 GiB and a 16 GiB host: the big one carries about 80% of the load.
    plan = plan_layers(mini(), [64 * GIB, 16 * GIB], context=CONTEXT)
    assert plan.split == [26, 6]
    loads = [h.weight_bytes + h.cache_bytes for h in plan.hosts]
    assert 0.75 < loads[0] / sum(loads) < 0.85
    # Nano on 3 equal 8 GiB hosts.
    assert plan_layers(nano(), [8 * GIB] * 3, context=CONTEXT).split == [18, 19, 19]


def test_speed_moves_layers_to_the_faster_host():
    even = plan_layers(nano(), [32 * GIB, 32 * GIB], context=CONTEXT).split
    fast = plan_layers(nano(), [32 * GIB, 32 * GIB], speeds=[1, 3], context=CONTEXT).split
    assert fast[1] > even[1] and fast[1] >= 3 * fast[0] - 5
    # Speed never plans a host past its memory: the fast host is small here.
    capped = plan_layers(mini(), [64 * GIB, 16 * GIB], speeds=[1, 10], context=CONTEXT)
    assert capped.fits and capped.hosts[1].weight_bytes + capped.hosts[1].cache_bytes <= capped.hosts[1].usable_bytes


def test_longer_context_costs_full_attention_layers_only():
    short = plan_layers(mini(), [64 * GIB, 64 * GIB], context=2048)
    long = plan_layers(mini(), [64 * GIB, 64 * GIB], context=131072)
    full_layers = sum(1 for l in range(32) if (l + 1) % 4 == 0)
    assert sum(h.cache_bytes for h in long.hosts) - sum(h.cache_bytes for h in short.hosts) == \
        full_layers * (131072 - 2048) * 2 * 4 * 128 * 2


def test_plan_that_cannot_fit_says_what_is_missing_where():
    plan = plan_layers(mini(), [16 * GIB] * 3, context=CONTEXT, hosts=["a", "b", "c"])
    assert not plan.fits
    text = plan.shortfall()
    need = hand_weights(MINI_BF16, 0, 32) + hand_cache("mini", 0, 32, CONTEXT)
    assert f"in all the model needs {need / GIB:.2f} GiB and the hosts offer {3 * 14.4:.2f} GiB usable" in text
    assert "host a (rank 0) needs" in text and "missing" in text
    for h in plan.hosts:  # the memory-proportional split, with each host's shortfall
        assert h.missing_bytes == max(0, h.weight_bytes + h.cache_bytes - h.usable_bytes)
    data = plan.to_json()
    assert data["fits"] is False and [h["layers"] for h in data["hosts"]][0][0] == 0
    # One host that is too small while the total would fit: still refused, and named.
    lopsided = plan_layers(quantize_config(mini(), 4), [64 * GIB, 0.2 * GIB], context=CONTEXT, hosts=["big", "tiny"])
    assert not lopsided.fits and "host tiny (rank 1)" in lopsided.shortfall()
    assert "in all" not in lopsided.shortfall()


def test_plan_json_shape():
    plan = plan_layers(nano(), [8 * GIB] * 3, context=CONTEXT, hosts=["x", "y", "z"])
    data = json.loads(json.dumps(plan.to_json()))
    assert data["fits"] is True
    for r, h in enumerate(data["hosts"]):
        assert {"host", "rank", "layers", "weight_bytes", "cache_bytes", "memory_bytes"} <= h.keys()
        assert h["rank"] == r and h["memory_bytes"] == 8 * GIB
    assert [h["layers"] for h in data["hosts"]] == [[0, 18], [18, 37], [37, 56]]


def test_bad_inputs():
    with pytest.raises(TrinityError, match="every host needs at least one layer"):
        plan_layers(mini(), [GIB] * 33)
    with pytest.raises(TrinityError, match="positive"):
        plan_layers(mini(), [GIB, 0])
    with pytest.raises(TrinityError, match="speeds"):
        plan_layers(mini(), [GIB, GIB], speeds=[1])


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
