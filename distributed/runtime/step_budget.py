"""The token budget per step: how many prompt tokens may go into the ring beside running rows.

A prompt prefills in chunks. While other sequences decode, each chunk delays their next token: with
several ranks it rides in a decode step's frame, with one it goes just before the step. At
--prefill-step-size (2,048 tokens) one chunk holds every running stream for as long as it takes:
seconds on a CPU, about a second on a GPU at 64 streams. So, as vLLM's `max_num_batched_tokens`
and Sarathi-Serve's stall-free batching do, a step carries its running rows plus at most B prompt
tokens. `--max-step-tokens N` fixes B. `--itl-target-ms T` lets B follow what steps cost: each
decode group's time from one reply to the next is measured, with the prompt tokens that entered the
ring meanwhile: B follows the ratio of the time prompt tokens may take of an interval to what
they took (an interval may hold several chunks: B scales their mean). The time a step alone takes
(a) is that of the intervals that carried no prompt tokens, or, before any came, the intercept of
a line fitted to the intervals, a + b x tokens (least squares, recent intervals weighted most; the
chunks alternate a little in size until a is measured, so that the fit can tell a from b). Prompt
tokens may take T - a, and where a step alone already takes T or more (64 streams on one GPU) a
step's time, a: the streams' time between tokens at most doubles while prompts are admitted, and
the prompts are not starved. B falls at once where an interval ran over, and grows by a quarter at
most a reply.
Either way a prompt with nothing decoding beside it is not bounded (it goes at full speed), and B
never falls below MIN_TOKENS, so a prompt always gets on.

A chunk's width is a power of two (at most its share of B): MLX's CUDA backend compiles and captures
kernels per shape, and a width that changed with every reply made each step a new shape (one H100, 8
streams under --itl-target-ms 150: 343 ms of launching a step against 18 ms unbounded, 16.7 tok/s
against 251). Powers of two keep the shapes to a dozen, as vLLM's captured CUDA-graph batch sizes do.
"""

import time
from typing import Dict, Optional, Tuple

MIN_TOKENS = 16
FIRST_TOKENS = 64  # B before anything is measured (--itl-target-ms)
SMOOTHING = 0.25  # the weight of the newest interval in the running figures
GROWTH = 2.0  # B grows by at most (1 - SMOOTHING) + SMOOTHING x GROWTH a reply
DITHER = 0.5  # until a step alone is measured, chunks alternate between (1 -+ DITHER) B: the fit needs them to
# differ, and at a ratio of 3 their powers of two do


