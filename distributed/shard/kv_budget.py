"""How many sequences' KV caches fit beside the weights: the default --max-batch.

Each rank's usable memory (measured before loading, shared between the ranks of
one host), less a reserve and its weights, is what its KV caches may take. One
sequence costs its layers' caches at a target context (a sliding layer keeps at
most its window). The tightest rank bounds the batch; bytes set aside first (a
prefix cache) come out of every rank's share.
"""

from dataclasses import dataclass
from typing import List, Sequence

from .memory_plan import DEFAULT_MARGIN
from .sizes import model_sizes

DEFAULT_CONTEXT = 4096  # tokens per sequence the default batch size plans for
CACHE_STEP = 256  # mlx-lm's KVCache grows by this many tokens at a time
MAX_BATCH = 256  # beyond this a bigger batch buys nothing on the ring (and the queue holds the rest)


@dataclass
class KvBudget:
    max_batch: int
    context: int  # tokens per sequence planned for
    tightest_rank: int
    free_bytes: List[int]  # per rank: left for KV caches after the weights and the reserve
    sequence_bytes: List[int]  # per rank: one sequence's caches at `context`

    def describe(self) -> str:
        r = self.tightest_rank
        return (f"{self.max_batch} sequences of {self.context} tokens (rank {r}: "
                f"{self.free_bytes[r] / 2**30:.2f} GiB free for KV caches, "
                f"{self.sequence_bytes[r] / 2**20:.1f} MiB a sequence)")


def kv_budget(config: dict, ranks: Sequence[dict], memory_bytes: Sequence[int], context: int,
              set_aside_bytes: int = 0, margin: float = DEFAULT_MARGIN) -> KvBudget:
    """`ranks`: rows as in rank_info (`layers`, `parameter_bytes`); `memory_bytes`: each rank's
    usable memory before loading, in the same order."""
    sizes = model_sizes(config)
    free, per_sequence = [], []
    for row, memory in zip(ranks, memory_bytes):
        start, end = row["layers"]
        free.append(max(0, int(memory * (1 - margin)) - row["parameter_bytes"] - set_aside_bytes))
        per_sequence.append(max(1, sizes.cache_bytes(start, end, context)))
    fits = [f // s for f, s in zip(free, per_sequence)]
    tightest = min(range(len(fits)), key=fits.__getitem__)
    return KvBudget(max(1, min(MAX_BATCH, fits[tightest])), context, tightest, free, per_sequence)


@dataclass
class ContextFit:
    context: int  # tokens a sequence (prompt + generation)
    batch: int  # sequences planned for at once
    tightest_rank: int
    free_bytes: int  # on that rank: left for KV caches after the weights, the reserve and what was set aside

    def describe(self) -> str:
        return (f"{self.context} tokens for each of {self.batch} sequences (rank {self.tightest_rank}: "
                f"{self.free_bytes / 2**30:.2f} GiB free for KV caches)")


def longest_context(config: dict, ranks: Sequence[dict], memory_bytes: Sequence[int], batch: int, limit: int,
                    set_aside_bytes: int = 0, margin: float = DEFAULT_MARGIN) -> ContextFit:
    """`--max-context auto`: the longest context, up to `limit`, at which `batch` sequences'
    caches fit beside the weights on every rank (0: not even one token does)."""
    sizes = model_sizes(config)
    fits = []
    for row, memory in zip(ranks, memory_bytes):
        start, end = row["layers"]
        free = max(0, int(memory * (1 - margin)) - row["parameter_bytes"] - set_aside_bytes)
        lo, hi = 0, limit  # the answer is in [lo, hi]; cache bytes only grow with the context
        while lo < hi:
            mid = (lo + hi + 1) // 2
            allocated = -(-mid // CACHE_STEP) * CACHE_STEP
            lo, hi = (mid, hi) if batch * sizes.cache_bytes(start, end, allocated) <= free else (lo, mid - 1)
        fits.append((lo, free))
    tightest = min(range(len(fits)), key=lambda r: fits[r][0])
    return ContextFit(fits[tightest][0], batch, tightest, fits[tightest][1])
