"""Speculative decoding (speculation.py, Batcher's verification frames): output equal to
decoding one token at a time, drafts rejected at every offset, far past the sliding
window (16 in the tiny checkpoint), over an in-process 2-stage pipeline; prompt lookup, and
its acceptance on the tiny editor's rewrite of held-out text."""

import sys

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import load_tokenizer

from distributed.runtime import speculation
from distributed.runtime.caches import compact, trim_newest
from distributed.runtime.request import GenerationRequest, TokenEvent
from distributed.runtime.scheduler import Scheduler
from types import SimpleNamespace

from distributed.runtime.speculation import (COSTLY_PAUSE, MAX_COSTLY_PAUSE, PROBE, PromptLookupDrafter,
                                             SpeculationOptions, SpeculationState, prompt_lookup, propose)
from distributed.shard.tiny_checkpoint import DEFAULT_MODEL
from reference import PROMPT, mlx_lm_greedy
from stages import in_process_pipeline

LONG = 120  # tokens generated: the window (16) wraps many times over
TOL = 1e-4
SCRIPTS = DEFAULT_MODEL.parents[2] / "scripts"


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    history = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert prompt_lookup(history, 2) == [7, 8]  # the latest [1, 2, 3] before the end
    assert prompt_lookup(history, 5) == [7, 8, 5, 1, 2]
    assert prompt_lookup([4, 5, 6, 5], 3) == []  # no 3- or 2-gram: one token alone is not enough
    assert prompt_lookup([4, 5, 6, 5], 3, min_ngram=1) == [6, 5]
    assert prompt_lookup([1, 2, 3], 3) == [] and prompt_lookup([1], 3) == []


@pytest.mark.parametrize("rotating", [True, False])
def test_trimming_after_a_multi_token_update_equals_never_feeding_them(rotating):
    """Past the window (rotating) and before it: drop 0..S-1 of S positions just added; the
    cache then holds what one-at-a-time updates of the kept positions give."""
    make = (lambda: RotatingKVCache(max_size=8)) if rotating else KVCache
    kv = lambda n, seed: mx.random.normal((1, 2, n, 4), key=mx.random.key(seed))  # noqa: E731
    for drop in range(4):
        for history in (3, 7, 8, 9, 30):
            plain, spec = make(), make()
            for t in range(history):
                x = kv(1, 100 + t)
                plain.update_and_fetch(x, x)
                spec.update_and_fetch(x, x)
            new = kv(4, history)  # 4 positions, the last `drop` rejected
            spec.update_and_fetch(new, new)
            trim_newest(spec, drop)
            for i in range(4 - drop):
                plain.update_and_fetch(new[:, :, i:i + 1], new[:, :, i:i + 1])
            a, b = compact(plain), compact(spec)
            assert a.offset == b.offset == history + 4 - drop
            assert mx.array_equal(a.keys, b.keys).item() and mx.array_equal(a.values, b.values).item()
            nxt = kv(1, 999)  # and the next token's update sees the same keys
            plain.update_and_fetch(nxt, nxt)
            spec.update_and_fetch(nxt, nxt)
            assert mx.array_equal(compact(plain).keys, compact(spec).keys).item()


class Oracle:
    """Drafts the reference continuation, wrong at one offset that moves each pass (0, 1,
    ..., K, then again), so every rejection offset is exercised, all-accepted passes too."""

    def __init__(self, reference, k):
        self.reference, self.k, self.passes = reference, k, 0
        self.rejected_at = set()  # (offset of the wrong draft, k: none) of passes past the window

    def propose(self, seq, k, after=()):
        at = len(seq.generated) + len(after)
        drafts = list(self.reference[at:at + k])
        wrong = self.passes % (self.k + 1)
        self.passes += 1
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % 250
        if len(PROMPT) + at > 16 and len(drafts) == k:
            self.rejected_at.add(wrong)
        return drafts


@pytest.fixture(scope="module")
def pipeline(hf_checkpoint):
    return in_process_pipeline(hf_checkpoint, (4, 4))[0]


def run(pipeline, path, drafter=None, k=4, **fields):
    scheduler = Scheduler(pipeline, load_tokenizer(path), prefill_step_size=16,
                          speculation=SpeculationOptions(prompt_lookup=True, num_draft_tokens=k, measured=False))
    if drafter is not None:
        scheduler.batcher.verifier.drafter = drafter
    handle = scheduler.submit(GenerationRequest(list(PROMPT), **fields))
    scheduler.run_pending()
    assert scheduler.failure is None, scheduler.failure
    events = list(handle.events())
    return [e for e in events if isinstance(e, TokenEvent)], events[-1], scheduler.batcher.verifier.stats


