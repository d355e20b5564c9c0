"""Where a prefix cache plugs into the batcher (prefix_cache.py implements it)."""

from .sequence import Sequence


class PrefixHooks:
    """Where a prefix cache plugs in; these defaults do nothing."""

    def restore(self, seq: Sequence) -> None:
        """At admission, before `seq` is batched: may fill `seq.slot` on every rank
        with the caches of a cached prefix of its prompt and drop those tokens from
        `seq.unsent` (leaving one at least: the last prompt token gives the first
        token). The batch's prefill then starts from that history."""

    def snapshot(self, seq: Sequence, slot: int, row: int) -> None:
        """`seq` has finished; row `row` of `slot` still holds its caches (its prompt
        and the tokens drawn since, `seq.sampled`: all, or all but the last, as the
        lookahead may have fed it) until right after this call."""

    def prefilled(self, seq: Sequence, slot: int, row: int) -> None:
        """`seq` has its first token and goes on decoding; row `row` of `slot` holds
        its whole prompt."""
