"""Starting the ranks through mlx.launch, and telling whether any of them failed.

mlx.launch exits 0 even when a rank fails: it only prints "Node with rank N
exited with code C" (and, for MPI, mpirun's own report, while ignoring mpirun's
status, and mpirun's report does not come through). So its stderr is passed
through as it comes and read for those lines, and MPI ranks run under
launch.guard, which prints such a line itself.
"""

import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Dict, List, Optional

from .hostfile import Hostfile

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
                  envs: Optional[List[str]] = None, extra: Optional[List[str]] = None) -> List[str]:
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


def run(cmd: List[str]) -> int:
    """Run mlx.launch, stdout straight through, stderr through and read; our exit status."""
    env = dict(os.environ)
    # mlx.launch --backend mpi looks for `mpirun` on PATH: this environment's first.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env)
    seen: List[str] = []

    def pump():
        for line in iter(proc.stderr.readline, b""):
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
            seen.append(line.decode(errors="replace"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    while True:
        try:
            status = proc.wait()
            break
        except KeyboardInterrupt:  # the ranks got the same Ctrl-C; wait for mlx.launch to wind down
            continue
    reader.join(timeout=10)
    failed = failed_ranks("".join(seen))
    for rank, code in sorted(failed.items()):
        who = "a rank (mpirun's report above)" if rank < 0 else f"rank {rank}"
        print(f"launch: {who} failed with exit status {code}", file=sys.stderr)
    return exit_status(failed, status)
