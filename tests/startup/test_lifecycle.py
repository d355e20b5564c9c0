"""Every way of stopping a ring ends every process within seconds and frees
its ports: real run_trinity.py ranks under mlx.launch (on its default ports,
so each case also shows the previous one left them free), under
`python -m launch run`, and one-shot generations interrupted with Ctrl-C; then
distributed.startup.lifecycle on its own (signals, the deadline, a second Ctrl-C)."""

import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest

from conftest import ROOT, free_port_range
from distributed.serving.proto import generation_pb2 as pb
from distributed.serving.proto import generation_pb2_grpc as pb_grpc
from distributed.startup.lifecycle import EXIT_STOP_TIMEOUT
from reference import PROMPT
from stop_paths import (MLX_LAUNCH_PORTS, RUN, STOP_PATHS, Launch, describe, free_port, mlx_launch, ports_in_use,
                        serve_launch_run, serve_mlx_launch, tagged, who_holds)

pytestmark = pytest.mark.slow  # every way of stopping a real ring

GONE_WITHIN_S = 30  # the stop deadline is 10 s; a hang never ends
OUR_TRACEBACK = re.compile(r'File ".*(run_trinity\.py|/distributed/|/launch/)')
IDS = ",".join(map(str, PROMPT))


def generate(port: int) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GenerationStub(channel)
        responses = list(stub.Generate(pb.GenerateRequest(token_ids=PROMPT, max_tokens=4), timeout=60))
    return responses[-1].finish_reason


# mlx.launch's own hang (mlx 0.32): a KeyboardInterrupt that lands while its main loop holds a
# queue's lock leaves the lock taken, and its output threads then wait on it for ever. Its ranks
# are gone by then (they stop on their own); a second Ctrl-C ends it.
MLX_LAUNCH_LOCK_HANG = re.compile(r'_distributed_utils/launch\.py".*\n(.*\n)*.*(queue\.py|threading\.py)"(.*\n)*KeyboardInterrupt')


