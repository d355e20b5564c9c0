"""Starting the ranks under a supervisor: ourselves for the ring backend (locally,
or over ssh for remote hosts), through mlx.launch otherwise (mlx_launch_ring.py)."""

import itertools
import os
import sys
from pathlib import Path
from typing import Callable, List, Optional

from distributed.startup.lifecycle import RESTARTS_ENV

from .hostfile import Hostfile
from .mlx_launch_ring import MlxLaunchRing
from .ring import DirectRing
from .ssh_ring import SshRing
from .supervisor import Supervisor


def launch_env() -> dict:
    """Our environment, with this interpreter's bin first: mlx.launch --backend mpi looks for
    `mpirun` on PATH (this environment's first), and ranks find the same tools."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def counting(make_ring: Callable[[int], object]) -> Callable[[], object]:
    """The supervisor's make_ring: make_ring(restarts so far), so that each attempt's ranks
    get RESTARTS_ENV (their metrics count the restarts)."""
    attempts = itertools.count()
    return lambda: make_ring(next(attempts))


def run(cmd: List[str], restarts: int = 0, grace: float = 20.0, restart_delay: float = 1.0, observer=None) -> int:
    """Run mlx.launch (restarted up to `restarts` times after a failure); our exit status."""
    env = launch_env()
    # mlx.launch passes its environment on to the ranks it starts here (remote ones get --env only).
    return Supervisor(restarts, grace, restart_delay, observer).run(
        counting(lambda n: MlxLaunchRing(cmd, {**env, RESTARTS_ENV: str(n)})))


def own_ring(command: List[str], hostfile: Hostfile, env: dict, envs: Optional[List[str]] = None,
             starting_port: Optional[int] = None, ssh: Optional[List[str]] = None, cwd: Optional[str] = None):
    """A ring we start ourselves: DirectRing when every host is local, else SshRing."""
    all_envs = list(hostfile.envs) + list(envs or [])
    if all(h.is_local for h in hostfile.hosts):
        ips = [h.ips[0] for h in hostfile.hosts]
        return DirectRing(command, len(hostfile.hosts), env, all_envs, ips, starting_port, cwd)
    return SshRing(command, hostfile.hosts, env, all_envs, starting_port, ssh, cwd)


def run_direct(command: List[str], hostfile: Hostfile, envs: Optional[List[str]] = None,
               starting_port: Optional[int] = None, restarts: int = 0, grace: float = 20.0,
               restart_delay: float = 1.0, ssh: Optional[List[str]] = None, cwd: Optional[str] = None,
               observer=None) -> int:
    """Start the ranks of a ring hostfile ourselves (local ones here, remote ones over ssh),
    without mlx.launch; our exit status."""
    env = launch_env()
    return Supervisor(restarts, grace, restart_delay, observer).run(
        counting(lambda n: own_ring(command, hostfile, env, [*(envs or []), f"{RESTARTS_ENV}={n}"],
                                    starting_port, ssh, cwd)))


def can_start_directly(hostfile: Hostfile, backend: Optional[str] = None) -> bool:
    """Every rank is on this machine and the backend is ring: no need for mlx.launch."""
    return (backend or hostfile.backend) == "ring" and all(h.is_local and h.ips for h in hostfile.hosts)


def can_start_ourselves(hostfile: Hostfile, backend: Optional[str] = None) -> bool:
    """The ring backend, every host with an IP: local ranks start here, remote ones over ssh."""
    return (backend or hostfile.backend) == "ring" and all(h.ips for h in hostfile.hosts)
