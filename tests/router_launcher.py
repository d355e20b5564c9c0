"""`python -m launch run --single-host N … -- run_trinity.py … --serve` as a real process,
with the launcher's router in front of the ranks: what the router's tests
(tests/launch/test_router.py, test_router_queue.py) start, watch and disturb."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import ROOT, free_port_range
from distributed.serving.proto import generation_pb2_grpc as pb_grpc
from grpc_stream import Stream

STARTED = re.compile(r"launch: started rank (\d+) \(pid (\d+)\)")
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class Launcher:
    """The launcher with `ranks` local ranks, its log in log_path; gRPC and HTTP on free ports.
    gate: a file whose absence holds every rank of an attempt before it starts (ring_gate.py)."""

    def __init__(self, model, log_path: Path, ranks: int, *launch_args, serve_args=(), gate: Path = None):
        base = free_port_range(2)
        self.address, self.http = f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"
        self.log_path = log_path
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        held = [str(ROOT / "tests" / "ring_gate.py"), str(gate)] if gate is not None else []
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "launch", "run", "--single-host", str(ranks), "--grace", "3",
                 "--restart-delay", "0.2", *launch_args, "--", *held, "run_trinity.py", "--model", str(model),
                 "--serve", self.address, "--http", self.http, "--max-context", "2048", "--max-tokens-cap", "1024",
                 "--peer-timeout", "2", *serve_args],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ranks(self) -> dict:
        """The latest attempt's rank pids."""
        attempts = []
        for rank, pid in STARTED.findall(self.output()):
            if rank == "0":
                attempts.append({})
            attempts[-1][int(rank)] = int(pid)
        return attempts[-1] if attempts else {}

    def all_pids(self):
        return [int(pid) for _, pid in STARTED.findall(self.output())]

    def status(self):
        try:
            return self.health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError as e:
            return e.code()

    def wait_serving(self, timeout=180):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"the launcher exited:\n{self.output()[-4000:]}"
            if self.status() == SERVING:
                return
            time.sleep(0.1)
        raise AssertionError(f"not SERVING after {timeout} s:\n{self.output()[-4000:]}")

    def close(self):
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid in self.all_pids():  # a failed test leaves no rank behind either
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass


def assert_same(stream: Stream, ref: Stream):
    assert stream.result() == ref.result()
    assert max(abs(a - b) for a, b in zip(stream.logprobs, ref.logprobs)) < 1e-4


@contextlib.contextmanager
def serving(la: Launcher):
    """The launcher once it serves; then stopped cleanly (close_cleanly)."""
    try:
        la.wait_serving()
        yield la
    finally:
        close_cleanly(la)


def close_cleanly(la: Launcher) -> None:
    """Stop the launcher with SIGTERM: a clean stop, and no rank of any attempt left running."""
    la.close()
    assert la.proc.returncode == 0, la.output()[-3000:]
    out = la.output()
    assert "server stopped (stopped by a signal)" in out and "launch: stopped by SIGTERM" in out, out[-3000:]
    end = time.monotonic() + 10
    while any(Path(f"/proc/{p}").exists() for p in la.all_pids()) and time.monotonic() < end:
        time.sleep(0.1)
    assert not [p for p in la.all_pids() if Path(f"/proc/{p}").exists()]
