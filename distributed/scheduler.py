"""The one place that decides what runs on the ring.

Front ends submit requests; a single thread drives rank 0's Pipeline and
streams events back to each request's handle. For now requests pass the ring
one at a time, in FIFO order, from a bounded queue. Continuous batching will
change `_run` only: submit/handle/events stay as they are.
"""

import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterator, List, Optional, Union

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from .generate import generate_tokens
from .pipeline import Pipeline
from .request import FinishEvent, GenerationRequest, TokenEvent

Event = Union[TokenEvent, FinishEvent]


class QueueFull(Exception):
    """More requests are waiting than --max-queue allows."""


class RingUnavailable(Exception):
    """The ring broke (a rank died or a link failed); nothing more can run."""


class RequestHandle:
    def __init__(self, request: GenerationRequest):
        self.request = request
        self._events: "queue.Queue[Event]" = queue.Queue()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop generating for this request; takes effect within one decode step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set() or self.request.expired()

    def emit(self, event: Event) -> None:
        self._events.put(event)

    def events(self) -> Iterator[Event]:
        """Token events as they are decoded, then one FinishEvent."""
        while True:
            event = self._events.get()
            yield event
            if isinstance(event, FinishEvent):
                return


class StopStrings:
    """Finds stop strings in streamed text, holding back what could begin one."""

    def __init__(self, stops: List[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str):
        """Returns (text safe to emit, whether a stop string was hit)."""
        self.pending += text
        for stop in self.stops:
            at = self.pending.find(stop)
            if at >= 0:
                out, self.pending = self.pending[:at], ""
                return out, True
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Scheduler:
    def __init__(self, pipeline: Pipeline, tokenizer, max_queue: int = 64, prefill_step_size: int = 2048,
                 on_failure: Optional[Callable[[str], None]] = None):
        self.pipeline = pipeline
        self.on_failure = on_failure  # e.g. turn health to NOT_SERVING
        self.tokenizer = tokenizer
        self.prefill_step_size = prefill_step_size
        self._waiting: "queue.Queue[RequestHandle]" = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        self.failure: Optional[str] = None
        self._stopping = threading.Event()
        self._active: set = set()  # handles being generated now
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
        """Make serve_forever() return after the current request (safe from a signal handler)."""
        self._stopping.set()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        if self.failure is not None:
            raise RingUnavailable(self.failure)
        handle = RequestHandle(request)
        try:
            self._waiting.put_nowait(handle)
        except queue.Full:
            raise QueueFull(f"{self._waiting.maxsize} requests are already waiting") from None
        return handle

    def abort(self, reason: str) -> None:
        """The ring is broken (called from a watchdog thread while the loop may be
        blocked on a dead peer): end every running and queued request with an
        error naming `reason`, and refuse new ones."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            doomed = list(self._active)
        while True:
            try:
                item = self._waiting.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, tuple):
                item[1].set_exception(RingUnavailable(reason))
            else:
                doomed.append(item)
        for handle in doomed:
            handle.emit(FinishEvent("error", len(handle.request.prompt_ids), 0, error=reason))
        if self.on_failure is not None:
            self.on_failure(reason)

    def call(self, fn: Callable[[Pipeline], object]) -> object:
        """Run fn(pipeline) on the scheduler thread between requests (e.g. rank info)."""
        if self.failure is not None:
            raise RingUnavailable(self.failure)
        future: Future = Future()
        self._waiting.put((fn, future))
        return future.result()

    def close(self) -> None:
        """Stop the loop (after the current request), then stop the other ranks."""
        if self._thread.is_alive():
            self.stop()
            self._thread.join()
        if self.failure is None:
            self.pipeline.close()

    def _run(self, until_idle: bool = False) -> None:
        while not self._stopping.is_set():
            try:
                handle = self._waiting.get(timeout=0.1)
            except queue.Empty:
                if until_idle:
                    return
                continue
            if isinstance(handle, tuple):
                fn, future = handle
                try:
                    future.set_result(fn(self.pipeline))
                except Exception as e:
                    future.set_exception(e)
                continue
            if self.failure is not None:
                handle.emit(FinishEvent("error", len(handle.request.prompt_ids), 0, error=self.failure))
                continue
            self._active.add(handle)
            try:
                self._generate(handle)
            except Exception as e:  # the ring is broken: fail this and every later request
                self.abort(f"{type(e).__name__}: {e}")
            finally:
                self._active.discard(handle)

    def _generate(self, handle: RequestHandle) -> None:
        req = handle.request
        if handle.cancelled:
            handle.emit(FinishEvent("cancelled", len(req.prompt_ids), 0))
            return
        if req.seed is not None:
            mx.random.seed(req.seed)
        sampler = make_sampler(req.temperature, req.top_p, req.min_p, top_k=req.top_k)
        detokenizer = self.tokenizer.detokenizer
        stops = StopStrings(req.stop)
        eos = self.tokenizer.eos_token_ids
        reason, count, hit = "length", 0, False
        tic = time.perf_counter()
        first_at = None
        for token, logprob in generate_tokens(self.pipeline, req.prompt_ids, req.max_tokens, sampler, self.prefill_step_size):
            first_at = first_at or time.perf_counter()
            if handle.cancelled:
                reason = "cancelled"
                break
            if token in eos:
                reason = "stop"
                break
            detokenizer.add_token(token)
            text, hit = stops.feed(detokenizer.last_segment)
            count += 1
            handle.emit(TokenEvent(token, logprob, text))
            if hit:
                reason = "stop"
                break
        self.pipeline.release()
        tail = ""
        if not hit:
            detokenizer.finalize()
            tail, _ = stops.feed(detokenizer.last_segment)
            tail += stops.flush()
        done = time.perf_counter()
        handle.emit(
            FinishEvent(
                reason,
                len(req.prompt_ids),
                count,
                prefill_tokens_per_sec=len(req.prompt_ids) / (first_at - tic) if first_at else 0.0,
                generation_tokens_per_sec=(count - 1) / (done - first_at) if first_at and count > 1 else 0.0,
                text=tail,
            )
        )
