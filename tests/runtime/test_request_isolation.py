"""One request never takes the ring down.

Batches of every shape: whatever prompts are admitted together, each gets exactly the greedy
tokens one-device mlx-lm gives it alone, and the ring serves on.

Prompts of 1 to 40 tokens (the window is 16), all equal or mixed, admitted together (submitted
before the scheduler runs), with and without prefix-cache hits, speculation (prompt lookup) and a
grammar beside them. First in process (two stages, deterministic admission), then through a real
ring of two processes over gRPC, where the batches form as requests arrive. Four prompts of one
token admitted together once took the ring down for good (mlx-lm's extract on a batch cache no
frame had reached). Then the numbers and stop strings that once did, refused before the queue.
"""

import math
import os
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.utils import load_tokenizer

from distributed.runtime.grammar import regex_grammar
from distributed.runtime.request import MAX_STOP_CHARS, MAX_STOPS, FinishEvent, GenerationRequest, TokenEvent
from distributed.runtime.scheduler import Scheduler
from distributed.runtime.speculation import SpeculationOptions
from distributed.serving.proto import generation_pb2 as pb
from grpc_server import SERVING, Server, generate, rpc_error
from reference import mlx_lm_greedy
from stages import in_process_pipeline

MAX_TOKENS = 6
STEP = 8  # prefill step: prompts longer than it go in several chunks


def prompt(length: int, seed: int) -> list:
    return [(seed * 31 + 7 * i + 3) % 250 + 1 for i in range(length)]


# Lengths of the prompts admitted together.
COMPOSITIONS = [[1], [1, 1], [1, 1, 1, 1], [2, 2, 2], [5, 5, 5, 5], [17, 17], [1, 2], [2, 1], [1, 7, 1, 3],
                [1, 20, 40], [40, 1, 1], [3, 1, 1, 1, 17], [9, 16, 17, 1, 33, 2]]


def expected(path, ids):
    return mlx_lm_greedy(path, ids, MAX_TOKENS, STEP)[0]


def outcome(handle):
    events = list(handle.events())
    assert isinstance(events[-1], FinishEvent)
    return [e.token_id for e in events if isinstance(e, TokenEvent)], events[-1]


@pytest.fixture(scope="module")
def scheduler(hf_checkpoint):
    pipeline, _ = in_process_pipeline(hf_checkpoint, (3, 5))
    return Scheduler(pipeline, load_tokenizer(hf_checkpoint), prefill_step_size=STEP, max_batch=8,
                     prefix_cache_bytes=2**24, speculation=SpeculationOptions(prompt_lookup=True, num_draft_tokens=3))


def run_together(scheduler, requests):
    handles = [scheduler.submit(r) for r in requests]
    scheduler.run_pending()
    assert scheduler.failure is None, scheduler.failure
    return [outcome(h) for h in handles]


