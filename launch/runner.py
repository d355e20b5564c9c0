"""Starting the ranks (ourselves for the ring backend: locally, or over ssh for remote
hosts; through mlx.launch otherwise), and telling whether any failed.

mlx.launch exits 0 even when a rank fails: it only prints "Node with rank N
exited with code C" (and, for MPI, mpirun's own report, while ignoring mpirun's
status, and mpirun's report does not come through). So its stderr is passed
through as it comes and read for those lines, and MPI ranks run under
launch.guard, which prints such a line itself.
"""

import os
import re
import shutil
import sys
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


def launch_env() -> dict:
    """Our environment, with this interpreter's bin first: mlx.launch --backend mpi looks for
    `mpirun` on PATH (this environment's first), and ranks find the same tools."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run(cmd: List[str], restarts: int = 0, grace: float = 20.0, restart_delay: float = 1.0) -> int:
    """Run mlx.launch (restarted up to `restarts` times after a failure); our exit status."""
    from .ring import MlxLaunchRing
    from .supervisor import Supervisor

    env = launch_env()
    return Supervisor(restarts, grace, restart_delay).run(lambda: MlxLaunchRing(cmd, env))


def own_ring(command: List[str], hostfile: Hostfile, env: dict, envs: Optional[List[str]] = None,
             starting_port: Optional[int] = None, ssh: Optional[List[str]] = None, cwd: Optional[str] = None):
    """A ring we start ourselves: DirectRing when every host is local, else SshRing."""
    from .ring import DirectRing
    from .ssh_ring import SshRing

    all_envs = list(hostfile.envs) + list(envs or [])
    if all(h.is_local for h in hostfile.hosts):
        ips = [h.ips[0] for h in hostfile.hosts]
        return DirectRing(command, len(hostfile.hosts), env, all_envs, ips, starting_port, cwd)
    return SshRing(command, hostfile.hosts, env, all_envs, starting_port, ssh, cwd)


def run_direct(command: List[str], hostfile: Hostfile, envs: Optional[List[str]] = None,
               starting_port: Optional[int] = None, restarts: int = 0, grace: float = 20.0,
               restart_delay: float = 1.0, ssh: Optional[List[str]] = None, cwd: Optional[str] = None) -> int:
    """Start the ranks of a ring hostfile ourselves (local ones here, remote ones over ssh),
    without mlx.launch; our exit status."""
    from .supervisor import Supervisor

    env = launch_env()
    return Supervisor(restarts, grace, restart_delay).run(
        lambda: own_ring(command, hostfile, env, envs, starting_port, ssh, cwd))


def can_start_directly(hostfile: Hostfile, backend: Optional[str] = None) -> bool:
    """Every rank is on this machine and the backend is ring: no need for mlx.launch."""
    return (backend or hostfile.backend) == "ring" and all(h.is_local and h.ips for h in hostfile.hosts)


def can_start_ourselves(hostfile: Hostfile, backend: Optional[str] = None) -> bool:
    """The ring backend, every host with an IP: local ranks start here, remote ones over ssh."""
    return (backend or hostfile.backend) == "ring" and all(h.ips for h in hostfile.hosts)
