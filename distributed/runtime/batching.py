"""Continuous batching: what rank 0 puts into the ring next.

Running sequences decode in groups, one per rank at most, that follow each
other around the ring: while rank 1 runs group A's step, rank 0 runs group
B's, so no rank waits for a whole round trip. A group is one batched decode
step (mlx-lm's batch caches, one row per sequence); sequences join a group
between its steps and leave it when they finish.

A new prompt is sent in chunks (mlx-lm's generate_step chunking, so a
sequence's tokens are those it would get alone), each chunk one behind the
other along the ring. While groups are decoding, at most one prefill frame is
in the ring, so a prompt delays a decode step by one chunk at most. A
sequence's first token comes from its own slot; then it joins a group.
"""

from collections import deque
from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx

from ..transport import Reply
from .pipeline import Pipeline
from .prefix_cache import PrefixCache
from .sequence import Sequence


@dataclass
class Group:
    slot: int
    members: List[Sequence] = field(default_factory=list)
    busy: bool = False  # its decode step is in the ring


@dataclass
class Outstanding:
    """A frame in the ring whose reply rank 0 waits for."""

    kind: str  # "chunk" (a prefill chunk), "first" (a prompt's last token) or "step"
    sequences: List[Sequence]
    group: Optional[Group] = None


class Batcher:
    def __init__(self, pipeline: Pipeline, tokenizer, max_batch: int = 16, prefill_step_size: int = 512,
                 prefix: Optional[PrefixCache] = None):
        self.pipeline, self.tokenizer = pipeline, tokenizer
        self.prefix = prefix or PrefixCache(pipeline)  # budget 0: off
        ranks = pipeline.num_ranks
        self.groups = [Group(slot) for slot in range(ranks)]
        self.group_cap = -(-max_batch // ranks)
        self.max_batch = max_batch
        self.depth = ranks  # prompt chunks in the ring at once: enough to keep every rank busy
        self.prefill_step_size = prefill_step_size
        self.prefilling: deque = deque()  # prompts not fully sent, in arrival order
        self.ready: deque = deque()  # first token out, waiting for room in a group
        self.outstanding: deque = deque()  # in the order their replies will come
        self.sequences = 0  # admitted and not finished
        self._next_slot = ranks  # slots below are the groups'

    @property
    def has_room(self) -> bool:
        return self.sequences < self.max_batch

    @property
    def idle(self) -> bool:
        return self.sequences == 0 and not self.outstanding

    def add(self, handle) -> None:
        self.prefilling.append(Sequence(handle, self.tokenizer, self._next_slot))
        self._next_slot = self._next_slot + 1 if self._next_slot < 2**31 - 1 else len(self.groups)
        self.sequences += 1

    def step(self) -> None:
        """Send what fits into the ring, then take one reply."""
        self._drop_cancelled_prompts()
        self._fill()
        if self.outstanding:
            self._receive()

    def drain(self) -> None:
        """Take every outstanding reply (before a control exchange such as rank info)."""
        while self.outstanding:
            self._receive()

    def shutdown(self, reason: str) -> None:
        """End every admitted sequence with an error (the server is stopping)."""
        self.drain()
        held = list(self.prefilling) + list(self.ready) + [s for g in self.groups for s in g.members]
        for seq in held:
            seq.finish("error", error=reason)
        self.prefilling.clear()
        self.ready.clear()
        for group in self.groups:
            group.members = []
        self.sequences = 0

    # -- sending --------------------------------------------------------------

    def _fill(self) -> None:
        decoding = bool(self.ready) or any(g.members for g in self.groups)
        if not decoding:  # prompt chunks fill the ring, one behind the other
            while self.prefilling and len(self.outstanding) < self.depth:
                self._send_chunk(self.prefilling[0])
        elif self.prefilling and all(o.kind == "step" for o in self.outstanding):
            self._send_chunk(self.prefilling[0])  # one prefill frame at a time beside decoding
        while (group := self._next_group()) is not None:
            self._send_step(group)

    def _next_group(self) -> Optional[Group]:
        """An idle group to step, after moving waiting sequences into it. A
        group takes newcomers only while no other group is smaller, so groups
        stay even."""
        for group in sorted((g for g in self.groups if not g.busy), key=lambda g: len(g.members)):
            while self.ready and len(group.members) < self.group_cap and len(group.members) <= min(
                len(g.members) for g in self.groups
            ):
                seq = self.ready.popleft()
                self.pipeline.join(group.slot, seq.slot)
                group.members.append(seq)
            if group.members:
                return group
        return None

    def _send_step(self, group: Group) -> None:
        tokens = mx.array([[s.next_token] for s in group.members], dtype=mx.uint32)
        self.pipeline.send(tokens, Reply.LAST, group.slot)
        group.busy = True
        self.outstanding.append(Outstanding("step", list(group.members), group))

    def _send_chunk(self, seq: Sequence) -> None:
        self.prefix.begin_prefill(seq, self.prefilling)  # prefix-cache hook: restore a hit, once
        if len(seq.unsent) > 1:
            n = min(self.prefill_step_size, len(seq.unsent) - 1, self.prefix.chunk_limit(seq))
            chunk, seq.unsent = seq.unsent[:n], seq.unsent[n:]
            self.pipeline.send(mx.array(chunk, dtype=mx.uint32)[None], Reply.ACK, seq.slot)
            self.outstanding.append(Outstanding("chunk", [seq]))
            self.prefix.after_chunk(seq)  # prefix-cache hook: store at the prompt's end (and shared prefixes)
            return
        self.pipeline.send(mx.array(seq.unsent, dtype=mx.uint32)[None], Reply.LAST, seq.slot)
        seq.unsent = []
        self.prefilling.popleft()
        self.outstanding.append(Outstanding("first", [seq]))

    def _drop_cancelled_prompts(self) -> None:
        for queue in (self.prefilling, self.ready):
            for seq in [s for s in queue if s.handle.cancelled]:
                queue.remove(seq)
                self.pipeline.release(seq.slot)  # after any of its chunks still in the ring
                self._finish(seq, "cancelled")

    # -- receiving ------------------------------------------------------------

    def _receive(self) -> None:
        frame = self.outstanding.popleft()
        _, h = self.pipeline.recv()
        if frame.kind == "chunk":
            return
        logits = self.pipeline.stage.head(h)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = self._sample(frame.sequences, logprobs)
        chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)
        mx.eval(tokens, chosen)
        results = zip(frame.sequences, tokens.tolist(), chosen.reshape(-1).tolist())
        if frame.kind == "first":
            seq, token, logprob = next(results)
            reason = seq.accept(token, logprob)
            if reason is None:
                self.ready.append(seq)
            else:
                self.pipeline.release(seq.slot)
                self._finish(seq, reason)
            return
        group = frame.group
        group.busy = False
        keep = []
        for i, (seq, token, logprob) in enumerate(results):
            reason = seq.accept(token, logprob)
            if reason is None:
                keep.append(i)
            else:
                self.prefix.finished(seq, group.slot, i)  # prefix-cache hook: store it before the filter
                self._finish(seq, reason)
        if len(keep) < len(group.members):
            self.pipeline.filter(group.slot, keep)
            group.members = [group.members[i] for i in keep]

    @staticmethod
    def _sample(sequences: List[Sequence], logprobs: mx.array) -> mx.array:
        greedy = mx.argmax(logprobs, axis=-1)
        if all(s.greedy for s in sequences):
            return greedy
        return mx.concatenate(
            [greedy[i : i + 1] if s.greedy else s.sample(logprobs[i : i + 1]) for i, s in enumerate(sequences)]
        )

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish(reason)
        self.sequences -= 1
