"""A draft model for speculative decoding (--draft-model): a small AFMoE checkpoint that
shares the target's tokenizer, on rank 0 only, proposing its greedy continuation.

Each sequence that speculates has the draft's caches of its history. A proposal first
brings them to the sequence's history (trimming what the target rejected, feeding what
it accepted and drew), then runs K greedy steps as one lazy graph, evaluated once: the
draft's tokens need no host decision between steps, so K drafts cost one round trip to
the device, not K. Its caches are plain KVCaches for every layer (a sliding layer masks
to its window: mlx-lm's KVCache.make_mask with window_size), as those trim exactly at
any offset; a RotatingKVCache cannot take back single-token updates once it wraps.

Caches are kept for the few sequences that speculate (one-row groups, at most one per
rank), least recently used first out, so the draft's memory is bounded by that count.
"""

from collections import OrderedDict
from typing import List, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

FEED_CHUNK = 512  # history tokens per draft pass when catching up (a prompt): bounded activations


class DraftCaches:
    def __init__(self, layers: int):
        self.caches = [KVCache() for _ in range(layers)]
        self.tokens: List[int] = []  # what the caches hold, in order


class ModelDrafter:
    def __init__(self, stage, capacity: int = 1):
        self.stage = stage  # every layer of the draft, with its embedding and head
        self.capacity = max(1, capacity)
        self.states: "OrderedDict[object, DraftCaches]" = OrderedDict()  # by sequence, least recent first

    def propose(self, seq, k: int, after: Sequence[int] = ()) -> List[int]:
        """The draft's greedy continuation (k tokens) of the sequence's history and `after`."""
        history = list(seq.request.prompt_ids) + seq.generated + list(after)
        state = self._state(seq)
        keep = min(common_prefix(state.tokens, history), len(history) - 1)  # one token fed at least
        drop = len(state.tokens) - keep
        if drop:
            for c in state.caches:
                c.trim(drop)
        feed = history[keep:]
        for start in range(0, len(feed) - FEED_CHUNK, FEED_CHUNK):  # all but the last chunk
            self._forward(feed[start:start + FEED_CHUNK], state.caches)
            mx.eval([c.state for c in state.caches])
        rest = feed[len(feed) - (len(feed) - 1) % FEED_CHUNK - 1:]
        y = mx.argmax(self._forward(rest, state.caches), axis=-1)
        drafts = [y]
        for _ in range(k - 1):
            y = mx.argmax(self._forward(y, state.caches), axis=-1)
            drafts.append(y)
        tokens = mx.concatenate(drafts).tolist()
        state.tokens = history + tokens[:-1]  # the last draft is proposed, not fed
        return tokens

    def _forward(self, tokens, caches) -> mx.array:
        """The draft's logits (1, vocab) after `tokens` (a list, or a (1,) array drawn lazily)."""
        x = mx.array([tokens], dtype=mx.uint32) if isinstance(tokens, list) else tokens[None]
        h = self.stage(self.stage.embed(x), caches)
        return self.stage.head(h[:, -1, :])

    def _state(self, seq) -> DraftCaches:
        if seq in self.states:
            self.states.move_to_end(seq)
            return self.states[seq]
        while len(self.states) >= self.capacity:
            self.states.popitem(last=False)
        state = self.states[seq] = DraftCaches(len(self.stage.layers))
        return state


def common_prefix(a: List[int], b: List[int]) -> int:
    """How many leading tokens two histories share. They part within the last pass's drafts,
    so the long shared head is compared at once and only the tail token by token."""
    n = min(len(a), len(b))
    start = max(0, n - 64)
    if a[:start] != b[:start]:
        start = 0
    for i in range(start, n):
        if a[i] != b[i]:
            return i
    return n
