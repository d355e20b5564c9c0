"""One request while it runs: its sampler and random key, what it does with its logits
besides sampling, its streamed text, and the events it sends back to its front end.

The sampling filters are mlx-lm's (sample_utils' apply_top_p, apply_min_p,
apply_top_k, in make_sampler's order) with one difference: a request's top_p
and min_p reach them as arrays, never as Python numbers. mx.compile keys its
cache on Python scalars, so mlx-lm's compiled filters keep one traced graph
(and on the CPU backend one JIT-built shared library, loaded for good) per
distinct value: with per-request sampling settings rank 0 grew by ~60 KiB and
spent seconds in the C++ compiler for each new value.

What rank 0 does with a sequence's logits besides sampling:

- Logits processors are mlx-lm's (`make_logits_processors`: logit_bias, repetition,
  presence and frequency penalties), one set per sequence with its own token
  history (its prompt, then each generated token), as mlx-lm's generate_step and
  BatchGenerator keep it. They shape what is sampled; the logprobs reported stay
  the model's, before processors and temperature.
- Top logprobs: the most likely tokens of the model's distribution at each step.
- Prompt logprobs: a sequence that asks for them is prefilled in a batch of its
  own whose chunk frames ask for every position's hidden state (Reply.ALL);
  PromptScores turns those into each prompt token's logprob given the tokens
  before it.
"""

import logging
import math
import random
import time
from typing import Callable, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import TokenBuffer
from mlx_lm.sample_utils import apply_top_p, make_logits_processors

from .grammar import apply_masks
from .request import REQUEST_FAILED, FinishEvent, GenerationRequest, PromptEvent, TokenEvent, TopLogprobs
from .speculation import SpeculationState

log = logging.getLogger(__name__)

HEAD_BLOCK = 128  # prompt positions per lm_head call: bounds rank 0's memory (a vocabulary of logits each)


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


def top_k_logprobs(logprobs: mx.array, k: int):
    """(ids, values) of the k largest entries of each row of `logprobs`, largest first."""
    ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., :k]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)


class PromptScores:
    """A prompt's logprobs, filled from the last stage's output at its positions."""

    def __init__(self, prompt: List[int], top: int):
        self.prompt, self.top = list(prompt), top
        self.logprobs: List[Optional[float]] = [None]  # the first token has no context
        self.tops: List[Optional[TopLogprobs]] = [None]

    def add(self, head: Callable[[mx.array], mx.array], h: mx.array) -> None:
        """`h` (1, n, hidden): the next n prompt positions' final hidden states; each
        gives the logprob of the prompt token after it."""
        for a in range(0, h.shape[1], HEAD_BLOCK):
            logits = head(h[:, a:a + HEAD_BLOCK])[0].astype(mx.float32)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            start = len(self.logprobs)
            targets = mx.array(self.prompt[start:start + logprobs.shape[0]])
            chosen = mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
            top = top_k_logprobs(logprobs, self.top) if self.top else None
            mx.eval(chosen, *(top or ()))
            self.logprobs += chosen.tolist()
            if top is None:
                self.tops += [[] for _ in range(logprobs.shape[0])]
            else:
                self.tops += [list(zip(i, v)) for i, v in zip(top[0].tolist(), top[1].tolist())]

    def event(self) -> PromptEvent:
        assert len(self.logprobs) == len(self.prompt), f"scored {len(self.logprobs)} of {len(self.prompt)} prompt tokens"
        return PromptEvent(self.prompt, self.logprobs, self.tops)


