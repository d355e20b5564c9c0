"""Faults become clean errors, never hangs: real processes, real signals.

A rank killed (SIGKILL) or frozen (SIGSTOP) mid-stream: the stream ends
UNAVAILABLE naming the rank and its host, and every surviving rank exits
non-zero within 15 s with a line naming the failed rank. Start-up: a missing
weight file on one rank is shown on rank 0; a rank that never connects makes
rank 0 exit naming it.
"""

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_server import LONG, NOT_SERVING, SERVER_ARGS, SERVICE, SERVING, Server, env, rpc_error

from conftest import ROOT, RUN, free_port_range
from distributed.serving.proto import generation_pb2 as pb
from distributed.shard.tiny_checkpoint import make_checkpoint
from distributed.startup.watchdog import EXIT_PEER_FAILED
from reference import PROMPT

EXIT_WITHIN_S = 15.0
IDS = ",".join(map(str, PROMPT))


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for its parent counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in "ZX"
    except OSError:
        return True


def wait_gone(pids, since: float, limit: float = EXIT_WITHIN_S) -> dict:
    """Seconds from `since` until each pid exited; fails past `limit`."""
    times = {}
    while len(times) < len(pids) and time.monotonic() - since < limit + 5:
        for pid in pids:
            if pid not in times and gone(pid):
                times[pid] = time.monotonic() - since
        time.sleep(0.02)
    late = {pid: times.get(pid) for pid in pids if times.get(pid, limit + 1) > limit}
    assert not late, f"still running (or late) after {limit} s: {late}"
    return times


def start_sse(server):
    """A streamed chat completion over HTTP, its headers and first event received."""
    conn = http.client.HTTPConnection(*server.http, timeout=60)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG, "stream": True}  # no model: the served one
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # the role chunk, sent at once
    return response


def start_in_flight(server):
    """A long greedy stream, with its first token received."""
    call = server.stub.Generate(pb.GenerateRequest(token_ids=PROMPT, max_tokens=LONG), timeout=120)
    next(call)
    return call


@pytest.fixture
def ranks3(hf_checkpoint):
    """3 ranks started by hand, with the environment mlx.launch gives them
    (MLX_RANK, MLX_HOSTFILE), so their exit codes are ours to see: mlx.launch
    itself SIGTERMs every rank 0.1-1.1 s after one dies, racing the watchdog."""
    s = Server(hf_checkpoint, 3, ["--split", "3,1,4", "--http", "127.0.0.1:0", *SERVER_ARGS], manual=True)
    try:
        s.wait_serving()
        s.http = s.http_address()
        s.ranks = s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).ranks
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("victim", [0, 1, 2])
def test_a_rank_killed_mid_stream(ranks3, victim):
    """P = 3; SIGKILL rank `victim` while a stream is running."""
    s = ranks3
    host = s.ranks[victim].host
    call = start_in_flight(s)
    sse = start_sse(s)
    killed_at = time.monotonic()
    os.kill(s.procs[victim].pid, signal.SIGKILL)
    error = rpc_error(list, call)
    seen_after = s.health_status()
    try:
        events = sse.read().decode()
    except (http.client.HTTPException, OSError) as e:  # rank 0 gone mid-read
        events = repr(e)
    survivors = [r for r in range(3) if r != victim]
    times = wait_gone([s.procs[r].pid for r in survivors], killed_at)
    codes = {r: s.procs[r].wait() for r in survivors}
    log = s.output(100000)
    # Every survivor logs one line naming the failed rank, and exits non-zero on its own.
    line = f"trinity: rank {victim} (host {host}) stopped responding (connection closed); exiting"
    assert log.count(line) == 2, log[-3000:]
    assert set(codes.values()) == {EXIT_PEER_FAILED}, (codes, log[-3000:])
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    if victim != 0:
        assert f"rank {victim} (host {host}) stopped responding" in error.details(), error.details()
        assert seen_after in (NOT_SERVING, grpc.StatusCode.UNAVAILABLE), seen_after  # UNAVAILABLE: exited
        # HTTP, mid-stream: an error event (OpenAI's shape) naming the rank, then the stream ends.
        error_event = next(json.loads(line[6:]) for line in events.splitlines() if line.startswith('data: {"error"'))
        assert error_event["error"]["type"] == "service_unavailable", error_event
        assert f"rank {victim} (host {host}) stopped responding" in error_event["error"]["message"], error_event
    print(f"SIGKILL rank {victim}: survivors exited after {sorted(round(t, 2) for t in times.values())} s; "
          f"health just after the stream's error: {seen_after}; client saw {error.code()}: {error.details()}")