@pytest.mark.parametrize("lengths", COMPOSITIONS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("speculative", [True, False], ids=["speculating", "plain"])
def test_every_composition_is_exact(scheduler, hf_checkpoint, lengths, speculative):
    prompts = [prompt(n, seed) for seed, n in enumerate(lengths)]
    results = run_together(scheduler, [GenerationRequest(p, max_tokens=MAX_TOKENS, speculative=speculative)
                                       for p in prompts])
    for p, (tokens, finish) in zip(prompts, results):
        assert finish.finish_reason in ("length", "stop"), finish.error
        assert tokens == expected(hf_checkpoint, p), (len(p), lengths)


@pytest.mark.parametrize("lengths", [[1, 1, 1], [20, 1, 20], [1, 33, 5, 33]], ids=lambda c: "-".join(map(str, c)))
def test_compositions_with_prefix_cache_hits(scheduler, hf_checkpoint, lengths):
    """Each prompt once alone (its caches stored), then again together with a longer one that
    shares it (both restore from the cache): exact every time, and the cache was used."""
    prompts = [prompt(n, 50 + seed) for seed, n in enumerate(lengths)]
    run_together(scheduler, [GenerationRequest(p, max_tokens=MAX_TOKENS) for p in prompts])
    again = prompts + [p + prompt(3, 90) for p in prompts]
    results = run_together(scheduler, [GenerationRequest(p, max_tokens=MAX_TOKENS) for p in again])
    for p, (tokens, _) in zip(again, results):
        assert tokens == expected(hf_checkpoint, p)
    assert sum(finish.cached_tokens for _, finish in results) > 0


def test_a_grammar_beside_plain_rows_of_one_token(scheduler, hf_checkpoint):
    """A constrained row admitted with one-token prompts: it keeps to its grammar, they stay exact."""
    prompts = [prompt(1, 70), prompt(1, 71), prompt(12, 72)]
    requests = [GenerationRequest(p, max_tokens=MAX_TOKENS) for p in prompts]
    requests.append(GenerationRequest(prompt(1, 73), max_tokens=MAX_TOKENS, grammar=regex_grammar("[a-z ]{1,40}")))
    results = run_together(scheduler, requests)
    for p, (tokens, _) in zip(prompts, results):
        assert tokens == expected(hf_checkpoint, p)
    tokens, finish = results[-1]
    text = load_tokenizer(hf_checkpoint).decode(tokens)
    assert finish.finish_reason in ("length", "stop") and re.fullmatch("[a-z ]{0,40}", text), (finish, text)


@pytest.fixture(scope="module")
def ring(hf_checkpoint):
    server = Server(hf_checkpoint, ranks=2, extra=["--prefill-step-size", str(STEP), "--max-batch", "8",
                                                   "--prompt-lookup", "--num-draft-tokens", "3"])
    try:
        server.wait_serving()
        yield server
    finally:
        server.stop()


def test_concurrent_batches_through_a_ring_of_two(ring, hf_checkpoint):
    """Every composition again, each as concurrent gRPC streams into a real ring of two
    processes (batches form as they arrive); then the ring still serves."""
    stub = ring.stub
    with ThreadPoolExecutor(8) as pool:
        for seed, lengths in enumerate(COMPOSITIONS):
            prompts = [prompt(n, 100 + 10 * seed + i) for i, n in enumerate(lengths)]
            outs = list(pool.map(lambda p: generate(stub, token_ids=p, max_tokens=MAX_TOKENS), prompts))
            for p, out in zip(prompts, outs):
                assert out["token_ids"] == expected(hf_checkpoint, p), (lengths, out.get("finish_reason"))
    assert ring.health_status() == SERVING


@pytest.mark.parametrize("field, value", [("repetition_context_size", 2**32 - 1), ("presence_context_size", 2**30),
                                          ("frequency_context_size", 2**31), ("top_logprobs", 21)])
def test_numbers_out_of_range_are_refused_before_the_queue(ring, hf_checkpoint, field, value):
    """A context size beyond the context (once a ValueError inside the scheduler's step, which
    took the ring down) is INVALID_ARGUMENT naming the field; the ring serves on, exactly."""
    error = rpc_error(generate, ring.stub, token_ids=prompt(3, 1), max_tokens=2, repetition_penalty=1.2,
                      **{field: value})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith(f"{field}: must be")
    assert generate(ring.stub, token_ids=prompt(5, 2), max_tokens=MAX_TOKENS)["token_ids"] == \
        expected(hf_checkpoint, prompt(5, 2))


def test_stop_strings_are_bounded_and_cheap(ring, hf_checkpoint):
    """A stop string over the limit is refused by name; one at the limit costs a request beside
    it nothing it can notice (the old matcher took 3 s a token for 480 KB), and is exact."""
    error = rpc_error(generate, ring.stub, token_ids=prompt(3, 3), max_tokens=2, stop=["x" * (MAX_STOP_CHARS + 1)])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop" in error.details()
    error = rpc_error(generate, ring.stub, token_ids=prompt(3, 3), max_tokens=2, stop=["a"] * (MAX_STOPS + 1))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and f"at most {MAX_STOPS}" in error.details()
    with ThreadPoolExecutor(2) as pool:
        long_stop = pool.submit(generate, ring.stub, token_ids=prompt(4, 4), max_tokens=MAX_TOKENS,
                                stop=["ab" * (MAX_STOP_CHARS // 2)] * MAX_STOPS)
        plain = generate(ring.stub, token_ids=prompt(6, 5), max_tokens=MAX_TOKENS)
        assert long_stop.result()["token_ids"] == expected(hf_checkpoint, prompt(4, 4))
    assert plain["token_ids"] == expected(hf_checkpoint, prompt(6, 5))


FAULT = '''
import os
if os.environ.get("MLX_RANK") == "1":  # rank 1 of the ring: its stage raises on a part of 7 positions
    from distributed.shard.stage import Stage
    _call, _mixed = Stage.__call__, Stage.mixed

    def _check(h):
        if h.shape[1] == 7:
            raise RuntimeError("injected fault: a frame of 7 positions")

    def _faulty_call(self, h, caches, *args, **kwargs):
        _check(h)
        return _call(self, h, caches, *args, **kwargs)

    def _faulty_mixed(self, parts, *args, **kwargs):
        for h, _ in parts:
            _check(h)
        return _mixed(self, parts, *args, **kwargs)

    Stage.__call__, Stage.mixed = _faulty_call, _faulty_mixed
'''


@pytest.fixture(scope="module")
def faulty_ring(hf_checkpoint, tmp_path_factory):
    """A ring of two whose rank 1 raises on any frame of 7 positions (a sitecustomize on its path):
    an error no check before the queue caught, on a rank other than 0."""
    faults = tmp_path_factory.mktemp("faults")
    (faults / "sitecustomize.py").write_text(FAULT)
    server = Server(hf_checkpoint, ranks=2, extra=["--prefill-step-size", str(STEP)],
                    environment={"PYTHONPATH": str(faults)})
    try:
        server.wait_serving()
        yield server
    finally:
        server.stop()


def test_a_frame_another_rank_cannot_run_fails_its_request_alone(faulty_ring, hf_checkpoint):
    """Rank 1 raises on one request's prefill chunk (7 positions): that request ends with an error
    naming the rank, health stays SERVING (the ring was never down), and the requests after it
    are exact. (A chunk riding in a decode step's frame fails that step's rows with it, as a
    frame that runs out of memory does: the rank cannot tell which part raised.)"""
    error = rpc_error(generate, faulty_ring.stub, token_ids=prompt(8, 7), max_tokens=4)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert error.details().startswith("this request failed: rank 1 could not run its frame"), error.details()
    assert faulty_ring.health_status() == SERVING
    with ThreadPoolExecutor(2) as pool:
        prompts = [prompt(5, 8), prompt(9, 9), prompt(1, 10)]
        for p, out in zip(prompts, pool.map(lambda p: generate(faulty_ring.stub, token_ids=p, max_tokens=MAX_TOKENS),
                                            prompts)):
            assert out["token_ids"] == expected(hf_checkpoint, p)
    assert "injected fault" in faulty_ring.output(20000)  # logged with its traceback on rank 1


# The gRPC fuzzer: Generate with every field drawn, extremes included. Each call ends normally
# or with a documented code; no reply names a Python exception; the ring serves on exactly.
OK_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
PYTHON_ERRORS = re.compile(r"Traceback|\b(Type|Attribute|Key|Index|Value|Recursion|Runtime|Unicode|Overflow|Assertion)"
                           r"Error\b")
uint32 = st.integers(0, 2**32 - 1)
extremes = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e20, -1e20, 2.0**63])
text = st.text(max_size=30)
# Each field: a value a client may well send (and the ring then runs), and values it should not.
VALID = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "min_p": st.floats(0, 0.5),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "top_k": st.integers(0, 300), "seed": st.integers(0, 2**64 - 1),
    "presence_context_size": st.integers(1, 64), "frequency_context_size": st.integers(1, 64),
    "repetition_context_size": st.integers(1, 64), "top_logprobs": st.integers(0, 20),
    "stop": st.lists(st.text(min_size=1, max_size=8), max_size=3),
    "logit_bias": st.dictionaries(st.integers(0, 250), st.floats(-100, 100), max_size=3),
    "prompt_logprobs": st.booleans(), "separate_reasoning": st.booleans(), "speculative": st.booleans(),
    "regex": st.sampled_from(["[a-z ]{1,20}", "[0-9]+", "(yes|no)"]),
    "json_schema": st.sampled_from(['{"type": "object"}', '{"type": "integer"}', '{"enum": ["a", "b"]}']),
    "lark_grammar": st.sampled_from(["start: /[a-z]+/", 'start: "x" | "y"']),
}
HOSTILE = {
    **{name: extremes for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                  "repetition_penalty")},
    **{name: uint32 for name in ("presence_context_size", "frequency_context_size", "repetition_context_size",
                                 "top_logprobs")},
    "top_k": st.integers(-2**31, 2**31 - 1), "max_tokens": st.sampled_from([-3, 0, 2**31 - 1]),
    "stop": st.sampled_from([["x" * 5000], ["a"] * 70, [""]]),
    "logit_bias": st.dictionaries(uint32, st.one_of(extremes, st.floats()), min_size=1, max_size=3),
    "resume_token_ids": st.lists(st.integers(0, 300), min_size=1, max_size=8),
    "token_ids": st.one_of(st.just([]), st.lists(uint32, min_size=1, max_size=4)),
    "regex": text, "json_schema": text, "lark_grammar": text,
}
CONSTRAINTS = ("regex", "json_schema", "lark_grammar")


