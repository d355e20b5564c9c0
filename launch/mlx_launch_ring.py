"""Starting a ring through mlx.launch (other backends than ring, remote hosts with
`--via mlx.launch`), and telling from its output whether any rank failed.

mlx.launch exits 0 even when a rank fails: it only prints "Node with rank N
exited with code C" (and, for MPI, mpirun's own report, while ignoring mpirun's
status, and mpirun's report does not come through). So its stderr is passed
through as it comes and read for those lines, and MPI ranks run under
launch.guard, which prints such a line itself.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Dict, List, Optional

from .hostfile import Hostfile
from .processes import children
from .ring import Failure, Ring, log

_EXITED = re.compile(r"(?:Node with rank|launch: rank) (\d+) exited with code (-?\d+)")
_KILLED = re.compile(r"Node with rank (\d+) was killed")
_MPI_FAILED = re.compile(r"exited with non-zero status|exited on signal|process rank \d+ .*exited")
_MPI_CODE = re.compile(r"Exit code:\s*(\d+)")
_MPI_SIGNAL = re.compile(r"exited on signal (\d+)")


def mlx_launch() -> str:
    """This environment's mlx.launch (the one next to the interpreter first)."""
    local = Path(sys.executable).parent / "mlx.launch"
    return str(local) if local.exists() else (shutil.which("mlx.launch") or "mlx.launch")


def build_command(hostfile: Hostfile, command: List[str], single_host: Optional[int] = None,
                  backend: Optional[str] = None, starting_port: Optional[int] = None,
                  envs: Optional[List[str]] = None, extra: Optional[List[str]] = None,
                  cwd: Optional[str] = None) -> List[str]:
    """The mlx.launch command line: the hostfile as it is (mlx.launch ignores our extra keys)."""
    cmd = [mlx_launch()]
    if single_host is not None:
        cmd += ["-n", str(single_host)]
    else:
        cmd += ["--hostfile", str(hostfile.path)]
    if backend:
        cmd += ["--backend", backend]
    if starting_port is not None:
        cmd += ["--starting-port", str(starting_port)]
    for e in envs or []:
        cmd += ["--env", e]
    if cwd:
        cmd += ["--cwd", cwd]
    if (backend or hostfile.backend) == "mpi":
        command = [sys.executable, "-m", "launch.guard", "--", *command]
    return cmd + list(extra or []) + ["--", *command]


def failed_ranks(stderr: str) -> Dict[int, int]:
    """Rank -> exit status for every rank that failed, from mlx.launch's (or mpirun's) report.

    A rank killed by mlx.launch after another failed counts only when no rank exited
    with an error itself. MPI's report names no rank reliably, so it is keyed -1.
    """
    exited = {int(r): int(c) for r, c in _EXITED.findall(stderr) if int(c) != 0}
    if exited:
        return exited
    killed = {int(r): 1 for r in _KILLED.findall(stderr)}
    if killed:
        return killed
    if _MPI_FAILED.search(stderr):
        code = _MPI_CODE.search(stderr)
        signal = _MPI_SIGNAL.search(stderr)
        return {-1: int(code.group(1)) if code else 128 + int(signal.group(1)) if signal else 1}
    return {}


def exit_status(failed: Dict[int, int], launcher_status: int) -> int:
    """Our exit status: the first failing rank's (signals as 128 + n), else mlx.launch's own.

    A rank that exited on its own is preferred over one killed by a signal: once
    one rank fails, mlx.launch SIGTERMs the others, and that is not the cause."""
    if failed:
        own = {r: c for r, c in failed.items() if c > 0}
        code = (own or failed)[min(own or failed)]
        code = 128 - code if code < 0 else code
        return code if 0 < code < 256 else 1
    return launcher_status


class MlxLaunchRing(Ring):
    """mlx.launch (remote hosts, other backends); its stderr read for failed ranks."""

    name = "mlx.launch"

    def __init__(self, cmd: List[str], env: dict):
        super().__init__()
        self.cmd, self.env = cmd, env
        self.seen: List[str] = []
        self.reader: Optional[threading.Thread] = None

    def start(self) -> None:
        proc = self.popen(0, self.cmd, self.env, stderr=subprocess.PIPE)
        log(f"started mlx.launch (pid {proc.pid})")

        def pump():
            for line in iter(proc.stderr.readline, b""):
                sys.stderr.buffer.write(line)
                sys.stderr.buffer.flush()
                text = line.decode(errors="replace")
                self.seen.append(text)
                for rank, code in _EXITED.findall(text):
                    if int(code) != 0:
                        self.events.put(("rank-exit", int(rank), int(code)))
                for rank in _KILLED.findall(text):
                    self.events.put(("rank-exit", int(rank), -signal.SIGTERM))

        self.reader = threading.Thread(target=pump, name="mlx.launch-stderr", daemon=True)
        self.reader.start()

    def _children(self) -> List[int]:
        """mlx.launch's children: the local ranks (bash exec'd into the command) and
        the ssh clients of remote ones. Empty without /proc."""
        return children(self.procs[0].pid) if self.procs else []

    def _rank0(self) -> Optional[int]:
        for pid in self._children():
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"MLX_RANK=0" in env or b"export MLX_RANK=0;" in cmdline:
                return pid
        return None

    def forward(self, sig: int) -> None:
        # To rank 0, which stops the ring; mlx.launch then exits once every rank has.
        # (An ssh client for a remote rank 0: its end of the session hangs up.)
        rank0 = self._rank0()
        if rank0 is not None:
            try:
                os.kill(rank0, sig)
                return
            except ProcessLookupError:
                pass
        self.kill_all(sig)  # as a Ctrl-C in the terminal did: mlx.launch and its local ranks alike

    def kill_all(self, sig: int) -> None:
        # SIGTERM to the ranks (mlx.launch reports how they exit, then exits itself);
        # anything else, or no rank left to signal, to the whole group.
        ranks = self._children() if sig == signal.SIGTERM else []
        for pid in ranks:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if not ranks:
            super().kill_all(sig)

    def stop_status(self) -> int:
        failure = self._report()
        return failure.status if failure else 0

    def on_event(self, event: tuple) -> Optional[Failure]:
        if event[0] == "rank-exit":
            return Failure(event[1], event[2])
        return None

    def _report(self) -> Optional[Failure]:
        if self.reader is not None:
            self.reader.join(timeout=10)
        failed = failed_ranks("".join(self.seen))
        status = exit_status(failed, self.exited.get(0, 0))
        if not failed and status == 0:
            return None
        if failed:
            own = {r: c for r, c in failed.items() if c > 0}
            rank = min(own or failed)
            return Failure(None if rank < 0 else rank, (own or failed)[rank])
        return Failure(None, status, detail=f"mlx.launch exited with status {status}")

    def on_exit(self, key: int, code: int) -> Optional[Failure]:
        return self._report()

    def final_failure(self) -> Optional[Failure]:
        return self._report()
