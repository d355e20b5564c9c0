"""The prefix cache: KV caches kept across requests, so a prompt that extends an
earlier one (a chat's next turn, a shared system prompt) prefills only the rest.

Distributed like the KV cache: rank 0 keeps the index (PrefixIndex: token
prefix -> entry, LRU, bounded in bytes) and every rank keeps its layers' slice
of each entry (caches.py), through ring ops that need no reply (pipeline.py: snapshot,
restore, evict). As in mlx-lm's server (LRUPromptCache) an entry is stored when
a sequence finishes (prompt and the generated tokens fed through the model) and
once it holds its whole prompt (so a chat's next turn hits, and the same prompt
again where the entry can be cut, see below). A hit restores the entry into the
new sequence's slot, cut to the common prefix if it can be (a shared system
prompt); at least the prompt's last token is always computed.

Trinity is a hybrid model: a sliding-window layer's cache that has wrapped (more
tokens than the window) has lost the keys before its window, and cannot be cut
back. So a prompt longer than the window is recorded (Op.RECORD, caches.Log): the
keys and values its frames bring to the sliding layers are kept unrotated, and its
entries keep them (caches.Stored), from which a window at any earlier position is
rebuilt. Such an entry can be cut to any common prefix with a new prompt (a new agent
session after the same system prompt and tools, a rewritten last message, the same
prompt again), whatever followed; each entry says how far (`cuttable`: the tokens
logged, all of them but those a long reply decoded past its window). The cost: an
entry holds every token on every layer, as a model without sliding layers would;
a prompt whose entry would not fit the budget so is not recorded, and its entries
serve only prompts that extend them whole, as before. An entry shorter than the
window (or a model without sliding layers) can be cut anywhere as it is.

Rank 0's index (PrefixIndex) finds the stored entry that saves the most of a prompt:
a radix tree over the entries' tokens, as SGLang's RadixCache keeps its prefixes:
each node holds a run of tokens that every entry below it shares, so a lookup walks
the prompt once, one node per branching point, whatever the number of entries.
Each node keeps the largest `cuttable` of the entries at and below it, so an entry that
can be cut to the common prefix is found without searching the subtree. (mlx-lm's PromptTrie,
a node per token, searches the subtree for a longer entry; it serves a handful of
entries. This index holds as many as the byte budget allows, thousands; scanning
them all cost rank 0 tens of ms per request.)

The entries themselves are kept least recently used first, bounded so that no rank
keeps more than `budget` bytes of them.
"""

from collections import OrderedDict
from dataclasses import dataclass
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from .disk_cache import BLOCK
from .caches import Stored
from .pipeline import Pipeline
from .sequence import Sequence


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclass
class Entry:
    id: int
    tokens: np.ndarray  # the tokens its caches cover
    cuttable: int  # it can be cut to any prefix of at most this many tokens (caches.Stored.cut)...
    nbytes: List[int]  # what each rank keeps
    lowest: int = 0  # ... and at least this many (caches.Stored.lowest: its logs start late)

    def cuts_to(self, tokens: int) -> bool:
        return self.lowest <= tokens <= self.cuttable


class Node:
    __slots__ = ("run", "parent", "children", "entry", "cuttable")

    def __init__(self, run: np.ndarray, parent: Optional["Node"]):
        self.run = run  # the tokens from the parent's end to this node's end
        self.parent = parent
        self.children: Dict[int, "Node"] = {}  # by the first token of the child's run
        self.entry: Optional[Entry] = None  # the entry whose tokens end here
        self.cuttable = -1  # the largest cuttable of the entries here and below (-1: none)


