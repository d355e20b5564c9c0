"""The token budget per step (runtime/step_budget.py): while other sequences decode, a prompt's
chunks carry at most B prompt tokens (--max-step-tokens), or as many as keep a step near a target
(--itl-target-ms); a prompt alone is not bounded, and every request stays exact."""

import pytest

from distributed.runtime.request import GenerationRequest
from distributed.runtime.step_budget import DITHER, FIRST_TOKENS, MIN_TOKENS, StepBudget
from prefill_frames import (PROMPTS, STEP, FrameLog, admitted_together, assert_alone, assert_no_caches_left,
                            scheduler_for, tokens_of)

LONG = [(7 * i + 3) % 250 + 1 for i in range(90)]
SPECULATING = PROMPTS[4]  # its greedy continuation: 71 tokens, then EOS


class Drafter:
    """Drafts a row's greedy continuation, a wrong last draft in every third pass."""

    def __init__(self, reference):
        self.reference, self.passes = reference, 0

    def propose(self, seq, k, after=()):
        at = len(seq.generated) + len(after)
        drafts = list(self.reference[at:at + k])
        self.passes += 1
        if self.passes % 3 == 0 and drafts:
            drafts[-1] = (drafts[-1] + 1) % 250
        return drafts


@pytest.mark.parametrize("split", [(8,), (4, 4)])
def test_chunks_beside_decoding_stay_within_the_budget(hf_checkpoint, split):
    """A 90-token prompt arriving while others decode goes in chunks of at most B tokens (the
    budget, under the 16-token prefill step), in the decode steps' frames (one rank under a budget
    too); the same prompt with nothing decoding goes in whole steps; all exact."""
    budget = 5
    late = []

    def submit_late(slot, shape, reply):  # once the running requests decode
        if slot < len(split) and not late:
            late.append(scheduler.submit(GenerationRequest(LONG, max_tokens=6)))

    scheduler = scheduler_for(hf_checkpoint, split, step_budget=StepBudget(budget))
    log = FrameLog(scheduler, submit_late)
    scheduler.start()
    try:
        running = [PROMPTS[4], PROMPTS[5]][:len(split)]
        handles = admitted_together(scheduler, [GenerationRequest(p, max_tokens=60) for p in running])
        results = [list(h.events()) for h in handles] + [list(late[0].events())]
        alone = scheduler.submit(GenerationRequest(LONG[::-1], max_tokens=3))
        alone_events = list(alone.events())
    finally:
        scheduler.close()
    for prompt, events, n in zip(running + [LONG], results, [60] * len(split) + [6]):
        assert_alone(hf_checkpoint, prompt, events, n)
    assert_alone(hf_checkpoint, LONG[::-1], alone_events, 3)
    *_, late_slot, alone_slot = dict.fromkeys(s.slot for s in log.prefill())  # in order of their first chunks
    chunks = [s for s in log.sends if s.slot == late_slot]
    assert sum(s.shape[1] for s in chunks) == len(LONG) - 1
    beside = [s.shape for s in chunks if s.decoding]
    assert beside and all(shape[1] <= budget for shape in beside), beside
    # powers of two (a GPU compiles each shape once), but for the prompt's last chunk: what is left
    assert all(shape[1] & (shape[1] - 1) == 0 for shape in beside if shape is not chunks[-1].shape), beside
    assert scheduler.batcher.budget.carried >= sum(shape[1] for shape in beside)
    assert [s.shape[1] for s in log.sends if s.slot == alone_slot] == [STEP] * 5 + [len(LONG) - 1 - 5 * STEP]
    assert_no_caches_left(scheduler.pipeline)


def test_the_target_steers_the_budget():
    """--itl-target-ms: B follows a line fitted to the intervals (a step alone, a prompt token):
    B = (target - step) / token; a step alone over the target still leaves prompts a step's time;
    never below MIN_TOKENS nor above the prefill step; a group that stops decoding starts afresh."""
    budget = StepBudget(target_ms=50, most=512)
    assert abs(budget.tokens - FIRST_TOKENS) <= FIRST_TOKENS * DITHER + 1

    def run(steps, step_s, token_s, every=1):
        t = budget._last.get(0, (0.0,))[0]
        for i in range(steps):  # every `every`-th interval carries a chunk
            tokens = budget.tokens if i % every == 0 else 0
            if tokens:
                budget.sent(tokens)
            t += step_s + token_s * tokens
            budget.replied(0, t)

    budget.replied(0, 0.0)
    run(40, 0.010, 0.002, every=2)  # a step alone 10 ms, a prompt token 2 ms: 20 fit beside it in 50 ms
    assert abs(budget.budget - 20) <= 2 and budget.step_seconds == pytest.approx(0.010)
    run(60, 0.010, 0.00005)  # prompt tokens get cheap: 800 would fit, the prefill step is 512
    assert budget.budget > 450
    budget.idle(0)
    budget.replied(0, 1e4)  # the first reply after idling measures nothing
    assert budget.budget > 450
    run(80, 0.080, 0.001, every=2)  # a step alone over the target: prompts still get a step's time, 80 tokens
    assert abs(budget.budget - 80) <= 8
    steady = StepBudget(target_ms=50, most=512)  # every interval carries prompt tokens: the line's intercept
    budget = steady
    budget.replied(0, 0.0)
    run(80, 0.080, 0.001)
    assert budget.step_seconds is None and abs(budget.budget - 80) <= 8
    run(80, 0.200, 0.05)  # tokens dear: the floor
    assert budget.tokens == MIN_TOKENS
    two = StepBudget(target_ms=50, most=512)  # two chunks an interval (a ring of two: both groups' steps carry one)
    two.replied(0, 0.0)
    t = 0.0
    for i in range(80):
        tokens = two.tokens if i % 2 == 0 else 0
        for _ in range(2 if tokens else 0):
            two.sent(tokens)
        t += 0.010 + 0.001 * 2 * tokens
        two.replied(0, t)
    assert abs(two.budget - 20) <= 2  # 10 ms + 2 x 20 tokens x 1 ms: the interval at its 50 ms
    fixed = StepBudget(32, target_ms=50)
    fixed.sent(32)
    fixed.replied(0, 0.0)
    fixed.replied(0, 5.0)
    assert fixed.tokens == 32 and StepBudget().tokens is None and StepBudget().columns(3) is None


