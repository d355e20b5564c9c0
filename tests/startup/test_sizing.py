"""Real 2-rank rings held to --memory-limit.

--max-context auto: the context it reports is the longest at which --max-batch sequences'
caches fit beside the tightest rank's weights; a request longer than that is refused up
front naming the numbers, one that fits is served, and every rank reports the memory it
plans with. A fixed --max-context beyond what fits: a prompt too big for the limit even
alone is refused before prefill with an error naming memory (gRPC RESOURCE_EXHAUSTED,
HTTP 507) while the ring goes on serving, exactly; a lone rank is held to its limit alike.
Both servers (two rings of 2 ranks on this host) under a mixed load serve every prompt that
fits alone (it waits for memory) and stay within their limits, and their buffer caches
within their bounds, as their metrics show."""

import http.client
import json
import re
import threading

import grpc
import pytest

from distributed.serving.proto import generation_pb2 as pb
from distributed.shard.memory import DEFAULT_MARGIN, cache_bound
from distributed.shard.tiny_checkpoint import DEFAULT_MODEL
from distributed.command_line import context_arg
from grpc_server import SERVING, Server, generate
from reference import PROMPT

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


def ring(max_context: str):
    s = Server(DEFAULT_MODEL, 2, ["--memory-limit", str(LIMIT), "--max-context", max_context, "--max-batch",
                                  str(BATCH), "--prefix-cache-bytes", "0", "--http", "127.0.0.1:0"])
    try:
        s.wait_serving()
        s.http = s.http_address()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def limited_ring():
    yield from ring("auto")


@pytest.fixture(scope="module")
def overcommitted_ring():
    """A 2048-token context (--max-context), more than LIMIT holds: the limit binds mid-request."""
    yield from ring("2048")


