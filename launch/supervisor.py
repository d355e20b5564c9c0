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
class Watch:
    """One attempt's watch over its ring (Supervisor._attempt)."""

    ring: Ring
    attempt: int
    attempts: int
    failure: Optional[Failure] = None
    failed_at: float = 0.0  # when the failure was seen
    last_exit_at: float = 0.0
    deadline: Optional[float] = None  # when the survivors get SIGTERM (after it: SIGKILL)
    termed: bool = False  # SIGTERM sent


def _tear_down(ring: Ring) -> None:
    """Kill whatever of `ring` is left and reap it."""
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
        w = Watch(ring, attempt, attempts)
        try:
            self._start(w)
            while ring.running() or ring.groups_alive():
                self._watch_once(w)
            return self._outcome(w)
        finally:
            _tear_down(ring)  # whatever happened above (an exception included), nothing of this ring survives
            self.ring = None

    def _start(self, w: "Watch") -> None:
        try:
            w.ring.start()
        except OSError as e:  # e.g. the command does not exist: whatever started is stopped below
            w.failure = Failure(None, 127, detail=f"could not be started: {e}")
            log(f"attempt {w.attempt}/{w.attempts}: {w.failure.describe()}")
            w.deadline = time.monotonic()
        if self.stop_signal is not None:  # a signal came while starting
            w.ring.forward(self.stop_signal)
            w.deadline = time.monotonic() + self.grace

    def _watch_once(self, w: "Watch") -> None:
        """One turn of the watch: act on a deadline that passed, or take the ring's next event."""
        ring, now = w.ring, time.monotonic()
        if w.deadline is not None and now >= w.deadline:
            return self._past_deadline(w, now)
        if (w.failure is not None and not w.termed and isinstance(ring, DirectRing) and ring.running()
                and now - w.last_exit_at >= STUCK_AFTER_S and _peers_reported(list(ring.exited.values()))):
            # Every rank that exited did so because its watchdog saw a peer fail, the
            # last of them STUCK_AFTER_S ago: the rest are the failed ones (frozen,
            # cut off). No need to wait out the grace for them.
            w.deadline = now
            return
        timeout = 0.5 if w.deadline is None else max(0.01, min(0.5, w.deadline - now))
        if not ring.running():
            # Every rank ended; wait briefly for what they started (same group) to end.
            if w.deadline is None:
                w.deadline = now + self.grace
            time.sleep(min(0.1, timeout))
            return
        try:
            event = ring.events.get(timeout=timeout)
        except queue.Empty:
            return
        if event[0] == "exit":
            self._on_exit(w, *event[1:])
        elif event[0] == "signal":
            self._stop_asked(w, event[1])
        elif w.failure is None and self.stop_signal is None:
            w.failure = ring.on_event(event)
            if w.failure is not None:
                self._failed(ring, w.failure, w.attempt, w.attempts)
                w.deadline = time.monotonic() + self.grace

    def _past_deadline(self, w: "Watch", now: float) -> None:
        """The survivors had their grace: SIGTERM, then (TERM_WAIT_S later) SIGKILL."""
        ring = w.ring
        if w.termed:
            alive = ring.running()
            if alive or ring.groups_alive():
                log(f"{self._whom(ring, alive) if alive else 'processes they started'} ignored SIGTERM: SIGKILL")
            ring.kill_all(signal.SIGKILL)
            w.deadline = now + TERM_WAIT_S  # reaped within moments
            return
        alive = ring.running()
        if alive:
            log(f"{self._whom(ring, alive)} still running "
                f"{time.monotonic() - w.failed_at if w.failure else self.grace:.0f} s later: SIGTERM")
        others = [c for k, c in ring.exited.items() if c != 0]
        if w.failure is not None and alive and isinstance(ring, DirectRing) and _peers_reported(others):
            # The cause is the rank that did not exit (frozen, stuck, cut off),
            # not the first one whose watchdog noticed.
            w.failure = ring.rank_failure(alive[0], EXIT_PEER_FAILED, "stopped responding: the other ranks reported "
                                          f"a failed peer (exit {EXIT_PEER_FAILED}) and it did not exit")
            log(f"attempt {w.attempt}/{w.attempts}: {w.failure.describe()}")
        ring.kill_all(signal.SIGTERM)
        ring.kill_all(signal.SIGCONT)  # a stopped (SIGSTOP) rank gets its SIGTERM too
        w.termed, w.deadline = True, now + TERM_WAIT_S

    def _on_exit(self, w: "Watch", key: int, code: int) -> None:
        ring = w.ring
        ring.exited[key] = code
        w.last_exit_at = time.monotonic()
        if (w.failure is not None and self.stop_signal is None and not w.termed
                and time.monotonic() - w.failed_at < CAUSE_WINDOW_S):
            # Ranks failing together: the one that died is the cause, not those
            # whose watchdog then made them exit (with EXIT_PEER_FAILED).
            other = ring.on_exit(key, code)
            if other is not None and _cause_rank(other) > _cause_rank(w.failure):
                log(f"attempt {w.attempt}/{w.attempts}: {other.describe()}: the cause, rather than "
                    f"rank {w.failure.rank}")
                w.failure = other
        if w.failure is None and self.stop_signal is None:
            w.failure = ring.on_exit(key, code)
            if w.failure is not None:
                self._failed(ring, w.failure, w.attempt, w.attempts)
                w.failed_at = time.monotonic()
                w.deadline = w.failed_at + self.grace
            elif key == 0 and isinstance(ring, DirectRing) and w.deadline is None:
                # Rank 0 finished: the others follow at once (it sent them STOP).
                w.deadline = time.monotonic() + self.grace

    def _stop_asked(self, w: "Watch", sig: int) -> None:
        if self.signals == 1:
            log(f"{signal_name(sig)}: stopping the ring")
            if not w.termed:
                w.ring.forward(sig)
            later = time.monotonic() + self.grace
            w.deadline = later if w.deadline is None else min(w.deadline, later)
        else:  # asked again: stop waiting
            w.deadline = time.monotonic()

    def _outcome(self, w: "Watch") -> Outcome:
        ring, failure = w.ring, w.failure
        if failure is None and self.stop_signal is None:
            failure = ring.final_failure()
            stuck = [k for k, c in ring.exited.items() if c != 0]
            if failure is None and stuck:  # e.g. killed after rank 0 finished without them
                key = stuck[0]
                detail = f"did not exit within {self.grace:g} s of rank 0 (killed)"
                failure = (ring.rank_failure(key, ring.exited[key], detail) if isinstance(ring, DirectRing)
                           else Failure(key, ring.exited[key], pid=ring.procs[key].pid, detail=detail))
        return Outcome(failure, ring.stop_status() if failure is None else 0)

    def _failed(self, ring: Ring, failure: Failure, attempt: int, attempts: int) -> None:
        alive = ring.running()
        log(f"attempt {attempt}/{attempts}: {failure.describe()}"
            + (f"; waiting up to {self.grace:g} s for {self._whom(ring, alive)} to exit" if alive else ""))

    @staticmethod
    def _whom(ring: Ring, keys: List[int]) -> str:
        if isinstance(ring, MlxLaunchRing):
            return "mlx.launch"
        return ("rank " if len(keys) == 1 else "ranks ") + ", ".join(map(str, keys))