def test_chunk_widths_are_powers_of_two_that_still_tell_the_fit_apart():
    """A chunk's columns: the largest power of two within its rows' share of B; the two chunk sizes
    the budget alternates between until a step alone is measured differ after that rounding too."""
    for tokens in range(1, 300):
        for rows in (1, 2, 3, 7, 16):
            cols = StepBudget(tokens).columns(rows)
            share = max(1, tokens // rows)
            assert cols & (cols - 1) == 0 and share / 2 < cols <= share
    for start in range(2 * MIN_TOKENS, 400):  # (at the floor both are MIN_TOKENS)
        budget = StepBudget(target_ms=50)
        budget.budget = float(start)
        widths = set()
        for _ in range(2):
            widths.add(budget.columns(1))
            budget.sent(budget.tokens)
        assert len(widths) == 2, start


@pytest.mark.parametrize("split", [(8,), (4, 4)])
def test_the_budget_holds_with_speculation_grammars_and_the_prefix_cache(hf_checkpoint, split):
    """Beside a row that speculates (its drafts: its greedy continuation, every third one wrong) and
    a row kept to a JSON schema, two long prompts arrive, the second restoring the first's prefix
    from the prefix cache: every chunk beside decoding stays within the budget, and every request
    gets what it gets alone."""
    from distributed.runtime.grammar import json_schema_grammar
    from distributed.runtime.speculation import SpeculationOptions
    from reference import mlx_lm_greedy, mlx_lm_masked_greedy

    budget, shared = 6, LONG[:70]
    RUNNING = 71
    grammar = json_schema_grammar({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
                                   "required": ["name"]})
    late = []
    arriving = [(PROMPTS[5], 40, grammar), (shared + [5, 9, 11], 4, None), (shared + [17, 4, 2, 8], 4, None)]

    def submit(prompt, max_tokens, grammar):
        late.append(scheduler.submit(GenerationRequest(prompt, max_tokens=max_tokens, grammar=grammar)))

    def submit_late(slot, shape, reply):  # once the first row speculates: two, then the third after the second
        if slot < len(split) and scheduler.batcher.verifier.stats.passes:
            if not late:
                submit(*arriving[0])
                submit(*arriving[1])
            elif len(late) == 2 and late[1].done:
                submit(*arriving[2])

    scheduler = scheduler_for(hf_checkpoint, split, step_budget=StepBudget(budget), prefix_cache_bytes=1 << 28,
                              speculation=SpeculationOptions(prompt_lookup=True, num_draft_tokens=3, measured=False))
    scheduler.batcher.verifier.drafter = Drafter(mlx_lm_greedy(hf_checkpoint, SPECULATING, RUNNING, STEP)[0])
    log = FrameLog(scheduler, submit_late)
    scheduler.start()
    try:
        results = [list(scheduler.submit(GenerationRequest(SPECULATING, max_tokens=RUNNING)).events())]
        for i in range(len(arriving)):  # each in turn (the first row may finish before they all came)
            if len(late) <= i:
                submit(*arriving[i])
            results.append(list(late[i].events()))
    finally:
        scheduler.close()
    assert_alone(hf_checkpoint, SPECULATING, results[0], RUNNING)
    assert tokens_of(results[1]) == mlx_lm_masked_greedy(hf_checkpoint, PROMPTS[5], grammar, 40)
    for (prompt, _, _), events in zip(arriving[1:], results[2:]):
        assert_alone(hf_checkpoint, prompt, events, 4)
    assert results[3][-1].cached_tokens >= len(shared) - 1
    beside = [s.shape for s in log.prefill() if s.decoding]
    assert beside and all(shape[1] <= budget for shape in beside), beside
    assert scheduler.batcher.verifier.stats.passes > 0
    assert_no_caches_left(scheduler.pipeline)


def test_a_padded_batch_never_goes_one_column_at_a_time_whatever_cuts_its_chunks():
    """mlx-lm's rotating batch cache takes a one-column frame for a decode step (it refuses one
    before finalize): a padded batch's chunks, cut by the budget while others decode and whole
    once they stop, never leave one column (it was: 63 of 72 sent in threes, then 8, then 1)."""
    from distributed.runtime.batching import Admission, PrefillBatch

    admission = Admission(None, None)
    for width in range(2, 40):
        for pattern in ([3, None], [None, 3, 3], [2], [5, 2, None], [1]):
            batch = PrefillBatch(0, [], [[0] * width, [0]], width, step=8, padded=True)
            chunks = []
            while batch.sent < batch.width:
                n = admission._columns(batch, pattern[len(chunks) % len(pattern)])
                assert n >= 2 and batch.width - batch.sent - n != 1, (width, pattern, chunks, n)
                chunks.append(n)
                batch.sent += n
            assert batch.sent == batch.width