def assert_all_gone(launch: Launch, how: str, ports=()) -> float:
    took = launch.wait_gone(GONE_WITHIN_S)
    if took is None and "Ctrl-C" in how and not launch.ranks() and MLX_LAUNCH_LOCK_HANG.search(launch.output):
        print(f"{how}: the ranks are gone; mlx.launch hangs on its own queue lock (its bug): killed")
        launch.kill()
        took = launch.wait_gone(GONE_WITHIN_S)
    assert took is not None, f"{describe(tagged(launch.tag))} still running {GONE_WITHIN_S} s after {how}:\n{launch.output[-3000:]}"
    # A process that is exiting loses its memory (and so its command line, which the tag
    # check reads) before its files: its sockets close a moment after it looks gone.
    deadline = time.monotonic() + GONE_WITHIN_S
    while (busy := ports_in_use(list(ports))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not busy, f"ports {busy} still taken after {how}:\n{who_holds(busy)}\n{launch.output[-3000:]}"
    assert not OUR_TRACEBACK.search(launch.output), launch.output[-4000:]
    print(f"{how}: every process gone after {took:.2f} s")
    return took


# Not "SIGINT to the launcher" alone: mlx.launch's main loop dies of the KeyboardInterrupt, while
# its output threads keep the process alive until the ranks exit, and nothing reaches the ranks
# (docs/failures.md: signal the group, as Ctrl-C in a terminal does, or use `python -m launch run`).
MLX_LAUNCH_PATHS = [p for p in STOP_PATHS if p != "SIGINT to the launcher" and "rank 1" not in p] + ["SIGTERM to rank 1"]


@pytest.mark.parametrize("how", MLX_LAUNCH_PATHS)
def test_a_serving_ring_under_mlx_launch_stops_completely(how, hf_checkpoint):
    busy = ports_in_use(MLX_LAUNCH_PORTS)
    assert not busy, f"mlx.launch's default ports {busy} are taken before the ring starts"
    port = free_port()
    ring = serve_mlx_launch(str(hf_checkpoint), port)
    try:
        ring.wait_for(r"^serving ")
        assert generate(port) == "length"  # it served, then went idle (its ranks parked)
        STOP_PATHS[how](ring)
        assert_all_gone(ring, how, MLX_LAUNCH_PORTS + [port])
        assert "exited with code" not in ring.output, ring.output[-3000:]  # mlx.launch names a rank that failed
        if "launcher" not in how:  # mlx.launch itself saw every rank end well
            assert ring.proc.returncode == 0, ring.output[-3000:]
    finally:
        ring.kill()


# SIGINT to launch run takes SIGTERM's path; the one-shot Ctrl-C test below sends it one.
LAUNCH_RUN_PATHS = ["SIGTERM to the launcher", "SIGKILL to the launcher", "SIGHUP to rank 1"]


@pytest.mark.parametrize("how", LAUNCH_RUN_PATHS)
def test_a_serving_ring_under_launch_run_stops_completely(how, hf_checkpoint):
    port = free_port()
    ring = serve_launch_run(str(hf_checkpoint), port)
    try:
        ring.wait_for(r"^serving .*\(router; rank 0 at ")  # the launcher's router serves `port` (launch/router/)
        assert generate(port) == "length"
        STOP_PATHS[how](ring)
        assert_all_gone(ring, how, [port])
        if how != "SIGKILL to the launcher":
            assert ring.proc.returncode == 0, ring.output[-3000:]
    finally:
        ring.kill()


@pytest.mark.parametrize("launcher", ["one process", "mlx.launch", "launch run"])
def test_ctrl_c_mid_generation_ends_the_one_shot_run(launcher, hf_checkpoint):
    """Ctrl-C in a terminal signals the whole foreground group: the launcher and every rank.
    mlx.launch's own loop dies of the KeyboardInterrupt (its traceback, and rank 0's last
    lines, are lost: mlx.launch's doing); `launch run` relays them and exits 0."""
    args = [RUN, "--model", str(hf_checkpoint), "--prompt-ids", IDS, "--max-tokens", "1000"]
    run = Launch({
        "one process": [sys.executable, *args],
        "mlx.launch": [mlx_launch(), "-n", "2", "--starting-port", str(free_port_range(3)), sys.executable, *args],
        "launch run": [sys.executable, "-m", "launch", "run", "--single-host", "2", "--", *args],
    }[launcher])
    try:
        # The text is streaming (under launch run: after its "ring ...; control ..." line).
        run.wait_for(r"; control \S+\n[^\n]*\S" if launcher == "launch run" else r"\S", timeout=120)
        os.killpg(run.proc.pid, signal.SIGINT)  # some tokens out, hundreds still to come (EOS is at ~400)
        assert_all_gone(run, "Ctrl-C")
        if launcher != "mlx.launch":
            generated = re.search(r"^Generation: (\d+) tokens", run.output, re.M)
            assert generated, run.output[-3000:]
            assert 0 < int(generated.group(1)) < 300, run.output[-3000:]  # cut short
            assert run.proc.returncode == 0, run.output[-3000:]
        assert "exited with code" not in run.output, run.output[-3000:]
    finally:
        run.kill()


# ---------------------------------------------------------------- the Lifecycle on its own

PROCESS = """
import sys, threading, time
from distributed.startup.lifecycle import Lifecycle, block_stop_signals
block_stop_signals()
mode = sys.argv[1]
lifecycle = Lifecycle(deadline=float(sys.argv[2])).start()
done = threading.Event()
def on_stop(reason):
    print("stopping:", reason, flush=True)
    if mode == "finish":
        done.set()
lifecycle.on_stop(on_stop)
if mode == "peer":
    lifecycle.request_stop("rank 1 (host h) stopped by SIGTERM", from_peer=True)
print("ready", flush=True)
busy = time.monotonic() + 60
while not done.is_set() and time.monotonic() < busy:
    sum(range(10000))  # the main thread never waits on anything Python could interrupt
print("finished", flush=True)
"""


def lifecycle_process(mode: str, deadline: float = 30.0) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", PROCESS, mode, str(deadline)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout.readline() in ("ready\n", "stopping: rank 1 (host h) stopped by SIGTERM\n")
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_runs_the_stop_callbacks_and_the_process_ends_cleanly(sig):
    proc = lifecycle_process("finish")
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out == f"stopping: stopped by {signal.Signals(sig).name}\nfinished\n", (out, err)
    assert f"trinity: stopped by {signal.Signals(sig).name}: stopping (at most 30 s)" in err


def test_a_stop_that_does_not_finish_ends_at_the_deadline():
    proc = lifecycle_process("hang", deadline=1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_STOP_TIMEOUT, err
    assert "the stop did not finish within 1 s; exiting" in err


def test_a_second_ctrl_c_exits_at_once_but_a_peers_relay_is_not_one():
    proc = lifecycle_process("peer")  # already stopping, as asked by another rank
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)  # our own first: nothing more happens
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=1.0)
    proc.send_signal(signal.SIGINT)  # our own second: out now
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_STOP_TIMEOUT, err
    assert "stopped by SIGINT again: exiting now" in err
