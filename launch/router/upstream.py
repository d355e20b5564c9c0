"""The router's gRPC channel to rank 0, and whether rank 0 serves now.

Rank 0 listens on the same internal address in every attempt of the ring, so one
channel serves them all (it reconnects quickly: rank 0 comes back within seconds);
when re-planning moves rank 0 to another host, retarget() opens one to its new address.
A thread polls rank 0's health. Each time rank 0 turns SERVING an epoch begins;
a request that sent in epoch E and saw its stream fail reports failed(E), which
ends that epoch at once (before the next poll), so requests wait for the next one
instead of retrying against a dead ring. When an epoch ends, the calls still running
in it are cancelled: a stream to a rank 0 whose host went silent gets no reset and
would otherwise wait for the client's deadline (replay.py replays what it cancels).
A health check that gets no answer in time ends the epoch only the LATE_CHECKS-th in a row:
rank 0 busy with a long prefill on a loaded host (Claude Code's 34k-token first prompt on a
CPU) answers late, and cancelling its prefill to replay it made it start over and over.
"""

import threading
import time
from typing import Callable, Dict, Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from distributed.serving.proto import generation_pb2 as pb
from distributed.serving.proto import generation_pb2_grpc as pb_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
POLL_DOWN_S = 0.1  # health polls while rank 0 is down or loading
POLL_UP_S = 0.5  # while it serves (a failed stream reports a failure sooner)
HEALTH_TIMEOUT_S = 2.0  # a health check's deadline
LATE_CHECKS = 3  # health checks in a row without an answer that mean rank 0 is gone (frozen, its host silent)
CHANNEL_OPTIONS = [  # reconnect within moments of the restarted rank 0 listening
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.max_receive_message_length", 64 * 2**20),
]


class Closed(Exception):
    """No ring will serve again (the launcher gave up, or stops); the reason is the message."""


class Retargeted(Exception):
    """A call went to the channel retarget() had just closed."""


class Upstream:
    def __init__(self, address: str, token: Optional[str] = None,
                 on_up: Callable[[int, Optional[float]], None] = lambda epoch, down_for: None,
                 on_down: Callable[[str], None] = lambda reason: None):
        self._connect(address)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.on_up, self.on_down = on_up, on_down
        self.epoch = 0  # counts the times rank 0 turned SERVING
        self.serving = False
        self.down_since: Optional[float] = None  # monotonic; None before the first epoch
        self.closed: Optional[str] = None
        self._calls: Dict[object, int] = {}  # calls in flight -> the epoch they were sent in
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._watch, name="router-upstream", daemon=True)

    def _connect(self, address: str) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def retarget(self, address: str) -> None:
        """Rank 0 moved to another host (re-planned): call it at `address` from now on. The old
        channel is closed: a call still on it to the vanished host would otherwise wait for
        TCP to give up; it ends CANCELLED while rank 0 is down, which replay.py counts as the
        ring's failure, so it is replayed on the new rank 0."""
        with self._cond:
            old = self.channel
            self._connect(address)
        old.close()

    def start(self) -> "Upstream":
        self._thread.start()
        return self

    def _watch(self) -> None:
        late = 0  # health checks in a row that got no answer in time
        while self.closed is None:
            asked = time.monotonic()
            try:
                up = self.ask(self._health)
                late = 0
            except Retargeted:
                continue  # asked on the channel retarget() just closed: ask the new one
            except grpc.RpcError as e:
                # No answer in time: a rank 0 busy with a long prefill on a loaded host answers late, a frozen
                # one never. Only LATE_CHECKS in a row end the epoch; a refusal or NOT_SERVING does at once.
                late = late + 1 if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else LATE_CHECKS
                up = late < LATE_CHECKS and self.serving
            if up:
                self._up(asked)
            elif self.serving:
                self.failed(self.epoch, "rank 0 is not serving" if late < LATE_CHECKS
                            else f"rank 0 did not answer {LATE_CHECKS} health checks in a row")
            time.sleep(POLL_UP_S if self.serving else POLL_DOWN_S)

    def ask(self, health) -> bool:
        """Whether rank 0 serves, asked through `health` (the stub the watcher read). retarget()
        may close its channel between that read and the call, which gRPC refuses with a
        ValueError: Retargeted then (the watcher thread died of it, and with it every epoch
        after: a request replayed after a restart waited for ever)."""
        try:
            return health.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S).status == SERVING
        except ValueError:
            if health is self._health:
                raise
            raise Retargeted() from None

    def _up(self, asked: float) -> None:
        with self._cond:
            if self.serving or self.closed is not None:
                return
            if self.down_since is not None and asked < self.down_since:
                return  # an answer from before the failure: the old rank 0
            self.serving, self.epoch = True, self.epoch + 1
            down_for = None if self.down_since is None else time.monotonic() - self.down_since
            epoch = self.epoch
            self._cond.notify_all()
        self.on_up(epoch, down_for)

    def failed(self, epoch: int, reason: str) -> None:
        """A call sent in `epoch` failed as rank 0 or its ring went down: that epoch is over."""
        with self._cond:
            if not self.serving or epoch != self.epoch:
                return
            self.serving, self.down_since = False, time.monotonic()
            doomed = [call for call, sent_in in self._calls.items() if sent_in == epoch]
        self.on_down(reason)
        for call in doomed:
            call.cancel()

    def track(self, call, epoch: int) -> None:
        """`call` was sent in `epoch`: cancelled if that epoch ends while it runs."""
        with self._cond:
            self._calls[call] = epoch
            ended = epoch != self.epoch or not self.serving
        if ended:
            call.cancel()

    def untrack(self, call) -> None:
        with self._cond:
            self._calls.pop(call, None)

    def wait_serving(self, give_up: Callable[[], bool]) -> int:
        """Block until rank 0 serves; returns the epoch. Raises Closed, or returns 0 once
        give_up() (polled every 0.1 s: a cancel, a deadline) is true."""
        with self._cond:
            while True:
                if self.closed is not None:
                    raise Closed(self.closed)
                if self.serving:
                    return self.epoch
                if give_up():
                    return 0
                self._cond.wait(0.1)

    def model_info(self, timeout: float = 30) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def close(self, reason: str) -> None:
        """No more epochs: waiting requests raise Closed(reason)."""
        with self._cond:
            if self.closed is None:
                self.closed = reason
            self.serving = False
            self._cond.notify_all()

    def shut(self) -> None:
        self.close("the server is shutting down")
        self.channel.close()
