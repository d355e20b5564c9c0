"""A watchdog beside mx.distributed, which has no timeouts: a dead, frozen or
unreachable peer blocks a receive (or mx.distributed.init) for ever.

The side channel is plain TCP. Rank 0 listens on a control address; every other
rank connects and says its rank and host; both ends then send a heartbeat every
`interval` seconds. Rank 0 declares rank r failed when its connection closes
(SIGKILL: EOF or reset, at once) or nothing arrives for `peer_timeout` seconds
(SIGSTOP, a cut link), and tells every surviving rank. A rank that loses rank 0
knows rank 0 failed. Each rank then logs one line naming the failed rank and its
host, runs its failure callback, and exits with EXIT_PEER_FAILED through
os._exit: its main thread may be blocked inside MLX for good.

Start-up: rank 0 waits `connect_timeout` for every rank to connect, naming those
that do not, then says "go"; ranks call mx.distributed.init only after that,
because the ring backend's init blocks for ever on a missing peer *while holding
the GIL* (no Python thread runs meanwhile; seen with mlx 0.32).

Where rank 0 listens (control_from_env), known to every rank before init:
TRINITY_CONTROL_ADDR=host:port if set (a launcher's choice); else, for the ring
backend, rank 0's IP in MLX_HOSTFILE at one above the highest port listed there
(the ring's own ports are the listed ones); for NCCL (mlx.launch --backend
nccl), NCCL_HOST_IP at NCCL_PORT + 1. Otherwise (MPI) the ranks agree on it
after init (handshake.agree_control_address).

Stopping (lifecycle.py): a rank asked to stop sends {"stop": reason}
to rank 0, which relays it to every rank; each then has a deadline to exit.
While stopping, a peer that goes away is no longer a failure.

Parking: while the ring is idle, the other ranks block here instead of in
mx.distributed's receive (which spins on some backends): rank 0 sends a PARK
frame round the ring, each rank waits in wait_wake(), and rank 0 sends
{"wake": n} here before its next frame.

Wire format: one JSON object per line. {"hello": rank, "host": name}, {"go": 1},
{"hb": 1[, "stats": {...}]} (another rank's RankStats report rides its heartbeats, for rank 0's
metrics), {"bye": 1} (a clean exit: stop watching me), {"failed": rank, "desc":
text} (rank 0 relaying a failure, or a rank leaving with an error of its own),
{"stop": reason}, {"wake": n}.
Anyone who can reach the port can end the ring, as with MLX's own ring ports:
keep both on a trusted network.
"""

import json
import logging
import os
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .. import TrinityError
from .control_link import CONTROL_ENV, HELLO_TIMEOUT_S, IO_TIMEOUT_S, Address, Peer, listen
from .lifecycle import log

EXIT_PEER_FAILED = 3


class PeerFailed(TrinityError):
    """A rank failed (raised only where the process is not already exiting)."""


