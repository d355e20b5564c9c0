"""A draft model for speculative decoding (--draft-model): a small AFMoE checkpoint that
shares the target's tokenizer, on rank 0 only, proposing its greedy continuation.

Each sequence that speculates has the draft's keys and values of its history: per layer, a
buffer of fixed size with position p in slot p % size (SlotCache). A sliding layer's buffer
holds its window and ROLLBACK positions more; a full-attention layer's holds every position
(grown by doubling). Attention reads the buffer and the new positions with a mask made
from positions, so taking back rejected drafts is only moving the sequence's position
back: the slots they wrote read as positions too old for any window that follows. And a
draft step has the same shapes at every position, so it is compiled once (mx.compile) and
runs as a few fused kernels: with OpenBLAS on a CPU a token of the bundled draft costs
0.29 ms against 0.6 ms as plain mlx-lm layers over KVCaches (per-operation overhead being
most of a step at its size).

A proposal first brings the buffers to the sequence's history (the position back to what
the target accepted, then feeding what it drew), then runs K greedy steps as one lazy
graph, evaluated once: the draft's tokens need no host decision between steps.

Buffers are kept for the few sequences that speculate (one-row groups, at most one per
rank), least recently used first out, so the draft's memory is bounded by that count.
"""

from collections import OrderedDict
from typing import List, Optional, Sequence

import mlx.core as mx

from ..shard.draft import ROLLBACK  # positions a proposal may take back at once (more: the history is fed again)

FEED_CHUNK = 512  # history tokens per draft pass when catching up (a prompt): bounded activations
FULL_SLOTS = 256  # a full-attention layer's first buffer


class SlotCache:
    """One layer's keys and values as mlx-lm's Attention asks for them: `offset`, the first
    new position (an array: the compiled step serves every position); update_and_fetch
    returns the buffer and the new positions' keys and values (the mask says which count)
    and keeps the buffer with the new ones written in."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        fetched = mx.concatenate([self.keys, keys], axis=2), mx.concatenate([self.values, values], axis=2)
        self.keys, self.values = self._write(self.keys, keys), self._write(self.values, values)
        return fetched

    def _write(self, buffer: mx.array, new: mx.array) -> mx.array:
        slots = buffer.shape[2]
        skipped = max(0, new.shape[2] - slots)  # more than fit: the last ones
        index = (self.offset + skipped + mx.arange(new.shape[2] - skipped)) % slots
        new = new[:, :, skipped:]
        return mx.put_along_axis(buffer, mx.broadcast_to(index[None, None, :, None], new.shape), new, axis=2)


def _mask(offset: mx.array, length: int, slots: int, window: Optional[int]) -> mx.array:
    """(length, slots + length): which of the buffer's slots and the new positions each new
    position attends to. Slot s holds the latest position below `offset` that is s modulo
    `slots` (none where that is negative); a window keeps the last `window` positions."""
    last = offset - 1
    held = last - (last - mx.arange(slots)) % slots
    keys = mx.concatenate([held, offset + mx.arange(length)])
    queries = (offset + mx.arange(length))[:, None]
    mask = (keys >= 0) & (keys <= queries)
    return mask & (keys > queries - window) if window else mask


def _forward(stage, windows: List[Optional[int]], tokens: mx.array, offset: mx.array, *buffers: mx.array):
    """The draft's greedy next token after `tokens` (1, length) at positions offset.., and
    the buffers (keys, values per layer) with them written in."""
    h = stage.embed(tokens)
    new = []
    for i, (layer, window) in enumerate(zip(stage.layers, windows)):
        cache = SlotCache(buffers[2 * i], buffers[2 * i + 1], offset)
        mask = _mask(offset, tokens.shape[1], cache.keys.shape[2], window)
        h = layer(h, mask, cache)
        new += [cache.keys, cache.values]
    return (mx.argmax(stage.head(h[:, -1, :]), axis=-1), *new)


class DraftState:
    """A sequence's draft buffers, and the tokens they hold (in order: the next position is their count)."""

    def __init__(self, stage, windows: List[Optional[int]]):
        attn = stage.layers[0].self_attn
        self.heads, self.head_dim = attn.n_kv_heads, attn.head_dim
        self.dtype = stage.norm.weight.dtype  # the keys' (weights may be quantized)
        self.windows = windows
        self.buffers: List[mx.array] = []
        self.tokens: List[int] = []

    def _zeros(self, slots: int) -> mx.array:
        return mx.zeros((1, self.heads, slots, self.head_dim), self.dtype)

    def ready_for(self, positions: int) -> None:
        """Buffers that hold `positions` positions (a full-attention layer's grow)."""
        if not self.buffers:
            self.buffers = [self._zeros(w + ROLLBACK if w else FULL_SLOTS) for w in self.windows for _ in "kv"]
        for i, window in enumerate(self.windows):
            slots = self.buffers[2 * i].shape[2]
            if window is None and slots < positions:  # slot = position there: copy into a bigger one
                grown = slots
                while grown < positions:  # doubling: few sizes, each compiled once
                    grown *= 2
                for j in (2 * i, 2 * i + 1):
                    self.buffers[j] = mx.concatenate([self.buffers[j], self._zeros(grown - slots)], axis=2)


