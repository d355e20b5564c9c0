"""Rank 0's loop: the thread that runs the ring (the Batcher decides what each step carries).

Front ends submit requests into a bounded FIFO queue; a single thread admits
them into the Batcher (continuous batching, up to --max-batch sequences at
once) and drives rank 0's Pipeline, streaming events back to each request's
handle.

A burst (many clients at once) is admitted as one prefill batch: a front end's thread
says when it starts building a request (`arriving`, which ends when that thread submits),
and a loop woken from idle by the first of a burst waits for those still arriving, up to
GATHER_S, before the batch's first frame goes. A request alone waits for nothing: nothing
else is arriving.
"""

import logging
import queue
import threading
import time
from contextlib import contextmanager
from concurrent.futures import Future
from typing import Callable, Iterator, Optional, Union

from .batching import Batcher
from .frames import PREFILL_STEP_SIZE
from .grammar import Grammars
from .memory_guard import ChunkBudget, MemoryAdmission, allocation_failed, describe
from .pipeline import Pipeline
from .prefix_cache import PrefixCache
from .request import RING_RESET, FinishEvent, GenerationRequest, TokenEvent
from .speculation import SpeculationOptions
from .step_budget import StepBudget

Event = Union[TokenEvent, FinishEvent]
log = logging.getLogger(__name__)

GATHER_S = 0.005  # at most, the wait for the rest of a burst (see above)


class QueueFull(Exception):
    """More requests are waiting than --max-queue allows."""


class RingUnavailable(Exception):
    """The ring broke (a rank died or a link failed); nothing more can run."""