class PrefixIndex:
    """Entries by token prefix, least recently used first, bounded so that no rank
    keeps more than `budget` bytes of entries."""

    def __init__(self, budget: int, ranks: int):
        self.budget = budget
        self.entries: "OrderedDict[int, Entry]" = OrderedDict()
        self.bytes = [0] * ranks  # per rank
        self._root = Node(np.zeros(0, dtype=np.int32), None)
        self._nodes: Dict[int, Node] = {}  # entry id -> the node it ends at

    def find(self, prompt: np.ndarray) -> Tuple[Optional[Entry], int]:
        """The entry that saves the most of `prompt`, and how many tokens it covers
        (at most all but the last prompt token); (None, 0) if none helps. An entry
        serves whole if it is a prefix of those tokens, or cut to their common prefix
        as far as it can be cut."""
        wanted = prompt[:-1]
        path, matched, below = self._walk(wanted)
        best, best_tokens = None, 0
        for node, depth in path:  # entries that are prefixes of the prompt: the deepest
            if node.entry is not None:
                best, best_tokens = node.entry, depth
        # Every entry below a node shares the node's depth with the prompt: cut there, as far
        # as the node's best entry can be cut. Below the walk's end they share all it matched.
        for node, depth in [(below, matched)] + path[::-1]:
            if node is not None and min(depth, node.cuttable) > best_tokens:
                entry = self._cuttable_under(node, min(depth, node.cuttable))
                if entry is not None:
                    best, best_tokens = entry, min(depth, node.cuttable)
        if best is not None:
            self.entries.move_to_end(best.id)
        return best, best_tokens

    def covered(self, tokens: np.ndarray) -> bool:
        return self.covering(tokens) is not None

    def covering(self, tokens: np.ndarray) -> Optional[Entry]:
        """An entry that already serves whatever one for `tokens` would (the same tokens,
        or one that extends them and can be cut to them), or None; it counts as used."""
        path, matched, below = self._walk(tokens)
        if matched < len(tokens):
            return None
        end = below or (path[-1][0] if path else self._root)
        entry = end.entry if below is None else None  # the same tokens
        if entry is None and end.cuttable >= len(tokens):
            entry = self._cuttable_under(end, len(tokens))  # or None: those below start cutting later
        if entry is not None:
            self.entries.move_to_end(entry.id)
        return entry

    def insert(self, entry: Entry) -> List[int]:
        """Add `entry` (most recently used); returns the ids of the entries dropped:
        those it makes useless (the same tokens; those it extends and can be cut to, as
        far back), then the least recently used while a rank is over budget; or only its
        own where one of the same tokens is cut further back."""
        node, path = self._make_path(entry.tokens)
        if node.entry is not None and node.entry.lowest < entry.lowest:  # the one there is cut further back
            return [entry.id]
        dropped = [node.entry.id] if node.entry is not None else []
        dropped += [n.entry.id for n in path[:-1]
                    if n.entry is not None and entry.cuts_to(len(n.entry.tokens)) and entry.lowest <= n.entry.lowest]
        for entry_id in dropped:
            self._remove(entry_id)
        if dropped:  # removing may have pruned or merged nodes on the way
            node, _ = self._make_path(entry.tokens)
        node.entry = entry
        self._nodes[entry.id] = node
        self._recount(node)
        self.entries[entry.id] = entry
        self.bytes = [a + b for a, b in zip(self.bytes, entry.nbytes)]
        while max(self.bytes) > self.budget and len(self.entries) > 1:
            dropped.append(self._remove(next(iter(self.entries))))
        return dropped

    def remove(self, entry_id: int) -> None:
        if entry_id in self.entries:
            self._remove(entry_id)

    # -- the tree ---------------------------------------------------------------

    def _walk(self, tokens: np.ndarray) -> Tuple[List[Tuple[Node, int]], int, Optional[Node]]:
        """Follow `tokens` down the tree: the nodes passed whole with the depth at their
        end, the tokens matched, and the node whose run the walk stopped inside (its
        entries share `matched` tokens), or None if it stopped at a node's end."""
        node, depth, path = self._root, 0, []
        while depth < len(tokens):
            child = node.children.get(int(tokens[depth]))
            if child is None:
                return path, depth, None
            n = common_prefix(child.run, tokens[depth:])
            if n < len(child.run):
                return path, depth + n, child
            node, depth = child, depth + n
            path.append((node, depth))
        return path, depth, None

    def _make_path(self, tokens: np.ndarray) -> Tuple[Node, List[Node]]:
        """The node where `tokens` end, splitting or adding nodes as needed, and the
        nodes on the way (root excluded, that one included)."""
        node, depth, path = self._root, 0, []
        while depth < len(tokens):
            key = int(tokens[depth])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = Node(tokens[depth:].copy(), node)
            n = common_prefix(child.run, tokens[depth:])
            if n < len(child.run):  # split the run: a node for the shared part above it
                upper = Node(child.run[:n].copy(), node)
                upper.cuttable = child.cuttable
                child.run, child.parent = child.run[n:].copy(), upper
                upper.children[int(child.run[0])] = child
                node.children[key] = child = upper
            node, depth = child, depth + n
            path.append(node)
        return node, path

    def _recount(self, node: Optional[Node]) -> None:
        """Each node's cuttable from its entry and children, from `node` up to the root."""
        while node is not None:
            own = node.entry.cuttable if node.entry is not None else -1
            node.cuttable = max([own] + [c.cuttable for c in node.children.values()])
            node = node.parent

    def _cuttable_under(self, node: Node, tokens: int) -> Optional[Entry]:
        """An entry at or below `node` that can be cut to `tokens`, or None. The nodes' cuttable
        leads the search; an entry whose logs start late (Entry.lowest) may still refuse."""
        todo = [node]
        while todo:
            node = todo.pop()
            if node.entry is not None and node.entry.cuts_to(tokens):
                return node.entry
            todo += [c for c in node.children.values() if c.cuttable >= tokens]
        return None

    def _remove(self, entry_id: int) -> int:
        entry = self.entries.pop(entry_id)
        self.bytes = [a - b for a, b in zip(self.bytes, entry.nbytes)]
        node = self._nodes.pop(entry_id)
        node.entry = None
        # Drop the nodes nothing needs now, and merge a run into its only child.
        while node is not self._root and node.entry is None and not node.children:
            del node.parent.children[int(node.run[0])]
            node = node.parent
        if node is not self._root and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()
            child.run, child.parent = np.concatenate([node.run, child.run]), node.parent
            node.parent.children[int(child.run[0])] = child
            node = child
        self._recount(node)
        return entry_id


