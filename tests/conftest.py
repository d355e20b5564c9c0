"""Shared fixtures: tiny checkpoints made at test time, and real rank launches."""

import atexit
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from distributed import logs
from distributed.shard.tiny_checkpoint import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
RUN = str(ROOT / "run_trinity.py")


def _stopped(signum, frame):
    signal.signal(signum, signal.SIG_DFL)  # a second one ends pytest at once (a teardown may hang)
    raise KeyboardInterrupt(f"pytest got {signal.Signals(signum).name}")


def pytest_configure(config):
    """SIGTERM (a CI timeout, `kill`) stops pytest as Ctrl-C does, so fixtures still end the
    processes they started (those run in sessions of their own and would outlive pytest).
    Logging as the command lines set it up (the launcher's lines, read in process by capsys).
    The servers this run starts keep their prefix caches' disk tier (its default folder, under
    XDG_CACHE_HOME) in a folder of this process's own, removed at its end: never the user's."""
    signal.signal(signal.SIGTERM, _stopped)
    logs.configure("info")
    cache = tempfile.mkdtemp(prefix="trinity-test-cache-")
    os.environ["XDG_CACHE_HOME"] = cache
    atexit.register(shutil.rmtree, cache, True)


def in_ci() -> bool:
    """CI=true (`.ci/run` sets it; so do most CI services)."""
    return os.environ.get("CI", "").lower() == "true"


def needs(what: str) -> None:
    """This machine lacks what the test needs (a tool, root, a Linux facility): outside CI the test
    is skipped with the reason "needs <what>"; under CI=true it fails, since CI installs everything
    the suite uses (scripts/setup-dev.sh). A skipif marker's reason phrased "needs …" counts the same
    (pytest_runtest_makereport below)."""
    if in_ci():
        pytest.fail(f"CI=true, and this test needs {what}", pytrace=False)
    pytest.skip(f"needs {what}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Two rules for skips. Where /proc is missing (macOS), a test that reads it is skipped as
    needing it, as needs() would. Under CI=true, a skip for something missing ("needs …", however
    it was raised) is a failure: CI must run every test."""
    outcome = yield
    report = outcome.get_result()
    error = call.excinfo.value if call.excinfo else None
    if (report.failed and isinstance(error, FileNotFoundError) and str(error.filename or "").startswith("/proc")
            and not os.path.isdir("/proc/self") and not in_ci()):
        report.outcome, report.longrepr = "skipped", (str(item.path), item.location[1] or 0,
                                                      f"Skipped: needs /proc (Linux): reads {error.filename}")
    if report.skipped and in_ci() and not hasattr(report, "wasxfail") and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
        if reason.startswith("Skipped: needs "):
            report.outcome, report.longrepr = "failed", f"CI=true, and this test was skipped: {reason[9:]}"


def pytest_collection_modifyitems(config, items):
    """Slow modules first: under xdist a module runs on one worker (--dist loadscope), so a long
    one handed out last would end the run alone while the other workers sit idle."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory) -> Path:
    """HF layout, float32, per-expert keys, 8 layers (S S S F S S S F), window 16."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny_hf"), layout="hf", seed=0)


@pytest.fixture(scope="session")
def mlx_checkpoint(tmp_path_factory) -> Path:
    """mlx-community layout: stacked experts, 4-bit, router 8-bit override."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny_mlx"), layout="mlx", seed=0)


def mlx_launch() -> str:
    exe = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    return exe


def free_port_range(n: int) -> int:
    """A base port with n free ports after it: the ring backend listens on base + rank,
    and rank 0's control link one above the highest (so a ring of N ranks needs N + 1).
    mlx.launch's fixed default would collide with any other ring on this machine."""
    for _ in range(100):
        base = random.randrange(20000, 32000 - n)  # below Linux's ephemeral range (32768+)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


def system_mpirun() -> str:
    """Debian's Open MPI (4.1) where installed; started directly, as a user would."""
    return "/usr/bin/mpirun" if Path("/usr/bin/mpirun").exists() else "mpirun"


def trinity_launch(ranks: int) -> list:
    """Our launcher's local ring (launch/ring.py DirectRing), the command as it is: no
    planned split, no router. What most multi-rank tests start: mlx.launch's output
    loop keeps a core and a half busy for as long as its ranks run (docs/benchmarks.md: the launcher's CPU),
    which on this 2-core machine slows every test beside it. The tests of mlx.launch
    itself (its backends, its stdin, its stops) name it."""
    return [sys.executable, "-m", "launch", "run", "--single-host", str(ranks), "--no-plan", "--no-router", "--"]