def parse_address(text: str, what: str = CONTROL_ENV) -> Address:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise TrinityError(f"{what}={text!r} is not HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


@dataclass
class Control:
    rank: int
    size: int
    address: Address  # where rank 0 listens
    hosts: List[str] = field(default_factory=list)  # what each rank is called, where known


def control_from_env(env=os.environ) -> Optional[Control]:
    """Rank, size and rank 0's control address from what the launcher set, before
    init; None when that is not enough (one process, or MPI: agreed after init)."""
    if "MLX_RANK" not in env:
        return None
    rank, size, hosts, address = int(env["MLX_RANK"]), 0, [], None
    if env.get("MLX_HOSTFILE"):
        try:
            ring = json.loads(Path(env["MLX_HOSTFILE"]).read_text() or "[]")
        except (OSError, ValueError):
            ring = []
        if len(ring) > 1:
            size = len(ring)
            hosts = [parse_address(node[0], "MLX_HOSTFILE")[0] for node in ring]
            top = max(parse_address(a, "MLX_HOSTFILE")[1] for node in ring for a in node)
            address = (hosts[0], top + 1)
    elif env.get("NCCL_HOST_IP") and env.get("NCCL_PORT") and env.get("MLX_WORLD_SIZE"):
        size = int(env["MLX_WORLD_SIZE"])
        address = (env["NCCL_HOST_IP"], int(env["NCCL_PORT"]) + 1)
        hosts = [env["NCCL_HOST_IP"]]
    if env.get(CONTROL_ENV):
        address = parse_address(env[CONTROL_ENV])
    if size < 2 or address is None:
        return None
    return Control(rank, size, address, hosts)


class Watchdog:
    def __init__(self, rank: int, size: int, address: Address, *, hosts: Sequence[str] = (),
                 candidates: Sequence[Address] = (), listener: Optional[socket.socket] = None,
                 peer_timeout: float = 5.0, connect_timeout: float = 60.0,
                 on_failure: Optional[Callable[[str], None]] = None, grace: float = 0.0,
                 on_stop: Optional[Callable[[str], None]] = None,
                 exit_process: Callable[[int], None] = os._exit):
        self.rank, self.size, self.address = rank, size, address
        self.host = socket.gethostname()
        self.hosts: Dict[int, str] = dict(enumerate(hosts))  # best name known for each rank
        self.hosts[rank] = self.host
        self.candidates = list(candidates) or [address]  # where rank 0 may be reached
        self.peer_timeout, self.connect_timeout = peer_timeout, connect_timeout
        self.interval = min(1.0, peer_timeout / 5)
        self.on_failure = on_failure  # rank 0 serving: scheduler.abort (ends streams, NOT_SERVING)
        self.grace = grace  # seconds for front ends to send their errors before the exit
        self.on_stop = on_stop  # another rank asked for a stop: lifecycle.request_stop
        self._report: Optional[Callable[[], dict]] = None  # another rank: its stats (send_stats)
        self.reports: Dict[int, dict] = {}  # rank 0: each rank's last report
        self.stopping = False  # a stop was announced: losing a peer is expected now
        self._woken = 0  # the last {"wake": n} from rank 0
        self._wake = threading.Condition()
        self.ready = threading.Event()  # every rank connected
        self.failed = threading.Event()  # set once on_failure has run
        self.failure: Optional[str] = None
        self.peers: Dict[int, Peer] = {}
        self._listener = listener
        self._exit = exit_process
        self._lock = threading.Lock()
        self._done = False  # close() or leave(): an exit of ours, nothing more to watch
        self._paused = False
        self._started = time.monotonic()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> "Watchdog":
        if self.rank == 0:
            if self._listener is None:
                self._listener = listen(self.address)
            threads = [self._accept]
        else:
            threads = [self._connect]
        for target in threads + [self._beat, self._monitor]:
            threading.Thread(target=target, name=f"watchdog-{target.__name__[1:]}", daemon=True).start()
        return self

    def wait_ready(self) -> None:
        """Block until every rank has connected (on failure the process exits)."""
        while not self.ready.wait(0.1):
            if self.failed.is_set():
                time.sleep(self.grace + 5.0)  # the watchdog thread is exiting the process
                raise PeerFailed(self.failure)

    @contextmanager
    def paused(self):
        """No timeouts inside (mx.distributed.init holds the GIL: nobody's heartbeats run)."""
        self._paused = True
        try:
            yield
        finally:
            now = time.monotonic()
            for peer in list(self.peers.values()):
                peer.last_seen = now
            self._paused = False

    def verdict(self, timeout: float) -> Optional[str]:
        """The failure, if the watchdog finds one within `timeout` seconds."""
        self.failed.wait(timeout)
        return self.failure

    def close(self) -> None:
        """A clean exit: peers stop watching us."""
        self._finish({"bye": 1})

    def leave(self, error: str) -> None:
        """Exiting with an error of our own: every rank learns it (and exits)."""
        self._finish({"failed": self.rank, "desc": self._describe(self.rank, f"failed: {error}")})

    def _finish(self, msg: dict) -> None:
        with self._lock:
            if self._done or self.failure is not None:
                return
            self._done = True
        for peer in list(self.peers.values()):
            peer.send(msg)
            try:
                peer.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        if self._listener is not None:
            self._listener.close()

    # ------------------------------------------------------------ stop and park

    def announce_stop(self, reason: str) -> None:
        """This process is stopping: rank 0 tells every rank, another rank tells rank 0 (once)."""
        with self._lock:
            if self.stopping or self._done:
                return
            self.stopping = True
        if not reason.startswith("rank "):  # ours, not one rank 0 relays
            reason = self._describe(self.rank, reason)
        for peer in list(self.peers.values()):
            peer.send({"stop": reason})

    def wake(self, n: int) -> None:
        """Rank 0: every rank parked at PARK frame `n` may receive again."""
        for peer in list(self.peers.values()):
            peer.send({"wake": n})

    def wait_wake(self, n: int) -> None:
        """Another rank, after passing PARK frame `n` on: block until rank 0 wakes the ring."""
        with self._wake:
            self._wake.wait_for(lambda: self._woken >= n)

    # ------------------------------------------------------------ threads

    def _accept(self) -> None:
        while not self._done:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(conn,), name="watchdog-greet", daemon=True).start()

    def _greet(self, conn: socket.socket) -> None:
        """Rank 0: a rank says hello; once all have, everyone may go on."""
        conn.settimeout(IO_TIMEOUT_S)
        peer = Peer(conn, None)
        msg = next(peer.lines(deadline=time.monotonic() + HELLO_TIMEOUT_S), {})
        r = msg.get("hello")
        with self._lock:
            ok = isinstance(r, int) and 0 < r < self.size and r not in self.peers and not self._done
            if ok:
                peer.host = str(msg.get("host") or self.hosts.get(r, "?"))
                self.hosts[r] = peer.host
                self.peers[r] = peer
                everyone = len(self.peers) == self.size - 1
        if not ok:  # a stranger, or a rank twice: not ours to judge
            conn.close()
            return
        peer.last_seen = time.monotonic()
        peer.send({"hello": 0, "host": self.host})
        if everyone:
            for p in list(self.peers.values()):
                p.send({"go": 1})
            self.ready.set()
        self._read(r, peer)

    def _connect(self) -> None:
        """Any other rank: reach rank 0 (it may start after us), say hello, listen."""
        while not self._done and not self.failed.is_set():
            for address in self.candidates:
                try:
                    sock = socket.create_connection(address, timeout=2.0)
                    break
                except OSError:
                    continue
            else:
                time.sleep(0.2)
                continue
            sock.settimeout(IO_TIMEOUT_S)
            peer = Peer(sock, self.hosts.get(0))
            peer.send({"hello": self.rank, "host": self.host})
            self.peers[0] = peer
            self._read(0, peer)
            return

    def _read(self, r: int, peer: Peer) -> None:
        for msg in peer.lines():
            if "hello" in msg and r == 0:
                peer.host = self.hosts[0] = str(msg.get("host") or peer.host)
            elif "go" in msg:
                self.ready.set()
            elif "bye" in msg:
                peer.gone = True
            elif "wake" in msg:
                with self._wake:
                    self._woken = max(self._woken, int(msg["wake"]))
                    self._wake.notify_all()
            elif "stop" in msg:
                if r == 0:  # rank 0 relays to everyone: nobody needs to hear it again from us
                    self.stopping = True
                if self.on_stop is not None:
                    self.on_stop(str(msg["stop"]))
            elif "stats" in msg and isinstance(msg["stats"], dict):
                self.reports[r] = msg["stats"]
            elif "failed" in msg:
                self._fail(str(msg.get("desc") or self._describe(msg["failed"], "failed")), msg["failed"])
                return
        if peer.gone:
            return
        if self.stopping:  # it exited on its own deadline, or rank 0 finished first
            self._end(self._describe(r, "exited while the ring was stopping"))
            return
        self._fail(self._describe(r, "stopped responding (connection closed)"), r)

    def send_stats(self, report: Callable[[], dict]) -> None:
        """Each heartbeat from now on carries report() (another rank's counters, shown by rank 0's
        metrics). Given once the rank's worker exists, which is made after this watchdog."""
        self._report = report

    def _beat(self) -> None:
        while not self._done and self.failure is None:
            beat = {"hb": 1}
            if self._report is not None:
                try:
                    beat["stats"] = self._report()
                except Exception as e:  # e.g. caches changing under us: the next beat has one
                    logging.getLogger(__name__).debug("no counters for this heartbeat: %s", e)
            for peer in list(self.peers.values()):
                peer.send(beat)
            time.sleep(self.interval)

    def _monitor(self) -> None:
        while not self._done and self.failure is None:
            time.sleep(self.interval / 2)
            if self._paused:
                continue
            now = time.monotonic()
            if not self.ready.is_set() and now - self._started > self.connect_timeout:
                self._never_connected()
            for r, peer in list(self.peers.items()):
                silent = now - peer.last_seen
                if not peer.gone and not self.stopping and silent > self.peer_timeout:
                    self._fail(self._describe(r, f"stopped responding (no heartbeat for {silent:.1f} s)"), r)

    def _never_connected(self) -> None:
        if self.rank != 0:
            if 0 in self.peers:
                return  # connected: rank 0 times out whoever is missing and tells us
            where = " or ".join(f"{h}:{p}" for h, p in self.candidates)
            self._fail(self._describe(0, f"did not answer on its control port {where} within "
                                         f"{self.connect_timeout:g} s"), 0)
            return
        missing = [r for r in range(1, self.size) if r not in self.peers]
        names = ", ".join(self._describe(r, "").strip() for r in missing)
        self._fail(f"{names} did not connect to rank 0 ({self.address[0]}:{self.address[1]}) within "
                   f"{self.connect_timeout:g} s", missing[0])

    # ------------------------------------------------------------ failure

    def _describe(self, r: int, what: str) -> str:
        return f"rank {r} (host {self.hosts.get(r, '?')}) {what}"

    def _fail(self, desc: str, failed_rank: int) -> None:
        with self._lock:
            if self._done or self.failure is not None:
                return
            self.failure = desc
        log(f"{desc}; exiting")
        if self.rank == 0:  # tell the survivors; each exits on its own
            for r, peer in list(self.peers.items()):
                if r != failed_rank:
                    peer.send({"failed": failed_rank, "desc": desc})
        try:
            if self.on_failure is not None:
                self.on_failure(desc)
        except Exception as e:  # the exit below matters more
            log(f"failure callback raised {type(e).__name__}: {e}")
        finally:
            self.failed.set()
        time.sleep(self.grace)
        self._exit(EXIT_PEER_FAILED)

    def _end(self, desc: str) -> None:
        """A peer went away during a stop: nothing to wait for, and nothing failed."""
        with self._lock:
            if self._done or self.failure is not None:
                return
            self.failure = desc
        log(f"{desc}; exiting")
        self.failed.set()
        time.sleep(self.grace)
        self._exit(0)
