"""How a rank process ends: stop signals, its launcher's death, and a deadline.

Any of SIGINT, SIGTERM or SIGHUP, or the death of the process that launched
this rank (mlx.launch, `python -m launch run`, mpirun's daemon, an ssh
session), asks for a stop. The callbacks registered with on_stop() turn that
into a clean end of the whole ring (rank 0 stops the scheduler and sends STOP
round the ring; another rank asks rank 0 to do so over the control channel).
From the first request on, a deadline runs: a stop that has not finished
within `deadline` seconds ends the process anyway, so nothing ever waits for
ever on a peer. A second request (a second Ctrl-C) ends it at once.

Signals are taken by a thread of ours in sigwait(), not by Python's handlers,
which run only on the main thread between bytecodes: a main thread blocked
inside MLX (a receive, a collective) would never run them. That needs the
signals blocked in every thread, so run_trinity.py calls block_stop_signals()
before anything starts a thread (numpy's BLAS, MLX, gRPC). Handlers are
installed too, for a process where some thread was started before that.

Nothing here imports more than the standard library, so that
block_stop_signals() can run first.
"""

import faulthandler
import os
import signal
import threading
import time
from typing import Callable, List, Optional

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_DEADLINE_S = 10.0  # a graceful stop that takes longer ends the process anyway
EXIT_STOP_TIMEOUT = 4  # the deadline passed (0 is a stop that finished)
PARENT_POLL_S = 0.5
# Set by the launchers that start ranks: a rank whose launcher dies stops.
LAUNCHER_ENV = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
# Set by `launch run` for each attempt: how many times it has restarted the ring before (for metrics).
RESTARTS_ENV = "TRINITY_RESTARTS"


def log(message: str) -> None:
    """One line on stderr, never raising: at a stop, the reader may be gone
    (mlx.launch killed), and a failed write must not stop the teardown."""
    try:
        os.write(2, f"trinity: {message}\n".encode(errors="replace"))
    except OSError:
        pass


def block_stop_signals() -> None:
    """Block stop signals in this thread and every thread started after it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def launcher_restarts(env=os.environ) -> int:
    """How many times `launch run --restart` restarted the ring before this attempt (0: not set)."""
    value = env.get(RESTARTS_ENV, "")
    return int(value) if value.isdigit() else 0


def launched_by_launcher(env=os.environ) -> bool:
    """Started by mlx.launch, launch run or mpirun: then our parent's death is a stop.
    (A process started from a shell by hand keeps running if the shell goes, as nohup expects.)"""
    return any(name in env for name in LAUNCHER_ENV)


class Lifecycle:
    def __init__(self, deadline: float = STOP_DEADLINE_S, exit_process: Callable[[int], None] = os._exit):
        self.deadline = deadline
        self.reason: Optional[str] = None  # why we are stopping; None while running
        self.stopping = threading.Event()
        self._callbacks: List[Callable[[str], None]] = []
        self._asked = 0  # stop requests of our own (signals, the launcher's death)
        self._lock = threading.Lock()
        self._exit = exit_process

    def start(self, watch_parent: bool = False) -> "Lifecycle":
        threading.Thread(target=self._take_signals, name="stop-signals", daemon=True).start()
        for sig in STOP_SIGNALS:  # where a thread does not block them (see the module's docstring)
            signal.signal(sig, lambda n, _frame: self.request_stop(f"stopped by {signal.Signals(n).name}"))
        if watch_parent:
            threading.Thread(target=self._watch_parent, args=(os.getppid(),), name="parent-watch",
                             daemon=True).start()
        return self

    def on_stop(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` at the first stop request (at once if one came already)."""
        with self._lock:
            self._callbacks.append(callback)
            reason = self.reason
        if reason is not None:
            callback(reason)

    def request_stop(self, reason: str, from_peer: bool = False) -> None:
        """Stop (see the module's docstring). `from_peer`: relayed by another rank,
        so a repeat is only an echo, not a second Ctrl-C."""
        with self._lock:
            first = self.reason is None
            if first:
                self.reason = reason
            if not from_peer:
                self._asked += 1
            asked, callbacks = self._asked, list(self._callbacks)
        if not first:
            if asked > 1 and not from_peer:  # a second Ctrl-C here (a peer's relay does not count)
                log(f"{reason} again: exiting now")
                self._exit(EXIT_STOP_TIMEOUT)
            return
        log(f"{reason}: stopping (at most {self.deadline:g} s)")
        self.stopping.set()
        threading.Thread(target=self._enforce_deadline, name="stop-deadline", daemon=True).start()
        for callback in callbacks:
            try:
                callback(reason)
            except Exception as e:  # one failing callback must not keep the others from running
                log(f"stop callback raised {type(e).__name__}: {e}")

    # ------------------------------------------------------------ threads

    def _take_signals(self) -> None:
        while True:
            sig = signal.sigwait(STOP_SIGNALS)
            self.request_stop(f"stopped by {signal.Signals(sig).name}")

    def _watch_parent(self, parent: int) -> None:
        """Poll, not PDEATHSIG: macOS has none, and Linux's fires when the parent's
        *thread* that started us ends (mlx.launch starts ranks from threads)."""
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        _detach_output()
        self.request_stop(f"the launcher (pid {parent}) exited")

    def _enforce_deadline(self) -> None:
        # faulthandler's timer is a C thread: it ends the process even if the
        # GIL is never released again (mx.distributed.init of the ring backend).
        devnull = open(os.devnull, "w")
        faulthandler.dump_traceback_later(self.deadline + 2.0, exit=True, file=devnull)
        time.sleep(self.deadline)
        log(f"the stop did not finish within {self.deadline:g} s; exiting")
        self._exit(EXIT_STOP_TIMEOUT)


