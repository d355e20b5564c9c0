"""launch/router/ while the ring is down: requests wait in a bounded queue, and their
deadlines still apply. Real processes: a launcher with 2 local ranks (--max-batch 2,
--max-queue 2: the router holds at most 4 requests) whose ranks start behind a gate
(tests/ring_gate.py): the test shuts it before it kills a rank, so the restarted ring
stays down while the test acts, however long that takes on a loaded machine (the
launcher has logged "restarting the whole ring in" and started ranks that wait at the
gate), and opens it when the ring may come back. Nothing may be left running."""

import json
import os
import signal
import time
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from distributed.serving.proto import generation_pb2 as pb
from grpc_stream import Stream
from reference import PROMPT
from router_launcher import NOT_SERVING, SERVING, Launcher, assert_same, serving

pytestmark = pytest.mark.slow  # requests waiting out ring restarts and deadlines

MAX_BATCH, MAX_QUEUE = 2, 2
BOUND = MAX_BATCH + MAX_QUEUE  # requests the router holds while the ring is down
RESTARTING = "restarting the whole ring in"
BACK = "launch: router: ring back after"
FULL = (f"server busy, retry later: {BOUND} requests are already waiting for the ring to restart "
        f"(rank 0's max batch {MAX_BATCH} + --max-queue {MAX_QUEUE})")
REQUESTS = [dict(token_ids=PROMPT[i:], max_tokens=24, temperature=0.0) for i in range(BOUND)]  # each its own output


@pytest.fixture(scope="module")
def launcher(hf_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("router_queue")
    gate = folder / "gate"
    gate.touch()  # open: the first ring starts at once
    la = Launcher(hf_checkpoint, folder / "launch.log", 2, "--restart", "4", gate=gate,
                  serve_args=("--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE)))
    la.gate = gate
    with serving(la):
        yield la
        gate.touch()  # a failed test's ring may still wait at it


@pytest.fixture(scope="module")
def undisturbed(launcher):
    streams = [Stream(launcher.stub, **fields) for fields in REQUESTS]
    for s in streams:
        s.result()
    return streams


def wait_until(condition, what, timeout=60):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"not {what} after {timeout} s"
        time.sleep(0.05)


def held(la) -> float:
    """Requests the router holds that rank 0 has not started (its /metrics)."""
    text = urllib.request.urlopen(f"http://{la.http}/metrics", timeout=10).read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "trinity_requests_waiting")


def take_the_ring_down(la) -> int:
    """Shut the gate and SIGKILL rank 1; returns once the attempt has ended (the next one's
    ranks wait at the gate until bring_the_ring_back) and the router says NOT_SERVING.
    Returns the "ring back" lines logged so far."""
    restarts, back = la.output().count(RESTARTING), la.output().count(BACK)
    la.gate.unlink()
    os.kill(la.ranks()[1], signal.SIGKILL)
    wait_until(lambda: la.output().count(RESTARTING) > restarts, "restarting")
    wait_until(lambda: la.status() == NOT_SERVING, "NOT_SERVING")
    return back


def bring_the_ring_back(la) -> None:
    la.gate.touch()


def assert_still_down(la, back: int):
    assert la.status() == NOT_SERVING and la.output().count(BACK) == back, la.output()[-2000:]


def test_requests_wait_for_the_ring_and_beyond_the_bound_are_refused(launcher, undisturbed):
    back = take_the_ring_down(launcher)
    waiting = []
    for i, fields in enumerate(REQUESTS):
        waiting.append(Stream(launcher.stub, **fields))
        wait_until(lambda: held(launcher) == i + 1, f"holding {i + 1} requests")
    refused = [Stream(launcher.stub, **REQUESTS[0]) for _ in range(2)]
    for s in refused:
        s.join(30)
        assert s.error == f"RESOURCE_EXHAUSTED: {FULL}", s.error
    body = json.dumps({"prompt": "hi", "max_tokens": 4}).encode()
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(urllib.request.Request(f"http://{launcher.http}/v1/completions", body,
                                                      {"Content-Type": "application/json"}), timeout=30)
    assert http.value.code == 429
    assert json.loads(http.value.read())["error"]["message"] == FULL.replace("server busy, retry later",
                                                                             "the server is busy")
    assert_still_down(launcher, back)
    assert all(s.is_alive() and not s.tokens for s in waiting) and held(launcher) == BOUND
    bring_the_ring_back(launcher)
    for stream, ref in zip(waiting, undisturbed):  # the ring is back: each as if nothing had happened
        assert_same(stream, ref)
    wait_until(lambda: launcher.status() == SERVING and launcher.output().count(BACK) == back + 1, "SERVING again")
    (line,) = [line for line in launcher.output().splitlines() if line.startswith(BACK)][back:]
    assert line.endswith("; replaying 0 requests")  # none was cut: they only waited


def test_a_deadline_applies_while_the_request_waits_for_the_ring(launcher, undisturbed):
    back = take_the_ring_down(launcher)
    calls = []
    for fields in REQUESTS:  # as many as the bound: each must give its place up at its deadline
        calls.append(launcher.stub.Generate(pb.GenerateRequest(**fields), timeout=2))
    for call in calls:
        with pytest.raises(grpc.RpcError) as error:
            list(call)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error.value
    assert_still_down(launcher, back)  # they ended at their deadline, not when the ring came back
    wait_until(lambda: held(launcher) == 0, "giving their places up")
    assert_still_down(launcher, back)  # the router let them go at their deadline, not only the client
    waiting = [Stream(launcher.stub, **fields) for fields in REQUESTS]
    wait_until(lambda: held(launcher) == BOUND, f"holding {BOUND} requests")
    assert_still_down(launcher, back)
    bring_the_ring_back(launcher)
    for stream, ref in zip(waiting, undisturbed):
        assert_same(stream, ref)
    assert_same(Stream(launcher.stub, **REQUESTS[0]), undisturbed[0])  # and it keeps serving
