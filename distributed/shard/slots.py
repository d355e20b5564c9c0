"""A rank's KV caches, by slot.

A slot holds either one sequence (mlx-lm's KVCache / RotatingKVCache, while
its prompt is prefilled) or a decode batch (mlx-lm's BatchKVCache /
BatchRotatingKVCache, with per-row offsets and left padding). Rank 0 and every
worker apply the same operations in the same order, so their slots always
describe the same sequences.
"""

from typing import Dict, List

import mlx.core as mx

from .stage import Stage


class SlotCaches:
    def __init__(self, stage: Stage):
        self.stage = stage
        self.slots: Dict[int, List] = {}

    def get(self, slot: int) -> List:
        """The caches of `slot`, fresh ones for a slot not seen before."""
        if slot not in self.slots:
            self.slots[slot] = self.stage.make_cache()
        return self.slots[slot]

    def drop(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def join(self, batch_slot: int, source_slot: int) -> None:
        """Append the one sequence in `source_slot` as the last row of `batch_slot`'s batch."""
        single = self.slots.pop(source_slot)
        rows = [c.merge([c]) for c in single]  # KVCache -> BatchKVCache of one row, etc.
        batch = self.slots.get(batch_slot)
        if batch is None:
            self.slots[batch_slot] = rows
            return
        for cache, row in zip(batch, rows):
            cache.extend(row)

    def filter(self, batch_slot: int, keep: List[int]) -> None:
        """Keep only rows `keep` (in that order) of `batch_slot`; no rows drops the slot."""
        if not keep:
            self.drop(batch_slot)
            return
        rows = mx.array(keep)
        for cache in self.slots[batch_slot]:
            cache.filter(rows)

    def evaluate(self, slot: int) -> None:
        """Force the slot's pending cache updates (bounds the lazy graph between chunks)."""
        mx.eval([c.state for c in self.slots[slot]])
