"""Continuous batching: requests decoding together get exactly what they get alone."""

import pytest
from mlx_lm.utils import load_tokenizer

from distributed.runtime.frames import FrameKind
from distributed.runtime.request import FinishEvent, GenerationRequest, TokenEvent
from distributed.runtime.scheduler import Scheduler
from reference import mlx_lm_greedy
from stages import generate, in_process_pipeline

# Different lengths: shorter and longer than the 16-token window and than
# several 8-token prefill chunks.
PROMPTS = [[(k * i + 5 * k) % 250 + 1 for i in range(n)] for k, n in [(3, 5), (7, 17), (11, 40), (13, 70), (17, 9), (19, 33)]]
MAX_TOKENS = [30, 12, 40, 25, 1, 35]


class SendLog:
    """Records each forward frame rank 0 sends: (slot, rows, prompt chunks already in
    the ring, in frames of their own or in decode steps, while a group was decoding)."""

    def __init__(self, scheduler):
        self.frames = []
        batcher, send = scheduler.batcher, scheduler.pipeline.send

        def logged(tokens, reply, slot=0, **hints):
            decoding = any(g.members for g in batcher.groups)
            prefill = sum(o.kind == FrameKind.CHUNK or bool(o.chunk) for o in batcher.outstanding) if decoding else 0
            self.frames.append((slot, tokens.shape[0], prefill))
            return send(tokens, reply, slot, **hints)

        scheduler.pipeline.send = logged


def run_together(scheduler, requests):
    handles = [scheduler.submit(r) for r in requests]
    return [list(h.events()) for h in handles]


def tokens_of(events):
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


@pytest.mark.parametrize("split", [(8,), (3, 1, 4), (2, 3, 3)])
def test_batched_greedy_equals_mlx_lm_alone(hf_checkpoint, split):
    pipeline, _ = in_process_pipeline(hf_checkpoint, split)
    scheduler = Scheduler(pipeline, load_tokenizer(hf_checkpoint), prefill_step_size=8, max_batch=6)
    log = SendLog(scheduler)
    scheduler.start()
    try:
        results = run_together(scheduler, [GenerationRequest(p, max_tokens=m) for p, m in zip(PROMPTS, MAX_TOKENS)])
    finally:
        scheduler.close()
    for prompt, max_tokens, events in zip(PROMPTS, MAX_TOKENS, results):
        ref_tokens, ref_logprobs = mlx_lm_greedy(hf_checkpoint, prompt, max_tokens, 8)
        assert tokens_of(events) == ref_tokens
        logprobs = [e.logprob for e in events if isinstance(e, TokenEvent)]
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-4
        assert events[-1].finish_reason in ("length", "stop")
    ranks = len(split)
    steps = [(slot, rows) for slot, rows, _ in log.frames if slot < ranks]
    assert max(rows for _, rows in steps) > 1, "requests never decoded together"
    assert max(rows for _, rows in steps) <= -(-6 // ranks), "a group grew past max_batch / P"
    assert len({slot for slot, _ in steps}) == ranks, "not every micro-batch group was used"
    # While groups decode, one prefill frame at most is in the ring, so a
    # prompt delays a decode step by one chunk at most.
    prefill_sends = [pending for slot, _, pending in log.frames if slot >= ranks]
    assert len(prefill_sends) > len(PROMPTS) and max(prefill_sends) == 0
    assert pipeline.caches.slots == {}
    for handler in getattr(pipeline.transport, "handlers", []):
        assert handler.__self__.caches.slots == {}


def test_seeded_sampling_is_the_same_alone_and_batched(hf_checkpoint):
    sampled = dict(temperature=0.9, top_p=0.95, top_k=50, seed=11)
    alone = [t for t, _ in generate(in_process_pipeline(hf_checkpoint, (3, 5))[0], hf_checkpoint, PROMPTS[2], 24, **sampled)]
    pipeline, _ = in_process_pipeline(hf_checkpoint, (3, 5))
    scheduler = Scheduler(pipeline, load_tokenizer(hf_checkpoint), max_batch=8).start()
    try:
        requests = [GenerationRequest(p, max_tokens=24, temperature=1.0, seed=i) for i, p in enumerate(PROMPTS)]
        requests.insert(3, GenerationRequest(PROMPTS[2], max_tokens=24, **sampled))
        results = run_together(scheduler, requests)
    finally:
        scheduler.close()
    assert tokens_of(results[3]) == alone


def test_cancelling_one_leaves_the_others_exact(hf_checkpoint):
    pipeline, _ = in_process_pipeline(hf_checkpoint, (4, 4))
    scheduler = Scheduler(pipeline, load_tokenizer(hf_checkpoint), prefill_step_size=8, max_batch=4).start()
    try:
        victim = scheduler.submit(GenerationRequest(PROMPTS[0], max_tokens=200))
        others = [scheduler.submit(GenerationRequest(p, max_tokens=30)) for p in PROMPTS[1:4]]
        seen = 0
        for event in victim.events():
            if isinstance(event, TokenEvent):
                seen += 1
                if seen == 5:
                    victim.cancel()
            finish = event
        results = [list(h.events()) for h in others]
    finally:
        scheduler.close()
    assert isinstance(finish, FinishEvent) and finish.finish_reason == "cancelled" and seen <= 6
    for prompt, events in zip(PROMPTS[1:4], results):
        assert tokens_of(events) == mlx_lm_greedy(hf_checkpoint, prompt, 30, 8)[0]
    assert pipeline.caches.slots == {}


def test_new_requests_join_while_others_decode(hf_checkpoint):
    """Requests arriving mid-generation are admitted between steps and still exact."""
    pipeline, _ = in_process_pipeline(hf_checkpoint, (3, 1, 4))
    scheduler = Scheduler(pipeline, load_tokenizer(hf_checkpoint), prefill_step_size=8, max_batch=3).start()
    late, results = [], {}
    try:
        first = scheduler.submit(GenerationRequest(PROMPTS[3], max_tokens=40))
        for i, event in enumerate(first.events()):
            if i in (3, 9, 15):  # each time, one more request; the last waits for room (max_batch=3)
                late.append((i, scheduler.submit(GenerationRequest(PROMPTS[i % 5], max_tokens=20))))
            results.setdefault("first", []).append(event)
        for i, handle in late:
            results[i] = list(handle.events())
    finally:
        scheduler.close()
    assert tokens_of(results["first"]) == mlx_lm_greedy(hf_checkpoint, PROMPTS[3], 40, 8)[0]
    for i, _ in late:
        assert tokens_of(results[i]) == mlx_lm_greedy(hf_checkpoint, PROMPTS[i % 5], 20, 8)[0]


def test_queued_beyond_max_batch_waits_its_turn(hf_checkpoint):
    pipeline, _ = in_process_pipeline(hf_checkpoint, (8,))
    scheduler = Scheduler(pipeline, load_tokenizer(hf_checkpoint), max_batch=2).start()
    try:
        results = run_together(scheduler, [GenerationRequest(p, max_tokens=10) for p in PROMPTS])
    finally:
        scheduler.close()
    for prompt, events in zip(PROMPTS, results):
        assert tokens_of(events) == mlx_lm_greedy(hf_checkpoint, prompt, 10, 512)[0]
