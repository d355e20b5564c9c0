"""The prefix cache: KV caches kept across requests, so a prompt that extends an
earlier one (a chat's next turn, a shared system prompt) prefills only the rest.

Distributed like the KV cache: rank 0 keeps the index (token prefix -> entry,
LRU, bounded in bytes) and every rank keeps its layers' slice of each entry
(caches.py), through ring ops that need no reply (pipeline.py: snapshot,
restore, evict). As in mlx-lm's server (LRUPromptCache) an entry is stored when
a sequence finishes (prompt and the generated tokens fed through the model) and
at the end of its prompt (all but the last token, so the same prompt again, or
any extension of it, hits); also where its prompt stops agreeing with an entry
or a waiting prompt (a shared system prompt). A hit restores the entry into the
new sequence's slot; at least the prompt's last token is always computed.

A sliding-window layer's cache that has wrapped (entry of `window` tokens or
more) cannot be cut back, so such an entry serves only prompts that extend all
of its tokens; an entry shorter than the window (or a model without sliding
layers) can be cut to any common prefix (mlx-lm's can_trim_prompt_cache).
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .pipeline import Pipeline

MIN_SHARED_GAIN = 32  # tokens: a prompt's agreement with others worth an entry of its own
DEFAULT_SHARE = 4  # the default budget: 1/DEFAULT_SHARE of the tightest rank's memory beside its weights


def default_budget(free_bytes: Sequence[int]) -> int:
    """Bytes for the prefix cache when --prefix-cache-bytes is not given, from each
    rank's memory left beside its weights (shard.kv_budget's free_bytes): a quarter
    of the tightest rank's."""
    return max(0, min(free_bytes) // DEFAULT_SHARE)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclass
class Entry:
    id: int
    tokens: np.ndarray  # the tokens its caches cover
    trimmable: bool  # can be cut to a shorter prefix
    nbytes: List[int]  # what each rank keeps


class PrefixIndex:
    """Rank 0's index: entries by token prefix, least recently used first, bounded
    so that no rank keeps more than `budget` bytes of entries."""

    def __init__(self, budget: int, ranks: int):
        self.budget = budget
        self.entries: "OrderedDict[int, Entry]" = OrderedDict()
        self.bytes = [0] * ranks  # per rank

    def find(self, prompt: np.ndarray) -> Tuple[Optional[Entry], int]:
        """The entry that saves the most of `prompt`, and how many tokens it covers
        (at most all but the last prompt token); (None, 0) if none helps."""
        best, best_tokens = None, 0
        for entry in self.entries.values():
            common = common_prefix(entry.tokens, prompt)
            if common == len(entry.tokens) < len(prompt):
                tokens = common  # the whole entry, as it is
            elif entry.trimmable:
                tokens = min(common, len(prompt) - 1)
            else:
                continue
            if tokens > best_tokens:
                best, best_tokens = entry, tokens
        if best is not None:
            self.entries.move_to_end(best.id)
        return best, best_tokens

    def shared(self, prompt: np.ndarray, others: Iterable[np.ndarray]) -> int:
        """The longest prefix `prompt` has in common with an entry or another prompt."""
        tokens = [e.tokens for e in self.entries.values()] + list(others)
        return max((common_prefix(t, prompt) for t in tokens), default=0)

    def covered(self, tokens: np.ndarray) -> bool:
        """An entry already serves whatever one for `tokens` would (the same tokens,
        or a trimmable entry that extends them); it counts as used."""
        for entry in self.entries.values():
            same = common_prefix(entry.tokens, tokens) == len(tokens)
            if same and (len(entry.tokens) == len(tokens) or entry.trimmable):
                self.entries.move_to_end(entry.id)
                return True
        return False

    def insert(self, entry: Entry) -> List[int]:
        """Add `entry` (most recently used); returns the ids of the entries dropped:
        those it makes useless (it is trimmable and extends them), then the least
        recently used while a rank is over budget."""
        dropped = []
        if entry.trimmable:
            dropped = [e.id for e in self.entries.values()
                       if common_prefix(e.tokens, entry.tokens) == len(e.tokens) <= len(entry.tokens)]
        for entry_id in dropped:
            self._remove(entry_id)
        self.entries[entry.id] = entry
        self.bytes = [a + b for a, b in zip(self.bytes, entry.nbytes)]
        while max(self.bytes) > self.budget and len(self.entries) > 1:
            dropped.append(self._remove(next(iter(self.entries))))
        return dropped

    def _remove(self, entry_id: int) -> int:
        entry = self.entries.pop(entry_id)
        self.bytes = [a - b for a, b in zip(self.bytes, entry.nbytes)]
        return entry_id


class PrefixCache:
    """What the batcher calls (budget 0: nothing, the cache is off):
    begin_prefill() before a sequence's first prompt chunk (look up, restore, plan
    where to store), chunk_limit() and after_chunk() around each chunk (store at the
    planned points), finished() when a sequence in a group ends (store it)."""

    def __init__(self, pipeline: Pipeline, budget: int = 0):
        self.pipeline, self.budget = pipeline, budget
        self.enabled = budget > 0
        args = pipeline.stage.args
        self.sliding = [t == "sliding_attention" for t in args.layer_types]
        self.window = args.sliding_window
        self.ranges = [r["layers"] for r in pipeline.rank_info()] if self.enabled else []
        self.index = PrefixIndex(budget, len(self.ranges))
        self._next_id = 0
        # Counters for the summary: prompts looked up, hits, their tokens, tokens restored.
        self.lookups = self.hits = self.prompt_tokens = self.cached_tokens = 0
        self.stored = self.evicted = 0

    # -- hooks ----------------------------------------------------------------

    def begin_prefill(self, seq, waiting: Sequence) -> None:
        """Before `seq`'s first prompt chunk: restore the best entry into its slot (its
        prompt then starts after the entry's tokens) and plan where to store entries.
        Called at every chunk; acts once. Late, not on admission, so that prompts
        ahead of it in the queue have stored their entries."""
        if not self.enabled or seq.store_at is not None:
            return
        prompt = np.array(seq.request.prompt_ids, dtype=np.int32)
        entry, tokens = self.index.find(prompt)
        self.lookups += 1
        self.prompt_tokens += len(prompt)
        if entry is not None:
            self.pipeline.restore(seq.slot, entry.id, tokens)
            seq.unsent = seq.request.prompt_ids[tokens:]
            seq.cached_tokens = tokens
            self.hits += 1
            self.cached_tokens += tokens
        others = [np.array(s.request.prompt_ids, dtype=np.int32) for s in waiting if s is not seq]
        shared = min(self.index.shared(prompt, others), len(prompt) - 1)
        points = [shared] if shared - tokens >= MIN_SHARED_GAIN else []
        seq.store_at = sorted({p for p in points + [len(prompt) - 1] if p > tokens})

    def chunk_limit(self, seq) -> int:
        """The most tokens `seq`'s next prompt chunk may take: it ends at the next store point."""
        if not self.enabled or not seq.store_at:
            return 1 << 31
        return seq.store_at[0] - self._fed(seq)

    def after_chunk(self, seq, slot: Optional[int] = None, row: int = 0) -> None:
        """After a prompt chunk was sent: store `seq` if it reached a store point. It is
        in its own slot, or row `row` of `slot` (prompts prefilled as one batch)."""
        fed = self._fed(seq)
        if self.enabled and seq.store_at and seq.store_at[0] == fed:
            seq.store_at.pop(0)
            self.store(seq.slot if slot is None else slot, row, seq.request.prompt_ids[:fed])

    def finished(self, seq, slot: int, row: int) -> None:
        """`seq`, row `row` of group `slot`, ends: store what it was fed (its prompt
        and the generated tokens but the last), before the row is filtered out."""
        if not self.enabled:
            return
        fed = self.pipeline.caches.length(slot, row)
        tokens = list(seq.request.prompt_ids) + seq.generated
        if fed <= len(tokens):
            self.store(slot, row, tokens[:fed])

    def summary(self) -> str:
        if not self.enabled:
            return "prefix cache: off"
        return (f"prefix cache: {len(self.index.entries)} entries, {max(self.index.bytes) / 2**20:.1f} MiB on the "
                f"fullest rank (budget {self.budget / 2**20:.1f} MiB); {self.hits} of {self.lookups} prompts hit, "
                f"{self.cached_tokens} of {self.prompt_tokens} prompt tokens reused; "
                f"{self.stored} entries stored, {self.evicted} evicted")

    # -- storing --------------------------------------------------------------

    def _fed(self, seq) -> int:
        return len(seq.request.prompt_ids) - len(seq.unsent)

    def store(self, slot: int, row: int, tokens: List[int]) -> None:
        """Keep row `row` of `slot`, which has been fed `tokens`, as an entry (unless
        one serves as well already, or it exceeds the budget), evicting as needed."""
        tokens = np.array(tokens, dtype=np.int32)
        if len(tokens) == 0 or self.index.covered(tokens):
            return
        entry_id = self._next_id
        self._next_id = (self._next_id + 1) % (1 << 31)
        fed, nbytes = self.pipeline.snapshot(slot, entry_id, row)
        assert fed == len(tokens), f"the slot holds {fed} tokens, expected {len(tokens)}"
        per_rank = self.entry_bytes(len(tokens), nbytes)
        if max(per_rank) > self.budget:
            self.pipeline.evict([entry_id])
            return
        trimmable = not any(self.sliding) or len(tokens) < self.window
        dropped = self.index.insert(Entry(entry_id, tokens, trimmable, per_rank))
        self.pipeline.evict(dropped)
        self.stored += 1
        self.evicted += len(dropped)

    def entry_bytes(self, tokens: int, rank0_bytes: int) -> List[int]:
        """What each rank keeps for an entry of `tokens` tokens: rank 0's measured
        bytes, scaled by the tokens each rank's layers hold (a sliding layer at most
        its window)."""
        held = [sum(min(tokens, self.window) if self.sliding[layer] else tokens for layer in range(start, end))
                for start, end in self.ranges]
        return [rank0_bytes * h // held[0] for h in held]
