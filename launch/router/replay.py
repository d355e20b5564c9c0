"""One request as the router forwards it to rank 0, and replays it when the ring fails.

The router sends rank 0 the request as token ids with every field (serving/wire.py: its
sampling, penalties, logit_bias, logprobs, stop strings, seed, speculation opt-out and grammar,
so that a constrained request is constrained here as on rank 0's own port). It
records what it passed on to the client (the prompt's logprobs, each token). When
the stream fails because rank 0 or its ring went down, the request waits for the
restarted rank 0 and is sent again with `resume_token_ids`: the tokens already
streamed, which rank 0 prefills after the prompt and counts as generated (for
max_tokens, stop strings, penalties and the seeded random key alike) without
streaming them again; the client sees a pause, not an error.
"""

import math
import threading
import time
from typing import Callable, List, Optional

import grpc

from distributed.runtime.request import FinishEvent, GenerationRequest, PromptEvent, TokenEvent, failure_kind
from distributed.serving.proto import generation_pb2 as pb
from distributed.serving.wire import to_wire

from .upstream import Closed, Upstream

POLL_GRACE_S = 0.2  # before asking whether rank 0 still serves after an unexpected error
RETRY_BUSY_S = 0.1  # rank 0's queue was full (a race with requests ending): try again after this
MAX_TIMEOUT_S = 10**7  # a longer deadline is none (one far beyond it overflows gRPC's, which then expires at once)
# Codes a call ends with when rank 0 or its ring goes away (UNAVAILABLE: the ring failed, rank 0
# stopped, or its connection was refused or reset); the others only if rank 0 is no longer serving.
RING_DOWN = (grpc.StatusCode.UNAVAILABLE,)
MAYBE_DOWN = (grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


def generate_request(r: GenerationRequest, resume: List[int], prompt_logprobs: bool) -> pb.GenerateRequest:
    """`r` as rank 0 takes it: every field (wire.py, the conversion rank 0's gRPC service reads
    back), with the tokens already streamed to resume from and whether the prompt's logprobs are
    still to come."""
    return to_wire(r, resume_ids=resume, prompt_logprobs=prompt_logprobs)


def _pairs(top: pb.TopLogprobs):
    return list(zip(top.token_ids, top.logprobs))


def prompt_event(r: pb.GenerateResponse) -> PromptEvent:
    """Rank 0's first response of a prompt_logprobs request, as its runtime made it."""
    logprobs = [None if i == 0 and math.isnan(v) else v for i, v in enumerate(r.prompt_logprobs)]
    tops = [None if i == 0 else _pairs(t) for i, t in enumerate(r.prompt_top_logprobs)]
    return PromptEvent(list(r.prompt_token_ids), logprobs, tops)


class Forwarded:
    """A request's life in the router: run() on a thread of its own, events to `emit`."""

    def __init__(self, request: GenerationRequest, upstream: Upstream, emit: Callable, decode: Callable,
                 on_replay: Callable[["Forwarded", float], None]):
        self.request, self.upstream, self.emit, self.decode = request, upstream, emit, decode
        self.on_replay = on_replay  # (request, seconds from the failure to its next token)
        self.tokens: List[int] = []  # passed on to the client
        self.text = ""  # their text as passed on
        self.prompt_sent = False
        self.started = False  # rank 0 has answered (it runs, or has its PromptEvent out)
        self.replays = 0
        self._failed_at: Optional[float] = None
        self._cancelled = threading.Event()
        self._call = None
        self._lock = threading.Lock()

    def cancel(self) -> None:
        self._cancelled.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()

    def _stopped(self) -> bool:
        return self._cancelled.is_set() or self.request.expired()

    def _finish(self, reason: str, error: Optional[str] = None, **usage) -> None:
        usage.setdefault("prompt_tokens", len(self.request.prompt_ids))
        usage.setdefault("completion_tokens", len(self.tokens))
        self.emit(FinishEvent(reason, error=error, **usage))

    def run(self) -> None:
        try:
            self._run()
        except Closed as e:
            self._finish("error", str(e))
        except Exception as e:  # never leave a client waiting on a handle that will not finish
            self._finish("error", f"router: {type(e).__name__}: {e}")

    def _run(self) -> None:
        while True:
            epoch = self.upstream.wait_serving(self._stopped)
            if self._stopped():
                return self._finish("cancelled")
            if self._done():
                return
            outcome = self._stream(epoch)
            if outcome is None:
                return
            code, details = outcome
            if self._stopped():
                return self._finish("cancelled")
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                time.sleep(RETRY_BUSY_S)
                continue
            down = code in RING_DOWN or (code in MAYBE_DOWN and not self._still_serving(epoch))
            if not down:  # rank 0's error as it is: its words say whose failure it is (failure_kind)
                kind = failure_kind(details)
                return self._finish("error", details if kind != "ring" else f"rank 0 answered {code.name}: {details}")
            self.upstream.failed(epoch, details)
            if self._failed_at is None:
                self._failed_at = time.monotonic()
            if self.started:
                self.replays += 1  # sent again below, with what was streamed

    def _done(self) -> bool:
        """Everything was streamed before the failure: end as rank 0 would have, without resending."""
        r = self.request
        if r.max_tokens == 0 and self.prompt_sent:
            self._finish("length")
            return True
        if r.max_tokens and len(self.tokens) >= r.max_tokens:
            whole = self.decode(self.tokens)
            rest = whole[len(self.text):] if whole.startswith(self.text) else ""
            self._finish("length", text=rest)
            return True
        return False

    def _still_serving(self, epoch: int) -> bool:
        time.sleep(POLL_GRACE_S)  # rank 0's health turns NOT_SERVING before its streams fail
        try:
            self.upstream.model_info(timeout=2)
        except grpc.RpcError:
            return False
        return self.upstream.serving and self.upstream.epoch == epoch

    def _stream(self, epoch: int):
        """Send once; None when the request ended, else (status code, details) of the failure."""
        r = self.request
        message = generate_request(r, self.tokens, r.prompt_logprobs and not self.prompt_sent)
        timeout = None if r.deadline is None else max(0.0, r.deadline - time.monotonic())
        if timeout is not None and timeout > MAX_TIMEOUT_S:  # gRPC's "no deadline" is a huge one
            timeout = None
        with self._lock:
            self._call = call = self.upstream.stub.Generate(message, timeout=timeout, metadata=self.upstream.metadata)
        self.upstream.track(call, epoch)
        if self._cancelled.is_set():
            call.cancel()
        try:
            for response in call:
                self.started = True
                if response.prompt_token_ids:
                    self.prompt_sent = True
                    self.emit(prompt_event(response))
                elif response.finish_reason:
                    u = response.usage
                    self._finish(response.finish_reason, text=response.text, prompt_tokens=u.prompt_tokens,
                                 completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens,
                                 prefill_tokens_per_sec=u.prefill_tokens_per_sec,
                                 generation_tokens_per_sec=u.generation_tokens_per_sec)
                    return None
                else:
                    self._token(response)
            return grpc.StatusCode.UNAVAILABLE, "rank 0 ended the stream without a finish reason"
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED or self._stopped():
                self._finish("cancelled")
                return None
            return e.code(), e.details() or e.code().name
        finally:
            self.upstream.untrack(call)
            with self._lock:
                self._call = None

    def _token(self, response: pb.GenerateResponse) -> None:
        if self._failed_at is not None:
            self.on_replay(self, time.monotonic() - self._failed_at)
            self._failed_at = None
        top = _pairs(response.top_logprobs[0]) if self.request.top_logprobs and response.top_logprobs else None
        for i, token in enumerate(response.token_ids):
            text = response.text if i == 0 else ""
            self.tokens.append(token)
            self.text += text
            self.emit(TokenEvent(token, response.logprobs[i], text, top if i == 0 else None))

