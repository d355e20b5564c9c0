"""A ring of ranks, started one of three ways; each attempt of the supervisor makes a fresh one.

Three ways to start a ring:

- DirectRing: every rank is on this machine and the backend is ring. The ranks
  are started here, as mlx.launch would start them (MLX_RANK, MLX_HOSTFILE
  naming a ring hostfile on free local ports), but without mlx.launch, whose
  output-relaying loop keeps a CPU core busy for as long as the ranks run (5 s of
  CPU per 5 s of wall time, measured), which halves decode on a small machine.
  Rank output goes straight to our stdout/stderr. Each rank also gets
  TRINITY_CONTROL_ADDR=127.0.0.1:<free port> (rank 0's control listener).
- SshRing (launch/ssh_ring.py): the ring backend with remote hosts; like
  DirectRing, but remote ranks start through one ssh client each.
- MlxLaunchRing: other backends, or `--via mlx.launch`, go through mlx.launch
  (ssh, mpirun, ...); its "Node with rank N exited with code C" lines tell which
  rank failed (mlx.launch itself exits 0 regardless).

Every rank (or mlx.launch) starts in a session and process group of its own, so
that a whole ring, whatever it started, can be signalled and killed as a group,
and so that a Ctrl-C in the terminal reaches only the launcher, which forwards it.
"""

import json
import logging
import os
import queue
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional

from distributed.startup.control_link import CONTROL_ENV

from .processes import free_ports, group_alive, signal_group, signal_name


def log(message: str) -> None:
    logging.getLogger("launch").info(f"launch: {message}")


@dataclass
class Failure:
    """Why a ring attempt ended badly. `code`: the exit code, negative for a signal."""

    rank: Optional[int]  # None: not known (mlx.launch / mpirun gave no rank)
    code: int
    host: str = ""
    pid: Optional[int] = None
    detail: str = ""  # instead of an exit code, e.g. "still running after rank 0 finished"

    @property
    def status(self) -> int:
        """Our exit status for it: the code, or 128 + n for a signal n."""
        code = 128 - self.code if self.code < 0 else self.code
        return code if 0 < code < 256 else 1

    def describe(self) -> str:
        who = "a rank" if self.rank is None or self.rank < 0 else f"rank {self.rank}"
        if self.detail:
            what = self.detail
        elif self.code < 0:
            what = f"was killed by {signal_name(-self.code)}"
        else:
            what = f"exited with code {self.code}"
        where = ", ".join(x for x in (f"host {self.host}" if self.host else "",
                                       f"pid {self.pid}" if self.pid else "") if x)
        return f"{who} {what}" + (f" ({where})" if where else "")


class Ring:
    """One attempt: processes started in groups of their own; exits and events on `events`."""

    name = "ring"

    def __init__(self):
        # SimpleQueue: put() is safe from a signal handler (queue.Queue's lock is not reentrant)
        self.events: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self.procs: Dict[int, subprocess.Popen] = {}  # key (rank, or 0 for mlx.launch) -> process
        self.exited: Dict[int, int] = {}

    # -- what subclasses provide
    def start(self) -> None:
        raise NotImplementedError

    def forward(self, sig: int) -> None:
        """A clean stop was asked for: pass it on."""
        raise NotImplementedError

    def on_exit(self, key: int, code: int) -> Optional[Failure]:
        """A process ended; return the failure it means, if any."""
        raise NotImplementedError

    def on_event(self, event: tuple) -> Optional[Failure]:
        return None

    def final_failure(self) -> Optional[Failure]:
        """After every process ended (and none failed on the way): anything wrong?"""
        return None

    def cleanup(self) -> None:
        pass

    def stop_status(self) -> int:
        """Our exit status after a stop signal: the first rank that did not exit 0."""
        bad = [c for c in self.exited.values() if c != 0]
        return Failure(None, bad[0]).status if bad else 0

    # -- shared machinery
    def _watch(self, key: int, proc: subprocess.Popen) -> None:
        def wait():
            self.events.put(("exit", key, proc.wait()))

        threading.Thread(target=wait, name=f"wait-{key}", daemon=True).start()

    @staticmethod
    def stdin_for(rank: int):
        """A rank started here: rank 0 reads our stdin (run-trinity --chat), the others nothing."""
        return None if rank == 0 else subprocess.DEVNULL

    def popen(self, key: int, cmd: List[str], env: dict, **kwargs) -> subprocess.Popen:
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, **kwargs)
        self.procs[key] = proc
        self._watch(key, proc)
        return proc

    def running(self) -> List[int]:
        return [k for k in self.procs if k not in self.exited]

    def groups_alive(self) -> List[int]:
        return [p.pid for p in self.procs.values() if group_alive(p.pid)]

    def kill_all(self, sig: int) -> None:
        for proc in self.procs.values():
            signal_group(proc.pid, sig)


