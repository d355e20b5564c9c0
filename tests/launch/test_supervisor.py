"""`python -m launch run --restart N` with real processes: a killed rank brings the
whole ring down and up again (clients that retry get the same greedy output), the
restart budget runs out with a non-zero exit, and a stop signal to the launcher is
a clean stop that is not restarted. No rank process may be left behind."""

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port_range
from distributed.serving.proto import generation_pb2 as pb
from distributed.serving.proto import generation_pb2_grpc as pb_grpc
from reference import PROMPT, mlx_lm_greedy

ROOT = Path(__file__).resolve().parents[2]
STARTED = re.compile(r"launch: started rank (\d+) \(pid (\d+)\)")
CONTROL = re.compile(r"control (127\.0\.0\.1:\d+)")
MAX_TOKENS = 8


class Launcher:
    def __init__(self, model, tmp_path, *launch_args):
        self.address = f"127.0.0.1:{free_port_range(1)}"
        self.metrics = f"127.0.0.1:{free_port_range(1)}"
        self.log_path = tmp_path / "launch.log"
        self.log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launch", "run", "--single-host", "2", *launch_args, "--",
             "run_trinity.py", "--model", str(model), "--serve", self.address, "--metrics", self.metrics],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def output(self) -> str:
        return self.log_path.read_text()

    def attempts(self):
        """Rank pids of each attempt, in order: [{rank: pid}, ...]."""
        out = []
        for rank, pid in STARTED.findall(self.output()):
            if rank == "0":
                out.append({})
            out[-1][int(rank)] = int(pid)
        return out

    def generate_retrying(self, timeout=120.0):
        """What a client that retries does: health SERVING, then one greedy Generate."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"the launcher exited:\n{self.output()[-4000:]}"
            try:
                status = self.health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    tokens, text = [], ""
                    for r in self.stub.Generate(pb.GenerateRequest(token_ids=PROMPT, max_tokens=MAX_TOKENS,
                                                                   temperature=0.0), timeout=60):
                        tokens += list(r.token_ids)
                        text += r.text
                    return tokens, text
            except grpc.RpcError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"no generation within {timeout:.0f} s:\n{self.output()[-4000:]}")

    def ring_counts(self):
        """(restarts, failures) as rank 0's metrics count them."""
        text = urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=10).read().decode()
        samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
        return samples["trinity_ring_restarts_total"], samples["trinity_ring_failures_total"]

    def close(self):
        self.channel.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for attempt in self.attempts():  # a failed test must not leave ranks behind either
            for pid in attempt.values():
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self.log.close()


def alive(pid: int) -> bool:
    """Running (a zombie, already dead and waiting to be reaped, does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def ring_processes(controls):
    """Every live process whose environment carries one of these rings' control address
    (the ranks, and anything they started)."""
    wanted = {f"TRINITY_CONTROL_ADDR={c}".encode() for c in controls}
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if env & wanted and alive(int(pid)):
            out.append(int(pid))
    return out


def wait_gone(pids, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.fixture(scope="module")
def reference(hf_checkpoint):
    return mlx_lm_greedy(hf_checkpoint, PROMPT, MAX_TOKENS, 2048)[0]


def test_restart_after_a_rank_is_killed_then_give_up(hf_checkpoint, tmp_path, reference):
    launcher = Launcher(hf_checkpoint, tmp_path, "--restart", "1", "--grace", "3", "--restart-delay", "0.2")
    try:
        before = launcher.generate_retrying()
        assert before[0] == reference
        assert launcher.ring_counts() == (0, 0)
        (first,) = launcher.attempts()
        os.kill(first[1], signal.SIGKILL)

        after = launcher.generate_retrying()  # reaches the restarted ring
        assert after == before
        assert launcher.ring_counts() == (1, 1)  # the restarted ring's rank 0 counts the failure before it
        _, second = launcher.attempts()
        assert set(second.values()).isdisjoint(first.values())
        assert wait_gone(list(first.values()), 10) == []
        out = launcher.output()
        assert "attempt 1/2 failed: rank 1 was killed by SIGKILL" in out and "restart 1 of 1" in out, out[-3000:]
        assert "trinity: server stopped (the pipeline is down: rank 1 " in out, out[-3000:]  # said by rank 0

        os.kill(second[1], signal.SIGKILL)  # the budget is spent: the launcher gives up
        assert launcher.proc.wait(timeout=60) == 128 + signal.SIGKILL, launcher.output()[-3000:]
        out = launcher.output()
        assert "attempt 2/2 failed: rank 1 was killed by SIGKILL" in out and "no restarts left" in out
        assert len(launcher.attempts()) == 2
        assert wait_gone(list(first.values()) + list(second.values()), 5) == []
        assert ring_processes(CONTROL.findall(out)) == []
    finally:
        launcher.close()


RANK_SCRIPT = """
import os, signal, subprocess, sys, time
rank = int(os.environ["MLX_RANK"])
mode = sys.argv[1]
print(f"rank {rank}: TRINITY_RESTARTS={os.environ.get('TRINITY_RESTARTS')}", file=sys.stderr, flush=True)
child = subprocess.Popen(["sleep", "300"])  # something the rank started: must not outlive the ring
def stop(*_):
    child.kill()
    sys.exit(0)
