"""How many prompt columns the next prefill chunk may carry under a memory budget.

Under --memory-limit or --max-context auto, a chunk's activations must fit half the margin the
plans leave on each rank (sizing.py). What a chunk allocates grows with the context it attends
to (its attention scores: rows x columns x the positions before it and its own), so the budget
is applied chunk by chunk, at that chunk's own context: a long prompt's early chunks stay as
long as --prefill-step-size allows and only the late ones shrink. Sized once at the longest
context instead, every chunk was as short as the last one may be: on an H200 under a 12 GiB
limit, 32-token chunks for Trinity-Mini's 131,072-token context, and a 2,048-token prompt took
38 s to prefill against 1.5 s without the limit.
"""

from ..shard.sizes import dtype_bytes, model_args
from .memory_guard import activation_bytes


class ChunkBudget:
    def __init__(self, config: dict, budget_bytes: int):
        self.args, self.itemsize, self.bytes = model_args(config), dtype_bytes(config), budget_bytes

    def activations(self, rows: int, columns: int, past: int) -> int:
        """What a chunk of `rows` x `columns` after `past` cached positions allocates, at most."""
        return activation_bytes(self.args, rows * columns, past + columns, self.itemsize)

    def columns(self, rows: int, past: int, most: int) -> int:
        """The longest chunk, up to `most` columns (1 at least), whose activations after `past`
        cached positions fit the budget."""
        return _longest(lambda n: self.activations(rows, n, past) <= self.bytes, most)

    def ending_at(self, context: int, most: int) -> int:
        """The longest one-row chunk that fits where it ends at `context` positions (the last
        chunk of a prompt that fills the context: the shortest a chunk gets)."""
        return _longest(lambda n: self.activations(1, n, max(0, context - n)) <= self.bytes, most)


def _longest(fits, most: int) -> int:
    """The largest n in [1, most] with fits(n) (1 if none): fits holds up to some n, not beyond."""
    lo, hi = 1, max(1, most)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
