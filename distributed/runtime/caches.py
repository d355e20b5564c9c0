"""A rank's KV caches, by slot.

A slot holds either one sequence (mlx-lm's KVCache / RotatingKVCache) or a
batch of several (mlx-lm's BatchKVCache / BatchRotatingKVCache, with per-row
offsets and left padding): a prefill batch, merged from its sequences' own
slots, or a decode group. A batch of one row goes back to the plain caches:
they decode faster, and exactly as mlx-lm's generate_step does. Rank 0 and
every worker apply the same operations (`apply`) in the same order, so their
slots always describe the same sequences.
"""

import copy
from typing import Dict, List, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

from ..shard.stage import Stage
from ..transport import Op

# Ops that change caches; each rank applies them with `apply` and rank 0 needs no reply.
CACHE_OPS = (Op.RESET, Op.JOIN, Op.FILTER, Op.MERGE, Op.PREPARE, Op.FINALIZE)


class SlotCaches:
    def __init__(self, stage: Stage):
        self.stage = stage
        self.slots: Dict[int, List] = {}

    def apply(self, op: int, slot: int, arg: int, values: Sequence[int]) -> None:
        """One cache op of the ring header; `values`: its int32 payload as a list."""
        if op == Op.RESET:
            self.drop(slot)
        elif op == Op.JOIN:
            self.join(slot, arg, list(values))
        elif op == Op.FILTER:
            self.filter(slot, list(values))
        elif op == Op.MERGE:
            self.merge(slot, list(values))
        elif op == Op.PREPARE:
            half = len(values) // 2
            self.prepare(slot, list(values[:half]), list(values[half:]))
        elif op == Op.FINALIZE:
            self.finalize(slot)
        else:
            raise ValueError(f"op {op} is not a cache op")

    def get(self, slot: int) -> List:
        """The caches of `slot`, fresh ones for a slot not seen before."""
        if slot not in self.slots:
            self.slots[slot] = self.stage.make_cache()
        return self.slots[slot]

    def drop(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def rows(self, slot: int) -> int:
        caches = self.slots[slot]
        return caches[0].offset.shape[0] if is_batch(caches) else 1

    def merge(self, batch_slot: int, sources: List[int]) -> None:
        """One batch in `batch_slot` from the sequences in `sources` (rows in that
        order; each may already hold a history, of any length: mlx-lm's merge
        left-pads the shorter ones). The sources' slots are gone afterwards."""
        singles = [self.get(s) for s in sources]
        for s in sources:
            del self.slots[s]
        self.slots[batch_slot] = [first.merge([c[i] for c in singles]) for i, first in enumerate(singles[0])]

    def prepare(self, slot: int, lengths: List[int], right_padding: List[int]) -> None:
        """Before right-padded prompt rows (mlx-lm's PromptProcessingBatch.prompt):
        padding must not evict or be mistaken for real entries."""
        for cache in self.slots[slot]:
            cache.prepare(lengths=lengths, right_padding=right_padding)

    def finalize(self, slot: int) -> None:
        """After the padded prompt rows: the padding becomes left padding, ready to decode."""
        for cache in self.slots[slot]:
            cache.finalize()

    def join(self, batch_slot: int, source_slot: int, rows: List[int]) -> None:
        """Append rows `rows` (in that order) of `source_slot` to `batch_slot`'s batch;
        the source keeps its other rows, and is gone once none are left."""
        rest = [r for r in range(self.rows(source_slot)) if r not in rows]
        source = self.slots[source_slot]
        if not rest:
            moved = self.slots.pop(source_slot)
            if rows != sorted(rows):
                moved = self._take(moved, rows)
        else:
            moved = self._take(source, rows)
            self.filter(source_slot, rest)
        batch = self.slots.get(batch_slot)
        if batch is None:
            self.slots[batch_slot] = moved
            return
        if not is_batch(batch):
            batch = self.slots[batch_slot] = [c.merge([c]) for c in batch]
        for cache, new in zip(batch, moved):
            cache.extend(new if is_batch(moved) else new.merge([new]))  # KVCache -> BatchKVCache of one row, etc.

    @staticmethod
    def _take(batch: List, rows: List[int]) -> List:
        """Rows `rows` of a batch as caches of their own (plain ones for one row)."""
        if len(rows) == 1:
            return [c.extract(rows[0]) for c in batch]
        taken = [copy.copy(c) for c in batch]
        index = mx.array(rows)
        for cache in taken:
            cache.filter(index)  # assigns new arrays: the source's stay as they were
        return taken

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
