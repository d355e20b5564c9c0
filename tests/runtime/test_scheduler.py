"""The scheduler: FIFO requests over an in-process ring, streaming, stop, cancel."""

import pytest
from mlx_lm.utils import load_tokenizer

from distributed.runtime.request import FinishEvent, GenerationRequest, RequestError, TokenEvent
from distributed.runtime.scheduler import QueueFull, Scheduler
from reference import PROMPT, mlx_lm_greedy
from stages import in_process_pipeline


@pytest.fixture
def scheduler(hf_checkpoint):
    pipeline, _ = in_process_pipeline(hf_checkpoint, (3, 1, 4))
    s = Scheduler(pipeline, load_tokenizer(hf_checkpoint), max_queue=2, prefill_step_size=8).start()
    yield s
    s.close()


def collect(handle):
    events = list(handle.events())
    assert isinstance(events[-1], FinishEvent)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    return tokens, events[-1], "".join(e.text for e in events)


def test_stream_equals_mlx_lm_and_caches_are_freed(scheduler, hf_checkpoint):
    ref, _ = mlx_lm_greedy(hf_checkpoint, PROMPT, 40, 8)
    tokens, finish, _ = collect(scheduler.submit(GenerationRequest(PROMPT, max_tokens=40)))
    assert [t.token_id for t in tokens] == ref
    assert finish.finish_reason == "length" and finish.completion_tokens == 40
    assert scheduler.pipeline.caches.slots == {}  # released after the request
    worker = scheduler.pipeline.transport.handlers[0].__self__
    assert worker.caches.slots == {}


def test_stop_string_ends_generation(scheduler):
    tokens, _, text = collect(scheduler.submit(GenerationRequest(PROMPT, max_tokens=40)))
    stop = text[10:13]
    stopped, finish, stopped_text = collect(scheduler.submit(GenerationRequest(PROMPT, max_tokens=40, stop=[stop])))
    assert finish.finish_reason == "stop"
    assert stopped_text == text[: text.index(stop)]
    assert len(stopped) < len(tokens)


def test_cancel_mid_stream_then_next_request_is_exact(scheduler, hf_checkpoint):
    handle = scheduler.submit(GenerationRequest(PROMPT, max_tokens=200))
    seen = 0
    for event in handle.events():
        if isinstance(event, TokenEvent):
            seen += 1
            if seen == 3:
                handle.cancel()
        else:
            finish = event
    assert finish.finish_reason == "cancelled" and seen <= 4
    ref, _ = mlx_lm_greedy(hf_checkpoint, PROMPT, 20, 8)
    tokens, _, _ = collect(scheduler.submit(GenerationRequest(PROMPT, max_tokens=20)))
    assert [t.token_id for t in tokens] == ref


def test_seeded_sampling_is_reproducible(scheduler):
    def run(seed):
        req = GenerationRequest(PROMPT, max_tokens=16, temperature=1.0, seed=seed)
        return [t.token_id for t in collect(scheduler.submit(req))[0]]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_token_ids_outside_the_vocabulary_are_refused_and_serving_goes_on(scheduler, hf_checkpoint):
    """An in-process caller that skipped validation: the embedding would read out of bounds
    (MLX's gather does not check; it crashed the process). The request is refused by name
    and the next one is served exactly."""
    vocab = scheduler.pipeline.stage.args.vocab_size
    for fields, name in [(dict(prompt_ids=PROMPT + [vocab]), "token_ids"),
                         (dict(prompt_ids=[-1] + PROMPT), "token_ids"),
                         (dict(prompt_ids=PROMPT, resume_ids=[vocab + 7]), "resume_token_ids"),
                         (dict(prompt_ids=PROMPT, logit_bias={vocab: 1.0}), "logit_bias")]:
        with pytest.raises(RequestError, match=rf"^{name}: token id -?\d+ is outside the vocabulary \[0, {vocab}\)$"):
            scheduler.submit(GenerationRequest(max_tokens=5, **fields))
    assert scheduler.waiting == 0 and scheduler.running == 0
    ref, _ = mlx_lm_greedy(hf_checkpoint, PROMPT, 10, 8)
    tokens, _, _ = collect(scheduler.submit(GenerationRequest(PROMPT, max_tokens=10)))
    assert [t.token_id for t in tokens] == ref


def test_queue_is_bounded(scheduler):
    """While the loop is held busy nothing is admitted, yet a burst as large as the batch's
    room (max_batch 16) and the queue (max_queue 2) is taken: 18 requests, the 19th is refused."""
    import threading

    started, release = threading.Event(), threading.Event()
    blocker = threading.Thread(target=scheduler.call, args=(lambda _: (started.set(), release.wait()),))
    blocker.start()
    try:
        started.wait(30)
        handles = [scheduler.submit(GenerationRequest(PROMPT, max_tokens=50)) for _ in range(16 + 2)]
        with pytest.raises(QueueFull, match=r"^18 requests are already running or waiting "
                                            r"\(--max-batch 16 \+ --max-queue 2\)$"):
            scheduler.submit(GenerationRequest(PROMPT, max_tokens=50))
    finally:
        release.set()
        blocker.join()
    for h in handles:
        h.cancel()
        assert collect(h)[1].finish_reason == "cancelled"


