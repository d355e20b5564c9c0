"""Running a ring (launch.ring), tearing it down without orphans, restarting it after a failure.

Supervisor.run() starts a ring and watches it:
- a rank exiting non-zero (or killed by a signal) is a failure: it is logged
  with the attempt number; the survivors get `grace` seconds to exit on their own
  (the watchdog makes them exit within 15 s, telling clients which rank failed),
  then SIGTERM, then SIGKILL, group by group; then, while restarts are left, the
  whole ring starts again (fresh ports), else `replan` (launch/replan.py) may plan
  a host that stays gone out and start the ring on the rest, else we exit with the
  failure's status.
  The cause logged is the rank that died, not those that exited because their
  watchdog saw it die (EXIT_PEER_FAILED, 3: "another rank failed"); when two or
  more ranks exit so and one stays (frozen, cut off), that one is named and stopped
  without waiting out the grace.
- SIGINT/SIGTERM/SIGHUP to the launcher is a clean stop, never restarted: the
  signal goes to rank 0 (which stops the other ranks through the ring), then after
  `grace` SIGTERM to every group, then SIGKILL. A second signal skips the wait.

Rings of ranks started one by one (DirectRing, and SshRing, its remote kind)
are watched rank by rank; a remote rank's "process group" here is its ssh
client, and SshRing passes the signals on over ssh (launch/ssh_ring.py).
"""

import queue
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Protocol

from distributed.startup.watchdog import EXIT_PEER_FAILED

from .mlx_launch_ring import MlxLaunchRing
from .processes import signal_name
from .ring import DirectRing, Failure, Ring, log

TERM_WAIT_S = 3.0  # after SIGTERM, before SIGKILL
CAUSE_WINDOW_S = 1.0  # exits this close to the first failure may name a likelier cause
STUCK_AFTER_S = 3.0  # the others exited with EXIT_PEER_FAILED this long ago: the rest are stuck
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _cause_rank(f: Failure) -> int:
    """How likely a failure is the root cause: a rank killed by a signal, then one that
    exited with an error of its own, then one whose watchdog saw another rank fail."""
    return 2 if f.code < 0 else 0 if f.code == EXIT_PEER_FAILED else 1


def _peers_reported(codes: List[int]) -> bool:
    """At least two ranks exited, all with EXIT_PEER_FAILED: their watchdogs agree a peer
    failed (one such exit alone could be an error of that rank's own with the same code)."""
    return len(codes) >= 2 and all(c == EXIT_PEER_FAILED for c in codes)


class Replan(Protocol):
    """What the Supervisor asks once the restarts are spent (launch/replan.py's Replanner)."""

    give_up_reason: Optional[str]  # once it gave up: why, in one line for clients; else None

    def __call__(self, failure: Optional[Failure]) -> Optional[Callable[[], Ring]]:
        """make_ring for a new host set (with a fresh restart budget), or None to give up."""


class NoReplan:
    """Re-planning is off: always give up, with no reason beyond the failure."""

    give_up_reason = None

    def __call__(self, failure: Optional[Failure]) -> None:
        return None


@dataclass
class Outcome:
    failure: Optional[Failure]
    stop_status: int = 0  # our exit status after that stop

    @property
    def status(self) -> int:
        return self.failure.status if self.failure is not None else self.stop_status


class Supervisor:
    def __init__(self, restarts: int = 0, grace: float = 20.0, restart_delay: float = 1.0,
                 replan: Optional[Replan] = None, observer=None):
        self.restarts, self.grace, self.restart_delay = restarts, grace, restart_delay
        # Asked once the restarts are spent (None: re-planning is off).
        self.replan: Replan = replan if replan is not None else NoReplan()
        # Told of a stop signal (stopping(), from the signal handler) and of giving up
        # (give_up(why)): the launcher's router (launch/router/).
        self.observer = observer
        self.stop_signal: Optional[int] = None
        self.signals = 0
        self.ring: Optional[Ring] = None
        self._wake: "queue.SimpleQueue[int]" = queue.SimpleQueue()

    def _on_signal(self, sig, _frame) -> None:
        self.signals += 1
        if self.stop_signal is None:
            self.stop_signal = sig
            if self.observer is not None:
                self.observer.stopping()
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
                replanned = self.replan(failure)
                if replanned is None:
                    # The line launch run has always printed (scripts and tests read it).
                    who = "a rank (mpirun's report above)" if failure.rank is None else f"rank {failure.rank}"
                    log(f"{who} failed with exit status {failure.status}")
                    if self.observer is not None:
                        self.observer.give_up(self.replan.give_up_reason
                                              or f"{failure.describe()}; no restarts left")
                    return failure.status
                make_ring, attempt = replanned, 0
            else:
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
            return Outcome(None)
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
                            failure = ring.rank_failure(stuck, EXIT_PEER_FAILED,
                                                        f"stopped responding: the other ranks reported a failed "
                                                        f"peer (exit {EXIT_PEER_FAILED}) and it did not exit")
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
                        # whose watchdog then made them exit (with EXIT_PEER_FAILED).
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
                    detail = f"did not exit within {self.grace:g} s of rank 0 (killed)"
                    failure = (ring.rank_failure(key, ring.exited[key], detail) if isinstance(ring, DirectRing)
                               else Failure(key, ring.exited[key], pid=ring.procs[key].pid, detail=detail))
            return Outcome(failure, ring.stop_status() if failure is None else 0)
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
