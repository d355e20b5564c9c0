"""Starting the ranks under a supervisor: ourselves for the ring backend (locally,
or over ssh for remote hosts), through mlx.launch otherwise (mlx_launch_ring.py)."""

import itertools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, List, Optional

from distributed.startup.lifecycle import RESTARTS_ENV

from .hostfile import Hostfile, to_json
from .mlx_launch_ring import MlxLaunchRing, build_command
from .ring import DirectRing
from .ssh_ring import SshRing
from .supervisor import Supervisor


def launch_env() -> dict:
    """Our environment, with this interpreter's bin first: mlx.launch --backend mpi looks for
    `mpirun` on PATH (this environment's first), and ranks find the same tools."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def counting(make_ring: Callable[[int], object], attempts=None) -> Callable[[], object]:
    """The supervisor's make_ring: make_ring(restarts so far), so that each attempt's ranks
    get RESTARTS_ENV (their metrics count the restarts). `attempts`: a counter shared by
    the rings of every host set (re-planning keeps counting)."""
    attempts = attempts if attempts is not None else itertools.count()
    return lambda: make_ring(next(attempts))


def own_ring(command: List[str], hostfile: Hostfile, env: dict, envs: Optional[List[str]] = None,
             starting_port: Optional[int] = None, ssh: Optional[List[str]] = None, cwd: Optional[str] = None):
    """A ring we start ourselves: DirectRing when every host is local, else SshRing."""
    all_envs = list(hostfile.envs) + list(envs or [])
    if all(h.is_local for h in hostfile.hosts):
        ips = [h.ips[0] for h in hostfile.hosts]
        return DirectRing(command, len(hostfile.hosts), env, all_envs, ips, starting_port, cwd)
    return SshRing(command, hostfile.hosts, env, all_envs, starting_port, ssh, cwd)


class Starter:
    """make_ring for a host set and its command: the first ring's, and the Replanner's
    `start` after a host is planned out. Restarts are counted across host sets
    (RESTARTS_ENV); a re-planned hostfile for mlx.launch is written to a temporary file."""

    def __init__(self, ours: bool, starting_port: Optional[int] = None, ssh: Optional[List[str]] = None,
                 cwd: Optional[str] = None, single_host: Optional[int] = None, backend: Optional[str] = None,
                 envs: Optional[List[str]] = None,
                 rebind: Optional[Callable[[Hostfile, List[str]], List[str]]] = None):
        self.ours, self.starting_port, self.ssh, self.cwd = ours, starting_port, ssh, cwd
        self.single_host, self.backend = single_host, backend
        self.envs = list(envs or [])  # every host set's ranks get them too (e.g. the router's token)
        # rebind(hostfile, command) -> the command with rank 0's internal --serve on a fresh port
        # (the router's): a restart never counts on getting back a port it let go of.
        self.rebind = rebind
        self.env = launch_env()
        self.attempts = itertools.count()
        self.files: List[str] = []

    def __call__(self, hostfile: Hostfile, layout) -> Callable[[], object]:
        envs = [*layout.envs, *self.envs]
        if self.ours:
            def ring(n: int):
                command = self.rebind(hostfile, layout.command) if n and self.rebind else layout.command
                return own_ring(command, hostfile, self.env, [*envs, f"{RESTARTS_ENV}={n}"], self.starting_port,
                                self.ssh, self.cwd)

            return counting(ring, self.attempts)
        if hostfile.path is None and self.single_host is None:
            fd, path = tempfile.mkstemp(prefix="trinity-hosts-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(to_json(hostfile), f)
            self.files.append(path)
            hostfile.path = Path(path)
        single_host = len(hostfile.hosts) if self.single_host else None
        def command_for(n: int) -> List[str]:
            command = self.rebind(hostfile, layout.command) if n and self.rebind else layout.command
            return build_command(hostfile, command, single_host=single_host, backend=self.backend,
                                 starting_port=self.starting_port, envs=[*envs, f"{RESTARTS_ENV}={n}"], cwd=self.cwd)

        return counting(lambda n: MlxLaunchRing(command_for(n), {**self.env, RESTARTS_ENV: str(n)}), self.attempts)

    def run(self, hostfile: Hostfile, layout, restarts: int = 0, grace: float = 20.0, restart_delay: float = 1.0,
            replan=None, observer=None) -> int:
        """Supervise the rings of `hostfile` (observer: the router, launch/router/); our exit status."""
        try:
            return Supervisor(restarts, grace, restart_delay, replan, observer).run(self(hostfile, layout))
        finally:
            self.close()

    def close(self) -> None:
        """Remove the hostfiles written for mlx.launch."""
        for path in self.files:
            try:
                os.unlink(path)
            except OSError:
                pass
        self.files.clear()


def can_start_ourselves(hostfile: Hostfile, backend: Optional[str] = None) -> bool:
    """The ring backend, every host with an IP: local ranks start here, remote ones over ssh."""
    return (backend or hostfile.backend) == "ring" and all(h.ips for h in hostfile.hosts)
