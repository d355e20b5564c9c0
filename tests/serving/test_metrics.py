"""Metrics, health and the access log (serving/metrics.py, http_api.Health, request_log.py) on
real servers: a scrape of /metrics, parsed with prometheus_client's text parser, after
real requests through gRPC and HTTP counts what the clients saw; /health follows the
ring; every request leaves one access-log line, and the server one line as it stops.

Two servers: 2 ranks serving gRPC and HTTP (its last test kills rank 1), and 1 rank
serving gRPC with --metrics on a port of its own (stopped with SIGTERM)."""

import http.client
import json
import os
import re
import signal
import socket
import time

import grpc
import openai
import pytest
from grpc_server import LONG, SERVER_ARGS, TOKEN, Server, generate, rpc_error
from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port_range
from distributed.serving.proto import generation_pb2 as pb
from distributed.startup.watchdog import EXIT_PEER_FAILED
from reference import PROMPT

SHORT = [1, 2, 3, 4, 5, 6]  # within the sliding window: asked twice, the second one hits the prefix cache
CHOICES = {5: 2}  # served's 6th request asks for n=2 choices (each its own sequence; the others have one)
ACCESS = re.compile(r"^trinity: request (.*)$", re.M)

STEP_TOKENS = 48  # the ring's --max-step-tokens


def get(address, path, conn=None, token=None):
    """(status, Content-Type, body) of GET path (on `conn`, kept alive, if given)."""
    conn = conn or http.client.HTTPConnection(*address, timeout=30)
    conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
    response = conn.getresponse()
    return response.status, response.getheader("Content-Type"), response.read().decode()


def scrape(address, conn=None, token=None) -> dict:
    """Every sample of one scrape: {(name, frozenset(labels.items())): value}."""
    status, kind, text = get(address, "/metrics", conn, token)
    assert status == 200 and kind.startswith("text/plain"), (status, kind, text)
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, **labels) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def scrape_until(address, done, what: str, timeout=30.0, **kw) -> dict:
    """Scrape until done(samples): counts land as answers end, other ranks' with their
    next heartbeat (about 1 s)."""
    end = time.monotonic() + timeout
    while True:
        samples = scrape(address, **kw)
        if done(samples) or time.monotonic() > end:
            assert done(samples), f"{what}: {sorted((n, sorted(ls), v) for (n, ls), v in samples.items())}"
            return samples
        time.sleep(0.1)


def access_lines(output: str) -> list:
    return [dict(kv.split("=", 1) for kv in re.findall(r'(\w+=(?:"[^"]*"|\S+))', line))
            for line in ACCESS.findall(output)]


@pytest.fixture(scope="module")
def ring(hf_checkpoint):
    """2 ranks started by hand, so that rank 0 outlives a killed rank 1 by its grace (about 1 s)."""
    s = Server(hf_checkpoint, 2, ["--http", "127.0.0.1:0", "--max-step-tokens", str(STEP_TOKENS), *SERVER_ARGS],
               manual=True)
    try:
        s.wait_serving()
        s.http = host, port = s.http_address()
        s.client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0, timeout=60)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def served(ring):
    """Requests through both front ends; what each client saw: (front end, status, outcome, prompt,
    cached and completion tokens), in order."""
    seen = []
    for fields in (dict(token_ids=PROMPT, max_tokens=8), dict(token_ids=SHORT, max_tokens=4),
                   dict(token_ids=SHORT, max_tokens=4), dict(prompt="Hello", max_tokens=5)):
        out = generate(ring.stub, **fields)
        u = out["usage"]
        assert len(out["token_ids"]) == u.completion_tokens
        seen.append(("grpc", "OK", out["finish_reason"], u.prompt_tokens, u.cached_tokens, u.completion_tokens))
    error = rpc_error(generate, ring.stub, token_ids=[10**6], max_tokens=4)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    seen.append(("grpc", "INVALID_ARGUMENT", "invalid", 0, 0, 0))

    model = ring.client.models.list().data[0].id
    c = ring.client.completions.create(model=model, prompt="Once upon", max_tokens=6, temperature=0, n=CHOICES[5])
    assert len(c.choices) == CHOICES[5]
    seen.append(("http", "200", c.choices[0].finish_reason, c.usage.prompt_tokens,
                 c.usage.prompt_tokens_details.cached_tokens, c.usage.completion_tokens))
    chunks = list(ring.client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}))
    u = chunks[-1].usage
    finish = next(ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason)
    seen.append(("http", "200", finish, u.prompt_tokens, u.prompt_tokens_details.cached_tokens, u.completion_tokens))
    with pytest.raises(openai.BadRequestError):
        ring.client.completions.create(model=model, prompt="x", max_tokens=0)
    seen.append(("http", "400", "invalid", 0, 0, 0))
    assert seen[2][4] > 0, seen  # the prefix cache served the second SHORT
    return seen


