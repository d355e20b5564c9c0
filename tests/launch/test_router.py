"""launch/router/: under `python -m launch run --restart N … --serve`, the front ends live
in the launcher and replay in-flight requests on the restarted ring. Real processes:
a launcher with 3 local ranks; ranks are SIGKILLed (rank 1, rank 2, rank 0) or frozen
(SIGSTOP) while streams run, and every stream must finish without an error and with
exactly the tokens and text of an undisturbed run. Nothing may be left running."""

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from browser import Browser, counter, events, page_state, ranks
from grpc_stream import Stream
from reference import PROMPT
from router_launcher import NOT_SERVING, SERVING, Launcher, assert_same, serving

pytestmark = pytest.mark.slow  # rings killed and frozen under the launcher, then restarted

LONG = 160  # tokens of the stream a kill interrupts (the tiny checkpoint's EOS comes at ~400)
KILL_AFTER = 12  # tokens a stream has passed on before the kill


@pytest.fixture(scope="module")
def launcher(hf_checkpoint, tmp_path_factory):
    with serving(Launcher(hf_checkpoint, tmp_path_factory.mktemp("router") / "launch.log", 3, "--restart", "8")) as la:
        yield la


@pytest.fixture(scope="module")
def undisturbed(launcher):
    return Stream(launcher.stub, token_ids=PROMPT, max_tokens=LONG, temperature=0.0)


def serve_port(pid: int) -> int:
    """The port of a rank 0's internal --serve (the router's upstream), from its command line."""
    args = subprocess.run(["ps", "-ww", "-o", "args=", "-p", str(pid)], capture_output=True, text=True).stdout.split()
    return int(args[args.index("--serve") + 1].rsplit(":", 1)[1])


@contextlib.contextmanager
def taken(port: int):
    """Another process's listening socket on `port`, as soon as the port is free (it was
    rank 0's: its kill frees it), held while the block runs."""
    squatter = socket.socket()
    end = time.monotonic() + 30
    while True:
        try:
            squatter.bind(("127.0.0.1", port))
            break
        except OSError:
            assert time.monotonic() < end, f"port {port} never freed"
            time.sleep(0.002)
    squatter.listen()
    try:
        yield
    finally:
        squatter.close()


def kill_mid_stream(launcher, streams, rank, sig=signal.SIGKILL, health=None, then=contextlib.nullcontext):
    """Once every stream has passed on KILL_AFTER tokens, signal `rank` of the ring; with `health`
    (a list), record the health states seen until SERVING again, inside then(the ranks killed)."""
    for s in streams:
        s.wait_tokens(KILL_AFTER)
    ranks = launcher.ranks()
    if health is not None:
        health.append(launcher.status())  # before the kill: the launcher may notice it before our first poll
    os.kill(ranks[rank], sig)
    with then(ranks):
        wait_health(launcher, health)
    return ranks


def wait_health(launcher, health) -> None:
    if health is not None:
        end = time.monotonic() + 120
        while time.monotonic() < end and not (NOT_SERVING in health and health[-1] == SERVING):
            status = launcher.status()
            if not health or health[-1] != status:
                health.append(status)
            time.sleep(0.02)


@pytest.mark.parametrize("rank", [2, 0])  # rank 1: the eight streams' kill below
def test_a_stream_survives_a_rank_killed_mid_stream(launcher, undisturbed, rank):
    stream = Stream(launcher.stub, token_ids=PROMPT, max_tokens=LONG, temperature=0.0)
    health = []
    # Rank 0's internal port is taken by another process the moment the kill frees it: the
    # restarted rank 0 serves the router on a fresh one (it cannot count on getting it back).
    port = serve_port(launcher.ranks()[0])
    squat = (lambda _: taken(port)) if rank == 0 else contextlib.nullcontext
    before = kill_mid_stream(launcher, [stream], rank, health=health, then=squat)
    assert_same(stream, undisturbed)
    assert health[:1] == [SERVING] and NOT_SERVING in health and health[-1] == SERVING, health
    assert launcher.ranks()[rank] != before[rank]  # a restarted ring served the rest
    assert serve_port(launcher.ranks()[0]) != port
    assert "launch: router: replayed a request after" in launcher.output()