def test_finished_requests_leave_nothing_behind(scheduler):
    """Done, sampled, cancelled mid-stream or cancelled while queued: once finished, nothing in the
    scheduler holds a request's handle (a soak's memory stays flat)."""
    import gc
    import threading
    import weakref

    def run(cancel_after=None, **sampling):
        handle = scheduler.submit(GenerationRequest(PROMPT, max_tokens=12, **sampling))
        for i, event in enumerate(handle.events()):
            if i + 1 == cancel_after:
                handle.cancel()
        assert event.finish_reason == ("length" if cancel_after is None else "cancelled")
        return weakref.ref(handle)

    refs = [run(), run(temperature=0.8, top_p=0.9, min_p=0.05, top_k=20, seed=1), run(cancel_after=3)]
    started, release = threading.Event(), threading.Event()  # hold the loop while two are queued and cancelled
    blocker = threading.Thread(target=scheduler.call, args=(lambda _: (started.set(), release.wait()),))
    blocker.start()
    started.wait(30)
    queued = [scheduler.submit(GenerationRequest(PROMPT, max_tokens=50)) for _ in range(2)]
    for handle in queued:
        handle.cancel()
    release.set()
    blocker.join()
    for handle in queued:
        assert collect(handle)[1].finish_reason == "cancelled"
    refs += [weakref.ref(h) for h in queued]
    del handle, queued
    scheduler.call(lambda _: None)  # one more turn of the loop
    gc.collect()
    assert [r() for r in refs] == [None] * 5
    assert scheduler._active == set() and scheduler.batcher.idle and scheduler.pipeline.caches.slots == {}


# ---------------------------------------------------------------- resuming a cut-off stream


@pytest.fixture(scope="module", params=["cold", "prefix-cache"])
def resume_scheduler(request, hf_checkpoint):
    """3 stages; prefill in chunks of 8; with the prefix cache, a resumed request restores its prompt's entry."""
    pipeline, _ = in_process_pipeline(hf_checkpoint, (3, 1, 4))
    s = Scheduler(pipeline, load_tokenizer(hf_checkpoint), prefill_step_size=8, max_batch=8,
                  prefix_cache_bytes=1 << 28 if request.param == "prefix-cache" else 0).start()
    yield s
    s.close()


def assert_resumes_exactly(scheduler, cuts=(1, 5, 23), max_tokens=24, **sampling):
    """The undisturbed run, then a request resuming each cut (all at once, batched): each
    streams exactly the rest, with the same finish, and the texts join up."""
    full_tokens, full_finish, full_text = collect(scheduler.submit(GenerationRequest(PROMPT, max_tokens, **sampling)))
    ids = [t.token_id for t in full_tokens]
    cuts = [k for k in cuts if k < len(ids)]
    assert len(cuts) >= 2, ids  # the run is long enough to cut
    hits = scheduler.prefix_cache.hits
    handles = [scheduler.submit(GenerationRequest(PROMPT, max_tokens, resume_ids=ids[:k], **sampling)) for k in cuts]
    for k, handle in zip(cuts, handles):
        tokens, finish, text = collect(handle)
        assert [t.token_id for t in tokens] == ids[k:], k
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(tokens, full_tokens[k:])), k
        assert (finish.finish_reason, finish.completion_tokens, finish.prompt_tokens) == \
            (full_finish.finish_reason, full_finish.completion_tokens, len(PROMPT)), k
        assert "".join(t.text for t in full_tokens[:k]) + text == full_text, k
    if scheduler.prefix_cache.enabled:  # each resumed request restored (at least) its prompt
        assert scheduler.prefix_cache.hits == hits + len(cuts)
    return ids, full_text


def test_resume_greedy(resume_scheduler):
    ids, _ = assert_resumes_exactly(resume_scheduler, cuts=(1, 5, 7, 23))
    character = resume_scheduler.tokenizer.decode(ids[6:9])  # cut 7 splits it: 3 byte-level tokens
    assert len(character) == 1 and len(character.encode()) == 3 and character != "\ufffd"
    assert_resumes_exactly(resume_scheduler, cuts=(1, 2, 3), max_tokens=4)  # ends at max_tokens right after


def test_resume_seeded_sampling(resume_scheduler):
    assert_resumes_exactly(resume_scheduler, temperature=0.8, top_p=0.9, seed=7)
    assert_resumes_exactly(resume_scheduler, cuts=(3, 9), temperature=1.0, top_k=20, min_p=0.05, seed=123)


def test_resume_penalties_and_logit_bias(resume_scheduler):
    """The processors see prompt + resumed tokens as history, as in the undisturbed run (context 8 < 24
    tokens: a window sliding over the resumed ones)."""
    for penalty in ({"repetition_penalty": 1.3, "repetition_context_size": 8},
                    {"presence_penalty": 1.5, "presence_context_size": 8},
                    {"frequency_penalty": 1.0, "frequency_context_size": 30}):
        assert_resumes_exactly(resume_scheduler, logit_bias={65: 3.0, 200: -5.0}, **penalty)
    assert_resumes_exactly(resume_scheduler, repetition_penalty=1.2, temperature=0.8, seed=7)


def test_resume_across_a_stop_string(resume_scheduler):
    """A stop string whose first part is in the resumed tokens' text: the replay stops where the
    undisturbed run did, after the text the stop strings held back."""
    tokens, _, text = collect(resume_scheduler.submit(GenerationRequest(PROMPT, max_tokens=24)))
    stop = text[12:16]
    at = text.index(stop)
    streamed = [len("".join(t.text for t in tokens[:k])) for k in range(len(tokens) + 1)]
    straddle = next(k for k, n in enumerate(streamed) if n > at)  # the first k tokens' text starts the stop
    assert streamed[straddle] < at + len(stop)  # and does not finish it
    _, out = assert_resumes_exactly(resume_scheduler, cuts=(1, straddle), stop=[stop])
    assert out == text[:at]