def test_a_scrape_counts_what_the_clients_saw(ring, served):
    samples = scrape_until(ring.http, lambda s: total(s, "trinity_requests_total") == len(served), "requests")
    for front_end in ("grpc", "http"):
        mine = [r for r in served if r[0] == front_end]
        gaps = sum(r[5] - CHOICES.get(i, 1) for i, r in enumerate(served) if r[0] == front_end and r[5] > 0)
        for outcome in {r[2] for r in mine}:
            assert total(samples, "trinity_requests_total", front_end=front_end, outcome=outcome) == \
                sum(r[2] == outcome for r in mine), (front_end, outcome)
        for i, name in ((3, "prompt_tokens"), (4, "prompt_tokens_cached"), (5, "generated_tokens")):
            assert total(samples, f"trinity_{name}_total", front_end=front_end) == sum(r[i] for r in mine), name
        # Every token was timed: the first of each request, then the gaps between a choice's tokens.
        ran = [r for r in mine if r[5] > 0]
        assert total(samples, "trinity_time_to_first_token_seconds_count", front_end=front_end) == len(ran)
        assert total(samples, "trinity_inter_token_latency_seconds_count", front_end=front_end) == gaps
        assert total(samples, "trinity_request_duration_seconds_count", front_end=front_end) == len(mine)
        assert total(samples, "trinity_time_to_first_token_seconds_sum", front_end=front_end) > 0
    assert total(samples, "trinity_prefix_cache_hits_total") >= 1
    assert total(samples, "trinity_prefix_cache_misses_total") >= 1
    assert total(samples, "trinity_prefix_cache_entries") >= 1
    info = ring.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert total(samples, "trinity_max_batch") == info.max_batch
    assert total(samples, "trinity_step_token_budget") == STEP_TOKENS  # --max-step-tokens
    assert total(samples, "trinity_requests_waiting") == total(samples, "trinity_sequences_running") == 0
    assert total(samples, "trinity_ring_failures_total") == total(samples, "trinity_ring_restarts_total") == 0
    assert total(samples, "process_resident_memory_bytes") > 0
    # Rank 0's loop: a step at least per token of the longest reply, every part timed, and over a ring
    # of two, time spent waiting for the ring's replies and building frames.
    assert total(samples, "trinity_loop_steps_total") >= max(r[5] for r in served)
    loop = {part: total(samples, "trinity_loop_seconds_total", part=part)
            for part in ("admit", "build", "launch", "sample", "wait", "accept", "prefix", "idle", "other")}
    assert loop["wait"] > 0 and loop["build"] > 0 and loop["accept"] > 0 and loop["idle"] > 0, loop

    # Rank 1 reports with its heartbeats: every frame went through both ranks.
    def ranks_agree(s):
        frames = [total(s, "trinity_rank_forward_frames_total", rank=str(r)) for r in (0, 1)]
        return frames[0] > 0 and frames[0] == frames[1]

    samples = scrape_until(ring.http, ranks_agree, "forward frames of rank 0 and rank 1")
    host = socket.gethostname()
    for rank in ("0", "1"):
        assert total(samples, "trinity_rank_forward_seconds_total", rank=rank, host=host) > 0
        assert total(samples, "trinity_prefix_cache_bytes", rank=rank) > 0  # each holds its slice of the entries
        assert total(samples, "trinity_rank_memory_peak_bytes", rank=rank) > 0
        assert total(samples, "trinity_rank_memory_active_bytes", rank=rank) > 0