class StepBudget:
    def __init__(self, tokens: Optional[int] = None, target_ms: Optional[float] = None, most: int = 1 << 30):
        self.fixed = tokens
        self.target = target_ms / 1000 if target_ms else None
        self.most = most  # B never exceeds it (a chunk is --prefill-step-size at most anyway)
        self.adaptive = self.target is not None and tokens is None
        self.budget = float(min(FIRST_TOKENS, most)) if self.adaptive else None
        self.step_seconds: Optional[float] = None  # a group's interval with no prompt tokens in it
        self.fit = Fit()  # a group's interval against the prompt tokens that went in meanwhile
        self.carried = 0  # prompt tokens sent while rows decode, ever
        self.chunks = 0  # the chunks that carried them
        self.largest = 0  # the most a chunk beside decoding carried
        self._up = False  # the next chunk's dither
        self._last: Dict[int, Tuple[float, int, int]] = {}  # group slot -> its last reply's time, carried, chunks

    @property
    def bounded(self) -> bool:
        """Whether chunks beside decoding are bounded (--max-step-tokens or --itl-target-ms)."""
        return self.fixed is not None or self.adaptive

    @property
    def tokens(self) -> Optional[int]:
        """B now; None: no bound."""
        if self.fixed is not None:
            return self.fixed
        if self.budget is None:
            return None
        dither = 0.0 if self.step_seconds is not None else DITHER if self._up else -DITHER  # (for the fit)
        return max(MIN_TOKENS, int(self.budget * (1 + dither)))

    def columns(self, rows: int) -> Optional[int]:
        """The most columns a chunk of `rows` rows may have beside decoding, a power of two (None: no bound)."""
        tokens = self.tokens
        return None if tokens is None else power_of_two_under(max(1, tokens // max(1, rows)))

    def sent(self, tokens: int) -> None:
        """`tokens` prompt tokens (padding included) went into the ring beside decoding rows."""
        self.carried += tokens
        self.chunks += tokens > 0
        self.largest = max(self.largest, tokens)
        self._up = not self._up

    def replied(self, group: int, now: Optional[float] = None) -> None:
        """Group `group`'s decode step replied (at `now`, monotonic seconds): learn from the
        interval since its last reply."""
        now = time.monotonic() if now is None else now
        last = self._last.get(group)
        self._last[group] = (now, self.carried, self.chunks)
        if last is None or not self.adaptive:
            return
        tokens, seconds, chunks = self.carried - last[1], now - last[0], self.chunks - last[2]
        self.fit.add(tokens, seconds)
        if tokens == 0:
            self.step_seconds = seconds if self.step_seconds is None else _mix(self.step_seconds, seconds)
        if tokens == 0:
            return
        step = self.step_seconds  # a step alone: measured where intervals without prompt tokens came
        if step is None:  # (none while prompts come steadily from the start: 64 at once) the line's
            line = self.fit.line()
            step = line[0] if line is not None else 0.0
        spare = max(self.target - step, step)  # what prompt tokens may take of an interval
        took = max(1e-6, seconds - step)
        # An interval may hold several chunks (with several ranks both groups' steps carry one): B, a
        # chunk's tokens, scales their mean.
        wanted = min(self.most, max(MIN_TOKENS, tokens / max(1, chunks) * spare / took))
        # Down at once, up by GROWTH at most: with several ranks, tokens sent in one interval may
        # cost in the next, and one interval that hid their cost must not let a 500-token chunk in.
        self.budget = wanted if wanted < self.budget else _mix(self.budget, min(wanted, GROWTH * self.budget))

    def idle(self, group: int) -> None:
        """Group `group` stopped decoding: its next reply starts a fresh interval."""
        self._last.pop(group, None)

    def describe(self) -> dict:
        return {"tokens": self.tokens if self.budget is None else int(self.budget), "fixed": self.fixed is not None,
                "itl_target_ms": None if self.target is None else round(self.target * 1000, 3),
                "step_ms": None if self.step_seconds is None else round(self.step_seconds * 1000, 3),
                "carried_tokens": self.carried, "largest_chunk": self.largest}


def power_of_two_under(n: int) -> int:
    """The largest power of two at most n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def _mix(old: float, new: float) -> float:
    return (1 - SMOOTHING) * old + SMOOTHING * new


class Fit:
    """seconds = a + b x tokens, fitted by least squares over the intervals added, the newest
    weighted most (exponentially: SMOOTHING)."""

    def __init__(self):
        self.means: Optional[Tuple[float, float, float, float]] = None  # of n, t, n*n, n*t

    def add(self, tokens: int, seconds: float) -> None:
        x = (tokens, seconds, tokens * tokens, tokens * seconds)
        self.means = x if self.means is None else tuple(_mix(m, v) for m, v in zip(self.means, x))

    def line(self) -> Optional[Tuple[float, float]]:
        """(a, b), a >= 0 and b > 0; None until the intervals' tokens vary enough to tell them apart."""
        if self.means is None:
            return None
        n, t, nn, nt = self.means
        spread = nn - n * n
        if spread < 0.01 * max(1.0, n * n) or spread <= 0:
            return None
        b = (nt - n * t) / spread
        return (max(0.0, t - b * n), b) if b > 0 else None
