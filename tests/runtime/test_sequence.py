"""One running request: stop strings in streamed text, its own random key, and its sampling filters;
logits processors, top logprobs and prompt logprobs through the real scheduler over an in-process
split pipeline, against one-device mlx-lm."""

import os

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import load_tokenizer

from distributed.runtime.request import FinishEvent, GenerationRequest, PromptEvent, RequestError, TokenEvent
from distributed.runtime.scheduler import RequestHandle, Scheduler
from distributed.runtime.sequence import Sequence, StopStrings
from reference import PROMPT, mlx_lm_greedy, mlx_lm_logprobs
from stages import in_process_pipeline


def test_stop_strings_hold_back_partial_matches():
    s = StopStrings(["END"])
    assert s.feed("abcE") == ("abc", False)
    assert s.feed("N") == ("", False)
    assert s.feed("x") == ("ENx", False)
    assert s.feed("yyEND and more") == ("yy", True)
    assert StopStrings([]).feed("abc") == ("abc", False)


def draws(tokenizer, seed, disturb):
    request = GenerationRequest([1, 2, 3], temperature=1.0, top_p=0.9, seed=seed)
    seq = Sequence(RequestHandle(request), tokenizer, slot=5)
    logprobs = mx.log(mx.softmax(mx.arange(50, dtype=mx.float32)[None] / 10, axis=-1))
    out = []
    for i in range(12):
        if disturb:
            mx.random.seed(i)  # other requests drawing from the global state meanwhile
            mx.random.uniform()
        out.append(seq.sample(logprobs).item())
    return out


def test_a_seeded_request_draws_from_its_own_key(hf_checkpoint):
    tokenizer = load_tokenizer(hf_checkpoint)
    assert draws(tokenizer, 3, disturb=False) == draws(tokenizer, 3, disturb=True)
    assert draws(tokenizer, 3, disturb=False) != draws(tokenizer, 4, disturb=False)


def sequence(tokenizer, **sampling):
    return Sequence(RequestHandle(GenerationRequest([1, 2, 3], **sampling)), tokenizer, slot=5)


def row(seed=0, vocab=300):
    x = mx.random.normal((1, vocab), key=mx.random.key(seed)) * 3
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def test_filters_are_mlx_lms():
    import math

    from mlx_lm import sample_utils

    from distributed.runtime import sequence as module

    for i, (top_p, min_p, top_k) in enumerate([(0.5, 0.01, 1), (0.9, 0.05, 5), (0.97, 0.1, 40)]):
        lp = row(i)
        assert mx.array_equal(sample_utils.apply_top_p(lp, mx.array(top_p)), sample_utils.apply_top_p(lp, top_p))
        assert mx.array_equal(module.apply_min_p(lp, mx.array(math.log(min_p))), sample_utils.apply_min_p(lp, min_p))
        assert mx.array_equal(module.apply_top_k(lp, top_k), sample_utils.apply_top_k(lp, top_k))


def test_draws_equal_mlx_lms_filters_with_the_same_key(hf_checkpoint):
    """The draws are those of mlx-lm's filters (given Python numbers) and a categorical draw with our key."""
    from mlx_lm import sample_utils

    tokenizer = load_tokenizer(hf_checkpoint)
    seq = sequence(tokenizer, temperature=0.7, top_p=0.9, min_p=0.02, top_k=30, seed=9)
    key = mx.random.key(9)
    for i in range(10):
        lp = row(i)
        expected = sample_utils.apply_top_k(sample_utils.apply_min_p(sample_utils.apply_top_p(lp, 0.9), 0.02), 30)
        key, draw = mx.random.split(key)
        assert seq.sample(lp).item() == mx.random.categorical(expected * (1 / 0.7), key=draw).item()


def test_new_sampling_settings_trace_nothing_new(hf_checkpoint, monkeypatch):
    """mx.compile keys its cache on Python numbers: given as numbers, every distinct top_p / min_p
    kept a traced graph (and on the CPU a JIT-built library) for good. Given as arrays, one serves all."""
    from collections import Counter

    from distributed.runtime import sequence as module

    traces = Counter()

    def counted(name, compiled):
        def body(*args):
            traces[name] += 1  # runs only while tracing
            return compiled(*args)

        return mx.compile(body)

    monkeypatch.setattr(module, "apply_top_p", counted("top_p", module.apply_top_p))
    monkeypatch.setattr(module, "apply_min_p", counted("min_p", module.apply_min_p))
    tokenizer = load_tokenizer(hf_checkpoint)
    for i in range(8):
        seq = sequence(tokenizer, temperature=0.5 + i / 10, top_p=0.6 + i / 20, min_p=0.01 * (i + 1), top_k=i + 1)
        mx.eval(seq.sample(row(i)))
    assert traces == {"top_p": 1, "min_p": 1}


