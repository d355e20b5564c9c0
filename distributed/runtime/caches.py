"""A rank's KV caches, by slot.

A slot holds either one sequence (mlx-lm's KVCache / RotatingKVCache) or a
decode batch of several (mlx-lm's BatchKVCache / BatchRotatingKVCache, with
per-row offsets and left padding). A batch of one row goes back to the plain
caches: they decode faster, and exactly as mlx-lm's generate_step does. Rank 0
and every worker apply the same operations in the same order, so their slots
always describe the same sequences.
"""

from typing import Dict, List

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

from ..shard.stage import Stage


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
        """Append the one sequence in `source_slot` as the last row of `batch_slot`."""
        single = self.slots.pop(source_slot)
        batch = self.slots.get(batch_slot)
        if batch is None:
            self.slots[batch_slot] = single
            return
        if not is_batch(batch):
            batch = self.slots[batch_slot] = [c.merge([c]) for c in batch]
        for cache, row in zip(batch, single):
            cache.extend(row.merge([row]))  # KVCache -> BatchKVCache of one row, etc.

    def filter(self, batch_slot: int, keep: List[int]) -> None:
        """Keep only rows `keep` (in that order) of `batch_slot`; no rows drops the slot."""
        if not keep:
            self.drop(batch_slot)
            return
        batch = self.slots[batch_slot]
        if not is_batch(batch):
            return  # one row, kept
        if len(keep) == 1:
            self.slots[batch_slot] = [c.extract(keep[0]) for c in batch]
            return
        rows = mx.array(keep)
        for cache in batch:
            cache.filter(rows)

    def evaluate(self, slot: int) -> None:
        """Force the slot's pending cache updates (bounds the lazy graph between chunks)."""
        mx.eval([c.state for c in self.slots[slot]])


def is_batch(caches: List) -> bool:
    return isinstance(caches[0], (BatchKVCache, BatchRotatingKVCache))
