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

A sliding-window cache that has wrapped cannot be cut back: the keys before its
window are gone. So while a prompt is prefilled (Op.RECORD), the keys and values
each frame brings to the sliding layers are also kept in order, as they come
(a Log, per sequence: rows are followed through merges, joins and filters), and
an entry keeps them beside its caches (Stored): a window is rebuilt from them at
any earlier position, and an entry serves any prompt that shares a prefix with it.
A log may start late (`start`): an entry read from disk at t holds the windows at t
only (Stored.from_file reads no more), so it, and the entries of the prompts that
restore it and go on, are cut at t or later only (Stored.lowest).
"""

import copy
import hashlib
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from ..shard.kv_quant import BatchQuantizedKVCache, QuantizedKVCache, plain, quantized
from ..shard.stage import Stage
from ..transport import Op
from .disk_cache import BLOCK, Corrupt, DiskCache, EntryFile, chain_hashes

# Ops that change caches; each rank applies them with `apply` and rank 0 needs no reply.
CACHE_OPS = (Op.RESET, Op.JOIN, Op.FILTER, Op.MERGE, Op.PREPARE, Op.FINALIZE, Op.SNAPSHOT, Op.RESTORE, Op.EVICT,
             Op.TRIM, Op.RECORD, Op.PERSIST)

KV = Tuple[mx.array, mx.array]


class Log:
    """A sequence's sliding-layer keys and values of positions [start, tokens), in order,
    unrotated (one list of chunks per layer; None for a full-attention layer). `open` while
    its prompt is prefilled: the frames of its slot add to it."""

    def __init__(self, chunks: List[Optional[List[KV]]], tokens: int, start: int = 0):
        self.chunks = chunks
        self.tokens = tokens
        self.start = start
        self.open = True

    def add(self, layer: int, kv: KV) -> None:
        self.chunks[layer].append(kv)

    def joined(self) -> List[Optional[KV]]:
        """Each layer's keys and values as one pair; the log keeps those from now on (an entry
        that shares them costs no copy)."""
        for chunks in self.chunks:
            if chunks is not None and len(chunks) > 1:
                chunks[:] = [(mx.concatenate([k for k, _ in chunks], axis=2),
                              mx.concatenate([v for _, v in chunks], axis=2))]
        return [None if c is None else c[0] for c in self.chunks]


@dataclass
class Stored:
    """A prefix-cache entry's slice on this rank: the compact caches after all its tokens and,
    where its sliding windows wrapped, each sliding layer's keys and values of positions
    [log_start, logged), unrotated, from which a window at an earlier position is rebuilt
    (one that lies inside them: Stored.lowest)."""

    caches: List
    log: List[Optional[KV]]
    logged: int
    log_start: int = 0

    @cached_property
    def nbytes(self) -> int:
        """Counted once: an entry never changes, and the access log and /v1/status sum every
        entry's bytes (walking each one's arrays per request took most of a core at 1,300 entries)."""
        arrays = tree_flatten([(c.keys, c.values) for c in self.caches] + [kv for kv in self.log if kv])
        arrays = [a for _, a in arrays]
        return sum({id(a): a.nbytes for a in arrays}.values())  # from_file's windows are its logs too

    def cut(self, tokens: int) -> List:
        """Fresh caches at its first `tokens` tokens (its arrays are new slices: the caches'
        in-place updates then copy, never write into the entry)."""
        out = []
        for cache, kv in zip(self.caches, self.log):
            if tokens == cache.offset or cache.is_trimmable() or kv is None:
                out.append(cut(cache, tokens))  # refuses to cut a wrapped window with no log
            else:
                out.append(window_at(kv, tokens, cache.max_size, self.log_start))
        return out

    @staticmethod
    def lowest(log_start: int, window: int) -> int:
        """The fewest tokens an entry whose logs start at `log_start` is cut to (any, from 0)."""
        return log_start + window if log_start else 0

    def on_disk(self) -> Tuple[List, Dict[str, str]]:
        """Its caches as the disk tier writes them (plain mlx-lm caches): each layer's, then each
        log as a KVCache, then the scales and the biases of each quantized layer (--kv-bits: its
        own KVCache holds the packed values) as two more; the metadata says which layers have one."""
        logs = [i for i, kv in enumerate(self.log) if kv is not None]
        quantized = [i for i, c in enumerate(self.caches) if isinstance(c, QuantizedKVCache)]
        extra = []
        for i in logs:
            c = KVCache()
            c.keys, c.values = self.log[i]
            c.offset = self.logged
            extra.append(c)
        extra += [plain(self.caches[i], j) for i in quantized for j in (1, 2)]
        meta = {"logged": str(self.logged), "logs": ",".join(map(str, logs)), "log_start": str(self.log_start)}
        if quantized:
            q = self.caches[quantized[0]]
            meta.update(quantized=",".join(map(str, quantized)), kv_bits=str(q.bits), kv_group_size=str(q.group_size))
        caches = [plain(c, 0) if i in quantized else c for i, c in enumerate(self.caches)]
        return caches + extra, meta

    @classmethod
    def from_file(cls, f: EntryFile, layers: int, tokens: int) -> Optional["Stored"]:
        """An entry of the first `tokens` tokens of the disk entry `f` (on_disk's layout), reading
        only what its caches hold: the full-attention layers' first `tokens` positions and each
        sliding layer's window before `tokens` (from its log, or from its window where `tokens`
        is the entry's whole length). Its logs are those windows (log_start: where they begin),
        so it is cut at `tokens` only. None where the file cannot give `tokens` so."""
        logs = [int(i) for i in f.meta.get("logs", "").split(",") if i]
        quantized = [int(i) for i in f.meta.get("quantized", "").split(",") if i]
        if (len(f.classes) != layers + len(logs) + 2 * len(quantized) or sorted(set(logs)) != logs
                or any(not 0 <= i < layers for i in logs + quantized) or any(f.classes[i] != "KVCache" for i in quantized)):
            raise Corrupt(f"{len(f.classes)} caches for {layers} layers, logs {logs} and quantized {quantized}")
        logged, log_start = int(f.meta.get("logged", 0)), int(f.meta.get("log_start", 0))
        wanted, shapes = [], []  # what to read of which cache; each layer's cache class, window, positions
        for i in range(layers):
            offset, *rest = f.scalars(i)[2:]
            if f.classes[i] == "KVCache":
                if tokens > offset:
                    return None
                wanted.append((i, 0, tokens))
                shapes.append((KVCache, None, tokens))
                continue
            keep, window, _ = rest
            held = min(tokens, window)
            if i in logs and log_start <= tokens - held and tokens <= logged:
                wanted.append((layers + logs.index(i), tokens - held - log_start, tokens - log_start))
            elif offset <= window and tokens <= offset:  # never wrapped: its positions from 0, in order
                wanted.append((i, tokens - held, tokens))
            elif tokens == offset and f.length(i) == held:  # compact: its window, in order
                wanted.append((i, 0, held))
            else:
                return None
            shapes.append((RotatingKVCache, (window, keep), held))
        caches, log, start = [], [None] * layers, 0
        for i, ((kind, args, held), keys_values) in enumerate(zip(shapes, f.read(wanted))):
            out = kind(*args) if args else kind()
            out.keys, out.values = keys_values
            out.offset = tokens
            if kind is RotatingKVCache:
                out._idx = held
                if tokens > args[0]:  # wrapped: the window is the log, from tokens - window
                    log[i], start = keys_values, tokens - args[0]
            caches.append(out)
        if quantized:  # each one's scales and biases, after the logs
            extra = layers + len(logs)
            parts = iter(f.read([(extra + k, 0, tokens) for k in range(2 * len(quantized))]))
            for i in quantized:
                q = QuantizedKVCache(int(f.meta["kv_group_size"]), int(f.meta["kv_bits"]))
                (k1, v1), (k2, v2) = next(parts), next(parts)
                q.keys, q.values = (caches[i].keys, k1, k2), (caches[i].values, v1, v2)
                q.offset = tokens
                caches[i] = q
        return cls(caches, log, tokens if start else 0, start)

    def seed(self, tokens: int) -> Tuple[List[Optional[KV]], int]:
        """Each sliding layer's keys and values of positions [start, tokens), and start (the
        log_start a Log seeded from them has)."""
        seeds = []
        for cache, kv in zip(self.caches, self.log):
            if not isinstance(cache, RotatingKVCache):
                seeds.append(None)
            else:
                k, v = kv if kv is not None else (cache.keys, cache.values)  # not wrapped: all its tokens
                start = self.log_start if kv is not None else 0
                assert start <= tokens <= start + k.shape[2], "an entry seeds a log only as far as it holds its tokens"
                seeds.append((k[..., :tokens - start, :], v[..., :tokens - start, :]))
        return seeds, self.log_start if any(kv is not None for kv in self.log) else 0


class Tap:
    """A sliding-window cache seen through: the keys and values of the frame's update are kept
    (SlotCaches.tapped gives them to the rows' logs)."""

    def __init__(self, cache):
        self.cache = cache
        self.kv: Optional[KV] = None

    def update_and_fetch(self, keys, values):
        self.kv = (keys, values)
        return self.cache.update_and_fetch(keys, values)

    def __getattr__(self, name):
        return getattr(self.cache, name)


class SlotCaches:
    def __init__(self, stage: Stage, disk: Optional[DiskCache] = None):
        self.stage = stage
        self.disk = disk if disk is not None and disk.enabled else None  # this rank's disk tier of entries
        self.slots: Dict[int, List] = {}
        self.entries: Dict[int, Stored] = {}  # prefix-cache entries
        # Which sequence each row of a slot is (the slot it started in), through merges, joins and
        # filters; the logs of those being recorded (Op.RECORD), and each padded batch's row lengths
        # with the columns its frames have brought so far (a row's log takes only its own tokens).
        self.rows_of: Dict[int, List[int]] = {}
        self.logs: Dict[int, Log] = {}
        self.padded: Dict[int, List] = {}

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
        elif op == Op.SNAPSHOT:  # prefix-cache entries: values are (entry, row) pairs
            self.snapshot(slot, list(zip(values[::2], values[1::2])))
        elif op == Op.RESTORE:  # (entry, tokens)
            self.restore(slot, *values)
        elif op == Op.EVICT:
            for entry in values:
                self.evict(entry)
        elif op == Op.TRIM:
            for cache in self.slots[slot]:
                trim_newest(cache, arg)
        elif op == Op.RECORD:  # (entry or -1, tokens)
            self.record(slot, *values)
        elif op == Op.PERSIST:  # (entry, its tokens...)
            self.persist(values[0], values[1:])
        else:
            raise ValueError(f"op {op} is not a cache op")

    def get(self, slot: int) -> List:
        """The caches of `slot`, fresh ones for a slot not seen before. With --quantized-kv-start,
        its whole full-attention caches are quantized here, before the first frame after they
        hold that many positions (mlx-lm quantizes after the step that brought them there)."""
        if slot not in self.slots:
            self.slots[slot] = self.stage.make_cache()
            self.rows_of[slot] = [slot]
        q, caches = self.stage.kv_quantization, self.slots[slot]
        if q and q.start and any(is_whole(c) and positions(c) >= q.start for c in caches):
            caches[:] = [quantized(c, q.group_size, q.bits) if is_whole(c) else c for c in caches]
        return caches

    def drop(self, slot: int) -> None:
        self.slots.pop(slot, None)
        self.rows_of.pop(slot, None)
        self.padded.pop(slot, None)
        self._forget_logs()

    def clear(self) -> None:
        """Drop every slot (Op.CLEAR); prefix-cache entries stay (they are evicted by name)."""
        self.slots.clear()
        self.rows_of.clear()
        self.logs.clear()
        self.padded.clear()

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
        layers = [alike([c[i] for c in singles]) for i in range(len(singles[0]))]
        self.slots[batch_slot] = [layer[0].merge(layer) for layer in layers]
        self.rows_of[batch_slot] = [i for s in sources for i in self.rows_of.pop(s)]

    def prepare(self, slot: int, lengths: List[int], right_padding: List[int]) -> None:
        """Before right-padded prompt rows (mlx-lm's PromptProcessingBatch.prompt):
        padding must not evict or be mistaken for real entries."""
        for cache in self.slots[slot]:
            cache.prepare(lengths=lengths, right_padding=right_padding)
        self.padded[slot] = [lengths, 0]

    def finalize(self, slot: int) -> None:
        """After the padded prompt rows: the padding becomes left padding, ready to decode."""
        for cache in self.slots[slot]:
            cache.finalize()
        self.padded.pop(slot, None)

    def join(self, batch_slot: int, source_slot: int, rows: List[int]) -> None:
        """Append rows `rows` (in that order) of `source_slot` to `batch_slot`'s batch;
        the source keeps its other rows, and is gone once none are left. A source no
        frame has reached yet (a one-token prompt: nothing to prefill) joins with
        fresh caches."""
        self.get(source_slot)
        rest = [r for r in range(self.rows(source_slot)) if r not in rows]
        source = self.slots[source_slot]
        ids = [self.rows_of[source_slot][r] for r in rows]
        for i in ids:  # they decode from now on: their prompts are whole
            if i in self.logs:
                self.logs[i].open = False
        self.rows_of[batch_slot] = self.rows_of.get(batch_slot, []) + ids  # first: the source's filter keeps their logs
        if not rest:
            moved = self.slots.pop(source_slot)
            del self.rows_of[source_slot]
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
        for i, new in enumerate(moved):
            batch[i], new = alike([batch[i], new if is_batch(moved) else new.merge([new])])  # KVCache -> BatchKVCache
            batch[i].extend(new)

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
        ids = self.rows_of[batch_slot]
        self.rows_of[batch_slot] = [ids[k] for k in keep]
        self._forget_logs()
        if not is_batch(batch):
            return  # one row, kept
        if len(keep) == 1:
            self.slots[batch_slot] = [extract_row(c, keep[0]) for c in batch]
            return
        rows = mx.array(keep)
        for cache in batch:
            cache.filter(rows)

    def lengths(self, slot: int) -> List[int]:
        """Tokens each row of `slot` has been fed (none in a slot no frame has reached)."""
        caches = self.get(slot)
        return caches[0].offset.tolist() if is_batch(caches) else [caches[0].offset]

    def snapshot(self, slot: int, pairs: Sequence[Tuple[int, int]]) -> List[Tuple[int, int, int, int]]:
        """Keep a copy of each (entry, row) pair's row of `slot` as prefix-cache entry `entry`. For
        each, (tokens it covers, bytes kept, tokens logged, where the logs start: Stored.cut). One
        wait for the device at most, whatever the rows: the batch's row bookkeeping is evaluated once
        (mlx-lm's extract would wait for it per layer and row), and the copies run on behind."""
        caches = self.slots[slot]
        if is_batch(caches):
            mx.eval([(c.left_padding, c.offset) for c in caches])
        out, copies = [], []
        for entry, row in pairs:
            stored = self._kept(slot, caches, row)
            copies += [(c.keys, c.values) for c in stored.caches] + [kv for kv in stored.log if kv is not None]
            self.entries[entry] = stored
            out.append((stored.caches[0].offset, stored.nbytes, stored.logged, stored.log_start))
        mx.async_eval(copies)
        return out

    def _kept(self, slot: int, caches: List, row: int) -> Stored:
        """Row `row` of `caches` (a slot's) as an entry of its own buffers, with its log."""
        if is_batch(caches):
            caches = [extract_row(c, row) for c in caches]
        kept = [compact(c) for c in caches]
        log = self.logs.get(self.rows_of[slot][row])
        tokens = kept[0].offset
        logged, start, layers = (log.tokens, log.start, log.joined()) if log is not None else (0, 0, [None] * len(kept))
        if log is not None and logged < tokens and logged >= tokens - min(tokens, self.stage.args.sliding_window):
            # The windows hold the tokens the log lacks (those fed by decode steps): the log then
            # covers them all (decided from the model's window: this rank may hold no sliding layer).
            layers = [kv if kv is None else whole_log(kv, c, start) for kv, c in zip(layers, kept)]
            logged = tokens
        return Stored(kept, layers, logged, start)

    def restore(self, slot: int, entry: int, tokens: int) -> None:
        """Fresh caches for `slot` from `entry`, at its first `tokens` tokens (fewer than it
        covers only where it can be cut: Stored.cut)."""
        self.slots[slot] = self.entries[entry].cut(tokens)
        self.rows_of[slot] = [slot]

    def record(self, slot: int, entry: int, tokens: int) -> None:
        """Keep a log of the sliding layers' keys and values for the sequence in `slot` (one
        row, before its prompt's frames), starting from entry `entry`'s first `tokens` (-1: none)."""
        caches = self.get(slot)
        if entry >= 0:
            layers, start = self.entries[entry].seed(tokens)
        else:
            layers, tokens, start = [None] * len(caches), 0, 0
        self.logs[self.rows_of[slot][0]] = Log(
            [[kv] if kv is not None else [] if isinstance(c, RotatingKVCache) else None for kv, c in zip(layers, caches)],
            tokens, start)

    @contextmanager
    def tapped(self, slot: int, columns: int):
        """`slot`'s caches for a frame of `columns` positions per row; the rows being recorded
        (Op.RECORD) add what the frame brings to their logs (not if the frame raises)."""
        caches = self.get(slot)
        ids = self.rows_of[slot]
        if not any(i in self.logs and self.logs[i].open for i in ids):
            yield caches
            return
        taps = [Tap(c) if isinstance(c, (RotatingKVCache, BatchRotatingKVCache)) else c for c in caches]
        yield taps
        padded = self.padded.get(slot)
        for row, i in enumerate(ids):
            log = self.logs.get(i)
            if log is None or not log.open:
                continue
            n = columns if padded is None else max(0, min(columns, padded[0][row] - padded[1]))
            for layer, tap in enumerate(taps):
                if isinstance(tap, Tap) and n:
                    k, v = tap.kv
                    log.add(layer, (k[row:row + 1, :, :n, :], v[row:row + 1, :, :n, :]))
            log.tokens += n
        if padded is not None:
            padded[1] += columns

    def _forget_logs(self) -> None:
        """Logs of sequences no slot holds now."""
        if self.logs:
            live = set(chain.from_iterable(self.rows_of.values()))
            for i in [i for i in self.logs if i not in live]:
                del self.logs[i]

    def evict(self, entry: int) -> None:
        self.entries.pop(entry, None)

    def persist(self, entry: int, tokens: Sequence[int]) -> None:
        """Queue entry `entry`, which covers `tokens`, for this rank's disk tier (dropped where
        the writer is behind: DiskCache.put never waits)."""
        if self.disk is not None and entry in self.entries:
            caches, meta = self.entries[entry].on_disk()
            self.disk.put(entry_key(tokens), np.array(tokens, dtype=np.int32), caches, meta)

    def load(self, entry: int, tokens: Sequence[int], cut: int) -> bool:
        """Entry `entry`: the first `cut` tokens of the disk tier's entry for `tokens`
        (Stored.from_file); whether this rank has it."""
        if self.disk is None:
            return False
        tokens = np.asarray(tokens, dtype=np.int32)

        def read(f: EntryFile) -> Optional[Stored]:
            if not np.array_equal(f.tokens, tokens):
                return None
            return Stored.from_file(f, len(self.stage.layers), cut)

        got = self.disk.read(entry_key(tokens), read)
        if got is not None:
            self.entries[entry] = got
        return got is not None

    def close(self) -> None:
        """Write what the disk tier has queued (bounded), then stop its writer."""
        if self.disk is not None:
            self.disk.close()

    def evaluate(self, slot: int) -> None:
        """Force the slot's pending cache updates (bounds the lazy graph between chunks)."""
        mx.eval([c.state for c in self.slots[slot]])


def is_whole(cache) -> bool:
    """A full-attention cache not quantized (yet)."""
    return type(cache) in (KVCache, BatchKVCache)


def positions(cache) -> int:
    """The positions a full-attention cache holds (a batch's: its longest row's, with padding)."""
    return cache._idx if isinstance(cache, BatchKVCache) else cache.offset


def alike(caches: List) -> List:
    """One layer's caches from several slots, all quantized where one is (--quantized-kv-start)."""
    q = next((c for c in caches if isinstance(c, (QuantizedKVCache, BatchQuantizedKVCache))), None)
    return [quantized(c, q.group_size, q.bits) if q and is_whole(c) else c for c in caches]


def is_batch(caches: List) -> bool:
    return isinstance(caches[0], (BatchKVCache, BatchRotatingKVCache))


def extract_row(cache, row: int):
    """Row `row` of a batch cache as a plain one. A batch no frame has reached yet (prompts of
    one token each: nothing to prefill, merged into a batch of empty caches) has no keys for
    mlx-lm's extract to slice: its rows are fresh caches."""
    if cache.empty():
        if isinstance(cache, BatchQuantizedKVCache):
            return QuantizedKVCache(cache.group_size, cache.bits)
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
        assert isinstance(cache, (KVCache, QuantizedKVCache)) and cache.offset >= n, type(cache).__name__
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
    return [{name: held(v) for name, v in vars(c).items()} for c in caches]


def held(v):
    """A new reference to an array (or a quantized cache's triple of them); a copy of anything else."""
    if isinstance(v, tuple) and v and isinstance(v[0], mx.array):
        return tree_map(mx.array, v)
    return mx.array(v) if isinstance(v, mx.array) else copy.copy(v)


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
        keys, values = tree_map(lambda v: v[..., : cache.offset, :], (cache.keys, cache.values))
        out = QuantizedKVCache(cache.group_size, cache.bits) if isinstance(cache, QuantizedKVCache) else KVCache()
    out.keys, out.values = tree_map(mx.array, (keys, values))
    out.offset = cache.offset
    return out


def entry_key(tokens: Sequence[int]) -> str:
    """An entry's name on disk: the chain hash of its token blocks (disk_cache.chain_hashes), then
    of the tokens after the last whole block (so two entries sharing their blocks differ)."""
    tokens = np.asarray(tokens, dtype="<i4")
    blocks = chain_hashes(tokens)
    tail = tokens[len(blocks) * BLOCK:]
    return hashlib.blake2b((blocks[-1] if blocks else "").encode() + tail.tobytes(), digest_size=16).hexdigest()


def whole_log(kv: KV, window, log_start: int = 0) -> KV:
    """A sliding layer's log (of positions from `log_start`) completed by its compact window
    (the window holds its newest tokens)."""
    start = window.offset - window.keys.shape[2] - log_start
    return tuple(mx.concatenate([a[..., :start, :], b], axis=2) for a, b in zip(kv, (window.keys, window.values)))


def window_at(kv: KV, tokens: int, window: int, log_start: int = 0) -> RotatingKVCache:
    """A sliding-window cache at position `tokens`, from a layer's unrotated keys and values of
    positions from `log_start` (as compact() leaves one: its last min(tokens, window)
    positions, in order)."""
    held = min(tokens, window)
    assert tokens - held >= log_start, "a window is rebuilt only from positions its log holds"
    out = RotatingKVCache(window)
    out.keys, out.values = (a[..., tokens - held - log_start:tokens - log_start, :] for a in kv)
    out.offset, out._idx = tokens, held
    return out


def cut(entry, tokens: int):
    """A new cache from a compact one, at its first `tokens` tokens. Its arrays are
    new slices: the cache's in-place updates then copy, never write into the entry."""
    drop = entry.offset - tokens
    if drop and not entry.is_trimmable():
        raise ValueError(f"a wrapped sliding-window cache cannot be cut from {entry.offset} to {tokens} tokens")
    held = tree_flatten(entry.keys)[0][1].shape[2] - drop
    out = copy.copy(entry)
    out.keys, out.values = tree_map(lambda a: a[..., :held, :], (entry.keys, entry.values))
    out.offset = tokens
    if isinstance(out, RotatingKVCache):
        out._idx = held
    return out
