"""Slot caches: sequences joined into a batch, filtered out of it, and back to one row;
prefix-cache entries snapshot from a slot or a batch row and restored into a new slot."""

import mlx.core as mx
import pytest

from distributed.runtime.caches import SlotCaches, hold, is_batch, put_back
from distributed.shard.loader import load_stage
from distributed.transport import Op

A = [(3 * i + 1) % 250 + 1 for i in range(23)]  # longer than the 16-token window
B = [(5 * i + 2) % 250 + 1 for i in range(6)]


def last_logits(stage, h):
    return stage.head(h)[:, -1, :]


def greedy_alone(stage, prompt, steps):
    caches = SlotCaches(stage)
    out = []
    logits = last_logits(stage, stage(stage.embed(mx.array(prompt)[None]), caches.get(0)))
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)
        out.append(token.item())
        logits = last_logits(stage, stage(stage.embed(token[:, None]), caches.get(0)))
    return out


def test_join_filter_and_back_to_one_row(hf_checkpoint):
    stage = load_stage(hf_checkpoint, 0, 8, True)
    caches = SlotCaches(stage)
    firsts = []
    for slot, prompt in ((10, A), (11, B)):
        h = stage(stage.embed(mx.array(prompt)[None]), caches.get(slot))
        firsts.append(mx.argmax(last_logits(stage, h), axis=-1).item())
    caches.join(0, 10, [0])
    assert not is_batch(caches.slots[0])  # one row: plain caches
    caches.join(0, 11, [0])
    assert is_batch(caches.slots[0]) and set(caches.slots) == {0}
    tokens, rows = [firsts], []
    for step in range(20):
        if step == 8:  # A leaves; B goes on alone, in plain caches again
            caches.filter(0, [1])
            assert not is_batch(caches.slots[0])
            tokens[-1] = tokens[-1][1:]
        logits = last_logits(stage, stage(stage.embed(mx.array(tokens[-1])[:, None]), caches.get(0)))
        tokens.append(mx.argmax(logits, axis=-1).tolist())
        rows.append(tokens[-1])
    a = [firsts[0]] + [r[0] for r in rows[:8]]
    b = [firsts[1]] + [r[-1] for r in rows]
    assert a == greedy_alone(stage, A, 9)
    assert b == greedy_alone(stage, B, 21)
    caches.filter(0, [])
    assert caches.slots == {}


def test_merge_histories_prefill_padded_rows_then_join_rows_into_groups(hf_checkpoint):
    """mlx-lm's batched prompt processing on slots: histories of different lengths merged,
    right-padded prompt rows in chunks between prepare and finalize, one first-token step,
    then the rows move into two groups (some now, the rest later) and decode on exactly."""
    stage = load_stage(hf_checkpoint, 0, 8, True)
    caches = SlotCaches(stage)
    prompts = [A, B, [(11 * i + 4) % 250 + 1 for i in range(30)]]
    histories = [20, 0, 5]  # 20: longer than the window
    for slot, prompt, n in zip((10, 11, 12), prompts, histories):
        if n:
            stage(stage.embed(mx.array(prompt[:n])[None]), caches.get(slot))
    caches.apply(Op.MERGE, 20, 0, [10, 11, 12])  # as a worker applies the ring's op
    assert set(caches.slots) == {20} and caches.rows(20) == 3
    rows = [p[n:-1] for p, n in zip(prompts, histories)]
    width = max(map(len, rows))  # 24
    caches.prepare(20, [len(r) for r in rows], [width - len(r) for r in rows])
    padded = mx.array([r + [0] * (width - len(r)) for r in rows])
    for start in range(0, width, 6):
        stage(stage.embed(padded[:, start:start + 6]), caches.get(20))
    caches.finalize(20)
    logits = last_logits(stage, stage(stage.embed(mx.array([[p[-1]] for p in prompts])), caches.get(20)))
    tokens = mx.argmax(logits, axis=-1).tolist()
    out = [[t] for t in tokens]
    caches.join(0, 20, [1])  # row 1 alone: plain caches
    assert not is_batch(caches.slots[0]) and caches.rows(20) == 2
    groups = {0: [1], 1: []}
    for step in range(16):
        if step == 5:  # the rest join group 1 together, in the order given; slot 20 is gone
            caches.join(1, 20, [1, 0])
            groups[1] = [2, 0]
            assert 20 not in caches.slots and caches.rows(1) == 2
        for slot, members in groups.items():
            if members:
                x = mx.array([[out[m][-1]] for m in members])
                logits = last_logits(stage, stage(stage.embed(x), caches.get(slot)))
                for m, t in zip(members, mx.argmax(logits, axis=-1).tolist()):
                    out[m].append(t)
    for prompt, tokens in zip(prompts, out):
        assert tokens == greedy_alone(stage, prompt, len(tokens))
