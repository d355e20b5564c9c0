"""What rank 0 does with a sequence's logits besides sampling: logits processors,
top logprobs and the prompt's logprobs.

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

from typing import Callable, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import TokenBuffer
from mlx_lm.sample_utils import make_logits_processors

from .grammar import apply_masks
from .request import GenerationRequest, PromptEvent, TopLogprobs

HEAD_BLOCK = 128  # prompt positions per lm_head call: bounds rank 0's memory (a vocabulary of logits each)


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