class SequenceLogits:
    """One sequence's processors, grammar constraint and token history, and what it reports."""

    def __init__(self, request: GenerationRequest, constraint=None):
        r = request
        self.constraint = constraint  # grammar.Constraint, or None
        self.processors = make_logits_processors(
            logit_bias=r.logit_bias or None,
            repetition_penalty=r.repetition_penalty if r.repetition_penalty != 1 else None,
            repetition_context_size=r.repetition_context_size,
            presence_penalty=r.presence_penalty or None,
            presence_context_size=r.presence_context_size,
            frequency_penalty=r.frequency_penalty or None,
            frequency_context_size=r.frequency_context_size,
        )
        self.top = r.top_logprobs
        self.prompt = PromptScores(r.prompt_ids, r.top_logprobs) if r.scores_prompt else None
        self._history = TokenBuffer(list(r.prompt_ids)) if self.processors else None
        self.error: Optional[str] = None  # the processors raised: the sequence ends with it (Sequence.accept)
        # Generated tokens already in the history. A resumed request's `generated` starts
        # with its resumed tokens: they join at its first step, as they did one by one.
        self._fed = 0

    @property
    def shapes(self) -> bool:
        """Whether anything changes the logits this sequence samples from."""
        return bool(self.processors) or self.constraint is not None

    def top_of(self, logprobs: mx.array):
        """(ids, values) of the top_logprobs most likely tokens of each row, lazily; None if it asks for none."""
        return top_k_logprobs(logprobs, self.top) if self.top else None

    def process(self, logits: mx.array, generated: List[int]) -> mx.array:
        """Apply the processors, then the grammar's mask, to one row of logits (1, vocab),
        after the tokens generated so far (each one fed back before this step) joined the history."""
        if self.processors:
            logits = self.processed(logits, generated)
        return self.constraint.mask(logits, generated) if self.constraint is not None else logits

    def processed(self, logits: mx.array, generated: List[int]) -> mx.array:
        """The processors applied; where they raise, `logits` as they are and `error` set: the
        sequence ends with it, alone, and the rows beside it go on."""
        new = generated[self._fed:]
        self._fed = len(generated)
        try:
            history = self._history.update_and_fetch(mx.array(new, dtype=mx.int32)) if new else self._history.tokens
            shaped = logits
            for processor in self.processors:
                shaped = processor(history, shaped)
            return shaped
        except Exception as e:
            self.error = f"its logits processors failed: {type(e).__name__}: {e}"
            return logits


def draw(sequences, logprobs: mx.array) -> mx.array:
    """Each row's next token: the argmax for greedy rows, the row's own sampler otherwise."""
    greedy = mx.argmax(logprobs, axis=-1)
    if all(s.greedy for s in sequences):
        return greedy
    return mx.concatenate(
        [greedy[i : i + 1] if s.greedy else s.sample(logprobs[i : i + 1]) for i, s in enumerate(sequences)]
    )


def shaped_logprobs(sequences, logits: mx.array, logprobs: mx.array) -> mx.array:
    """What each row samples from: its logprobs, or (a batch where some sequence has
    processors or a grammar) the processed, masked logits of every row, normalised (for a
    row without either, the same numbers as its logprobs) unless every row is greedy."""
    if not any(s.logits.shapes for s in sequences):
        return logprobs
    if any(s.logits.processors for s in sequences):
        logits = mx.concatenate([s.logits.processed(logits[i:i + 1], s.generated) if s.logits.processors
                                 else logits[i:i + 1] for i, s in enumerate(sequences)])
    logits = apply_masks([s.logits.constraint for s in sequences], [s.generated for s in sequences], logits)
    if all(s.greedy for s in sequences):  # argmax needs no normalising (which costs more than the mask)
        return logits
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def top_candidates(sequences, logprobs: mx.array):
    """(ids, values) of the most likely tokens of each row, lazily, as many as the
    sequence asking for the most wants; None if none asks."""
    k = max(s.logits.top for s in sequences)
    return top_k_logprobs(logprobs, k) if k else None


def top_logprobs(sequences, top) -> List[Optional[TopLogprobs]]:
    """Each sequence's `top_logprobs` most likely tokens of its row (None where it
    asked for none), from top_candidates' (evaluated) result."""
    if top is None:
        return [None] * len(sequences)
    ids, values = top[0].tolist(), top[1].tolist()
    return [list(zip(i[:s.logits.top], v[:s.logits.top])) if s.logits.top else None
            for s, i, v in zip(sequences, ids, values)]



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
        self.disk_tokens = 0  # of those, read from the disk tier for it
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
                disk_tokens=min(self.disk_tokens, len(self.request.prompt_ids)),
                stop_sequence=self.stop_sequence,
            )
        )
