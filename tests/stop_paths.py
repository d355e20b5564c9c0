"""Real rings started as a user would, and every way of stopping them
(used by tests/startup/test_lifecycle.py).

Every process a launch starts carries an environment marker, so the processes
are found wherever they end up: an orphaned rank is reparented to init, out of
reach of a process-tree walk.
"""

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
RUN = str(ROOT / "run_trinity.py")
TAG_ENV = "TRINITY_TEST_TAG"
# mlx.launch's defaults: ring ports from 32323, one per rank; the control port one above.
MLX_LAUNCH_PORTS = [32323, 32324, 32325]


def mlx_launch() -> str:
    """This environment's mlx.launch (else the one on PATH)."""
    beside = Path(sys.executable).parent / "mlx.launch"
    return str(beside) if beside.exists() else shutil.which("mlx.launch") or "mlx.launch"


def tagged(tag: str) -> List[int]:
    """Live (not zombie) processes whose environment holds our marker."""
    marker = f"{TAG_ENV}={tag}".encode()
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            state = Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0]
            if state != b"Z" and marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                out.append(int(pid))
        except OSError:
            continue
    return out


def free_port() -> int:
    """A port free now, below Linux's ephemeral range (32768+), where any outgoing
    connection on this machine could take it once the server has let it go."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        if not ports_in_use([port]):
            return port
    raise RuntimeError("no free port")


def ports_in_use(ports: List[int]) -> List[int]:
    """Ports something still listens on (a port in TIME_WAIT binds again with SO_REUSEADDR, as MLX's do)."""
    busy = []
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                busy.append(port)
    return busy


def describe(pids: List[int]) -> str:
    """ps's view of processes, for an assertion's message."""
    if not pids:
        return "(none)"
    return subprocess.run(["ps", "-o", "pid,ppid,stat,args", "-p", ",".join(map(str, pids))],
                          capture_output=True, text=True).stdout


def who_holds(ports: List[int]) -> str:
    """ss's view of the ports, for an assertion's message."""
    out = subprocess.run(["ss", "-tanp"], capture_output=True, text=True).stdout
    return "\n".join(line for line in out.splitlines() if any(f":{p} " in line for p in ports))


class Launch:
    """One command started in a session of its own with the marker; output collected."""

    def __init__(self, cmd: List[str], extra_env: Optional[Dict[str, str]] = None):
        self.tag = uuid.uuid4().hex
        # Unbuffered: a launcher's stdout lines and stderr lines keep their order in the pipe.
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", **{TAG_ENV: self.tag}, **(extra_env or {}))
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        # stdin: a pipe that stays open and silent, as a terminal's is. (At EOF, /dev/null,
        # mlx.launch's main loop spins on it, and a SIGINT lands in its queue locks.)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                                     env=env, cwd=ROOT, start_new_session=True)
        self.chunks: List[bytes] = []  # as they come (streamed text has no newlines)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for chunk in iter(lambda: self.proc.stdout.read1(65536), b""):
            self.chunks.append(chunk)

    @property
    def output(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            found = re.search(pattern, self.output, re.M)
            if found:
                return found
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n{self.output[-4000:]}")

    def ranks(self) -> List[int]:
        """The processes running run_trinity.py."""
        out = []
        for pid in tagged(self.tag):
            try:
                if b"run_trinity.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    out.append(pid)
            except OSError:
                continue
        return out

    def rank_pid(self, rank: int) -> int:
        """The process that runs run_trinity.py as rank `rank`."""
        for pid in tagged(self.tag):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"run_trinity.py" in cmdline and f"MLX_RANK={rank}".encode() in environ:
                return pid
        raise AssertionError(f"no rank {rank} among {tagged(self.tag)}:\n{self.output[-2000:]}")

    def wait_gone(self, timeout: float = 30) -> Optional[float]:
        """Seconds until every marked process is gone (None: some still run after `timeout`)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if not tagged(self.tag):
                took = time.monotonic() - start
                self.proc.wait(timeout=10)  # an exiting process leaves /proc's view before wait() can reap it
                return took
            time.sleep(0.02)
        return None

    def kill(self) -> None:
        """Whatever is left: SIGKILL (a failing test must not leave ranks behind)."""
        for pid in tagged(self.tag):
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.stdin:
            self.proc.stdin.close()


def serve_mlx_launch(model: str, grpc_port: int, ranks: int = 2, extra=()) -> Launch:
    """`mlx.launch -n N python run_trinity.py --serve` on mlx.launch's default ports."""
    return Launch([mlx_launch(), "-n", str(ranks), sys.executable, RUN, "--model", model,
                   "--serve", f"127.0.0.1:{grpc_port}", *extra])


def serve_launch_run(model: str, grpc_port: int, ranks: int = 2, extra=()) -> Launch:
    return Launch([sys.executable, "-m", "launch", "run", "--single-host", str(ranks), "--", RUN,
                   "--model", model, "--serve", f"127.0.0.1:{grpc_port}", *extra])


# name -> how to stop a ring that `launch` started: a function of the Launch.
def _group(sig: int) -> Callable[[Launch], None]:
    return lambda launch: os.killpg(launch.proc.pid, sig)


def _launcher(sig: int) -> Callable[[Launch], None]:
    return lambda launch: os.kill(launch.proc.pid, sig)


def _rank(rank: int, sig: int) -> Callable[[Launch], None]:
    return lambda launch: os.kill(launch.rank_pid(rank), sig)


STOP_PATHS: Dict[str, Callable[[Launch], None]] = {
    "SIGTERM to the launcher's group": _group(signal.SIGTERM),
    "SIGINT to the launcher's group (Ctrl-C)": _group(signal.SIGINT),
    "SIGTERM to the launcher": _launcher(signal.SIGTERM),
    "SIGINT to the launcher": _launcher(signal.SIGINT),
    "SIGKILL to the launcher": _launcher(signal.SIGKILL),
    "SIGTERM to rank 0": _rank(0, signal.SIGTERM),
    "SIGTERM to rank 1": _rank(1, signal.SIGTERM),
    "SIGINT to rank 1": _rank(1, signal.SIGINT),
    "SIGHUP to rank 1": _rank(1, signal.SIGHUP),
}
