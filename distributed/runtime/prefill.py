"""Batched admission: waiting prompts prefill together, then decode with the running rows.

As mlx-lm's BatchGenerator does (PromptProcessingBatch in mlx_lm/generate.py):
the sequences' own slots, which may already hold histories of different
lengths (a restored prefix), are merged into one batch (mlx-lm's cache merge
left-pads the shorter histories); each row's remaining prompt but its last
token is right-padded to the longest, the caches are `prepare`d for that
padding, the rows go through in chunks, and `finalize` turns the padding into
left padding. Each row's last prompt token is then the input of its first
decode step: the rows join a decode group, whose next step gives their first
tokens beside the running rows' next ones. (mlx-lm's BatchGenerator gives the
last tokens a step of their own first; in a ring that step is a whole extra
round, and the running rows wait behind it.) A batch of one sequence stays in
its own slot with plain caches, as mlx-lm's generate_step runs it, until it
joins a group.

Admission takes every waiting sequence, in arrival order, while the batch's
padded prompt tokens stay within a budget; a sequence arriving while a batch
is being sent waits for the next one. Each frame carries at most
`prefill_step_size` prompt tokens (padding included), so a prefill frame beside
decode steps delays them by a bounded amount.
"""

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import mlx.core as mx

from ..transport import Reply
from .pipeline import Pipeline
from .sequence import Sequence

# Prompt tokens per prefill frame (--prefill-step-size), as mlx-lm's generate and
# BatchGenerator: on an H200 a batch of 64 prompts prefilled 1.4x faster in frames
# of 2048 tokens than of 512 (bench/bench_steps.py).
PREFILL_STEP_SIZE = 2048


@dataclass
class PrefillBatch:
    slot: int  # a batch slot, or the one member's own slot
    members: List[Sequence]  # its rows, in order
    rows: List[List[int]] = field(default_factory=list)  # each row's prompt tokens to prefill
    width: int = 0  # the longest row: columns to send (every prompt token but the last)
    sent: int = 0  # columns sent so far
    step: int = 1  # columns per frame (at most: a ChunkBudget may cut a frame shorter)
    past: int = 0  # positions the rows' caches held before their first chunk (a restored prefix)
    padded: bool = False  # caches prepared for right padding: finalize before decoding

    @property
    def done(self) -> bool:
        """Every chunk is sent."""
        return self.sent >= self.width

    @property
    def live(self) -> List[Sequence]:
        return [s for s in self.members if not s.finished]