def test_one_access_log_line_per_request(ring, served):
    lines = access_lines(ring.output(10**7))[: len(served)]
    got = [(x["front_end"], x["status"], x["outcome"], int(x["prompt_tokens"]), int(x["cached_tokens"]),
            int(x["completion_tokens"])) for x in lines]
    assert got == served, "\n".join(ACCESS.findall(ring.output(10**7)))
    for x, seen in zip(lines, served):
        assert (x["ttft_s"] == "-") == (seen[5] == 0) and float(x["duration_s"]) >= 0
        assert ("error" in x) == (seen[2] == "invalid"), x
        assert x["client"].startswith("ipv4:127.0.0.1:" if seen[0] == "grpc" else "127.0.0.1"), x
    assert [x["route"] for x in lines] == ["Generate"] * 5 + ["/v1/completions", "/v1/chat/completions",
                                                              "/v1/completions"]
    assert json.loads(lines[-1]["error"]).startswith("max_tokens: ")


def test_gauges_while_a_request_runs(ring, served):
    status, _, body = get(ring.http, "/health")
    assert (status, json.loads(body)) == (200, {"status": "serving"})
    call = ring.stub.Generate(pb.GenerateRequest(token_ids=PROMPT, max_tokens=LONG), timeout=120)
    next(call)
    scrape_until(ring.http, lambda s: total(s, "trinity_sequences_running") == 1
                 and all(total(s, "trinity_kv_cache_bytes", rank=r) > 0 for r in ("0", "1")),
                 "a running sequence with KV caches on both ranks")
    call.cancel()
    scrape_until(ring.http, lambda s: total(s, "trinity_requests_total", front_end="grpc", outcome="cancelled") == 1
                 and total(s, "trinity_sequences_running") == 0, "the cancelled request")


def test_a_prompt_arriving_while_one_decodes_rides_in_its_steps(ring, served):
    """Chunked prefill over the real ring: with a request decoding in each group (both ranks busy),
    a new prompt's chunk goes in a decode step (a mixed frame, which both ranks count), and its
    tokens are those it gets alone."""
    fresh = list(reversed(PROMPT))  # not in the prefix cache: its prompt has chunks to send
    calls = [ring.stub.Generate(pb.GenerateRequest(token_ids=PROMPT[k:], max_tokens=LONG), timeout=120)
             for k in (0, 1)]
    for call in calls:
        next(call)
    beside = generate(ring.stub, token_ids=fresh, max_tokens=8)
    for call in calls:
        call.cancel()
    alone = generate(ring.stub, token_ids=fresh, max_tokens=8)
    assert beside["token_ids"] == alone["token_ids"]
    assert max(abs(a - b) for a, b in zip(beside["logprobs"], alone["logprobs"])) < 1e-4
    scrape_until(ring.http, lambda s: total(s, "trinity_rank_mixed_frames_total", rank="0") > 0
                 and total(s, "trinity_rank_mixed_frames_total", rank="0")
                 == total(s, "trinity_rank_mixed_frames_total", rank="1"), "mixed frames on both ranks")