_FORKS = []  # this worker's fork server for one-rank runs, started by the first (ended in pytest_unconfigure)


def _forks():
    if not _FORKS:
        from cli_forks import CliForks

        _FORKS.append(CliForks().__enter__())
    return _FORKS[0]


def pytest_unconfigure(config):
    while _FORKS:
        _FORKS.pop().__exit__(None, None, None)


def run_cli(args, ranks: int = 1, backend: str = "ring", timeout: int = 180, env: dict = None) -> subprocess.CompletedProcess:
    """Run run_trinity.py as `ranks` real processes: a ring of the ring backend started
    by our launcher ("ring") or by `mlx.launch` ("mlx.launch"), `mlx.launch` with the
    MPI backend ("mlx-mpi", Open MPI 5 from PyPI), or the system's `mpirun` directly
    ("mpirun"). `env`: added to the environment of every process. One rank with no `env` of its
    own runs as a fork of a process that has imported distributed.cli (cli_forks.py): the same
    main, status and output, without a second or two of imports each time."""
    if ranks == 1 and env is None:
        return _forks().run(args, timeout)  # the same main in a process of its own (cli_forks.py)
    if ranks == 1:
        cmd = [sys.executable, RUN, *args]
    elif backend == "mpirun":
        cmd = [system_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), sys.executable, RUN, *args]
    elif backend == "mlx-mpi":
        cmd = [mlx_launch(), "--backend", "mpi", "--mpi-arg=--oversubscribe", "-n", str(ranks), sys.executable, RUN, *args]
    elif backend == "mlx.launch":
        cmd = [mlx_launch(), "-n", str(ranks), "--starting-port", str(free_port_range(ranks + 1)),
               sys.executable, RUN, *args]
    else:
        assert backend == "ring", backend
        cmd = [*trinity_launch(ranks), sys.executable, RUN, *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           **(env or {})}
    # The environment's own bin first, so mlx.launch finds the mpirun that pip installed.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def run_json(args, ranks: int = 1, backend: str = "ring", env: dict = None) -> dict:
    proc = run_cli([*args, "--json"], ranks, backend, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"stdout is not one JSON object:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-3000:]}")


def run_trinity(args, env=None, prefix=(), timeout=120):
    """run_trinity.py (under `prefix`, e.g. mpirun) in its own session; whatever
    it started is killed on the way out. `env` adds to this environment (None
    removes a variable). Returns (status, stdout, stderr)."""
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    full_env = {k: v for k, v in full_env.items() if v is not None}
    full_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{full_env.get('PATH', '')}"
    proc = subprocess.Popen([*prefix, sys.executable, RUN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=full_env, cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return proc.returncode, out, err


def wait_until(condition, timeout=30, interval=0.01):
    """Poll until condition() holds (a test waits on the event itself, never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(interval)


def kill_group(proc):
    """SIGKILL everything in proc's session (it was started with start_new_session):
    mpirun gives each rank a process group of its own, but they stay in its session."""
    for pid in [proc.pid, *session_members(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def process_parents() -> dict:
    """Every process's parent, {pid: ppid}: from /proc on Linux, from `ps` where there is none (macOS)."""
    if not os.path.isdir("/proc/self"):
        out = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
        return {int(pid): int(ppid) for pid, ppid in (line.split() for line in out.splitlines() if line.strip())}
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parents[int(pid)] = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
        except OSError:
            continue
    return parents


def session_members(sid: int):
    """Process ids in session `sid`: from /proc on Linux, from `ps` where there is none (macOS)."""
    if not os.path.isdir("/proc/self"):
        members = []
        for pid in process_parents():
            try:
                if os.getsid(pid) == sid:
                    members.append(pid)
            except OSError:
                continue
        return members
    members = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # state, ppid, pgrp, session
            members.append(int(pid))
    return members


def one_error_line(status, out, err) -> str:
    """The run failed with exactly one `error: …` line and no traceback; returns that line."""
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert status != 0 and len(lines) == 1 and "Traceback" not in err and out == "", (status, out, err)
    return lines[0]
