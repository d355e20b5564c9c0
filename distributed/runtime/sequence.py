"""One request while it runs: its sampler and random key, its streamed text,
and the events it sends back to its front end.

The sampling filters are mlx-lm's (sample_utils' apply_top_p, apply_min_p,
apply_top_k, in make_sampler's order) with one difference: a request's top_p
and min_p reach them as arrays, never as Python numbers. mx.compile keys its
cache on Python scalars, so mlx-lm's compiled filters keep one traced graph
(and on the CPU backend one JIT-built shared library, loaded for good) per
distinct value: with per-request sampling settings rank 0 grew by ~60 KiB and
spent seconds in the C++ compiler for each new value (issue 11 item 9).
"""

import logging
import math
import random
import time
from typing import List, Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from .logits import SequenceLogits
from .request import REQUEST_FAILED, FinishEvent, TokenEvent
from .speculation import SpeculationState


@mx.compile
def apply_min_p(logprobs: mx.array, log_min_p: mx.array) -> mx.array:
    """mlx-lm's apply_min_p (min_tokens_to_keep=1) with log(min_p) as an array."""
    threshold = mx.max(logprobs, axis=-1, keepdims=True) + log_min_p
    return mx.where(logprobs < threshold, -float("inf"), logprobs)


def apply_top_k(logprobs: mx.array, top_k: int) -> mx.array:
    """mlx-lm's apply_top_k, not compiled: k sets a shape, so a compiled version
    would keep a graph per distinct k (up to the vocabulary size)."""
    mask_idx = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(logprobs, mask_idx, mx.array(-float("inf"), logprobs.dtype), axis=-1)


log = logging.getLogger(__name__)


