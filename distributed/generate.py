"""Turning forward passes into tokens: chunked prefill, one token per decode step."""

from typing import Iterator, List, Tuple

import mlx.core as mx

from .pipeline import Pipeline
from .transport import Reply


def generate_tokens(
    pipeline: Pipeline,
    prompt: List[int],
    max_tokens: int,
    sampler,
    prefill_step_size: int = 2048,
    slot: int = 0,
) -> Iterator[Tuple[int, float]]:
    """Yield (token, logprob) pairs; logprob is the natural-log probability
    under the model, before temperature. The caller stops on EOS.

    Prefill mirrors mlx-lm's generate_step (all but the last prompt token in
    chunks, then the last token) so results match it exactly.
    """
    pipeline.reset(slot)
    remaining = mx.array(prompt, dtype=mx.uint32)
    while remaining.size > 1:
        n = min(prefill_step_size, remaining.size - 1)
        pipeline.forward(remaining[None, :n], Reply.NONE, slot)
        remaining = remaining[n:]
    y = remaining
    for _ in range(max_tokens):
        logits = pipeline.logits(y[None], Reply.LAST, slot)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        y = sampler(logprobs)
        mx.eval(y, logprobs)
        token = y.item()
        yield token, logprobs[0, token].item()
