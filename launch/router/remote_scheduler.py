"""The router's scheduler: what the front ends ask of rank 0's runtime Scheduler (submit,
rank_info, rank_reports, waiting, running; no prefix_cache), answered by forwarding each
request to rank 0 (replay.py: a thread per request, which replays it on a restarted ring).

Its bound is rank 0's own: up to max_batch requests running and --max-queue waiting
(QueueFull beyond), whether the ring is up or restarting, so rank 0 never refuses
what the router took; the router sets max_batch afresh each time rank 0 serves again
(a restarted rank 0 measures its memory again; a re-planned one holds other layers).
Once the launcher gives up (no restarts left) or stops, every request still held ends
with an error naming why, and new ones get RingUnavailable.
"""

import contextlib
import queue
import random
import threading
from typing import Callable, List, Optional

import grpc

from distributed.runtime.grammar import one_line
from distributed.runtime.request import FinishEvent, GenerationRequest, RequestError
from distributed.runtime.scheduler import QueueFull, RingUnavailable
from distributed.serving.grpc_service import tensor_share_row

from .replay import Forwarded
from .upstream import Upstream


class RemoteHandle:
    """What submit() returns: the request, its events as they come, cancel()."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self._events: "queue.SimpleQueue" = queue.SimpleQueue()
        self.forwarded: Optional[Forwarded] = None

    def emit(self, event) -> None:
        self._events.put(event)

    def events(self, idle=None):
        """As RequestHandle.events: None after each `idle` seconds without an event."""
        while True:
            try:
                event = self._events.get(timeout=idle)
            except queue.Empty:
                yield None
                continue
            yield event
            if isinstance(event, FinishEvent):
                return

    def cancel(self) -> None:
        self.forwarded.cancel()


class RemoteScheduler:
    prefix_cache = None  # rank 0's metrics report it

    def __init__(self, upstream: Upstream, decode: Callable[[List[int]], str], max_queue: int, max_batch: int,
                 on_replay: Callable[[Forwarded, float], None] = lambda forwarded, paused: None):
        self.upstream, self.decode, self.on_replay = upstream, decode, on_replay
        self.max_queue = max_queue
        self.set_max_batch(max_batch)
        self.failure: Optional[str] = None
        self._active: set = set()
        self._lock = threading.Lock()

    def set_max_batch(self, max_batch: int) -> None:
        """Rank 0's max batch (GetModelInfo): with --max-queue, how many requests we hold."""
        self.max_batch = max(1, max_batch)
        self.capacity = self.max_queue + self.max_batch

    def _streaming(self) -> int:
        with self._lock:
            return sum(1 for f in self._active if f.started and self.upstream.serving)

    @property
    def waiting(self) -> int:
        """Requests held that rank 0 has not started (queued there, or waiting for the ring)."""
        return len(self._active) - self._streaming()

    @property
    def running(self) -> int:
        """Requests rank 0 is running for us now."""
        return self._streaming()

    def arriving(self):
        """Rank 0's own front end gathers a burst (runtime/scheduler.py): nothing to wait for here."""
        return contextlib.nullcontext()

    def submit(self, request: GenerationRequest) -> RemoteHandle:
        if self.failure is not None:
            raise RingUnavailable(self.failure)
        if request.grammar is not None:  # refused here as rank 0's scheduler refuses it: a 400 naming its field
            check_grammar(request.grammar)
        if request.seed is None and request.temperature > 0:
            # Rank 0 would draw a random key; a seed of ours lets a replay continue its sequence.
            request.seed = random.getrandbits(63)
        handle = RemoteHandle(request)
        forwarded = handle.forwarded = Forwarded(request, self.upstream, self._emitter(handle), self.decode,
                                                 self.on_replay)
        with self._lock:
            if len(self._active) >= self.capacity:
                raise QueueFull(self._full(len(self._active)))
            self._active.add(forwarded)
        threading.Thread(target=forwarded.run, name="router-request", daemon=True).start()
        return handle

    def _full(self, held: int) -> str:
        where = "running or waiting" if self.upstream.serving else "waiting for the ring to restart"
        return (f"{held} requests are already {where} (rank 0's max batch {self.max_batch} "
                f"+ --max-queue {self.max_queue})")

    def _emitter(self, handle: RemoteHandle):
        def emit(event) -> None:
            if isinstance(event, FinishEvent):
                with self._lock:
                    self._active.discard(handle.forwarded)
            handle.emit(event)
        return emit

    def rank_info(self) -> List[dict]:
        """Rank 0's rows, asked afresh (GetModelInfo)."""
        if self.failure is not None:
            raise RingUnavailable(self.failure)
        try:
            info = self.upstream.model_info()
        except grpc.RpcError as e:
            raise RingUnavailable(e.details() or e.code().name) from None
        return rank_rows(info)

    def rank_reports(self) -> dict:
        return {}  # per-rank counters stay on rank 0's --metrics

    def held(self) -> List[Forwarded]:
        with self._lock:
            return list(self._active)

    def close(self, reason: str) -> None:
        """No ring will serve again: requests held end with `reason`, new ones are refused."""
        self.failure = reason
        self.upstream.close(reason)


def check_grammar(grammar: str) -> None:
    """RequestError("grammar", …) if llguidance rejects the grammar (as runtime/grammar.py's
    Constraint does on rank 0, which the router's requests reach only later)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise RequestError("grammar", f"the grammar library rejects it: {one_line(error)}")


def rank_rows(info) -> List[dict]:
    """pb.ModelInfo's ranks as the runtime's rank_info() rows."""
    rows = []
    for r in info.ranks:
        rows.append({"rank": r.rank, "host": r.host, "layers": [r.layer_start, r.layer_end], "embed": r.embed,
                     "head": r.head, "peak_memory_bytes": r.peak_memory_bytes, "parameter_bytes": r.parameter_bytes,
                     "memory_bytes": r.memory_bytes, "memory_limited": r.memory_limited})
        if r.HasField("tensor"):  # --tensor-parallel-size
            rows[-1]["tensor"] = tensor_share_row(r.tensor)
    return rows
