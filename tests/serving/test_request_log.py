"""request_log.py on its own: a request's events, timed through its Trace, become one
access-log line and its metrics; refused requests get their outcome from the status;
the stop line sums what was served (tests/serving/test_metrics.py: the same on real
servers, through both front ends); and the recent figures' arithmetic (the last minute's tok/s,
TTFT percentiles, forward shares, the chart's 10 s steps) on a clock the test moves."""

import json
import time

from distributed.runtime.request import FinishEvent, GenerationRequest, TokenEvent
from distributed.runtime.scheduler import RequestHandle
from distributed.serving.request_log import Recent, RequestLog, percentile


def handle_with(*events) -> RequestHandle:
    handle = RequestHandle(GenerationRequest([1, 2, 3, 4]))
    for event in events:
        handle.emit(event)
    return handle


def sample(log: RequestLog, name: str, **labels) -> float:
    return log.metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_request_that_ran():
    lines = []
    log = RequestLog(write=lines.append)
    trace = log.begin("http", "/v1/completions", "127.0.0.1")
    tokens = [TokenEvent(t, -0.5, "x") for t in (7, 8, 9)]
    handle = handle_with(*tokens, FinishEvent("length", 4, 3, cached_tokens=2, disk_tokens=1))
    assert list(trace.events(handle))[:3] == tokens
    trace.end(200)
    trace.end(200)  # once only
    assert len(lines) == 1 and lines[0].startswith(
        "request front_end=http route=/v1/completions status=200 outcome=length prompt_tokens=4 cached_tokens=2 "
        "cached_ram=1 cached_disk=1 completion_tokens=3 ttft_s=0."), lines
    assert lines[0].endswith(" client=127.0.0.1") and "error=" not in lines[0]
    assert sample(log, "trinity_requests_total", front_end="http", outcome="length") == 1
    assert sample(log, "trinity_prompt_tokens_total", front_end="http") == 4
    assert sample(log, "trinity_prompt_tokens_cached_total", front_end="http") == 2
    assert sample(log, "trinity_generated_tokens_total", front_end="http") == 3
    assert sample(log, "trinity_time_to_first_token_seconds_count", front_end="http") == 1
    assert sample(log, "trinity_inter_token_latency_seconds_count", front_end="http") == 2


def test_refused_requests_and_a_failed_one():
    lines = []
    log = RequestLog(write=lines.append)
    for front_end, status in (("http", 429), ("grpc", "INVALID_ARGUMENT"), ("http", 503), ("grpc", None),
                              ("http", 200)):  # the last: a stream whose client went away
        log.begin(front_end, "r", "c").end(status, "why" if status else None)
    failed = log.begin("grpc", "Generate", "c")  # open as the ring fails: the stop line waits for it
    log.ring_failed("rank 1 died")
    list(failed.events(handle_with(TokenEvent(5, -1.0, "y"), FinishEvent("error", 4, 1, error="rank 1 died"))))
    failed.end("UNAVAILABLE")
    end = time.monotonic() + 10
    while not lines[-1].startswith("server stopped"):
        assert time.monotonic() < end, lines
        time.sleep(0.01)
    stop = lines.pop()  # after the failed request's line
    outcomes = [dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)["outcome"] for line in lines]
    assert outcomes == ["queue_full", "invalid", "unavailable", "cancelled", "cancelled", "error"], lines
    assert json.loads(lines[-1].split("error=", 1)[1]) == "rank 1 died"
    assert " ttft_s=- " in lines[0] and " status=- " in lines[3]
    assert sample(log, "trinity_requests_total", front_end="grpc", outcome="error") == 1
    assert sample(log, "trinity_generated_tokens_total", front_end="grpc") == 1
    assert sample(log, "trinity_request_duration_seconds_count", front_end="http") == 3

    log.stopped("stopped by SIGTERM")  # the server already said it stopped
    assert sample(log, "trinity_ring_failures_total") == 1
    stops = [line for line in lines if line.startswith("server stopped")] + [stop]
    assert len(stops) == 1 and stops[0].startswith("server stopped (the pipeline is down: rank 1 died): up "), stops
    assert stops[0].endswith(" s, served 6 requests (2 cancelled, 1 error, 1 invalid, 1 queue_full, "
                             "1 unavailable), 4 prompt tokens (0 cached), 1 generated tokens"), stops



class Clock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


def test_percentile_is_the_nearest_rank():
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([3.0, 1.0, 2.0], 0.99) == 3.0
    assert percentile(list(range(1, 101)), 0.99) == 99


def test_tokens_and_first_tokens_of_the_last_minute_only():
    clock = Clock()
    recent = Recent(clock)
    for _ in range(30):
        recent.token()
    recent.first_token(0.5)
    clock.now += 10
    for _ in range(30):
        recent.token()
    recent.first_token(0.1)
    assert recent.figures() == {"window_s": 60.0, "tokens_per_s": 6.0, "first_tokens": 2, "ttft_p50_s": 0.1,
                                "ttft_p99_s": 0.5}  # 60 tokens over the 10 s since the start
    clock.now += 55  # the first second's tokens and first token are over a minute old
    assert recent.figures() == {"window_s": 60.0, "tokens_per_s": 0.5, "first_tokens": 1, "ttft_p50_s": 0.1,
                                "ttft_p99_s": 0.1}


def test_history_steps_of_10_s_over_five_minutes():
    clock = Clock(1000.0)
    recent = Recent(clock)
    recent.token()
    recent.first_token(0.2)
    clock.now = 1025.0
    for _ in range(5):
        recent.token()
    points = recent.history()["points"]
    assert points == [{"tokens_per_s": 0.1, "ttft_p50_s": 0.2}, {"tokens_per_s": 0.0, "ttft_p50_s": None},
                      {"tokens_per_s": 1.0, "ttft_p50_s": None}]  # the last: 5 tokens in its 5 s so far
    clock.now = 1000.0 + 3600
    assert len(recent.history()["points"]) == 30 and recent.history()["points"][-1]["tokens_per_s"] == 0


def test_forward_share_from_the_oldest_snapshot_that_has_the_rank():
    clock = Clock()
    recent = Recent(clock)
    assert recent.forward_shares({0: {"forward_seconds": 1.0}}) == {0: None}  # nothing a second old yet
    clock.now += 2
    shares = recent.forward_shares({0: {"forward_seconds": 2.0}, 1: {"forward_seconds": 5.0}})
    assert shares == {0: 0.5, 1: None}  # rank 1 was first heard now
    clock.now += 4
    assert recent.forward_shares({0: {"forward_seconds": 2.0}, 1: {"forward_seconds": 6.0}}) == {0: 0.1667, 1: 0.25}
