"""Running a ring of ranks, tearing it down without orphans, restarting it after a failure.

Two ways to start a ring:

- DirectRing: every rank is on this machine and the backend is ring. The ranks
  are started here, as mlx.launch would start them (MLX_RANK, MLX_HOSTFILE
  naming a ring hostfile on free local ports), but without mlx.launch, whose
  output-relaying loop keeps a CPU core busy for as long as the ranks run (5 s of
  CPU per 5 s of wall time, measured), which halves decode on a small machine.
  Rank output goes straight to our stdout/stderr. Each rank also gets
  TRINITY_CONTROL_ADDR=127.0.0.1:<free port> (rank 0's control listener).
- MlxLaunchRing: anything with remote hosts or another backend goes through
  mlx.launch (ssh, mpirun, ...); its "Node with rank N exited with code C" lines
  tell which rank failed (mlx.launch itself exits 0 regardless).

Every rank (or mlx.launch) starts in a session and process group of its own, so
that a whole ring, whatever it started, can be signalled and killed as a group,
and so that a Ctrl-C in the terminal reaches only the launcher, which forwards it.

Supervisor.run() starts a ring and watches it:
- a rank exiting non-zero (or killed by a signal) is a failure: it is logged
  with the attempt number; the survivors get `grace` seconds to exit on their own
  (the watchdog makes them exit within 15 s, telling clients which rank failed),
  then SIGTERM, then SIGKILL, group by group; then, while restarts are left, the
  whole ring starts again (fresh ports), else we exit with the failure's status.
  The cause logged is the rank that died, not those that exited because their
  watchdog saw it die (exit 3, distributed.watchdog.EXIT_PEER_FAILED); when two or
  more ranks exit so and one stays (frozen, cut off), that one is named and stopped
  without waiting out the grace.
- SIGINT/SIGTERM/SIGHUP to the launcher is a clean stop, never restarted: the
  signal goes to rank 0 (which stops the other ranks through the ring), then after
  `grace` SIGTERM to every group, then SIGKILL. A second signal skips the wait.
"""

import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

CONTROL_ENV = "TRINITY_CONTROL_ADDR"
TERM_WAIT_S = 3.0  # after SIGTERM, before SIGKILL
# distributed.watchdog's EXIT_PEER_FAILED: "another rank failed", never the cause itself.
PEER_FAILED_EXIT = 3
CAUSE_WINDOW_S = 1.0  # exits this close to the first failure may name a likelier cause
STUCK_AFTER_S = 3.0  # the others exited with PEER_FAILED_EXIT this long ago: the rest are stuck
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def log(message: str) -> None:
    print(f"launch: {message}", file=sys.stderr, flush=True)


def signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


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


