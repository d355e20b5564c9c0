"""--max-context auto on a real 2-rank ring held to --memory-limit: the context it reports
is the longest at which --max-batch sequences' caches fit beside the tightest rank's
weights; a request longer than that is refused up front naming the numbers, one that fits
is served, and every rank reports the memory it plans with."""

import json

import grpc
import pytest

from distributed.serving.proto import generation_pb2 as pb
from distributed.shard.memory_plan import DEFAULT_MARGIN
from distributed.shard.tiny_checkpoint import DEFAULT_MODEL
from distributed.startup.sizing import context_arg
from grpc_server import Server

LIMIT = 7_000_000  # bytes a rank: the tiny model's weights and a few hundred tokens of two sequences
BATCH = 2


def by_hand_context(config: dict, layers, parameter_bytes: int) -> int:
    """The longest context whose caches (grown 256 tokens at a time, a sliding layer's
    capped at its window) fit BATCH times in LIMIT less the margin and the weights."""
    kv_token = 2 * config["num_key_value_heads"] * config.get("head_dim", config["hidden_size"] // config["num_attention_heads"]) * 4
    kinds = config["layer_types"][layers[0]:layers[1]]
    free = int(LIMIT * (1 - DEFAULT_MARGIN)) - parameter_bytes
    best = 0
    for c in range(1, config["max_position_embeddings"] + 1):
        allocated = -(-c // 256) * 256
        per_sequence = sum(min(allocated, config["sliding_window"]) if k == "sliding_attention" else allocated
                           for k in kinds) * kv_token
        if BATCH * per_sequence <= free:
            best = c
    return best


@pytest.fixture(scope="module")
def limited_ring():
    s = Server(DEFAULT_MODEL, 2, ["--memory-limit", str(LIMIT), "--max-context", "auto",
                                  "--max-batch", str(BATCH), "--prefix-cache-bytes", "0"])
    try:
        s.wait_serving()
        yield s
    finally:
        s.stop()


def test_the_context_is_what_the_tightest_rank_holds(limited_ring):
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    info = limited_ring.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert [(r.memory_bytes, r.memory_limited) for r in info.ranks] == [(LIMIT, True)] * 2
    expected = min(by_hand_context(config, (r.layer_start, r.layer_end), r.parameter_bytes) for r in info.ranks)
    assert 0 < info.max_context == expected < config["max_position_embeddings"]  # the memory binds, not the model
    assert info.max_batch == BATCH
    assert f"max context: {expected} tokens for each of {BATCH} sequences" in limited_ring.output()


def test_a_request_that_could_not_fit_is_refused_and_one_that_fits_is_served(limited_ring):
    context = limited_ring.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).max_context
    prompt = [5 + i % 50 for i in range(context - 3)]
    with pytest.raises(grpc.RpcError) as e:
        list(limited_ring.stub.Generate(pb.GenerateRequest(token_ids=prompt, max_tokens=4), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"prompt ({context - 3} tokens) + max_tokens (4) exceeds the context of {context} tokens" in e.value.details()
    replies = list(limited_ring.stub.Generate(pb.GenerateRequest(token_ids=prompt, max_tokens=3), timeout=120))
    assert sum(len(r.token_ids) for r in replies) == 3 and replies[-1].finish_reason == "length"


@pytest.mark.parametrize("text, value", [("auto", "auto"), ("AUTO", "auto"), ("4096", 4096)])
def test_max_context_takes_a_count_or_auto(text, value):
    assert context_arg(text) == value


@pytest.mark.parametrize("text", ["0", "-1", "lots", ""])
def test_max_context_refuses_anything_else(text):
    from argparse import ArgumentTypeError

    with pytest.raises(ArgumentTypeError):
        context_arg(text)
