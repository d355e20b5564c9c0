"""Prefill chunks cut by a memory budget at their own context (runtime/memory_guard.py's ChunkBudget): a long
prompt's early chunks stay long, later ones shrink, no chunk's activations pass the budget, and
the tokens are exactly those served alone without any budget."""

import json

import pytest

from distributed.runtime.memory_guard import ChunkBudget
from distributed.runtime.request import GenerationRequest
from prefill_frames import PROMPTS, STEP, FrameLog, assert_alone, assert_no_caches_left, run_admitted, scheduler_for


def config_of(path):
    return json.loads((path / "config.json").read_text())


def test_the_longest_chunk_that_fits_shrinks_as_its_context_grows(hf_checkpoint):
    budget = ChunkBudget(config_of(hf_checkpoint), 0)
    budget.bytes = budget.activations(1, STEP, 24)  # 16 columns fit up to 24 positions before them
    for rows, past in [(1, 0), (1, 24), (1, 60), (2, 10), (3, 200)]:
        n = budget.columns(rows, past, STEP)
        assert budget.activations(rows, n, past) <= budget.bytes or n == 1
        assert n == STEP or budget.activations(rows, n + 1, past) > budget.bytes, (rows, past, n)
    assert budget.columns(1, 0, STEP) == STEP and budget.columns(1, 24, STEP) == STEP
    assert STEP > budget.columns(1, 60, STEP) > budget.columns(1, 200, STEP) >= 1
    assert budget.columns(2, 24, STEP) < STEP  # two rows allocate twice a row's
    n = budget.ending_at(200, STEP)
    assert budget.activations(1, n, 200 - n) <= budget.bytes < budget.activations(1, n + 1, 199 - n)


@pytest.mark.parametrize("prompts", [[PROMPTS[3]], PROMPTS[2:4]], ids=["alone", "padded batch"])
def test_chunks_cut_at_their_context_keep_the_tokens_exact(hf_checkpoint, prompts):
    budget = ChunkBudget(config_of(hf_checkpoint), 0)
    budget.bytes = budget.activations(len(prompts), STEP // len(prompts), 20)
    scheduler = scheduler_for(hf_checkpoint, (4, 4), chunk_budget=budget)
    log = FrameLog(scheduler)
    results = run_admitted(scheduler, [GenerationRequest(p, max_tokens=12) for p in prompts])
    for prompt, events in zip(prompts, results):
        assert_alone(hf_checkpoint, prompt, events, 12)
    chunks = [s.shape for s in log.prefill()]
    columns = [cols for _, cols in chunks]
    assert columns[0] == STEP // len(prompts) and columns == sorted(columns, reverse=True), columns
    assert columns[-1] < columns[0] and sum(columns) >= max(len(p) for p in prompts) - 1
    past = 0
    for rows, cols in chunks:
        assert rows == len(prompts)
        assert budget.activations(rows, cols, past) <= budget.bytes or cols <= 3, (past, cols)
        past += cols
    if len(prompts) > 1:
        assert min(columns) >= 2, "a padded batch never sends a one-column chunk"
    assert_no_caches_left(scheduler.pipeline)