class ModelDrafter:
    proposes_all = True  # every proposal is as many tokens as asked for (verification._next_length)

    def __init__(self, stage, capacity: int = 1):
        self.stage = stage  # every layer of the draft, with its embedding and head
        self.capacity = max(1, capacity)
        self.windows = [stage.args.sliding_window if layer.use_sliding else None for layer in stage.layers]
        self.states: "OrderedDict[object, DraftState]" = OrderedDict()  # by sequence, least recent first
        self._step = mx.compile(self._forward)  # one token: the same shapes at every position
        self._warm_up()

    def _warm_up(self) -> None:
        """Compile the step now (tens of milliseconds on a CPU), not in a request's first pass.
        A draft whose layers cannot be traced (a RoPE that reads its offset on the host, as
        mlx-lm's dynamic NTK scaling does) steps uncompiled."""
        state = DraftState(self.stage, self.windows)
        state.ready_for(1)
        args = (mx.zeros((1, 1), mx.uint32), mx.array(0), *state.buffers)
        try:
            mx.eval(self._step(*args))
        except ValueError:
            self._step = self._forward
            mx.eval(self._step(*args))

    def _forward(self, tokens, offset, *buffers):
        return _forward(self.stage, self.windows, tokens, offset, *buffers)

    def propose(self, seq, k: int, after: Sequence[int] = ()) -> List[int]:
        """The draft's greedy continuation (k tokens) of the sequence's history and `after`."""
        history = list(seq.request.prompt_ids) + seq.generated + list(after)
        state = self._state(seq)
        keep = min(common_prefix(state.tokens, history), len(history) - 1)  # one token fed at least
        if len(state.tokens) - keep > ROLLBACK:  # its slots may have overwritten positions still in a window
            state = self._state(seq, fresh=True)
            keep = 0
        feed = history[keep:]
        state.ready_for(len(history) + k)
        position = keep
        for start in range(0, len(feed) - FEED_CHUNK, FEED_CHUNK):  # all but the last chunk
            _, *state.buffers = self._run(feed[start:start + FEED_CHUNK], position, state.buffers)
            position += FEED_CHUNK
            mx.eval(state.buffers)
        rest = feed[len(feed) - (len(feed) - 1) % FEED_CHUNK - 1:]
        y, *buffers = self._run(rest, position, state.buffers)
        position += len(rest)
        drafts = [y]
        for i in range(k - 1):
            y, *buffers = self._step(y[None], mx.array(position + i), *buffers)
            drafts.append(y)
        tokens = mx.concatenate(drafts).tolist()
        state.buffers = buffers
        state.tokens = history + tokens[:-1]  # the last draft is proposed, not fed
        return tokens

    def _run(self, tokens: List[int], offset: int, buffers: List[mx.array]):
        x = mx.array([tokens], dtype=mx.uint32)
        run = self._step if len(tokens) == 1 else self._forward  # a longer feed's shapes vary: not compiled
        return run(x, mx.array(offset), *buffers)

    def _state(self, seq, fresh: bool = False) -> DraftState:
        if seq in self.states and not fresh:
            self.states.move_to_end(seq)
            return self.states[seq]
        self.states.pop(seq, None)
        while len(self.states) >= self.capacity:
            self.states.popitem(last=False)
        state = self.states[seq] = DraftState(self.stage, self.windows)
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