class PrefixHooks:
    """Where a prefix cache plugs in; these defaults do nothing."""

    def restore(self, seq: Sequence, settle: Callable[[], None] = lambda: None) -> None:
        """At admission, before `seq` is batched: may fill `seq.slot` on every rank
        with the caches of a cached prefix of its prompt and drop those tokens from
        `seq.unsent` (leaving one at least: the last prompt token gives the first
        token). The batch's prefill then starts from that history. `settle()` takes
        every reply the ring owes (before an exchange that waits for its own)."""

    def snapshot(self, rows: List[Tuple[Sequence, int]], slot: int) -> None:
        """Each (seq, row) of `rows` has finished; row `row` of `slot` still holds its caches
        (its prompt and the tokens drawn since, `seq.sampled`: all, or all but the last, as
        the lookahead may have fed it) until right after this call."""

    def prefilled(self, rows: List[Tuple[Sequence, int]], slot: int) -> None:
        """Each (seq, row) of `rows` has its first token and goes on decoding; row `row` of
        `slot` holds its whole prompt."""


# Entries of fewer tokens are not written to disk (their prefill costs less than a file), and a disk
# entry is read only where it restores this many tokens more than RAM does.
DISK_MIN_TOKENS = BLOCK
DEFAULT_SHARE = 4  # the default budget: 1/DEFAULT_SHARE of the tightest rank's memory beside its weights