def test_a_killed_rank_turns_health_down_and_counts_a_ring_failure(ring, served):
    """Last: the ring does not survive it."""
    conn = http.client.HTTPConnection(*ring.http, timeout=30)  # kept alive: rank 0 lives about 1 s after the failure
    assert get(ring.http, "/health", conn)[0] == 200
    call = ring.stub.Generate(pb.GenerateRequest(token_ids=PROMPT, max_tokens=LONG), timeout=120)
    received = len(next(call).token_ids)
    os.kill(ring.procs[1].pid, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as failure:
        for response in call:
            received += len(response.token_ids)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    # Health turned down before any client heard of the failure.
    status, kind, body = get(ring.http, "/health", conn)
    body = json.loads(body)
    assert status == 503 and kind == "application/json" and body["status"] == "down", body
    host = socket.gethostname()
    assert body["reason"].startswith(f"the pipeline is down: rank 1 (host {host}) stopped responding"), body
    samples = scrape(ring.http, conn)
    assert total(samples, "trinity_ring_failures_total") == 1
    assert ring.procs[0].wait(timeout=15) == EXIT_PEER_FAILED
    output = ring.output(10**7)
    stop = re.search(r"trinity: server stopped \(the pipeline is down: rank 1 \(host .*\) stopped responding.*\): "
                     r"up [\d.]+ s, served (\d+) requests", output)
    # It counts the request the failure ended (+ the five before it), logged before it.
    assert stop and int(stop.group(1)) == len(served) + 6, output[-3000:]
    failed = access_lines(output[: stop.start()])[-1]
    assert (failed["status"], failed["outcome"]) == ("UNAVAILABLE", "error"), failed
    assert int(failed["completion_tokens"]) == received, failed  # what the client got before the error
    assert "rank 1" in json.loads(failed["error"])


def test_a_metrics_port_beside_grpc_alone(hf_checkpoint, monkeypatch):
    """--metrics: /health (open) and /metrics (behind the token) on a port of their own, from
    before the model loads; a Generate call refused for its token is logged and counted; the
    launcher's restart count; the stop line."""
    monkeypatch.setenv("TRINITY_RESTARTS", "2")  # as `launch run` sets it after two restarts
    port = free_port_range(1)
    s = Server(hf_checkpoint, 1, ["--metrics", f"127.0.0.1:{port}", "--auth-token", TOKEN, *SERVER_ARGS])
    address, auth = ("127.0.0.1", port), [("authorization", f"Bearer {TOKEN}")]
    try:
        states = []  # /health as the server starts, each change once
        end = time.monotonic() + 300
        while not states or states[-1] != (200, "serving"):
            assert time.monotonic() < end and s.procs[0].poll() is None, s.output()
            try:
                status, _, body = get(address, "/health")
            except OSError:
                time.sleep(0.005)
                continue
            state = (status, json.loads(body)["status"])
            if not states or states[-1] != state:
                states.append(state)
        assert states == [(503, "loading"), (200, "serving")], states
        s.wait_serving()
        outs = [generate(s.stub, metadata=auth, token_ids=PROMPT, max_tokens=n) for n in (3, 5)]
        denied = rpc_error(lambda: generate(s.stub, token_ids=PROMPT, max_tokens=3))  # no token
        assert denied.code() == grpc.StatusCode.UNAUTHENTICATED, denied
        assert get(address, "/metrics")[0] == 401
        assert get(address, "/v1/models", token=TOKEN)[0] == 404  # no API here
        samples = scrape_until(address, lambda x: total(x, "trinity_requests_total") == 3, "requests", token=TOKEN)
        assert total(samples, "trinity_requests_total", front_end="grpc", outcome="unauthenticated") == 1
        assert total(samples, "trinity_generated_tokens_total", front_end="grpc") == \
            sum(o["usage"].completion_tokens for o in outs)
        assert total(samples, "trinity_ring_restarts_total") == total(samples, "trinity_ring_failures_total") == 2
        assert total(samples, "trinity_rank_forward_frames_total", rank="0") > 0
        os.kill(s.procs[0].pid, signal.SIGTERM)
        assert s.procs[0].wait(timeout=30) == 0
        prompt, cached, generated = (sum(getattr(o["usage"], k) for o in outs)
                                     for k in ("prompt_tokens", "cached_tokens", "completion_tokens"))
        refused = [line for line in access_lines(s.output()) if line["status"] == "UNAUTHENTICATED"]
        assert [(r["route"], r["outcome"], r["completion_tokens"]) for r in refused] == \
            [("Generate", "unauthenticated", "0")], s.output()
        assert re.search(rf"trinity: server stopped \(stopped by SIGTERM\): up [\d.]+ s, served 3 requests "
                         rf"\(2 length, 1 unauthenticated\), {prompt} prompt tokens \({cached} cached\), {generated} generated tokens$",
                         s.output(), re.M), s.output()
    finally:
        s.stop()