def post(address, path: str, body: dict):
    conn = http.client.HTTPConnection(*address, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def metrics(address) -> dict:
    """{(name, rank): value} of the per-rank samples of one /metrics scrape."""
    conn = http.client.HTTPConnection(*address, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    return {(m[0], m[1]): float(m[2]) for m in re.findall(r'^(trinity_\w+)\{[^}]*rank="(\d+)"[^}]*\} (\S+)$', text, re.M)}


def greedy(stub, prompt, max_tokens=16):
    return generate(stub, token_ids=prompt, max_tokens=max_tokens)["token_ids"]


def test_the_context_is_what_the_tightest_rank_holds(limited_ring):
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    info = limited_ring.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert [(r.memory_bytes, r.memory_limited) for r in info.ranks] == [(LIMIT, True)] * 2
    expected = min(by_hand_context(config, (r.layer_start, r.layer_end), r.parameter_bytes) for r in info.ranks)
    assert 0 < info.max_context == expected < config["max_position_embeddings"]  # the memory binds, not the model
    assert info.max_batch == BATCH
    assert f"max context: {expected} tokens for each of {BATCH} sequences" in limited_ring.output()


def test_a_request_past_the_context_is_clamped_and_one_with_no_room_refused(limited_ring):
    """max_tokens beyond the room the prompt leaves is clamped to it (as vLLM and llama.cpp do:
    the reply ends with "length" there); a prompt that leaves no room is refused, naming the context."""
    context = limited_ring.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).max_context
    prompt = [5 + i % 50 for i in range(context - 3)]
    replies = list(limited_ring.stub.Generate(pb.GenerateRequest(token_ids=prompt, max_tokens=4), timeout=120))
    assert sum(len(r.token_ids) for r in replies) == 3 and replies[-1].finish_reason == "length"
    full = [5 + i % 50 for i in range(context)]
    with pytest.raises(grpc.RpcError) as e:
        list(limited_ring.stub.Generate(pb.GenerateRequest(token_ids=full, max_tokens=1), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"prompt ({context} tokens) + max_tokens (1) exceeds the context of {context} tokens" in e.value.details()


LONG_PROMPT = [5 + i % 50 for i in range(1800)]  # fits the context (2048), not LIMIT


TOO_BIG = (r"out of memory on rank [01]: the request \(\d+ tokens with max_tokens\) needs [\d.]+ MiB for its caches "
           r"and frames, above the [\d.]+ MiB its --memory-limit of {} MiB leaves beside the weights; refused before prefill")


def refused_frames(address) -> float:
    return sum(v for (name, _), v in metrics(address).items() if name == "trinity_rank_memory_refused_frames_total")


def test_a_request_too_big_for_the_limit_alone_is_refused_before_prefill(overcommitted_ring):
    """The context (2048) admits it, the limit does not: refused up front, naming memory
    (gRPC RESOURCE_EXHAUSTED, HTTP 507), no frame of it ever sent; the ring goes on exactly."""
    s = overcommitted_ring
    fresh = greedy(s.stub, PROMPT)  # the ring's first request
    with pytest.raises(grpc.RpcError) as e:
        generate(s.stub, token_ids=LONG_PROMPT, max_tokens=4)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert re.fullmatch(TOO_BIG.format(r"6\.7"), e.value.details()), e.value.details()
    assert s.health_status() == SERVING
    assert greedy(s.stub, PROMPT) == fresh  # served exactly, as on the fresh ring
    status, body = post(s.http, "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 4})
    assert status == 507 and re.fullmatch(TOO_BIG.format(r"6\.7"), body["error"]["message"]), (status, body)
    assert greedy(s.stub, PROMPT) == fresh and s.health_status() == SERVING
    line = [x for x in s.output(10**7).splitlines() if "prompt_tokens=1800" in x][0]
    assert "status=RESOURCE_EXHAUSTED outcome=out_of_memory" in line and "memory_peak_mib=" in line
    assert refused_frames(s.http) == 0  # refused before prefill: no rank was asked to run it


LONE_LIMIT = 12_000_000  # one rank holds every layer, the embedding and the head: ~8.3 MiB in use


def test_a_lone_rank_is_held_to_its_limit():
    """One rank, no ring (MLX's CPU allocator would not raise past the limit, and a failed
    malloc there is a SIGSEGV): a request too big for it is refused before prefill, and it
    goes on exactly."""
    s = Server(DEFAULT_MODEL, 1, ["--memory-limit", str(LONE_LIMIT), "--max-context", "2048", "--max-batch",
                                  str(BATCH), "--prefix-cache-bytes", "0"])
    try:
        s.wait_serving()
        fresh = greedy(s.stub, PROMPT)
        with pytest.raises(grpc.RpcError) as e:
            generate(s.stub, token_ids=LONG_PROMPT, max_tokens=4)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert re.fullmatch(TOO_BIG.format(r"11\.4").replace("[01]", "0"), e.value.details()), e.value.details()
        assert s.health_status() == SERVING and greedy(s.stub, PROMPT) == fresh
    finally:
        s.stop()


def test_two_servers_on_one_host_stay_within_their_limits(limited_ring, overcommitted_ring):
    """A mixed load on both at once (prompts short and long, concurrent, beyond --max-batch;
    on the overcommitted ring one too big for its limit alone): every prompt that fits alone
    is served, exactly (a prompt waits in the queue until it fits beside those running), the
    too-big one alone fails, before prefill; no rank's peak passes its limit, no buffer
    cache its bound (as /metrics and GetModelInfo's live figures show), and no frame was refused."""
    context = limited_ring.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).max_context
    lengths = [12, context - 40, 100, context // 2, 40, context - 10]
    prompts = [[3 + (i + j) % 90 for j in range(n)] for i, n in enumerate(lengths)]
    alone = [greedy(limited_ring.stub, p, 8) for p in prompts]  # each served alone first
    outcomes = {}

    def load(server, key, order):
        for i in order:
            try:
                outcomes[key, i] = greedy(server.stub, LONG_PROMPT if i == len(prompts) else prompts[i], 8)
            except grpc.RpcError as e:
                outcomes[key, i] = (e.code(), e.details())

    order = list(range(len(prompts)))
    threads = [threading.Thread(target=load, args=(server, (name, t), order[t:] + order[:t] + extra))
               for name, server, extra in (("planned", limited_ring, []), ("overcommitted", overcommitted_ring, [6]))
               for t in range(3)]  # 3 clients a server: one more than --max-batch
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (key, i), outcome in outcomes.items():
        if i == len(prompts):
            assert outcome[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and re.fullmatch(TOO_BIG.format(r"6\.7"), outcome[1])
        else:
            assert outcome == alone[i], (key, lengths[i], outcome)
    for server in (limited_ring, overcommitted_ring):
        assert server.health_status() == SERVING
        server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)  # after it, every rank has reported
        for r in server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).ranks:  # live: MLX's now
            assert 0 < r.parameter_bytes <= r.active_memory_bytes <= LIMIT, r
            assert r.cache_memory_bytes <= cache_bound(LIMIT), r
        m = metrics(server.http)
        for rank in ("0", "1"):
            figures = {name: v for (name, r), v in m.items() if r == rank and "memory" in name}
            assert figures["trinity_rank_memory_limit_bytes"] == LIMIT, figures
            assert 0 < figures["trinity_rank_memory_active_bytes"] <= figures["trinity_rank_memory_peak_bytes"] <= LIMIT, (
                server.http, rank, figures)
            assert figures["trinity_rank_memory_cache_bytes"] <= cache_bound(LIMIT), figures
            assert figures["trinity_rank_memory_refused_frames_total"] == 0, figures


@pytest.mark.parametrize("text, value", [("auto", "auto"), ("AUTO", "auto"), ("4096", 4096)])
def test_max_context_takes_a_count_or_auto(text, value):
    assert context_arg(text) == value


@pytest.mark.parametrize("text", ["0", "-1", "lots", ""])
def test_max_context_refuses_anything_else(text):
    from argparse import ArgumentTypeError

    with pytest.raises(ArgumentTypeError):
        context_arg(text)


@pytest.mark.parametrize("max_context", ["auto", "65536"])
def test_auto_context_bounds_the_prefill_chunk_to_the_margin(max_context):
    """--max-context auto leaves the margin to activations, so each prefill chunk must fit in it
    (half: the rest holds replies and logits) at its own context: a prompt's first chunk longer
    than its last, near the auto context; a fixed context without --memory-limit keeps the
    chunk asked for."""
    from distributed.command_line import parse_settings
    from distributed.runtime.memory_guard import activation_bytes
    from distributed.shard.config import model_args
    from distributed.startup.sizing import serving_sizes
    from trinity_configs import mini

    gib, asked = 1 << 30, 8192
    settings = parse_settings(["--max-context", max_context, "--max-batch", "1", "--prefix-cache-bytes", "0",
                               "--prefill-step-size", str(asked), "--prompt", "x"])
    rows = [{"layers": [0, 16], "parameter_bytes": 8 * gib}, {"layers": [16, 32], "parameter_bytes": 6 * gib}]
    memory = [24 * gib, 12 * gib]
    sizes = serving_sizes(settings.sizing, mini(), rows, memory)
    assert sizes.prefill_step_size == asked
    if max_context != "auto":
        assert sizes.chunk_budget is None
        return
    budget, half_margin = sizes.chunk_budget, int(min(memory) * DEFAULT_MARGIN) // 2
    assert budget.bytes == half_margin
    last, first = budget.ending_at(sizes.max_context, asked), budget.columns(1, 0, asked)
    fits = [activation_bytes(model_args(mini()), n, sizes.max_context, 2) <= half_margin for n in (last, last + 1)]
    assert last < first <= asked and fits == [True, False], (first, last, sizes.max_context)
    assert any(line.startswith(f"prefill chunk: up to {asked} tokens, {last} where a prompt nears") for line in sizes.lines)
