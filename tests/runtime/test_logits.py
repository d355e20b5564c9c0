"""Logits processors, top logprobs and prompt logprobs (runtime/logits.py) through the
real scheduler over an in-process split pipeline, against one-device mlx-lm."""

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import load_tokenizer

from distributed.runtime.request import FinishEvent, GenerationRequest, PromptEvent, RequestError, TokenEvent
from distributed.runtime.scheduler import Scheduler
from reference import PROMPT, mlx_lm_greedy, mlx_lm_logprobs
from stages import in_process_pipeline

PENALTIES = [
    dict(repetition_penalty=1.5),
    dict(presence_penalty=1.5, presence_context_size=40),
    dict(frequency_penalty=2.0, frequency_context_size=30),
    dict(logit_bias={40: 100.0, 41: 100.0}),  # two tokens made (almost) certain
    dict(repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty=0.7, logit_bias={5: -100.0}),
]
SHORT = [9, 4, 22, 13, 7]  # another prompt, decoding beside it


def processors(p):
    return make_logits_processors(
        logit_bias=p.get("logit_bias"), repetition_penalty=p.get("repetition_penalty"),
        repetition_context_size=p.get("repetition_context_size", 20), presence_penalty=p.get("presence_penalty"),
        presence_context_size=p.get("presence_context_size", 20), frequency_penalty=p.get("frequency_penalty"),
        frequency_context_size=p.get("frequency_context_size", 20))


@pytest.fixture(scope="module")
def scheduler(hf_checkpoint):
    pipeline, _ = in_process_pipeline(hf_checkpoint, (3, 5))
    s = Scheduler(pipeline, load_tokenizer(hf_checkpoint), prefill_step_size=16, max_batch=8,
                  prefix_cache_bytes=2**24).start()
    yield s
    s.close()


def run(scheduler, *requests):
    handles = [scheduler.submit(r) for r in requests]
    return [list(h.events()) for h in handles]


def tokens(events):
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def test_penalties_equal_mlx_lm_generate_with_the_same_processors(scheduler, hf_checkpoint):
    plain = mlx_lm_greedy(hf_checkpoint, PROMPT, 40, 16)[0]
    # All at once, each beside a request without processors: each row keeps its own history.
    results = run(scheduler, *[GenerationRequest(PROMPT, max_tokens=40, **p) for p in PENALTIES],
                  GenerationRequest(SHORT, max_tokens=40))
    for p, events in zip(PENALTIES, results):
        ref, _ = mlx_lm_greedy(hf_checkpoint, PROMPT, 40, 16, logits_processors=processors(p))
        assert tokens(events) == ref, p
        assert ref != plain, f"{p} changed nothing: the test would not see it ignored"
    assert tokens(results[-1]) == mlx_lm_greedy(hf_checkpoint, SHORT, 40, 16)[0]
    # The reported logprobs stay the model's (before processors): the first token's, from the prompt alone.
    first = next(e for e in results[3] if isinstance(e, TokenEvent))
    assert abs(first.logprob - mlx_lm_logprobs(hf_checkpoint, PROMPT)[-1, first.token_id].item()) < 1e-4


def top_of(row, k):
    ids = mx.argsort(-row)[:k].tolist()
    return ids, [row[i].item() for i in ids]


def assert_top(top, row, k):
    ids, values = top_of(row, k)
    assert [i for i, _ in top] == ids
    assert max(abs(v - w) for (_, v), w in zip(top, values)) < 1e-4


def test_top_logprobs_are_the_models_most_likely_tokens(scheduler, hf_checkpoint):
    (events,) = run(scheduler, GenerationRequest(PROMPT, max_tokens=6, top_logprobs=5, temperature=0.7, seed=1))
    generated = tokens(events)
    for i, event in enumerate(e for e in events if isinstance(e, TokenEvent)):
        row = mlx_lm_logprobs(hf_checkpoint, PROMPT + generated[:i])[-1]
        assert_top(event.top_logprobs, row, 5)
        assert abs(event.logprob - row[event.token_id].item()) < 1e-4
    (events,) = run(scheduler, GenerationRequest(PROMPT, max_tokens=2))
    assert all(e.top_logprobs is None for e in events if isinstance(e, TokenEvent))


@pytest.mark.parametrize("max_tokens", [0, 5])
def test_prompt_logprobs_equal_mlx_lm(scheduler, hf_checkpoint, max_tokens):
    """A 40-token prompt in 16-token chunks (Reply.ALL), admitted with others that batch
    together, and after its own prompt was cached (the cache must not skip positions)."""
    run(scheduler, GenerationRequest(PROMPT, max_tokens=2))  # now in the prefix cache
    scored = GenerationRequest(PROMPT, max_tokens=max_tokens, prompt_logprobs=True, top_logprobs=3)
    others = [GenerationRequest(SHORT, max_tokens=8), GenerationRequest(PROMPT[:20], max_tokens=8)]
    results = run(scheduler, others[0], scored, others[1])
    events = results[1]
    prompt_event = events[0]
    assert isinstance(prompt_event, PromptEvent) and prompt_event.token_ids == PROMPT
    ref = mlx_lm_logprobs(hf_checkpoint, PROMPT)
    assert prompt_event.logprobs[0] is None and prompt_event.top_logprobs[0] is None
    expected = [ref[i - 1, t].item() for i, t in enumerate(PROMPT) if i > 0]
    assert max(abs(a - b) for a, b in zip(prompt_event.logprobs[1:], expected)) < 1e-4
    for i in range(1, len(PROMPT)):
        assert_top(prompt_event.top_logprobs[i], ref[i - 1], 3)
    assert tokens(events) == mlx_lm_greedy(hf_checkpoint, PROMPT, max_tokens, 16)[0] if max_tokens else tokens(events) == []
    finish = events[-1]
    assert isinstance(finish, FinishEvent) and finish.finish_reason == "length" and finish.completion_tokens == max_tokens
    assert finish.cached_tokens == 0
    assert [tokens(e) for e in (results[0], results[2])] == [mlx_lm_greedy(hf_checkpoint, p.prompt_ids, 8, 16)[0]
                                                            for p in others]


def test_validation():
    for fields, name in [(dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
                         (dict(repetition_penalty=0), "repetition_penalty"), (dict(top_logprobs=21), "top_logprobs"),
                         (dict(logit_bias={3: 101}), "logit_bias"), (dict(logit_bias={300: 1}), "logit_bias"),
                         (dict(presence_context_size=0), "presence_context_size"), (dict(max_tokens=0), "max_tokens")]:
        with pytest.raises(RequestError) as e:
            GenerationRequest(PROMPT, **fields).validate(259, 1024)
        assert e.value.field == name
    GenerationRequest(PROMPT, max_tokens=0, prompt_logprobs=True).validate(259, 1024)