def test_eight_concurrent_streams_through_one_kill(launcher):
    fields = [dict(token_ids=PROMPT, max_tokens=LONG, temperature=0.0),
              dict(token_ids=PROMPT[:3], max_tokens=60, temperature=0.0),
              dict(token_ids=PROMPT, max_tokens=120, temperature=0.8, seed=7),
              dict(token_ids=PROMPT[2:], max_tokens=90, temperature=1.0, top_k=20, seed=11),
              dict(token_ids=PROMPT, max_tokens=40, temperature=0.0),
              dict(token_ids=PROMPT[:5], max_tokens=150, temperature=0.7, top_p=0.9, seed=3),
              dict(token_ids=PROMPT[1:], max_tokens=80, temperature=0.0, stop=["the"]),
              dict(token_ids=PROMPT, max_tokens=100, temperature=0.9, seed=5, repetition_penalty=1.2)]
    refs = [Stream(launcher.stub, **f) for f in fields]
    for ref in refs:
        ref.result()
    streams = [Stream(launcher.stub, **f) for f in fields]
    long = [s for s, ref in zip(streams, refs) if len(ref.tokens) > 3 * KILL_AFTER]
    assert len(long) >= 4
    health = []
    before = kill_mid_stream(launcher, long, 1, health=health)
    for stream, ref in zip(streams, refs):
        assert_same(stream, ref)
    assert health[:1] == [SERVING] and NOT_SERVING in health and health[-1] == SERVING, health
    assert launcher.ranks()[1] != before[1]  # a restarted ring served the rest


@pytest.mark.parametrize("rank", [2, 0])
def test_a_frozen_rank_is_timed_out_and_the_stream_replayed(launcher, undisturbed, rank):
    # A frozen rank 0 keeps its connections open and silent: the router's health poll
    # times out, ends the epoch and cancels the stream, which is replayed on the new ring.
    stream = Stream(launcher.stub, token_ids=PROMPT, max_tokens=LONG, temperature=0.0)
    frozen = kill_mid_stream(launcher, [stream], rank, sig=signal.SIGSTOP)[rank]
    assert_same(stream, undisturbed)
    assert f"rank {rank}" in launcher.output() and not Path(f"/proc/{frozen}").exists()


def test_an_openai_http_stream_survives_a_kill(launcher, undisturbed):
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{launcher.http}/v1", api_key="none", max_retries=0)
    chunks = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=LONG, temperature=0,
                                       stream=True)
    text, n, killed = "", 0, None
    for chunk in chunks:
        text += chunk.choices[0].text
        n += 1
        if n == KILL_AFTER:
            killed = launcher.ranks()
            os.kill(killed[1], signal.SIGKILL)
    assert killed is not None and launcher.ranks()[1] != killed[1]
    assert text == undisturbed.result()[1]
    health = urllib.request.urlopen(f"http://{launcher.http}/health", timeout=10).read()
    assert b'"serving"' in health


def test_the_status_page_shows_the_ring_down_and_back(launcher, tmp_path):
    # The router outlives the ring: its page stays readable, says why, and counts the restart.
    browser = Browser()
    try:
        browser.open(f"http://{launcher.http}/")
        browser.wait(lambda: page_state(browser) == "serving" and len(ranks(browser)) == 3, "the ring drawn")
        restarts = int(counter(browser, "restarts"))
        os.kill(launcher.ranks()[1], signal.SIGKILL)
        browser.wait(lambda: page_state(browser) == "recovering", "the ring down", timeout=120)
        assert browser.text("#state").startswith("NOT_SERVING") and browser.text("#reason"), browser.text("#reason")
        assert len(ranks(browser)) == 3  # the last rank map stays, dimmed
        browser.screenshot("status-page-down.png", tmp_path)
        browser.wait(lambda: page_state(browser) == "serving", "the ring back", timeout=120)
        assert int(counter(browser, "restarts")) == int(counter(browser, "ring failures")) == restarts + 1
        assert events(browser)[-3:] == ["serving", "recovering", "serving"]
        assert browser.console_errors() == []
    finally:
        browser.close()


def test_the_launcher_gives_up_requests_fail_naming_the_failure(hf_checkpoint, tmp_path):
    la = Launcher(hf_checkpoint, tmp_path / "launch.log", 2, "--restart", "0")
    try:
        la.wait_serving()
        stream = Stream(la.stub, token_ids=PROMPT, max_tokens=LONG, temperature=0.0)
        stream.wait_tokens(KILL_AFTER)
        os.kill(la.ranks()[1], signal.SIGKILL)
        stream.join(120)
        assert stream.error is not None and stream.error.startswith("UNAVAILABLE"), stream.error
        assert "rank 1 was killed by SIGKILL" in stream.error and "no restarts left" in stream.error
        assert la.proc.wait(timeout=60) == 128 + signal.SIGKILL
    finally:
        la.close()


def test_no_router_serves_from_rank_0(hf_checkpoint, tmp_path, undisturbed):
    la = Launcher(hf_checkpoint, tmp_path / "launch.log", 2, "--no-router")
    try:
        la.wait_serving()
        stream = Stream(la.stub, token_ids=PROMPT, max_tokens=LONG, temperature=0.0)
        assert stream.result()[:2] == undisturbed.result()[:2]
        out = la.output()
        assert f"on {la.address} (gRPC) and {la.http} (HTTP)" in out and "router" not in out, out[-3000:]
    finally:
        la.close()