class StopStrings:
    """Finds stop strings in streamed text, holding back what could begin one.

    Each stop is matched as Knuth-Morris-Pratt match a pattern, a character at a time, keeping
    the longest prefix of it that the text so far ends with: a token's text costs time linear
    in its length (times the number of stops), never in the stops' lengths, and what is held
    back is exactly the longest such prefix. (Searching the held-back text again for every
    stop and every prefix at each token cost a 480 KB stop 3 s a token.)"""

    def __init__(self, stops: List[str]):
        self.stops = [s for s in stops if s]
        self._fallback = [_prefix_function(s) for s in self.stops]
        self._matched = [0] * len(self.stops)  # of each stop: the prefix the text ends with
        self.pending = ""
        self.hit: Optional[str] = None  # the stop string found

    def feed(self, text: str):
        """Returns (text safe to emit, whether a stop string was hit)."""
        for at, char in enumerate(text):
            for i, stop in enumerate(self.stops):
                k, fallback = self._matched[i], self._fallback[i]
                while k and stop[k] != char:
                    k = fallback[k - 1]
                k += stop[k] == char
                if k == len(stop):  # the text up to here ends with it
                    out, self.pending, self.hit = (self.pending + text[:at + 1])[:-k], "", stop
                    return out, True
                self._matched[i] = k
        self.pending += text
        keep = max(self._matched, default=0)
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _prefix_function(s: str) -> List[int]:
    """For each i, the length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    table, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        k += s[i] == s[k]
        table[i] = k
    return table


class Sequence:
    def __init__(self, handle, tokenizer, slot: int):
        req = handle.request
        self.handle, self.request, self.slot = handle, req, slot
        # What is prefilled: the prompt, then any tokens a resumed request produced
        # before (request.resume_ids), which count as generated from the start.
        self.fed_prompt: List[int] = list(req.prompt_ids) + list(req.resume_ids)
        self.unsent: List[int] = list(self.fed_prompt)  # prompt tokens not yet sent into the ring
        self.next_token: Optional[int] = None  # the input of the next decode step
        self.generated: List[int] = list(req.resume_ids)  # tokens streamed so far
        # Every token drawn (also an EOS or one after a cancel): fed or to be fed.
        self.sampled: List[int] = list(req.resume_ids)
        # Prefix cache (prefix_cache.py): prompt tokens restored from an entry, and where
        # in the prompt to store entries (None: not looked up yet).
        self.cached_tokens = 0
        self.greedy = req.temperature == 0
        # Arrays, not numbers, into compiled code (see the module's docstring).
        self._top_p = mx.array(req.top_p, dtype=mx.float32) if 0 < req.top_p < 1 else None
        self._log_min_p = mx.array(math.log(req.min_p), dtype=mx.float32) if req.min_p > 0 else None
        # Every sampled request draws from its own key, so a seeded request's
        # tokens do not depend on what else runs beside it.
        self._key = mx.random.key(req.seed if req.seed is not None else random.getrandbits(63))
        self.logits = SequenceLogits(req, handle.constraint)  # processors, grammar, top and prompt logprobs
        self._detokenizer = tokenizer.detokenizer
        self._stops = StopStrings(req.stop)
        self.stop_sequence: Optional[str] = None  # the stop string that ended it
        self._eos = tokenizer.eos_token_ids
        self.count = 0
        self._stopped_before = False  # a stop string ended within the resumed tokens
        self._resume(req.resume_ids)
        self.finished = False  # its FinishEvent is out (its cache rows may still be dropped later)
        self.error: Optional[str] = None  # what failed in this sequence's own work (accept): it alone ends
        self.started = time.perf_counter()
        self.first_at: Optional[float] = None
        self.spec = SpeculationState()  # speculative decoding's (speculation.py)

    def _resume(self, tokens: List[int]) -> None:
        """Bring the streaming state to where the original run was after `tokens`:
        their text goes through the detokenizer and stop strings and is dropped (the
        client has it; what the stop strings hold back stays pending), and the key
        advances one draw per token, as Sequence.sample split it (greedy draws none)."""
        for token in tokens:
            self._detokenizer.add_token(token)
            _, hit = self._stops.feed(self._detokenizer.last_segment)
            self._stopped_before = self._stopped_before or hit
            if not self.greedy:
                self._key = mx.random.split(self._key)[0]
        self.count = len(tokens)
        mx.eval(self._key)

    def sample(self, logprobs: mx.array) -> mx.array:
        """Draw the next token from one row of log-probabilities (1, vocab):
        mlx-lm's filters in make_sampler's order, then a draw with our own key."""
        if self._top_p is not None:
            logprobs = apply_top_p(logprobs, self._top_p)
        if self._log_min_p is not None:
            logprobs = apply_min_p(logprobs, self._log_min_p)
        if 0 < self.request.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self.request.top_k)
        self._key, draw = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1 / self.request.temperature), key=draw)

    @property
    def awaiting_first(self) -> bool:
        """No token accepted yet: its next decode step gives its first token."""
        return self.first_at is None

    @property
    def ends_at_next_token(self) -> bool:
        """The next token accepted reaches max_tokens: the request ends there, whatever it is."""
        return self.count + 1 >= self.request.max_tokens

    def accept(self, token: int, logprob: float, top=None) -> Optional[str]:
        """Stream a decoded token (`top`: its top logprobs); returns the finish reason
        if the request is done. Where this sequence's own work fails (its logits processors,
        its text, its stop strings), the reason is "error" and `error` says what: the request
        ends alone, and the rows beside it go on."""
        if self.logits.error is not None:  # the token was drawn without them: not streamed
            self.error = self.logits.error
            return "error"
        try:
            return self._accept(token, logprob, top)
        except Exception as e:
            log.error("a request failed on its own token", exc_info=e)
            self.error = f"{type(e).__name__}: {e}"
            return "error"

    def _accept(self, token: int, logprob: float, top=None) -> Optional[str]:
        now = time.perf_counter()
        self.first_at = self.first_at or now
        self.spec.clock.token(now)
        self.sampled.append(token)
        self.spec.pause = max(0, self.spec.pause - 1)
        if self.handle.cancelled:
            return "cancelled"
        if self.logits.prompt is not None:  # the prompt's logprobs go first
            self.handle.emit(self.logits.prompt.event())
            self.logits.prompt = None
        if self.request.max_tokens == 0:  # the prompt scored, nothing to generate
            return "length"
        if self._stopped_before:  # the original run had stopped (its finish was lost)
            self._stops = None
            return "stop"
        if token in self._eos:
            return "stop"
        self._detokenizer.add_token(token)
        text, hit = self._stops.feed(self._detokenizer.last_segment)
        self.count += 1
        self.generated.append(token)
        constraint = self.logits.constraint
        if constraint is not None and constraint.error is not None:  # the matcher failed on an earlier token
            return "error"
        self.handle.emit(TokenEvent(token, logprob, text, top))
        if hit:
            self.stop_sequence, self._stops = self._stops.hit, None  # nothing after the stop string is sent
            return "stop"
        self.next_token = token
        return "length" if self.count >= self.request.max_tokens else None

    def finish(self, reason: str, error: Optional[str] = None) -> None:
        self.finished = True
        if reason == "error" and error is None:
            error = self.error or (self.logits.constraint.error if self.logits.constraint is not None else None)
            error = f"{REQUEST_FAILED}: {error}" if error else error
        tail = ""
        if self._stops is not None and reason != "error":
            self._detokenizer.finalize()
            tail, _ = self._stops.feed(self._detokenizer.last_segment)
            tail += self._stops.flush()
        done, first = time.perf_counter(), self.first_at
        new = self.count - len(self.request.resume_ids)  # generated by this run
        self.handle.emit(
            FinishEvent(
                reason,
                len(self.request.prompt_ids),
                self.count,
                prefill_tokens_per_sec=len(self.fed_prompt) / (first - self.started) if first else 0.0,
                generation_tokens_per_sec=(new - 1) / (done - first) if first and new > 1 else 0.0,
                error=error,
                text=tail,
                cached_tokens=min(self.cached_tokens, len(self.request.prompt_ids)),  # of the prompt's tokens
                stop_sequence=self.stop_sequence,
            )
        )