@pytest.mark.parametrize("k", [1, 4])
def test_rejections_at_every_offset_far_past_the_window_change_nothing(pipeline, hf_checkpoint, k, monkeypatch):
    monkeypatch.setattr(speculation, "AHEAD_ODDS", 0.0)  # frames ahead after every pass that held
    ref_tokens, ref_logprobs = mlx_lm_greedy(hf_checkpoint, PROMPT, LONG, 16)
    oracle = Oracle(ref_tokens, k)
    tokens, finish, stats = run(pipeline, hf_checkpoint, oracle, k, max_tokens=LONG)
    assert [e.token_id for e in tokens] == ref_tokens[:LONG]
    assert max(abs(e.logprob - r) for e, r in zip(tokens, ref_logprobs)) < TOL
    assert oracle.rejected_at == set(range(k + 1))  # every offset, and all accepted
    assert 0 < stats.accepted < stats.drafted and stats.passes + stats.cancelled == oracle.passes
    assert stats.cancelled > 0  # frames drafted ahead (two stages), some on drafts that did not hold


def test_frames_drafted_ahead_through_three_stages_change_nothing(hf_checkpoint, monkeypatch):
    """Up to three frames of one sequence in the ring at once (speculation.Verifier), each
    assuming the drafts before it hold: those behind a rejection, at every offset, are
    cancelled and their positions taken back on every stage, far past the window."""
    monkeypatch.setattr(speculation, "AHEAD_ODDS", 0.0)  # frames ahead after every pass that held
    ref_tokens, ref_logprobs = mlx_lm_greedy(hf_checkpoint, PROMPT, LONG, 16)
    oracle = Oracle(ref_tokens, 3)
    three = in_process_pipeline(hf_checkpoint, (3, 1, 4))[0]
    tokens, finish, stats = run(three, hf_checkpoint, oracle, 3, max_tokens=LONG)
    assert [e.token_id for e in tokens] == ref_tokens[:LONG]
    assert max(abs(e.logprob - r) for e, r in zip(tokens, ref_logprobs)) < TOL
    assert oracle.rejected_at == set(range(4))
    assert stats.cancelled > 0 and stats.passes + stats.cancelled <= oracle.passes  # a one-token proposal: no frame
    # At the default odds (AHEAD_ODDS), drafts that miss one pass in four send fewer frames ahead.
    monkeypatch.undo()
    tokens, _, gated = run(three, hf_checkpoint, Oracle(ref_tokens, 3), 3, max_tokens=LONG)
    assert [e.token_id for e in tokens] == ref_tokens[:LONG] and gated.cancelled < stats.cancelled


def test_processors_stops_limits_and_top_logprobs_as_without_speculation(pipeline, hf_checkpoint):
    fields = dict(max_tokens=60, repetition_penalty=1.3, logit_bias={5: 2.0}, top_logprobs=3)
    plain, plain_finish, _ = run(pipeline, hf_checkpoint, Oracle([], 4), max_tokens=60, repetition_penalty=1.3,
                                 logit_bias={5: 2.0}, top_logprobs=3, speculative=False)
    ref = [e.token_id for e in plain]
    processors = make_logits_processors(logit_bias={5: 2.0}, repetition_penalty=1.3)
    assert ref == mlx_lm_greedy(hf_checkpoint, PROMPT, 60, 16, processors)[0]
    spec, finish, stats = run(pipeline, hf_checkpoint, Oracle(ref, 4), **fields)
    assert stats.accepted > 0
    assert [e.token_id for e in spec] == ref and finish.completion_tokens == plain_finish.completion_tokens
    for a, b in zip(spec, plain):
        assert abs(a.logprob - b.logprob) < TOL
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
    # max_tokens inside a pass, and a stop string inside one: nothing streamed past either.
    for n in (1, 2, 7):
        out, f, _ = run(pipeline, hf_checkpoint, Oracle(ref, 4), max_tokens=n)
        assert len(out) == n and f.finish_reason == "length"
    text = "".join(e.text for e in spec)
    stop = text[20:23]
    out, f, _ = run(pipeline, hf_checkpoint, Oracle(ref, 4), max_tokens=60, repetition_penalty=1.3,
                    logit_bias={5: 2.0}, stop=[stop])
    assert f.finish_reason == "stop" and "".join(e.text for e in out) + f.text == text[:text.index(stop)]


def test_seeded_sampling_stays_seeded(pipeline, hf_checkpoint):
    runs = [run(pipeline, hf_checkpoint, None, max_tokens=40, temperature=0.8, seed=11)[0] for _ in range(2)]
    assert [e.token_id for e in runs[0]] == [e.token_id for e in runs[1]]