@st.composite
def generate_requests(draw):
    """A plausible request; half of them with one or two fields made hostile."""
    fields = {"max_tokens": draw(st.integers(1, 6))}
    which = draw(st.sampled_from(["token_ids", "prompt", "messages"]))
    if which == "token_ids":
        fields["token_ids"] = draw(st.lists(st.integers(1, 250), min_size=1, max_size=40))
    elif which == "prompt":
        fields["prompt"], fields["chat_template"] = draw(st.text(min_size=1, max_size=30)), draw(st.booleans())
    else:
        fields["messages"] = [pb.ChatMessage(role=draw(st.sampled_from(["user", "system", "assistant", "bogus"])),
                                             content=draw(text)) for _ in range(draw(st.integers(1, 3)))]
    optional = sorted(set(VALID) - set(CONSTRAINTS))
    for name in draw(st.lists(st.sampled_from(optional), max_size=4, unique=True)):
        fields[name] = draw(VALID[name])
    constraint = draw(st.sampled_from((None,) + CONSTRAINTS))
    if constraint is not None:
        fields[constraint] = draw(VALID[constraint])
    if draw(st.booleans()):
        for name in draw(st.lists(st.sampled_from(sorted(HOSTILE)), min_size=1, max_size=2, unique=True)):
            if name in CONSTRAINTS:
                for other in CONSTRAINTS:
                    fields.pop(other, None)
            fields[name] = draw(HOSTILE[name])
    return fields


def test_fuzzed_generate_requests(ring, hf_checkpoint):
    stub, cases, outcomes = ring.stub, [], Counter()

    @settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 80)), deadline=None, derandomize="FUZZ_EXAMPLES" not in os.environ, database=None,
              suppress_health_check=list(HealthCheck))
    @given(generate_requests())
    def case(fields):
        cases.append(fields)
        try:
            outcomes[generate(stub, timeout=3, **fields)["finish_reason"]] += 1
        except grpc.RpcError as e:
            outcomes[e.code().name] += 1
            assert e.code() in OK_CODES, (e.code(), e.details(), fields)
            assert not PYTHON_ERRORS.search(e.details() or ""), (e.details(), fields)
        if len(cases) % 20 == 0:  # after each batch of cases: the ring serves exactly
            assert generate(stub, token_ids=prompt(7, 11), max_tokens=MAX_TOKENS)["token_ids"] == \
                expected(hf_checkpoint, prompt(7, 11))

    case()
    print("fuzzed Generate outcomes:", dict(outcomes))
    assert len(cases) >= 80 and ring.health_status() == SERVING
    assert sum(outcomes[r] for r in ("length", "stop")) >= 10, outcomes  # the cases reach the ring too