def default_budget(free_bytes: List[int]) -> int:
    """Bytes for the prefix cache when --prefix-cache-bytes is not given, from each
    rank's memory left beside its weights (shard.memory.kv_budget's free_bytes): a quarter
    of the tightest rank's."""
    return max(0, min(free_bytes) // DEFAULT_SHARE)


class PrefixCache(PrefixHooks):
    """The batcher's prefix hooks (PrefixHooks; budget 0: nothing, the cache
    is off): restore() at admission (look up, restore into the sequence's slot),
    prefilled() once a row holds its whole prompt and snapshot() when it finishes
    (store what it was fed)."""

    def __init__(self, pipeline: Pipeline, budget: int = 0):
        self.pipeline, self.budget = pipeline, budget
        self.enabled = budget > 0
        args = pipeline.stage.args
        self.sliding = [t == "sliding_attention" for t in args.layer_types]
        self.window = args.sliding_window
        # A layer's keys and values of one token, at most (a tensor share holds less): what a log costs.
        head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
        self.token_bytes = 2 * args.num_key_value_heads * head_dim * pipeline.stage.norm.weight.dtype.size
        self.ranges = [r["layers"] for r in pipeline.rank_info()] if self.enabled else []
        self.index = PrefixIndex(budget, len(self.ranges))
        self._next_id = 0
        # Counters for the summary: prompts looked up, hits, their tokens, tokens restored.
        self.lookups = self.hits = self.prompt_tokens = self.cached_tokens = 0
        self.stored = self.evicted = 0
        # The disk tier (caches.SlotCaches.disk, every rank's own): rank 0's index of what it holds,
        # which the other ranks confirm at each load (Pipeline.load: on every rank or on none).
        self.disk = pipeline.caches.disk if self.enabled else None
        self.disk_index = PrefixIndex(1 << 62, 1)
        self._disk_keys: Dict[int, np.ndarray] = {}
        self._disk_next = 0
        self.disk_hits = self.disk_failed = self.disk_tokens = self.disk_written = 0
        self.disk_seconds = 0.0
        for tokens, meta in (self.disk.listing() if self.disk is not None else ()):
            self._disk_indexed(tokens, int(meta.get("logged", 0)), int(meta.get("log_start", 0)))

    # -- hooks ----------------------------------------------------------------

    def restore(self, seq, settle: Callable[[], None] = lambda: None) -> None:
        """At admission, before `seq` is batched: restore the best entry into its slot
        (its prompt then starts after the entry's tokens; the last prompt token is
        always left to compute), read from disk first where that saves more."""
        if not self.enabled:
            return
        prompt = np.array(seq.fed_prompt, dtype=np.int32)
        entry, tokens = self.index.find(prompt)
        on_disk, disk_tokens = self.disk_index.find(prompt) if self.disk is not None else (None, 0)
        if on_disk is not None and disk_tokens >= tokens + DISK_MIN_TOKENS and self._load(on_disk, disk_tokens, settle):
            entry, tokens = self.index.find(prompt)
            seq.disk_tokens = tokens
            self.disk_tokens += tokens
        self.lookups += 1
        self.prompt_tokens += len(prompt)
        if entry is not None:
            self.pipeline.restore(seq.slot, entry.id, tokens)
            seq.unsent = seq.fed_prompt[tokens:]
            seq.cached_tokens = tokens
            self.hits += 1
            self.cached_tokens += tokens
        if self._records(len(prompt)) and (entry is None or entry.cuts_to(tokens)):
            self.pipeline.record(seq.slot, -1 if entry is None else entry.id, tokens)

    def _records(self, tokens: int) -> bool:
        """Whether a prompt of `tokens` is logged (caches.Log) so that its entries can be cut
        anywhere: where it wraps a window, and its entry, every layer holding every token,
        fits the budget on the fullest rank."""
        if not any(self.sliding) or tokens <= self.window:
            return False
        layers = max(end - start for start, end in self.ranges)
        return layers * tokens * self.token_bytes <= self.budget

    def store_rows(self, rows: List[Tuple[Sequence, int]], slot: int, to_disk: bool = False) -> None:
        """Store what each (seq, row) of `rows` of `slot` was fed: its prompt and the tokens
        drawn since (all, or all but the last: the batcher's lookahead may have fed
        it already); before the rows are filtered out. `to_disk`: written to the disk
        tier too."""
        if not self.enabled or not rows:
            return
        fed = self.pipeline.caches.lengths(slot)
        drawn = [(list(seq.request.prompt_ids) + seq.sampled, row) for seq, row in rows]  # sampled: resumed first
        self.store([(tokens[:fed[row]], row) for tokens, row in drawn if fed[row] <= len(tokens)], slot, to_disk)

    prefilled = store_rows  # the batcher's two store points

    def snapshot(self, rows: List[Tuple[Sequence, int]], slot: int) -> None:
        """A finished sequence is also written to disk: what it was fed serves whatever its prompt
        alone would (it can be cut anywhere), so each request writes one entry, not two."""
        self.store_rows(rows, slot, to_disk=True)

    def summary(self) -> str:
        if not self.enabled:
            return "prefix cache: off"
        return (f"prefix cache: {len(self.index.entries)} entries, {max(self.index.bytes) / 2**20:.1f} MiB on the "
                f"fullest rank (budget {self.budget / 2**20:.1f} MiB); {self.hits} of {self.lookups} prompts hit, "
                f"{self.cached_tokens} of {self.prompt_tokens} prompt tokens reused; "
                f"{self.stored} entries stored, {self.evicted} evicted" + self._disk_summary())

    def _disk_summary(self) -> str:
        if self.disk is None:
            return "; disk tier off"
        return (f"; disk tier: {self.disk_hits} loads ({self.disk_tokens} tokens, {self.disk_seconds:.2f} s), "
                f"{self.disk_failed} not on every rank, {self.disk_written} entries written")

    # -- storing --------------------------------------------------------------

    def store(self, rows: List[Tuple[List[int], int]], slot: int, to_disk: bool = False) -> None:
        """Keep each (tokens, row) of `rows`, row `row` of `slot` having been fed `tokens`, as an
        entry (unless one serves as well already, or it exceeds the budget), evicting as needed.
        The rows are copied in one op on every rank; one that an entry stored just before it
        covers (the same prompt twice) is dropped again."""
        wanted = [(np.array(tokens, dtype=np.int32), row) for tokens, row in rows if tokens]
        fresh = []
        for tokens, row in wanted:
            covering = self.index.covering(tokens)
            if covering is None:
                fresh.append((tokens, row, self._new_id()))
            elif to_disk:
                self._write(covering)
        kept = self.pipeline.snapshot(slot, [(entry_id, row) for _, row, entry_id in fresh]) if fresh else []
        for (tokens, _, entry_id), (fed, nbytes, logged, log_start) in zip(fresh, kept):
            assert fed == len(tokens), f"the slot holds {fed} tokens, expected {len(tokens)}"
            self._keep(entry_id, tokens, logged, log_start, nbytes, to_disk)

    def _keep(self, entry_id: int, tokens: np.ndarray, logged: int, log_start: int, nbytes: int,
              to_disk: bool) -> None:
        """Index a snapshot every rank holds (or drop it: over the budget, or covered by now)."""
        per_rank = self.entry_bytes(len(tokens), logged - log_start, nbytes)
        covering = self.index.covering(tokens)
        if max(per_rank) > self.budget or covering is not None:
            self.pipeline.evict([entry_id])
            if covering is not None and to_disk:
                self._write(covering)
            return
        entry = self._entry(entry_id, tokens, logged, log_start, per_rank)
        if to_disk:
            self._write(entry)
        dropped = self.index.insert(entry)
        self.pipeline.evict(dropped)
        self.stored += 1
        self.evicted += len(dropped)

    def _entry(self, entry_id: int, tokens: np.ndarray, logged: int, log_start: int, nbytes: List[int]) -> Entry:
        if not any(self.sliding) or len(tokens) < self.window:
            return Entry(entry_id, tokens, len(tokens), nbytes)
        return Entry(entry_id, tokens, logged, nbytes, Stored.lowest(log_start, self.window))

    # -- the disk tier --------------------------------------------------------

    def _write(self, entry: Entry) -> None:
        """Have every rank write `entry` to its disk, unless a disk entry serves as well already."""
        if self.disk is None or len(entry.tokens) < DISK_MIN_TOKENS or self.disk_index.covered(entry.tokens):
            return
        self.pipeline.persist(entry.id, entry.tokens.tolist())
        stored = self.pipeline.caches.entries[entry.id]
        self._disk_indexed(entry.tokens, stored.logged, stored.log_start)
        self.disk_written += 1

    def _disk_indexed(self, tokens: np.ndarray, logged: int, log_start: int) -> None:
        """Index a disk entry, with how far it can be cut (on_disk's meta says; a file whose
        windows never wrapped is cut anywhere, as in RAM)."""
        entry_id = self._disk_next = self._disk_next + 1
        for dropped in self.disk_index.insert(self._entry(entry_id, tokens, logged, log_start, [0])):
            self._disk_keys.pop(dropped, None)
        self._disk_keys[entry_id] = tokens

    def _load(self, on_disk: Entry, tokens: int, settle: Callable[[], None]) -> bool:
        """Read the first `tokens` tokens of `on_disk` into RAM as a new entry on every rank
        (only what they need: caches.Stored.from_file); False (and forgotten) where a rank does
        not have it whole: no rank then keeps it."""
        settle()
        start = time.perf_counter()
        entry_id = self._new_id()
        ok = self.pipeline.load(entry_id, on_disk.tokens.tolist(), tokens)
        if ok:
            stored = self.pipeline.caches.entries[entry_id]
            per_rank = self.entry_bytes(tokens, stored.logged - stored.log_start, stored.nbytes)
            ok = max(per_rank) <= self.budget
        if not ok:
            self.pipeline.evict([entry_id])
            self.disk_index.remove(on_disk.id)
            self._disk_keys.pop(on_disk.id, None)
            self.disk_failed += 1
            return False
        entry = self._entry(entry_id, on_disk.tokens[:tokens], stored.logged, stored.log_start, per_rank)
        self.pipeline.evict(self.index.insert(entry))
        self.disk_hits += 1
        self.disk_seconds += time.perf_counter() - start
        return True

    def _new_id(self) -> int:
        entry_id = self._next_id
        self._next_id = (self._next_id + 1) % (1 << 31)
        return entry_id

    def entry_bytes(self, tokens: int, logged: int, rank0_bytes: int) -> List[int]:
        """What each rank keeps for an entry of `tokens` tokens, `logged` of them in its logs: rank
        0's measured bytes, scaled by the tokens each rank's layers hold (a sliding layer its
        window, at most, and the log)."""
        held = [sum(min(tokens, self.window) + logged if self.sliding[layer] else tokens
                    for layer in range(start, end)) for start, end in self.ranges]
        return [rank0_bytes * h // held[0] for h in held]