def _detach_output() -> None:
    """Our launcher is gone, and with it the reader of our stdout/stderr pipes:
    writes would fail (EPIPE), so they go nowhere instead."""
    import stat

    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.dup2(devnull, fd)
        except OSError:
            pass
    os.close(devnull)


class RankStop:
    """What a stop request does in each phase of a rank's life (registered with
    Lifecycle.on_stop). Every rank first tells the others (rank 0 tells all,
    another rank tells rank 0, which then stops the ring). Then:
    - still starting (joining the ranks, loading weights, which can take
      minutes): exit at once, status 0;
    - rank 0 serving: the scheduler stops, then STOP goes round the ring;
    - rank 0 with a one-shot generation: the request is cancelled (its text so
      far is printed), then STOP goes round;
    - another rank in the ring: keep serving until rank 0's STOP arrives.
    """

    def __init__(self, lifecycle: Lifecycle):
        self.lifecycle = lifecycle
        self.watchdog = None  # the ranks' watchdog, once they have joined (none for one process)
        self.in_ring = False
        self._stop_scheduler: Optional[Callable[[], None]] = None

    def joined(self, watchdog) -> None:
        """The ranks have joined: stops and this rank's end are told to the others through `watchdog`."""
        self.watchdog = watchdog

    def leave(self, error: Optional[str]) -> None:
        """This rank exits: the other ranks stop watching it (error None) or learn its error."""
        if self.watchdog is None:
            return
        if error is None:
            self.watchdog.close()
        else:
            self.watchdog.leave(error)

    def __call__(self, reason: str) -> None:
        if self.watchdog is not None:
            self.watchdog.announce_stop(reason)
        if self._stop_scheduler is not None:
            self._stop_scheduler()
        elif not self.in_ring:
            self.lifecycle._exit(0)

    def running(self, stop_scheduler: Optional[Callable[[], None]] = None) -> None:
        """This rank is in the ring now; rank 0 says how to stop its scheduler."""
        self._stop_scheduler = stop_scheduler
        self.in_ring = True
        if stop_scheduler is not None and self.lifecycle.stopping.is_set():
            stop_scheduler()  # a stop came while we were between phases