def free_ports(n: int, host: str = "127.0.0.1") -> List[int]:
    """n consecutive ports free now (the ranks bind them moments later). Taken below
    Linux's ephemeral range (32768+), where outgoing connections, the ring's own
    included, would otherwise take them in the meantime."""
    for _ in range(200):
        base = random.randrange(20000, 32000 - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind((host, port))
            return list(range(base, base + n))
        except OSError:
            continue
    socks = [socket.socket() for _ in range(n)]  # crowded: any free ports
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def group_members(pgid: int) -> List[int]:
    """Live processes of process group `pgid` (Linux: from /proc; zombies, already dead
    and waiting for init to reap them, do not count)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            out.append(int(pid))
    return out


def group_alive(pgid: int) -> bool:
    """Whether any process of process group `pgid` still runs."""
    if os.path.isdir("/proc/self"):
        return bool(group_members(pgid))
    try:  # no /proc (macOS): zombies count too, until reaped
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but not ours any more (pid reuse): not our orphan
        return False


def _cause_rank(f: "Failure") -> int:
    """How likely a failure is the root cause: a rank killed by a signal, then one that
    exited with an error of its own, then one whose watchdog saw another rank fail."""
    return 2 if f.code < 0 else 0 if f.code == PEER_FAILED_EXIT else 1


def _peers_reported(codes: List[int]) -> bool:
    """At least two ranks exited, all with PEER_FAILED_EXIT: their watchdogs agree a peer
    failed (one such exit alone could be an error of that rank's own with the same code)."""
    return len(codes) >= 2 and all(c == PEER_FAILED_EXIT for c in codes)


def children(pid: int) -> List[int]:
    """Live child processes of pid (Linux: from /proc; empty elsewhere)."""
    out = []
    if not os.path.isdir("/proc/self"):
        return out
    for child in os.listdir("/proc"):
        if not child.isdigit():
            continue
        try:
            with open(f"/proc/{child}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue
        if len(fields) > 1 and int(fields[1]) == pid and fields[0] != b"Z":
            out.append(int(child))
    return out


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


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

    def popen(self, key: int, cmd: List[str], env: dict, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True, **kwargs)
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
                 ips: Optional[List[str]] = None, starting_port: Optional[int] = None):
        super().__init__()
        self.command, self.size, self.env = command, size, env
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
        self.control = f"127.0.0.1:{free_ports(1)[0]}"

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

    def start(self) -> None:
        self.plan()
        if self.size > 1:
            fd, self.hostfile = tempfile.mkstemp(prefix="trinity-ring-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(self.ring, f)
        for rank in range(self.size):
            proc = self.popen(rank, self.command, self.rank_env(rank))
            log(f"started rank {rank} (pid {proc.pid}) on {self.ips[rank]}")
        if self.size > 1:
            log("ring " + " -> ".join(a[0] for a in self.ring) + f"; control {self.control}")

    def forward(self, sig: int) -> None:
        # Rank 0 stops the others through the ring; they get signals only if that fails.
        if 0 in self.running():
            signal_group(self.procs[0].pid, sig)
        else:
            self.kill_all(signal.SIGTERM)

    def on_exit(self, rank: int, code: int) -> Optional[Failure]:
        if code == 0:
            return None
        return Failure(rank, code, self.ips[rank], self.procs[rank].pid)

    def final_failure(self) -> Optional[Failure]:
        return None

    def cleanup(self) -> None:
        if self.hostfile:
            try:
                os.unlink(self.hostfile)
            except OSError:
                pass
            self.hostfile = None


class MlxLaunchRing(Ring):
    """mlx.launch (remote hosts, other backends); its stderr read for failed ranks."""

    name = "mlx.launch"

    def __init__(self, cmd: List[str], env: dict):
        super().__init__()
        self.cmd, self.env = cmd, env
        self.seen: List[str] = []
        self.reader: Optional[threading.Thread] = None

    def start(self) -> None:
        from .runner import _EXITED, _KILLED

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
        from .runner import exit_status, failed_ranks

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


@dataclass
class Outcome:
    failure: Optional[Failure]
    stopped_by: Optional[int]  # the signal that asked for a clean stop
    stop_status: int = 0  # our exit status after that stop

    @property
    def status(self) -> int:
        return self.failure.status if self.failure is not None else self.stop_status


class Supervisor:
    def __init__(self, restarts: int = 0, grace: float = 20.0, restart_delay: float = 1.0):
        self.restarts, self.grace, self.restart_delay = restarts, grace, restart_delay
        self.stop_signal: Optional[int] = None
        self.signals = 0
        self.ring: Optional[Ring] = None
        self._wake: "queue.SimpleQueue[int]" = queue.SimpleQueue()

    def _on_signal(self, sig, _frame) -> None:
        self.signals += 1
        if self.stop_signal is None:
            self.stop_signal = sig
        if self.ring is not None:
            self.ring.events.put(("signal", sig))
        self._wake.put(sig)

    def run(self, make_ring) -> int:
        """make_ring() -> Ring, called once per attempt. Returns our exit status."""
        previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        try:
            return self._loop(make_ring)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _loop(self, make_ring) -> int:
        attempts = self.restarts + 1
        attempt = 0
        while True:
            attempt += 1
            ring = make_ring()
            outcome = self._attempt(ring, attempt, attempts)
            if self.stop_signal is not None:
                log(f"stopped by {signal_name(self.stop_signal)}"
                    + (f"; exit status {outcome.status}" if outcome.status else ""))
                return outcome.status
            if outcome.failure is None:
                return outcome.status
            failure = outcome.failure
            if attempt >= attempts:
                log(f"attempt {attempt}/{attempts} failed: {failure.describe()}; "
                    + (f"no restarts left (--restart {self.restarts})" if self.restarts else "not restarting")
                    + f"; exit status {failure.status}")
                # The line launch run has always printed (scripts and tests read it).
                who = "a rank (mpirun's report above)" if failure.rank is None else f"rank {failure.rank}"
                log(f"{who} failed with exit status {failure.status}")
                return failure.status
            log(f"attempt {attempt}/{attempts} failed: {failure.describe()}; restarting the whole ring "
                f"in {self.restart_delay:g} s (restart {attempt} of {self.restarts})")
            try:
                self._wake.get(timeout=self.restart_delay)
            except queue.Empty:
                pass
            if self.stop_signal is not None:
                log(f"stopped by {signal_name(self.stop_signal)} before restarting")
                return failure.status

    def _attempt(self, ring: Ring, attempt: int, attempts: int) -> Outcome:
        self.ring = ring
        if self.stop_signal is not None:
            return Outcome(None, self.stop_signal)
        if attempts > 1:
            log(f"attempt {attempt}/{attempts}: starting the ring ({ring.name})")
        failure: Optional[Failure] = None
        failed_at = last_exit_at = 0.0
        deadline: Optional[float] = None  # when the survivors get SIGTERM
        termed = False
        try:
            try:
                ring.start()
            except OSError as e:  # e.g. the command does not exist: whatever started is stopped below
                failure = Failure(None, 127, detail=f"could not be started: {e}")
                log(f"attempt {attempt}/{attempts}: {failure.describe()}")
                deadline = time.monotonic()
            if self.stop_signal is not None:  # a signal came while starting
                ring.forward(self.stop_signal)
                deadline = time.monotonic() + self.grace
            while ring.running() or ring.groups_alive():
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    if not termed:
                        alive = ring.running()
                        if alive:
                            log(f"{self._whom(ring, alive)} still running "
                                f"{time.monotonic() - failed_at if failure else self.grace:.0f} s later: SIGTERM")
                        others = [c for k, c in ring.exited.items() if c != 0]
                        if failure is not None and alive and isinstance(ring, DirectRing) and _peers_reported(others):
                            # The cause is the rank that did not exit (frozen, stuck, cut off),
                            # not the first one whose watchdog noticed.
                            stuck = alive[0]
                            failure = Failure(stuck, PEER_FAILED_EXIT, ring.ips[stuck], ring.procs[stuck].pid,
                                              detail=f"stopped responding: the other ranks reported a failed peer "
                                                     f"(exit {PEER_FAILED_EXIT}) and it did not exit")
                            log(f"attempt {attempt}/{attempts}: {failure.describe()}")
                        ring.kill_all(signal.SIGTERM)
                        ring.kill_all(signal.SIGCONT)  # a stopped (SIGSTOP) rank gets its SIGTERM too
                        termed, deadline = True, now + TERM_WAIT_S
                    else:
                        alive = ring.running()
                        if alive or ring.groups_alive():
                            log(f"{self._whom(ring, alive) if alive else 'processes they started'} "
                                "ignored SIGTERM: SIGKILL")
                        ring.kill_all(signal.SIGKILL)
                        deadline = now + TERM_WAIT_S  # reaped within moments
                    continue
                if (failure is not None and not termed and isinstance(ring, DirectRing) and ring.running()
                        and now - last_exit_at >= STUCK_AFTER_S and _peers_reported(list(ring.exited.values()))):
                    # Every rank that exited did so because its watchdog saw a peer fail, the
                    # last of them STUCK_AFTER_S ago: the rest are the failed ones (frozen,
                    # cut off). No need to wait out the grace for them.
                    deadline = now
                    continue
                timeout = 0.5 if deadline is None else max(0.01, min(0.5, deadline - now))
                if not ring.running():
                    # Every rank ended; wait briefly for what they started (same group) to end.
                    if deadline is None:
                        deadline = now + self.grace
                    time.sleep(min(0.1, timeout))
                    continue
                try:
                    event = ring.events.get(timeout=timeout)
                except queue.Empty:
                    continue
                kind = event[0]
                if kind == "exit":
                    _, key, code = event
                    ring.exited[key] = code
                    last_exit_at = time.monotonic()
                    if (failure is not None and self.stop_signal is None and not termed
                            and time.monotonic() - failed_at < CAUSE_WINDOW_S):
                        # Ranks failing together: the one that died is the cause, not those
                        # whose watchdog then made them exit (with PEER_FAILED_EXIT).
                        other = ring.on_exit(key, code)
                        if other is not None and _cause_rank(other) > _cause_rank(failure):
                            log(f"attempt {attempt}/{attempts}: {other.describe()}: the cause, rather than "
                                f"rank {failure.rank}")
                            failure = other
                    if failure is None and self.stop_signal is None:
                        failure = ring.on_exit(key, code)
                        if failure is not None:
                            self._failed(ring, failure, attempt, attempts)
                            failed_at = time.monotonic()
                            deadline = failed_at + self.grace
                        elif key == 0 and isinstance(ring, DirectRing) and deadline is None:
                            # Rank 0 finished: the others follow at once (it sent them STOP).
                            deadline = time.monotonic() + self.grace
                elif kind == "signal":
                    if self.signals == 1:
                        log(f"{signal_name(event[1])}: stopping the ring")
                        if not termed:
                            ring.forward(event[1])
                        later = time.monotonic() + self.grace
                        deadline = later if deadline is None else min(deadline, later)
                    else:  # asked again: stop waiting
                        deadline = time.monotonic()
                elif failure is None and self.stop_signal is None:
                    failure = ring.on_event(event)
                    if failure is not None:
                        self._failed(ring, failure, attempt, attempts)
                        deadline = time.monotonic() + self.grace
            if failure is None and self.stop_signal is None:
                failure = ring.final_failure()
                stuck = [k for k, c in ring.exited.items() if c != 0]
                if failure is None and stuck:  # e.g. killed after rank 0 finished without them
                    key = stuck[0]
                    failure = Failure(key, ring.exited[key], pid=ring.procs[key].pid,
                                      detail=f"did not exit within {self.grace:g} s of rank 0 (killed)")
            return Outcome(failure, self.stop_signal, ring.stop_status() if failure is None else 0)
        finally:
            # Whatever happened above (an exception included), nothing of this ring survives.
            if ring.groups_alive():
                ring.kill_all(signal.SIGKILL)
            for proc in ring.procs.values():
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            end = time.monotonic() + 5
            while ring.groups_alive() and time.monotonic() < end:
                time.sleep(0.05)
            ring.cleanup()
            self.ring = None

    def _failed(self, ring: Ring, failure: Failure, attempt: int, attempts: int) -> None:
        alive = ring.running()
        log(f"attempt {attempt}/{attempts}: {failure.describe()}"
            + (f"; waiting up to {self.grace:g} s for {self._whom(ring, alive)} to exit" if alive else ""))

    @staticmethod
    def _whom(ring: Ring, keys: List[int]) -> str:
        if isinstance(ring, MlxLaunchRing):
            return "mlx.launch"
        return ("rank " if len(keys) == 1 else "ranks ") + ", ".join(map(str, keys))