def test_a_rank_frozen_mid_stream(hf_checkpoint):
    """SIGSTOP: the rank's connection stays open but its heartbeats stop. Ranks
    started by hand (as a launcher would), so their exit codes are ours to see."""
    s = Server(hf_checkpoint, 2, [*SERVER_ARGS, "--peer-timeout", "2"], manual=True)
    try:
        s.wait_serving()
        call = start_in_flight(s)
        frozen_at = time.monotonic()
        os.kill(s.procs[1].pid, signal.SIGSTOP)
        error = rpc_error(list, call)
        detected = time.monotonic() - frozen_at
        seen_after = s.health_status()
        assert s.procs[0].wait(timeout=EXIT_WITHIN_S) == EXIT_PEER_FAILED
        exited = time.monotonic() - frozen_at
        host = socket.gethostname()
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert re.search(rf"rank 1 \(host {re.escape(host)}\) stopped responding \(no heartbeat for 2\.\d s\)",
                         error.details()), error.details()
        assert seen_after in (NOT_SERVING, grpc.StatusCode.UNAVAILABLE), seen_after
        # Not at once (it waited out the 2 s peer timeout, less the time since the last heartbeat); the
        # upper bound is the exit's own, as a loaded machine delays the watchdog's thread.
        assert 1.0 <= detected < EXIT_WITHIN_S, detected
        assert "trinity: rank 1 (host" in s.output() and "no heartbeat" in s.output()
        print(f"SIGSTOP rank 1: stream failed after {detected:.2f} s, rank 0 exited after {exited:.2f} s")
        # Thawed, the frozen rank finds rank 0 gone and exits too.
        os.kill(s.procs[1].pid, signal.SIGCONT)
        assert s.procs[1].wait(timeout=EXIT_WITHIN_S) == EXIT_PEER_FAILED
        assert "trinity: rank 0 (host" in s.output()
    finally:
        for p in s.procs:
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        s.stop()


def test_a_rank_killed_while_the_ring_is_idle(hf_checkpoint):
    """No request running, so no MLX call notices: only the watchdog can. Health is
    watched, not polled: the server pushes NOT_SERVING to the stream however briefly
    it lasts before rank 0 exits (about 1 s), and the stream ends when rank 0 does."""
    s = Server(hf_checkpoint, 2, SERVER_ARGS, manual=True)
    try:
        s.wait_serving(timeout=120)
        watch = s.health.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=EXIT_WITHIN_S + 10)
        assert next(watch).status == SERVING
        killed_at = time.monotonic()
        s.procs[1].kill()
        seen = []  # health after the kill, as pushed, then how the stream ended
        try:
            for response in watch:
                seen.append(response.status)
        except grpc.RpcError as e:
            seen.append(e.code())
        wait_gone([s.procs[0].pid], killed_at)
        code = s.procs[0].wait()
        log = s.output()
        assert seen[:1] == [NOT_SERVING] and SERVING not in seen, (seen, log)
        assert code == EXIT_PEER_FAILED, (code, log)
        assert f"trinity: rank 1 (host {socket.gethostname()}) stopped responding (connection closed)" in log, log
        names = [getattr(x, "name", None) or health_pb2.HealthCheckResponse.ServingStatus.Name(x) for x in seen]
        print(f"idle ring: rank 0 exited {time.monotonic() - killed_at:.2f} s after rank 1 was killed; health {names}")
    finally:
        s.stop()


def start_rank(rank: int, hostfile: str, args, out):
    return subprocess.Popen([sys.executable, RUN, *args], env=dict(env(), MLX_RANK=str(rank), MLX_HOSTFILE=hostfile),
                            stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True)