def jit_libraries() -> int:
    with open("/proc/self/maps") as f:
        return len({line.split()[-1] for line in f if line.rstrip().endswith(".so") and "/mlx/" in line
                    and "site-packages" not in line})


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux): counts mapped libraries")
def test_new_sampling_settings_load_no_new_kernel_library(hf_checkpoint):
    """The CPU backend builds fused kernels as shared libraries and loads them for good: before the
    fix each new top_p and min_p loaded two (~60 KiB of rank 0's memory per request, seconds of g++)."""
    tokenizer = load_tokenizer(hf_checkpoint)
    mx.eval(sequence(tokenizer, temperature=1.0, top_p=0.9, min_p=0.05).sample(row()))
    before = jit_libraries()
    for i in range(4):
        mx.eval(sequence(tokenizer, temperature=1.0, top_p=0.61 + i / 17, min_p=0.013 * (i + 1)).sample(row(i)))
    assert jit_libraries() == before


def test_top_k_at_or_above_the_vocabulary_keeps_every_token(hf_checkpoint):
    """mlx-lm's apply_top_k raises there, which ended the whole ring (the scheduler took it for a ring failure)."""
    tokenizer = load_tokenizer(hf_checkpoint)
    for top_k in (300, 10**6):
        a, b = sequence(tokenizer, temperature=1.0, top_k=top_k, seed=4), sequence(tokenizer, temperature=1.0, seed=4)
        assert [a.sample(row(i)).item() for i in range(6)] == [b.sample(row(i)).item() for i in range(6)]


# ---------------------------------------------------------------- resuming a cut-off stream


def replay(tokenizer, tokens, resume=0, **sampling):
    """Run a Sequence over `tokens` as if the model had drawn them, after resuming the first
    `resume`: (the draws it made, each streamed event's text, the finish event)."""
    request = GenerationRequest([1, 2, 3], max_tokens=len(tokens) + 2, resume_ids=tokens[:resume], **sampling)
    handle = RequestHandle(request)
    seq = Sequence(handle, tokenizer, slot=5)
    drawn, reason = [], None
    for i, token in enumerate(tokens[resume:], resume):
        if not seq.greedy:
            drawn.append(seq.sample(row(i)).item())
        if (reason := seq.accept(token, -1.0)) is not None:
            break
    seq.finish(reason or "length")
    events = list(handle.events())
    return drawn, [e.text for e in events[:-1]], events[-1]


def test_a_resumed_sequence_goes_on_as_the_undisturbed_one(hf_checkpoint):
    """For every cut: the same draws from the key, the text of the first k tokens plus the resumed
    stream's equals the undisturbed text (a character split over byte tokens, a stop string split
    over the cut), and the same finish."""
    tokenizer = load_tokenizer(hf_checkpoint)
    tokens = tokenizer.encode("ab€ cé!d zz")  # byte-level: € and é span 3 and 2 tokens
    sampling = dict(temperature=0.8, top_p=0.9, seed=7, stop=["é!"])
    drawn, texts, finish = replay(tokenizer, tokens, **sampling)
    assert finish.finish_reason == "stop" and "".join(texts) + finish.text == "ab€ c"
    stopped_at = len(texts)  # the token that completes "é!"
    for k in range(1, stopped_at):
        resumed, resumed_texts, resumed_finish = replay(tokenizer, tokens, k, **sampling)
        assert resumed == drawn[k:], k
        assert "".join(texts[:k] + resumed_texts) + resumed_finish.text == "ab€ c", k
        assert (resumed_finish.finish_reason, resumed_finish.completion_tokens) == ("stop", finish.completion_tokens)
        assert resumed_finish.prompt_tokens == 3


def test_a_stop_string_within_the_resumed_tokens_ends_it_at_once(hf_checkpoint):
    """The original run stopped but its finish was lost: the replay streams nothing more."""
    tokenizer = load_tokenizer(hf_checkpoint)
    tokens = tokenizer.encode("xé!yy")
    _, texts, finish = replay(tokenizer, tokens, resume=4, stop=["é!"])
    assert texts == [] and finish.finish_reason == "stop" and finish.text == "" and finish.completion_tokens == 4


def test_greedy_resume_draws_nothing(hf_checkpoint):
    tokenizer = load_tokenizer(hf_checkpoint)
    key = Sequence(RequestHandle(GenerationRequest([1], seed=3, resume_ids=[5, 6])), tokenizer, slot=0)._key
    assert mx.array_equal(key, Sequence(RequestHandle(GenerationRequest([1], seed=3)), tokenizer, slot=0)._key)


def test_resume_validation():
    from distributed.runtime.request import RequestError

    for resume, max_tokens, says in (([1, 2, 3], 3, "leave none"), ([300], 5, "outside the vocabulary")):
        with pytest.raises(RequestError) as e:
            GenerationRequest([1, 2], max_tokens=max_tokens, resume_ids=resume).validate(259, 64)
        assert e.value.field == "resume_token_ids" and says in str(e.value)
    GenerationRequest([1, 2], max_tokens=4, resume_ids=[1, 2, 3]).validate(259, 64)
    with pytest.raises(RequestError, match="max_tokens"):  # the resumed tokens are inside max_tokens
        GenerationRequest([1] * 60, max_tokens=5, resume_ids=[1, 2]).validate(259, 64)


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