def test_measured_cost_pauses_passes_while_they_cost_more_than_plain_steps():
    """PassClock on given times: plain tokens 10 ms apart; a pass of 3 tokens taking 50 ms
    from the token before it (16.7 ms a token) pauses drafting, each more such pass in a row
    twice as long; a fast one after them does not."""
    state = SpeculationState()
    clock = state.clock
    clock.drafting()
    clock.judged(2)
    clock.token(0.0), clock.token(0.0)
    state.back_off(1)
    assert state.pause == PROBE and clock.plain is None  # no plain step timed yet: time some
    for t in (0.010, 0.020, 0.030):
        clock.token(t)
    clock.drafting()
    clock.judged(3)
    for _ in range(3):
        clock.token(0.080)
    state.pause = 0
    state.back_off(2)
    assert clock.costs_more and state.pause == COSTLY_PAUSE
    pauses = []
    for start in (0.2, 0.4, 0.6, 0.8, 1.0, 1.2):  # more passes that cost more: longer pauses each time
        clock.last = start
        clock.drafting()
        clock.judged(3)
        for _ in range(3):
            clock.token(start + 0.080)
        state.pause = 0
        state.back_off(2)
        pauses.append(state.pause)
    assert pauses == [2 * COSTLY_PAUSE, 4 * COSTLY_PAUSE, 8 * COSTLY_PAUSE] + [MAX_COSTLY_PAUSE] * 3
    for _ in range(2):
        start = clock.last
        clock.drafting()
        clock.judged(4)
        for _ in range(4):
            clock.token(start + 0.010)  # 2.5 ms a token: the rate drops below the plain steps'
        state.pause = 0
        state.back_off(3)
    assert not clock.costs_more and state.pause == 0 and clock.costly == 0
    clock.spec_time = 1.0  # passes that cost more ...
    clock.measured = False  # ... but --speculate always: never paused for cost
    state.back_off(3)
    assert state.pause == 0


def test_proposals_that_find_nothing_pause_drafting_longer_each_time():
    """Nothing to propose skips 1, 2, 4, ... 32 tokens (each costs a step its lookahead);
    a proposal resets it."""
    class Nothing:
        def propose(self, seq, k, after=()):
            return []

    seq = SimpleNamespace(spec=SpeculationState(), count=0, request=SimpleNamespace(max_tokens=1000),
                          logits=SimpleNamespace(constraint=None))
    pauses = []
    for _ in range(8):
        assert propose(Nothing(), SpeculationOptions(prompt_lookup=True), seq) == []
        pauses.append(seq.spec.pause)
    assert pauses == [1, 2, 4, 8, 16, 32, 32, 32]
    seq.generated, seq.request.prompt_ids = [1, 2, 3, 1, 2], [9]
    assert propose(PromptLookupDrafter(), SpeculationOptions(prompt_lookup=True), seq) == [3, 1, 2]
    assert seq.spec.empty == 0


def test_prompt_lookup_drafts_most_of_the_tiny_editors_rewrite(tmp_path):
    """Real acceptance in the input-grounded case: the tiny editor (scripts/make_tiny_editor.py)
    rewrites a held-out paragraph in the past tense, a copy of its prompt but for its edits;
    prompt lookup drafts the copied runs and misses at the edits. Output as without
    speculation, token for token."""
    sys.path.insert(0, str(SCRIPTS))
    from make_tiny_editor import EDITS, heldout_prompt, main as make_editor

    make_editor(["--out", str(tmp_path)])
    tokenizer = load_tokenizer(tmp_path)
    prompt = heldout_prompt()
    pipeline = in_process_pipeline(tmp_path, (2, 2))[0]

    def rewrite(lookup):
        scheduler = Scheduler(pipeline, tokenizer, speculation=SpeculationOptions(
            prompt_lookup=lookup, num_draft_tokens=4, measured=False))
        handle = scheduler.submit(GenerationRequest(tokenizer.encode(prompt), max_tokens=160))
        scheduler.run_pending()
        assert scheduler.failure is None, scheduler.failure
        return [e.token_id for e in handle.events() if isinstance(e, TokenEvent)], scheduler.batcher.verifier.stats

    plain, _ = rewrite(False)
    tokens, stats = rewrite(True)
    assert tokens == plain
    # The passage with its edits (then the end of text, which is not streamed).
    edits = {tokenizer.encode(old)[0]: tokenizer.encode(new)[0] for old, new in EDITS.items()}
    passage = tokenizer.encode(prompt.split("\n")[1])
    assert plain == [edits.get(t, t) for t in passage] and any(t in edits for t in passage)
    # Most of it comes from accepted drafts (49 of 80 here: at most 4 a pass), a few tokens a pass.
    assert stats.accepted >= 0.55 * len(plain) and stats.passes <= len(plain) / 3, (stats, len(plain))
