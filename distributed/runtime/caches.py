"""A rank's KV caches, by slot.

A slot holds either one sequence (mlx-lm's KVCache / RotatingKVCache) or a
batch of several (mlx-lm's BatchKVCache / BatchRotatingKVCache, with per-row
offsets and left padding): a prefill batch, merged from its sequences' own
slots, or a decode group. A batch of one row goes back to the plain caches:
they decode faster, and exactly as mlx-lm's generate_step does. Rank 0 and
every worker apply the same operations (`apply`) in the same order, so their
slots always describe the same sequences.

Each rank also keeps its layers' slice of the prefix cache's entries (rank 0
holds the index: prefix_cache.py): a sequence's caches copied at some point,
restored later into a new sequence's slot.
"""

import copy
from contextlib import contextmanager
from typing import Dict, List, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from ..shard.stage import Stage
from ..transport import Op

# Ops that change caches; each rank applies them with `apply` and rank 0 needs no reply.
CACHE_OPS = (Op.RESET, Op.JOIN, Op.FILTER, Op.MERGE, Op.PREPARE, Op.FINALIZE, Op.SNAPSHOT, Op.RESTORE, Op.EVICT,
             Op.TRIM)


class SlotCaches:
    def __init__(self, stage: Stage):
        self.stage = stage
        self.slots: Dict[int, List] = {}
        self.entries: Dict[int, List] = {}  # prefix-cache entries: compact plain caches

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
        elif op == Op.SNAPSHOT:  # prefix-cache entries: values are (entry, row)
            self.snapshot(slot, *values)
        elif op == Op.RESTORE:  # (entry, tokens)
            self.restore(slot, *values)
        elif op == Op.EVICT:
            for entry in values:
                self.evict(entry)
        elif op == Op.TRIM:
            for cache in self.slots[slot]:
                trim_newest(cache, arg)
        else:
            raise ValueError(f"op {op} is not a cache op")

    def get(self, slot: int) -> List:
        """The caches of `slot`, fresh ones for a slot not seen before."""
        if slot not in self.slots:
            self.slots[slot] = self.stage.make_cache()
        return self.slots[slot]

    def drop(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def clear(self) -> None:
        """Drop every slot (Op.CLEAR); prefix-cache entries stay (they are evicted by name)."""
        self.slots.clear()

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
        the source keeps its other rows, and is gone once none are left. A source no
        frame has reached yet (a one-token prompt: nothing to prefill) joins with
        fresh caches."""
        self.get(source_slot)
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
            return [extract_row(c, rows[0]) for c in batch]
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
            self.slots[batch_slot] = [extract_row(c, keep[0]) for c in batch]
            return
        rows = mx.array(keep)
        for cache in batch:
            cache.filter(rows)

    def length(self, slot: int, row: int = 0) -> int:
        """Tokens the sequence in row `row` of `slot` has been fed (none in a slot no
        frame has reached)."""
        caches = self.get(slot)
        return caches[0].offset[row].item() if is_batch(caches) else caches[0].offset

    def snapshot(self, slot: int, entry: int, row: int = 0) -> Tuple[int, int]:
        """Keep a copy of row `row` of `slot` as prefix-cache entry `entry`.
        Returns (tokens it covers, bytes kept)."""
        caches = self.slots[slot]
        if is_batch(caches):
            caches = [extract_row(c, row) for c in caches]
        kept = [compact(c) for c in caches]
        mx.eval([(c.keys, c.values) for c in kept])
        self.entries[entry] = kept
        return kept[0].offset, sum(c.nbytes for c in kept)

    def restore(self, slot: int, entry: int, tokens: int) -> None:
        """Fresh caches for `slot` from `entry`, cut to its first `tokens` tokens (fewer
        than it covers only if its caches are trimmable: no sliding window wrapped)."""
        self.slots[slot] = [cut(c, tokens) for c in self.entries[entry]]

    def evict(self, entry: int) -> None:
        self.entries.pop(entry, None)

    def evaluate(self, slot: int) -> None:
        """Force the slot's pending cache updates (bounds the lazy graph between chunks)."""
        mx.eval([c.state for c in self.slots[slot]])


def is_batch(caches: List) -> bool:
    return isinstance(caches[0], (BatchKVCache, BatchRotatingKVCache))


def extract_row(cache, row: int):
    """Row `row` of a batch cache as a plain one. A batch no frame has reached yet (prompts of
    one token each: nothing to prefill, merged into a batch of empty caches) has no keys for
    mlx-lm's extract to slice: its rows are fresh caches."""
    if cache.empty():
        return RotatingKVCache(cache.max_size) if isinstance(cache, BatchRotatingKVCache) else KVCache()
    return cache.extract(row)


def trim_newest(cache, n: int) -> None:
    """Drop the newest n positions of a plain cache, right after the multi-token update
    that added them (a verification frame: speculation.py). A KVCache trims as mlx-lm's
    does. A RotatingKVCache is cut here: mlx-lm's trim does nothing once the window has
    wrapped (mlx-lm issue #1914), but after a multi-token update (its _update_concat)
    the buffer is in temporal order with the new positions last, so they are its last n
    entries, whatever the offset. The next update, of one token or several, trims the
    buffer back to the window from its oldest end, as it does after any such update."""
    if n <= 0:
        return
    if isinstance(cache, RotatingKVCache):
        assert cache._idx == cache.keys.shape[2] >= n, "a RotatingKVCache is trimmed only after a multi-token update"
        cache.keys, cache.values = cache.keys[..., :-n, :], cache.values[..., :-n, :]
        cache.offset -= n
        cache._idx -= n
    else:
        assert isinstance(cache, KVCache) and cache.offset >= n, type(cache).__name__
        cache.trim(n)


@contextmanager
def keeping(caches, n: int):
    """While a verification frame's graph is built (its masks and its cache updates): each
    RotatingKVCache keeps the `n` positions before the window too (speculation.Verifier: those
    of frames before it in the ring, which a rejection may still take back; trim_newest
    then leaves the window whole). The next update trims the buffer back as usual."""
    rotating = [c for c in caches or () if isinstance(c, RotatingKVCache)] if n > 0 else []
    for c in rotating:
        c.max_size += n
    try:
        yield
    finally:
        for c in rotating:
            c.max_size -= n


def hold(caches) -> List[dict]:
    """The caches' state now, to put back (put_back) when a graph built on them is dropped,
    evaluated or not (a step built before its frame came, and the frame was another:
    StageWorker.build_ahead). The cache updates assign in place (`keys[..., i, :] = k` changes the array
    object itself), so each array is held as a new reference to its value now: lazy, nothing
    is copied."""
    return [{name: mx.array(v) if isinstance(v, mx.array) else copy.copy(v) for name, v in vars(c).items()}
            for c in caches]


def put_back(caches, held: List[dict]) -> None:
    for cache, state in zip(caches, held):
        vars(cache).clear()
        vars(cache).update(state)


def compact(cache):
    """A plain cache holding only what the next tokens need, in temporal order, in
    buffers of its own (not views of a larger, padded or batch buffer): a
    KVCache's `offset` tokens, a RotatingKVCache's last min(offset, window)."""
    if isinstance(cache, RotatingKVCache):
        held = min(cache.offset, cache.max_size)
        keys, values = (cache._temporal_order(v)[..., -held:, :] for v in (cache.keys, cache.values))
        out = RotatingKVCache(cache.max_size)
        out._idx = held
    else:
        keys, values = (v[..., : cache.offset, :] for v in (cache.keys, cache.values))
        out = KVCache()
    out.keys, out.values, out.offset = mx.array(keys), mx.array(values), cache.offset
    return out


def cut(entry, tokens: int):
    """A new cache from a compact one, at its first `tokens` tokens. Its arrays are
    new slices: the cache's in-place updates then copy, never write into the entry."""
    drop = entry.offset - tokens
    if drop and not entry.is_trimmable():
        raise ValueError(f"a wrapped sliding-window cache cannot be cut from {entry.offset} to {tokens} tokens")
    held = entry.keys.shape[2] - drop
    out = copy.copy(entry)
    out.keys, out.values, out.offset = entry.keys[..., :held, :], entry.values[..., :held, :], tokens
    if isinstance(out, RotatingKVCache):
        out._idx = held
    return out
