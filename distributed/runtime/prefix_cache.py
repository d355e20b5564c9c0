"""The prefix cache: KV caches kept across requests, so a prompt that extends an
earlier one (a chat's next turn, a shared system prompt) prefills only the rest.

Distributed like the KV cache: rank 0 keeps the index (prefix_index.py: token
prefix -> entry, LRU, bounded in bytes) and every rank keeps its layers' slice
of each entry (caches.py), through ring ops that need no reply (pipeline.py: snapshot,
restore, evict). As in mlx-lm's server (LRUPromptCache) an entry is stored when
a sequence finishes (prompt and the generated tokens fed through the model) and
once it holds its whole prompt (so a chat's next turn hits, and the same prompt
again where the entry can be cut, see below). A hit restores the entry into the
new sequence's slot, cut to the common prefix if it can be (a shared system
prompt); at least the prompt's last token is always computed.

A sliding-window layer's cache that has wrapped (entry of `window` tokens or
more) cannot be cut back, so such an entry serves only prompts that extend all
of its tokens; an entry shorter than the window (or a model without sliding
layers) can be cut to any common prefix (mlx-lm's can_trim_prompt_cache).
"""

from typing import List, Sequence

import numpy as np

from .pipeline import Pipeline
from .prefix_index import Entry, PrefixIndex

DEFAULT_SHARE = 4  # the default budget: 1/DEFAULT_SHARE of the tightest rank's memory beside its weights


def default_budget(free_bytes: Sequence[int]) -> int:
    """Bytes for the prefix cache when --prefix-cache-bytes is not given, from each
    rank's memory left beside its weights (shard.kv_budget's free_bytes): a quarter
    of the tightest rank's."""
    return max(0, min(free_bytes) // DEFAULT_SHARE)


class PrefixCache:
    """The batcher's prefix hooks (prefix_hooks.PrefixHooks; budget 0: nothing, the cache
    is off): restore() at admission (look up, restore into the sequence's slot),
    prefilled() once a row holds its whole prompt and snapshot() when it finishes
    (store what it was fed)."""

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

    def restore(self, seq) -> None:
        """At admission, before `seq` is batched: restore the best entry into its slot
        (its prompt then starts after the entry's tokens; the last prompt token is
        always left to compute)."""
        if not self.enabled:
            return
        prompt = np.array(seq.fed_prompt, dtype=np.int32)
        entry, tokens = self.index.find(prompt)
        self.lookups += 1
        self.prompt_tokens += len(prompt)
        if entry is not None:
            self.pipeline.restore(seq.slot, entry.id, tokens)
            seq.unsent = seq.fed_prompt[tokens:]
            seq.cached_tokens = tokens
            self.hits += 1
            self.cached_tokens += tokens

    def store_row(self, seq, slot: int, row: int) -> None:
        """Store what row `row` of `slot` (`seq`) was fed: its prompt and the tokens
        drawn since (all, or all but the last: the batcher's lookahead may have fed
        it already); before the row is filtered out."""
        if not self.enabled:
            return
        fed = self.pipeline.caches.length(slot, row)
        tokens = list(seq.request.prompt_ids) + seq.sampled  # sampled starts with any resumed tokens
        if fed <= len(tokens):
            self.store(slot, row, tokens[:fed])

    snapshot = prefilled = store_row  # the batcher's two store points

    def summary(self) -> str:
        if not self.enabled:
            return "prefix cache: off"
        return (f"prefix cache: {len(self.index.entries)} entries, {max(self.index.bytes) / 2**20:.1f} MiB on the "
                f"fullest rank (budget {self.budget / 2**20:.1f} MiB); {self.hits} of {self.lookups} prompts hit, "
                f"{self.cached_tokens} of {self.prompt_tokens} prompt tokens reused; "
                f"{self.stored} entries stored, {self.evicted} evicted")

    # -- storing --------------------------------------------------------------

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