class RequestHandle:
    def __init__(self, request: GenerationRequest):
        self.request = request
        self.constraint = None  # grammar.Constraint where the request has a grammar
        self._events: "queue.Queue[Event]" = queue.Queue()
        self._cancelled = threading.Event()
        self.done = False  # its FinishEvent was emitted
        self.streamed = 0  # TokenEvents emitted (a failure's FinishEvent reports them)

    def cancel(self) -> None:
        """Stop generating for this request; takes effect within one decode step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set() or self.request.expired()

    def emit(self, event: Event) -> None:
        if self.done:  # e.g. the watchdog already failed it
            return
        self.done = isinstance(event, FinishEvent)
        self.streamed += isinstance(event, TokenEvent)
        self._events.put(event)

    def events(self, idle: Optional[float] = None) -> Iterator[Optional[Event]]:
        """Token events as they are decoded, then one FinishEvent; with `idle`, None after each
        `idle` seconds without one (a streamed reply's keep-alive)."""
        while True:
            try:
                event = self._events.get(timeout=idle)
            except queue.Empty:
                yield None
                continue
            yield event
            if isinstance(event, FinishEvent):
                return


class Scheduler:
    def __init__(self, pipeline: Pipeline, tokenizer, max_queue: int = 64, prefill_step_size: int = PREFILL_STEP_SIZE,
                 max_batch: int = 16, on_failure: Optional[Callable[[str], None]] = None,
                 prefill_batch_tokens: int = 2048, prefix_cache_bytes: int = 0,
                 speculation: Optional[SpeculationOptions] = None, memory: Optional[MemoryAdmission] = None,
                 chunk_budget: Optional[ChunkBudget] = None, step_budget: Optional[StepBudget] = None):
        self.pipeline, self.tokenizer = pipeline, tokenizer
        self.on_failure = on_failure  # e.g. turn health to NOT_SERVING
        self.grammars = Grammars(tokenizer, pipeline.stage.args.vocab_size)  # constrained decoding's tokenizer
        self.prefix_cache = PrefixCache(pipeline, prefix_cache_bytes)  # 0: off
        self.memory = memory  # --memory-limit: admission waits for memory
        self.batcher = Batcher(pipeline, tokenizer, max_batch, prefill_step_size, prefill_batch_tokens,
                               self.prefix_cache, speculation, memory, chunk_budget, step_budget)
        # Bound: max_batch running + max_queue waiting. A burst within the batch's room is
        # taken even before the loop moves it from this queue into the batch.
        self.max_queue, self.capacity = max_queue, max_batch + max_queue
        self._waiting: "queue.Queue[RequestHandle]" = queue.Queue()
        self._calls: "queue.Queue" = queue.Queue()  # (fn, future) to run between steps
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        self.failure: Optional[str] = None
        self._stopping = threading.Event()
        self._active: set = set()  # handles admitted and not finished
        self._arriving: set = set()  # front-end threads building a request to submit (arriving())
        self._lock = threading.Lock()

    def start(self) -> "Scheduler":
        """Run the loop on a background thread (tests, in-process front ends).

        Processes that exit should rather call serve_forever() or run_pending()
        on the main thread: MLX tears down per-thread state when a thread ends,
        and a thread that used MLX and ends while Python finalizes aborts."""
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Run the loop on the calling thread until stop()."""
        self._run()

    def run_pending(self) -> None:
        """Process what is queued now on the calling thread, then return."""
        self._run(until_idle=True)

    def stop(self) -> None:
        """Make serve_forever() return soon; requests still running end with an
        error (safe from a signal handler)."""
        self._stopping.set()

    @property
    def waiting(self) -> int:
        """Requests queued and not admitted yet (read from any thread)."""
        return self._waiting.qsize()

    @property
    def running(self) -> int:
        """Requests admitted and not finished (read from any thread)."""
        return self.batcher.sequences

    @contextmanager
    def arriving(self):
        """Around a front end's building of a request, on its thread: until that thread submits
        (or leaves the block), a burst's loop waits for it, so that they prefill together."""
        me = threading.get_ident()
        with self._lock:
            self._arriving.add(me)
        try:
            yield
        finally:
            with self._lock:
                self._arriving.discard(me)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue `request`; raises RequestError for token ids outside the vocabulary
        (the front ends validate everything first; this guards in-process callers),
        QueueFull or RingUnavailable."""
        if self.failure is not None:
            raise RingUnavailable(self.failure)
        request.validate_token_ids(self.pipeline.stage.args.vocab_size)
        handle = RequestHandle(request)
        if request.grammar is not None:  # compiled here, in the caller's thread: it can take a while
            handle.constraint = self.grammars.constraint(request.grammar)
        with self._lock:
            held = self._waiting.qsize() + self.batcher.sequences
            if held >= self.capacity:
                raise QueueFull(f"{held} requests are already running or waiting "
                                f"(--max-batch {self.batcher.max_batch} + --max-queue {self.max_queue})")
            self._waiting.put_nowait(handle)
            self._arriving.discard(threading.get_ident())  # arrived
        return handle

    def call(self, fn: Callable[[Pipeline], object]) -> object:
        """Run fn(pipeline) on the scheduler thread with nothing in the ring (e.g. rank info)."""
        if self.failure is not None:
            raise RingUnavailable(self.failure)
        future: Future = Future()
        self._calls.put((fn, future))
        if self.failure is not None:  # the loop may no longer run calls
            raise RingUnavailable(self.failure)
        return future.result()

    def rank_info(self) -> list:
        """Each rank's row (rank_info.py), asked afresh between steps."""
        return self.call(lambda pipeline: pipeline.rank_info())

    def rank_reports(self) -> dict:
        """Each rank's counters for the metrics, as last heard (never waits for the ring)."""
        return self.pipeline.rank_reports()

    def abort(self, reason: str) -> None:
        """The ring is broken (called from a watchdog thread while the loop may be
        blocked on a dead peer): end every running and queued request with an
        error naming `reason`, and refuse new ones."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            doomed = list(self._active)
        if self.on_failure is not None:  # first, so that a client told of the failure finds health down
            self.on_failure(reason)
        while not self._waiting.empty():
            self._fail_waiting(block=False)
        while not self._calls.empty():
            self._calls.get_nowait()[1].set_exception(RingUnavailable(reason))
        for handle in doomed:
            # Tokens count as Sequence.finish counts them: a resumed request's included.
            produced = handle.streamed + len(handle.request.resume_ids)
            handle.emit(FinishEvent("error", len(handle.request.prompt_ids), produced, error=reason))

    def close(self) -> None:
        """Stop the loop, then stop the other ranks."""
        if self._thread.is_alive():
            self.stop()
            self._thread.join()
        if self.failure is None:
            self.pipeline.close()

    def _run(self, until_idle: bool = False) -> None:
        while not self._stopping.is_set():
            if self.failure is not None:
                if until_idle and self._waiting.empty():
                    return
                self._fail_waiting(block=True)
                continue
            try:
                self._run_calls()
                if self.batcher.idle and not until_idle and self._waiting.empty() and self._calls.empty():
                    self.pipeline.park()  # the other ranks sleep until the next frame
                with self.pipeline.stats.clock.part("idle" if self.batcher.idle else "admit"):
                    self._admit(block=self.batcher.idle)
                if self.batcher.idle:
                    if until_idle and self._waiting.empty() and self._calls.empty():
                        return
                    continue
                self.batcher.step()
            except Exception as e:
                self._recover(e)
            with self._lock:
                self._active = {h for h in self._active if not h.done}
        if self.failure is None and not self.batcher.idle:
            self.batcher.shutdown("the server is shutting down")

    def _recover(self, error: Exception) -> None:
        """A step raised `error` that no one request was found to cause (a row's own failures
        end that row alone: Batcher._accept): every admitted request ends with an error, every
        rank drops its caches, and the ring serves on (Batcher.reset). Where MLX could not
        allocate on rank 0, the error names memory (memory_guard.py). Only if the reset
        fails too is the ring broken: then nothing is served half-alive, the loop ends and
        the process exits non-zero (a launcher's --restart starts it again)."""
        try:
            if allocation_failed(error):
                return self.batcher.reset(describe(self.pipeline.guard.own_failure()) + f" ({error})")
            log.error("a step failed; resetting the ring", exc_info=error)
            self.batcher.reset(f"{RING_RESET} ({type(error).__name__})")
        except Exception as e:
            log.error("resetting the ring failed; the ring is down", exc_info=e)
            self.abort(f"{type(e).__name__}: {e}")
            self._stopping.set()

    def _run_calls(self) -> None:
        while not self._calls.empty():
            fn, future = self._calls.get_nowait()
            self.batcher.drain()  # the call's frames must not mix with replies
            try:
                future.set_result(fn(self.pipeline))
            except Exception as e:
                future.set_exception(e)

    def _admit(self, block: bool) -> None:
        """Move queued requests into the batcher while it has room (waiting
        briefly for one if `block`)."""
        gather_until = None
        while self.batcher.has_room:
            try:
                handle = self._next_waiting(block, gather_until)
            except queue.Empty:
                return
            if block:  # woken from idle: the rest of a burst may be arriving
                gather_until = time.monotonic() + GATHER_S
            block = False
            if handle.cancelled:  # never admitted, so not kept in _active (pruned only after a step)
                handle.emit(FinishEvent("cancelled", len(handle.request.prompt_ids), 0))
                continue
            refused = self.memory.refusal(handle.request) if self.memory is not None else None
            if refused is not None:  # too big for the limit even alone: before prefill
                handle.emit(FinishEvent("error", len(handle.request.prompt_ids), 0, error=refused))
                continue
            with self._lock:
                self._active.add(handle)
            self.batcher.add(handle)

    def _next_waiting(self, block: bool, gather_until: Optional[float]) -> RequestHandle:
        """The next queued request: waiting briefly for one if `block`, else one queued now or,
        until `gather_until`, one that a front end is still building; queue.Empty otherwise."""
        if block:
            return self._waiting.get(timeout=0.05)
        while True:
            try:
                return self._waiting.get_nowait()
            except queue.Empty:
                if gather_until is None or not self._arriving or time.monotonic() >= gather_until:
                    raise
            try:
                return self._waiting.get(timeout=0.0005)
            except queue.Empty:
                pass

    def _fail_waiting(self, block: bool) -> None:
        """After a failure: answer anything still queued with the error."""
        try:
            handle = self._waiting.get(timeout=0.1) if block else self._waiting.get_nowait()
        except queue.Empty:
            return
        handle.emit(FinishEvent("error", len(handle.request.prompt_ids), 0, error=self.failure))