def ring_hostfile(tmp_path: Path, ranks: int) -> str:
    base = free_port_range(ranks + 1)  # + 1: rank 0's control port is one above the ring's
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(ranks)]))
    return str(path)


def test_a_missing_weight_file_is_shown_on_rank_0(tmp_path):
    """Rank 1's weight file is missing; each rank has its own output, as on two
    machines: rank 0's must show rank 1's error."""
    model = make_checkpoint(tmp_path / "model", layers_per_file=2)  # rank 1 alone reads file 3 of 4
    missing = "model-00003-of-00004.safetensors"
    (model / missing).unlink()
    hostfile = ring_hostfile(tmp_path, 2)
    args = ["--model", str(model), "--prompt-ids", IDS, "--max-tokens", "4"]
    outs = [open(tmp_path / f"rank{r}.log", "w+") for r in range(2)]
    procs = [start_rank(r, hostfile, args, outs[r]) for r in range(2)]
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    rank0, rank1 = (Path(o.name).read_text() for o in outs)
    assert codes[0] != 0 and codes[1] != 0, (codes, rank0, rank1)
    assert f"error: rank 1 failed to start on host {socket.gethostname()}: weight file {missing} is missing" in rank0, rank0
    assert f"error: weight file {missing} is missing" in rank1, rank1
    assert "Traceback" not in rank0 + rank1 and "trinity:" not in rank0 + rank1  # each says why, once


def test_a_rank_that_never_connects(tmp_path):
    """Only rank 0 of 2 starts (and, apart, only rank 1 of 2): each exits naming
    the rank that never came, within --connect-timeout."""
    args = ["--prompt-ids", IDS, "--max-tokens", "4", "--connect-timeout", "3"]
    outs = [open(tmp_path / f"alone{r}.log", "w+") for r in range(2)]
    hostfiles = []
    for r in range(2):  # two separate rings: rank 0 of one, rank 1 of the other
        (tmp_path / f"ring{r}").mkdir()
        hostfiles.append(ring_hostfile(tmp_path / f"ring{r}", 2))
    procs = [start_rank(r, hostfiles[r], args, outs[r]) for r in range(2)]
    started = time.monotonic()
    try:
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    took = time.monotonic() - started
    rank0, rank1 = (Path(o.name).read_text() for o in outs)
    assert codes == [EXIT_PEER_FAILED, EXIT_PEER_FAILED], (codes, rank0, rank1)
    assert re.search(r"trinity: rank 1 \(host 127\.0\.0\.1\) did not connect to rank 0 .* within 3 s", rank0), rank0
    assert re.search(r"trinity: rank 0 \(host 127\.0\.0\.1\) did not answer on its control port", rank1), rank1
    print(f"lone ranks exited after {took:.1f} s (3 s connect timeout)")


def test_a_one_shot_run_exits_with_the_message(hf_checkpoint, tmp_path):
    """Not serving: rank 1 killed mid-generation; rank 0 exits non-zero naming it."""
    hostfile = ring_hostfile(tmp_path, 2)
    args = [sys.executable, RUN, "--model", str(hf_checkpoint), "--prompt-ids", IDS, "--max-tokens", str(LONG)]
    err = open(tmp_path / "rank0.err", "w+")
    procs = [subprocess.Popen(args, env=dict(env(), MLX_RANK=str(r), MLX_HOSTFILE=hostfile), cwd=ROOT,
                              stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                              stderr=err if r == 0 else subprocess.DEVNULL, start_new_session=True)
             for r in range(2)]
    try:
        assert procs[0].stdout.read(1), "rank 0 printed no text"  # generating now
        killed_at = time.monotonic()
        procs[1].kill()
        assert procs[0].wait(timeout=EXIT_WITHIN_S) == EXIT_PEER_FAILED
        took = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    stderr = Path(err.name).read_text()
    assert f"trinity: rank 1 (host {socket.gethostname()}) stopped responding (connection closed); exiting" in stderr
    print(f"one-shot: rank 0 exited {took:.2f} s after rank 1 was killed")
