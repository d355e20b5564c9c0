"""Slot caches: sequences joined into a batch, filtered out of it, and back to one row."""

import mlx.core as mx

from distributed.runtime.caches import SlotCaches, is_batch
from distributed.shard.loader import load_stage

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