class DirectRing(Ring):
    """Local ranks of the ring backend, started here with MLX_RANK and MLX_HOSTFILE."""

    name = "direct"

    def __init__(self, command: List[str], size: int, env: dict, envs: Optional[List[str]] = None,
                 ips: Optional[List[str]] = None, starting_port: Optional[int] = None, cwd: Optional[str] = None):
        super().__init__()
        self.command, self.size, self.env, self.cwd = command, size, env, cwd
        self.envs = list(envs or [])  # NAME=VALUE, as mlx.launch's --env
        self.ips = ips or ["127.0.0.1"] * size
        self.starting_port = starting_port
        self.hostfile: Optional[str] = None
        self.ring: List[List[str]] = []
        self.control = ""

    def plan(self) -> None:
        """Ports for this attempt: --starting-port's, else free ones (fresh for every restart)."""
        ports = ([self.starting_port + r for r in range(self.size)] if self.starting_port is not None
                 else free_ports(self.size))
        self.ring = [[f"{ip}:{port}"] for ip, port in zip(self.ips, ports)]
        self.control = f"127.0.0.1:{free_ports(1, avoid=ports)[0]}"

    def rank_env(self, rank: int) -> dict:
        env = dict(self.env)
        env.update(e.split("=", 1) for e in self.envs)
        env["MLX_RANK"] = str(rank)
        env[CONTROL_ENV] = self.control
        if self.hostfile:
            env["MLX_HOSTFILE"] = self.hostfile
        else:
            env.pop("MLX_HOSTFILE", None)
        return env

    def describe_commands(self) -> List[str]:
        """What start() runs, for --dry-run (the ring hostfile is written at start)."""
        import shlex

        self.plan()
        lines = []
        if self.size > 1:
            lines.append(f"# MLX_HOSTFILE: a file holding {json.dumps(self.ring)}")
        for rank in range(self.size):
            env = [f"MLX_RANK={rank}", f"{CONTROL_ENV}={self.control}"]
            if self.size > 1:
                env.append("MLX_HOSTFILE=<ring hostfile>")
            lines.append(shlex.join(["env", *env, *self.envs, *self.command]))
        return lines

    def host(self, rank: int) -> str:
        return self.ips[rank]

    def write_hostfile(self) -> None:
        fd, self.hostfile = tempfile.mkstemp(prefix="trinity-ring-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(self.ring, f)

    def start(self) -> None:
        self.plan()
        if self.size > 1:
            self.write_hostfile()
        for rank in range(self.size):
            proc = self.popen(rank, self.command, self.rank_env(rank), cwd=self.cwd, stdin=self.stdin_for(rank))
            log(f"started rank {rank} (pid {proc.pid}) on {self.ips[rank]}")
        if self.size > 1:
            log("ring " + " -> ".join(a[0] for a in self.ring) + f"; control {self.control}")

    def forward(self, sig: int) -> None:
        # Rank 0 stops the others through the ring; they get signals only if that fails.
        if 0 in self.running():
            signal_group(self.procs[0].pid, sig)
        else:
            self.kill_all(signal.SIGTERM)

    def rank_failure(self, rank: int, code: int, detail: str = "") -> Failure:
        return Failure(rank, code, self.host(rank), self.procs[rank].pid, detail)

    def on_exit(self, rank: int, code: int) -> Optional[Failure]:
        return None if code == 0 else self.rank_failure(rank, code)

    def final_failure(self) -> Optional[Failure]:
        return None

    def cleanup(self) -> None:
        if self.hostfile:
            try:
                os.unlink(self.hostfile)
            except OSError:
                pass
            self.hostfile = None
