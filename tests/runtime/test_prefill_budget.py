"""runtime/prefill.py's frame token budget: a chunk riding in a decode step's frame shrinks by
the step's rows (--prefill-step-size counts both, as vLLM's max_num_batched_tokens does), and a
padded batch never sends a chunk of one column, which mlx-lm's rotating batch cache would take
for a decode step."""

import itertools

import pytest

from distributed.runtime.prefill import Admission, PrefillBatch
from distributed.runtime.request import GenerationRequest
from prefill_frames import PROMPTS, STEP, FrameLog, admitted_together, assert_alone, assert_no_caches_left, \
    scheduler_for


def chunk_widths(width, step, rows, padded, rooms):
    """The columns of each chunk of a batch whose frames have `rooms` tokens left (None: alone)."""
    batch = PrefillBatch(0, [], [[0] * width] * rows, width, step=step, padded=padded)
    widths = []
    for room in itertools.cycle(rooms):
        if batch.done:
            return widths
        widths.append(Admission._columns(batch, room))
        batch.sent += widths[-1]


@pytest.mark.parametrize("padded", [False, True])
def test_chunks_cover_the_prompt_within_the_room_they_are_given(padded):
    for width, step, rows in itertools.product(range(2, 40), (2, 3, 8), (1, 2, 3)):
        if padded and width % step == 1:
            continue  # _form pads such a batch one column wider
        for rooms in ([None], [15], [5, None], [1], [4, 9, None, 2]):
            widths = chunk_widths(width, step, rows, padded, rooms)
            assert sum(widths) == width, (width, step, rows, rooms, widths)
            smallest = 2 if padded else 1
            assert all(smallest <= n <= max(step, smallest + 1) for n in widths), (width, step, rooms, widths)
            for n, room in zip(widths, itertools.cycle(rooms)):
                if room is not None and room >= (smallest + 1) * rows:
                    assert n * rows <= room, (width, step, rows, rooms, widths)
        assert set(chunk_widths(width, step, rows, padded, [None])[:-1]) <= {step}  # alone: `step` each


def test_a_padded_batch_is_never_left_with_one_column():
    # 22 columns in chunks of 7 would leave one: the third chunk takes 6 instead.
    assert chunk_widths(22, 8, 2, True, [14]) == [7, 7, 6, 2]
    assert chunk_widths(22, 8, 2, False, [14]) == [7, 7, 7, 1]
    assert chunk_widths(9, 8, 2, True, [4]) == [2, 2, 2, 3]


def test_a_padded_batch_riding_in_steps_stays_exact_within_the_budget(hf_checkpoint):
    """Two ranks, one row decoding in each group: a late padded pair (22 and 9 tokens before their
    last) rides in the steps in chunks of 7 columns (14 tokens + the step's row <= 16), then 6 and 2
    rather than 7 and a lone column; every request stays what it is alone."""
    late_prompts = [PROMPTS[3][:23], PROMPTS[1][:10]]
    late = []

    def submit_late(slot, shape, reply):  # once the running requests decode
        if slot < 2 and not late:
            late.extend(scheduler.submit(GenerationRequest(p, max_tokens=6)) for p in late_prompts)

    scheduler = scheduler_for(hf_checkpoint, (4, 4))
    log = FrameLog(scheduler, submit_late)
    scheduler.start()
    try:
        running = [PROMPTS[2], PROMPTS[5]]
        handles = admitted_together(scheduler, [GenerationRequest(p, max_tokens=30) for p in running])
        results = [list(h.events()) for h in handles] + [list(h.events()) for h in late]
    finally:
        scheduler.close()
    for prompt, events, n in zip(running + late_prompts, results, [30, 30, 6, 6]):
        assert_alone(hf_checkpoint, prompt, events, n)
    late_slot = log.prefill()[-1][0]
    chunks = [i for i, s in enumerate(log.sends) if s[0] == late_slot]
    assert [log.sends[i][1] for i in chunks] == [(2, 7), (2, 7), (2, 6), (2, 2)] and chunks == log.mixed
    assert all(2 * log.sends[i][1][1] + log.sends[i + 1][1][0] <= STEP for i in chunks)
    assert_no_caches_left(scheduler.pipeline)