def next_logits(stage, caches, slot, tokens):
    return last_logits(stage, stage(stage.embed(mx.array(tokens)[None]), caches.get(slot)))


def test_snapshot_of_a_batch_row_restores_as_the_sequence_alone(hf_checkpoint):
    """A row of a decode batch (both wrapped and not: A is past the 16-token window,
    B is not) is kept as an entry; restored into a new slot, it continues exactly as
    the sequence computed alone, and the restored slot's updates leave the entry as it was."""
    stage = load_stage(hf_checkpoint, 0, 8, True)
    caches = SlotCaches(stage)
    for slot, prompt in ((10, A), (11, B)):
        stage(stage.embed(mx.array(prompt)[None]), caches.get(slot))
    caches.join(0, 10, [0])  # JOIN now moves listed rows
    caches.join(0, 11, [0])
    step = [[7], [9]]
    stage(stage.embed(mx.array(step)), caches.get(0))  # one decode step, as a batch
    assert caches.lengths(0) == [len(A) + 1, len(B) + 1]
    assert [kept[0] for kept in caches.snapshot(0, [(0, 0), (1, 1)])] == [len(A) + 1, len(B) + 1]  # both rows, one op
    for row, prompt in enumerate((A, B)):
        fed = prompt + step[row]
        alone = SlotCaches(stage)
        expected = next_logits(stage, alone, 0, fed + [5, 6])
        for slot in (20, 21):  # twice: the first restored slot must not have changed the entry
            caches.restore(slot, row, len(fed))
            got = next_logits(stage, caches, slot, [5, 6])
            assert mx.abs(got - expected).max().item() < 1e-4
    # Only B's entry (shorter than the window) can be cut back.
    caches.restore(30, 1, 3)
    assert mx.abs(next_logits(stage, caches, 30, B[3:]) - next_logits(stage, SlotCaches(stage), 0, B)).max().item() < 1e-4
    with pytest.raises(ValueError, match="wrapped"):
        caches.restore(31, 0, 3)
    caches.evict(0)
    assert set(caches.entries) == {1}


def test_a_step_built_then_dropped_leaves_the_caches_as_they_were(hf_checkpoint):
    """A rank builds the next decode step before its frame comes (worker.build_ahead); when the
    frame is another, hold / put_back undo the step's cache updates, even evaluated. Every
    frame's output then equals that of a run that never built one, past the window of 16 and
    through multi-token frames whose last position is then trimmed (verification frames)."""
    stage = load_stage(hf_checkpoint, 0, 8, True)
    feeds = [A] + [[t] if i % 4 else [t, t + 1, t + 2] for i, t in enumerate(range(3, 60, 2))]

    def run(drop_steps: bool):
        caches, outs = SlotCaches(stage), []

        def frame(slot, tokens):
            if drop_steps:
                held = hold(caches.get(slot))
                garbage = mx.full((tokens.shape[0], 1), 7)
                mx.eval(stage(stage.embed(garbage), caches.get(slot)))  # a step whose frame never came
                put_back(caches.get(slot), held)
            outs.append(stage(stage.embed(tokens), caches.get(slot)))
            mx.eval(outs[-1])

        for feed in feeds:  # one sequence: plain caches
            frame(0, mx.array([feed]))
            if len(feed) > 1 and feed is not A:
                caches.apply(Op.TRIM, 0, 1, [])  # the last position rejected, as a verification frame's
        frame(1, mx.array([B]))
        caches.join(0, 1, [0])  # two rows: batch caches
        for t in range(40):
            frame(0, mx.array([[t + 5], [t + 9]]))
        return outs

    for built, plain in zip(run(True), run(False)):
        assert mx.array_equal(built, plain)