class Admission:
    """Forms prefill batches from waiting sequences and sends their frames."""

    def __init__(self, pipeline: Pipeline, new_slot: Callable[[], int], prefill_step_size: int = PREFILL_STEP_SIZE,
                 batch_tokens: int = 2048, memory=None, chunk_budget=None):
        self.pipeline, self.new_slot = pipeline, new_slot
        self.prefill_step_size, self.batch_tokens = prefill_step_size, batch_tokens
        self.waiting: deque = deque()  # admitted, in arrival order, not yet in a batch
        self.current: Optional[PrefillBatch] = None  # the batch whose frames are being sent
        self.memory = memory  # --memory-limit: a MemoryAdmission a prompt waits for (memory_guard.py)
        self.chunk_budget = chunk_budget  # --memory-limit, --max-context auto: a ChunkBudget (memory_guard.py)

    def held(self) -> List[Sequence]:
        """Sequences waiting or in the batch being sent."""
        return list(self.waiting) + (self.current.members if self.current else [])

    @property
    def pending(self) -> bool:
        """A batch is being sent or a sequence waits for one."""
        return self.current is not None or bool(self.waiting)

    @property
    def next_scored(self) -> bool:
        """The next chunk is a scored prompt's (its frame needs a reply of its own)."""
        seq = self.current.members[0] if self.current else self.waiting[0] if self.waiting else None
        return seq is not None and seq.request.scores_prompt

    def send_next(self, carry: Optional[Callable[[mx.array, int], None]] = None) -> Optional[PrefillBatch]:
        """Send the next chunk of the current batch, forming a batch first if needed
        (a batch of one-token prompts has no chunk to send). Returns the batch, or None
        if nothing waits. Once `done`, the batch is no longer current: its prompts are
        in the ring but each row's last token, the input of the row's first decode
        step (its `next_token`). With `carry`, the chunk goes through carry(tokens, slot)
        instead, to ride in a decode step's frame (never a scored prompt's: see next_scored)."""
        batch = self.current or self._form()
        if batch is None:
            return None
        if batch.sent < batch.width:
            n = self._columns(batch)
            chunk = [(row[batch.sent:batch.sent + n] + [0] * n)[:n] for row in batch.rows]  # right-padded
            batch.sent += n
            # A scored prompt needs every position's output (logits.PromptScores).
            reply = Reply.ALL if batch.members[0].request.scores_prompt else Reply.ACK
            if carry is not None:
                assert reply == Reply.ACK, "a scored prompt's chunk goes alone (see next_scored)"
                carry(mx.array(chunk, dtype=mx.uint32), batch.slot)
            else:
                self.pipeline.send(mx.array(chunk, dtype=mx.uint32), reply, batch.slot)
        if batch.done:
            if batch.padded:
                self.pipeline.finalize(batch.slot)
            for seq in batch.members:
                seq.next_token, seq.unsent = seq.unsent[-1], []
            self.current = None
        return batch

    def _columns(self, batch: PrefillBatch) -> int:
        """The next chunk's columns: `step`, the rest, or fewer where its activations at its
        context would not fit the chunk budget."""
        left = batch.width - batch.sent
        n = min(batch.step, left)
        if self.chunk_budget is None:
            return n
        n = min(n, self.chunk_budget.columns(len(batch.rows), batch.past + batch.sent, n))
        if batch.padded:  # never a chunk of one column, nor one left over (see _form)
            n = max(2, n)
            n += (left - n == 1) * (1 if n == 2 else -1)
        return n

    def _form(self) -> Optional[PrefillBatch]:
        """The next batch: waiting sequences in arrival order while its padded tokens
        fit the budget (one at least) and each fits the memory beside those running."""
        taken: List[Sequence] = []
        longest = 0
        while self.waiting:
            n = len(self.waiting[0].unsent)
            alone = self.waiting[0].request.scores_prompt  # scored: a batch of its own, plain caches
            if taken and (alone or (len(taken) + 1) * max(longest, n) > self.batch_tokens):
                break
            if self.memory is not None and not self.memory.admits(self.waiting[0]):
                break  # it waits for running sequences to finish (it fits alone: Scheduler._admit)
            taken.append(self.waiting.popleft())
            if self.memory is not None:
                self.memory.admit(taken[-1])
            longest = max(longest, n)
            if alone:
                break
        if not taken:
            return None
        rows = [s.unsent[:-1] for s in taken]  # the last token gives the first token
        width = max(len(r) for r in rows)
        step = max(1, self.prefill_step_size // len(taken))
        past = max(len(s.fed_prompt) - len(s.unsent) for s in taken)
        if len(taken) == 1:
            batch = PrefillBatch(taken[0].slot, taken, rows, width, step=step, past=past)
        else:
            batch = PrefillBatch(self.new_slot(), taken, rows, width, step=step, past=past)
            self.pipeline.merge(batch.slot, [s.slot for s in taken])
            if any(len(r) < width for r in rows):
                # Padded rows: no chunk of one column, which mlx-lm's rotating batch
                # cache takes for a decode step (it refuses one before finalize).
                batch.step = max(2, step)
                batch.width += batch.width % batch.step == 1  # one more column of padding
                lengths = [len(r) for r in rows]
                self.pipeline.prepare(batch.slot, lengths, [batch.width - n for n in lengths])
                batch.padded = True
        self.current = batch
        return batch

    def drop_cancelled(self, finish: Callable[[Sequence], None]) -> None:
        """Cancelled sequences end now (`finish`). A waiting one frees its slot; a
        row of the batch being sent stays until the batch is done (the batcher drops
        it then), unless no row is left, when the batch is abandoned."""
        for seq in [s for s in self.waiting if s.handle.cancelled]:
            self.waiting.remove(seq)
            self.pipeline.release(seq.slot)  # it may hold a restored prefix
            finish(seq)
        batch = self.current
        if batch is not None:
            for seq in batch.live:
                if seq.handle.cancelled:
                    finish(seq)
            if not batch.live:
                self.pipeline.release(batch.slot)  # after its chunks still in the ring
                self.current = None