if (mode == "fail" and rank == 1) or (mode == "peers" and rank < 2):
    time.sleep(0.5)
    child.kill()
    sys.exit(3)
if rank == 0 or mode != "stubborn":
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
else:  # "stubborn": the other ranks ignore SIGTERM and SIGINT
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
print(f"rank {rank} ready", file=sys.stderr, flush=True)
time.sleep(300)
"""


def marked(mark: str):
    """Live processes whose environment carries TEST_RING_MARK=mark (inherited by everything
    a launcher started: mlx.launch, the ranks, what they started)."""
    want = f"TEST_RING_MARK={mark}".encode()
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if want in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") and alive(int(pid)):
                out.append(int(pid))
        except OSError:
            continue
    return out


def start_script(tmp_path, mode, *launch_args):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    log = open(tmp_path / "launch.log", "w")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TEST_RING_MARK=str(tmp_path))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.Popen([sys.executable, "-m", "launch", "run", "--single-host", "3", "--no-plan", *launch_args,
                             "--", str(script), mode], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)
    return proc, tmp_path / "launch.log"


def wait_for(path, text, count, timeout=30):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.read_text().count(text) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{count} x {text!r} not seen:\n{path.read_text()[-3000:]}")


@pytest.mark.parametrize("via, mode, sig, status", [("direct", "clean", signal.SIGTERM, 0),
                                                     ("direct", "stubborn", signal.SIGINT, 137),
                                                     ("mlx.launch", "clean", signal.SIGTERM, 0)])
def test_a_stop_signal_is_a_clean_stop_not_a_restart(tmp_path, via, mode, sig, status):
    """The signal goes to rank 0 (which stops the others through the ring, in real runs);
    ranks that are still there after --grace get SIGTERM, then SIGKILL. Never restarted;
    nothing the ranks started is left."""
    proc, log = start_script(tmp_path, mode, "--via", via, "--restart", "3", "--grace", "1")
    try:
        wait_for(log, "ready", 3)
        assert len(marked(str(tmp_path))) >= 7  # the launcher, 3 ranks, 3 sleeps (+ mlx.launch)
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=30) == status, log.read_text()
        out = log.read_text()
        assert f"{signal.Signals(sig).name}: stopping the ring" in out and "attempt 2" not in out, out
        if mode == "stubborn":
            assert "ignored SIGTERM: SIGKILL" in out
        assert wait_gone(marked(str(tmp_path)), 2) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("via", ["direct", "mlx.launch"])
def test_restart_budget_with_a_failing_rank(tmp_path, via):
    proc, log = start_script(tmp_path, "fail", "--via", via, "--restart", "2", "--grace", "0.5",
                             "--restart-delay", "0")
    try:
        assert proc.wait(timeout=60) == 3, log.read_text()
        out = log.read_text()
        assert "attempt 3/3: starting the ring" in out and "attempt 4" not in out
        for n in (1, 2):
            assert f"attempt {n}/3 failed: rank 1 exited with code 3" in out and f"restart {n} of 2" in out
        for n in (0, 1, 2):  # each attempt's ranks know how many restarts came before (their metrics count them)
            assert f"rank 1: TRINITY_RESTARTS={n}" in out, out
        assert "no restarts left (--restart 2); exit status 3" in out
        if via == "direct":
            assert len(CONTROL.findall(out)) == 3
        else:
            assert out.count("started mlx.launch") == 3
        assert wait_gone(marked(str(tmp_path)), 2) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_rank_that_did_not_exit_is_named_when_the_others_report_a_failed_peer(tmp_path):
    """Ranks 0 and 1 exit with the watchdog's "a peer failed" status (3) while rank 2
    stays (as a frozen rank would): rank 2 is named the cause and stopped without
    waiting out --grace."""
    tic = time.monotonic()
    proc, log = start_script(tmp_path, "peers", "--grace", "30")
    try:
        assert proc.wait(timeout=60) == 3, log.read_text()
        assert time.monotonic() - tic < 20
        out = log.read_text()
        assert "attempt 1/1 failed: rank 2 stopped responding: the other ranks reported a failed peer" in out, out
        assert wait_gone(marked(str(tmp_path)), 2) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
