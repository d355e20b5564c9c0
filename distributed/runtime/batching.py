"""Continuous batching: what rank 0 puts into the ring next.

Running sequences decode in groups, one per rank at most, that follow each other around the ring: while
rank 1 runs group A's step, rank 0 runs group B's, so no rank waits for a whole round trip. A group is
one batched decode step (mlx-lm's batch caches, one row per sequence); sequences join a group between
its steps and leave it when they finish. A group's next step is sent as soon as its tokens are sampled,
before rank 0 looks at them (lookahead, as mlx-lm's generate does), so the host's work per step (reading
the tokens, streaming them, building the next step) overlaps the device's.

New sequences are admitted in batches (`prefill`): waiting prompts prefill together, in chunks that
follow each other along the ring. While groups are decoding, each chunk rides in a group's decode step,
in the same frame (chunked prefill, as vLLM and Sarathi-Serve mix them: Stage.mixed runs the MoE over
both), so the running rows take a token per chunk, and a step is delayed by one bounded chunk at most
(with one rank, a chunk goes alone: `mix`). Then the batch's rows join the groups, each with its last
prompt token as its next input.

Batched admission (Admission) goes as mlx-lm's BatchGenerator does (PromptProcessingBatch in
mlx_lm/generate.py): the sequences' own slots, which may already hold histories of different
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

from ..transport import Op, Reply
from .frames import CHUNKS_PER_STAGE, MIN_CHUNK, PREFILL_STEP_SIZE, FrameKind, Group, Outstanding
from .grammar import prepare_masks
from .memory_guard import allocation_failed, describe
from .pipeline import Pipeline
from .prefix_cache import PrefixHooks
from .sequence import Sequence, draw, shaped_logprobs, top_candidates, top_logprobs
from .speculation import SpeculationOptions, Verdict, Verifier
from .step_budget import StepBudget


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
        self.last_tokens = 0  # prompt tokens of the chunk send_next sent last

    def add(self, seq: Sequence) -> None:
        """`seq` waits for a batch (in arrival order)."""
        self.waiting.append(seq)

    def clear(self) -> None:
        """Forget every waiting sequence and the batch being sent (the batcher ended them all)."""
        self.waiting.clear()
        self.current = None

    def abandon(self, ids: set) -> None:
        """A frame failed for the sequences whose id() is in `ids`: a batch being sent with one of them
        is abandoned whole (a chunk covers every row), its slot released on every rank."""
        current = self.current
        if current is not None and any(id(s) in ids for s in current.members):
            self.pipeline.release(current.slot)  # after its chunks still in the ring
            self.current = None

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

    def send_next(self, carry: Optional[Callable[[mx.array, int], None]] = None,
                  columns: Optional[Callable[[int], Optional[int]]] = None) -> Optional[PrefillBatch]:
        """Send the next chunk of the current batch, forming a batch first if needed
        (a batch of one-token prompts has no chunk to send). Returns the batch, or None
        if nothing waits. Once `done`, the batch is no longer current: its prompts are
        in the ring but each row's last token, the input of the row's first decode
        step (its `next_token`). With `carry`, the chunk goes through carry(tokens, slot)
        instead, to ride in a decode step's frame (never a scored prompt's: see next_scored).
        `columns(rows)`: the most columns a chunk of so many rows may have (the step budget's beside
        decoding rows: StepBudget.columns), None for no bound.
        `last_tokens` says what went (padding included)."""
        self.last_tokens = 0
        batch = self.current or self._form()
        if batch is None:
            return None
        if batch.sent < batch.width:
            n = self._columns(batch, None if columns is None else columns(len(batch.rows)))
            self.last_tokens = n * len(batch.rows)
            chunk = [(row[batch.sent:batch.sent + n] + [0] * n)[:n] for row in batch.rows]  # right-padded
            batch.sent += n
            # A scored prompt needs every position's output (sequence.PromptScores).
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

    def _columns(self, batch: PrefillBatch, most: Optional[int] = None) -> int:
        """The next chunk's columns: `step`, the rest, or fewer: `most` (the step budget's), or
        where its activations at its context would not fit the chunk budget."""
        left = batch.width - batch.sent
        n = min(batch.step, left)
        if most is not None:
            n = min(n, most)
        if self.chunk_budget is not None:
            n = min(n, self.chunk_budget.columns(len(batch.rows), batch.past + batch.sent, n))
        if batch.padded:  # never a chunk of one column, nor one left over (see _form), whatever cut the last
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
        step = self._step(len(taken), width)
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

    def _step(self, rows: int, width: int) -> int:
        """Columns per chunk: prefill_step_size's share of each row, and with several stages short
        enough that the prompt makes CHUNKS_PER_STAGE chunks a stage (each MIN_CHUNK tokens at least)."""
        step = max(1, self.prefill_step_size // rows)
        stages = self.pipeline.num_ranks
        if stages > 1:
            step = min(step, max(-(-width // (CHUNKS_PER_STAGE * stages)), MIN_CHUNK // rows))
        return max(1, step)

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


class Batcher:
    def __init__(self, pipeline: Pipeline, tokenizer, max_batch: int = 16, prefill_step_size: int = PREFILL_STEP_SIZE,
                 prefill_batch_tokens: int = 2048, prefix: Optional[PrefixHooks] = None,
                 speculation: Optional[SpeculationOptions] = None, memory=None, chunk_budget=None,
                 step_budget: Optional[StepBudget] = None):
        """`memory`, `chunk_budget`: what admission waits for and cuts prefill chunks to (Admission);
        `step_budget`: the prompt tokens a chunk beside decoding rows may have (step_budget.py)."""
        self.pipeline, self.tokenizer = pipeline, tokenizer
        self.clock = pipeline.stats.clock  # where the loop's time goes (loop_clock.py)
        ranks = pipeline.num_ranks
        # One-row groups' verification frames (speculation.Verifier): what it sends and decides, this applies.
        self.verifier = Verifier(pipeline, speculation or SpeculationOptions())
        self.groups = [Group(slot) for slot in range(ranks)]
        self.group_cap = -(-max_batch // len(self.groups))
        self.max_batch = max_batch
        self.depth = ranks  # prompt chunks in the ring at once: enough to keep every rank busy
        self.prefix = prefix or PrefixHooks()
        self.budget = step_budget or StepBudget()
        # Prompt chunks ride in decode steps' frames (_send_step) with several ranks, where a frame of its
        # own would hold the groups' steps back a whole frame at every rank, and with one under a step
        # budget: a bounded chunk then costs about its tokens, where alone it costs a pass over every
        # expert's weights too (one H100, Mini's shape, 8 streams: 83 tok/s against 290 unbounded). With
        # one rank and whole chunks, the chunk alone first gives the earlier first tokens (bench_load
        # --arrival-gap: TTFT p50 +13% to +52% mixed on an H200, +6% to +36% on a CPU).
        self.mix = ranks > 1 or self.budget.bounded
        self.admission = Admission(pipeline, self._new_slot, prefill_step_size, prefill_batch_tokens, memory,
                                   chunk_budget)
        self.ready: deque = deque()  # PrefillBatch: prefilled rows waiting to join a group
        self.outstanding: deque = deque()  # in the order their replies will come
        self.sequences = 0  # admitted and not finished
        self._next_slot = len(self.groups)  # slots below are the groups'

    @property
    def has_room(self) -> bool:
        return self.sequences < self.max_batch

    @property
    def idle(self) -> bool:
        return self.sequences == 0 and not self.outstanding

    def add(self, handle) -> None:
        seq = Sequence(handle, self.tokenizer, self._new_slot())
        self.sequences += 1
        if not seq.request.scores_prompt:  # those need every prompt position computed
            with self.clock.part("prefix"):
                self.prefix.restore(seq, self.drain)
        self.admission.add(seq)

    def step(self) -> None:
        """Send what fits into the ring, then take one reply."""
        self._drop_cancelled()
        with self.clock.part("build"):
            self._fill()
        if self.outstanding:
            self._receive()

    def drain(self) -> None:
        """Take every outstanding reply (before a control exchange such as rank info)."""
        while self.outstanding:
            self._receive(lookahead=False)

    def shutdown(self, reason: str) -> None:
        """End every admitted sequence with an error (the server is stopping)."""
        self.drain()
        self._end_all(reason)

    def reset(self, reason: str) -> None:
        """End every admitted sequence with `reason` and start the ring clean: every reply
        still owed is read and dropped and every rank drops every slot (Pipeline.clear).
        After an error that no one row is to blame for, the batcher's and the caches' state
        may disagree anywhere; this is the one way back to a state they agree on. Prefix-cache
        entries stay: each was complete on every rank when it was indexed."""
        self._end_all(reason)
        self.outstanding.clear()
        self.pipeline.clear()

    def _end_all(self, reason: str) -> None:
        held = self.admission.held() + [s for b in self.ready for s in b.members]
        for seq in held + [s for g in self.groups for s in g.members]:
            if not seq.finished:
                seq.finish("error", error=reason)
        self.admission.clear()
        self.ready.clear()
        for group in self.groups:
            group.members, group.busy = [], False
        self.sequences = 0

    def _new_slot(self) -> int:
        slot = self._next_slot
        self._next_slot = slot + 1 if slot < 2**31 - 1 else len(self.groups)
        return slot

    # -- sending --------------------------------------------------------------

    def _fill(self) -> None:
        decoding = bool(self.ready) or any(g.members for g in self.groups)
        if not decoding:  # prompt chunks fill the ring, one behind the other
            while len(self.outstanding) < self.depth and self._send_prefill():
                pass
        elif not self.mix:
            self._send_prefill_beside()  # one rank: before the step
        while (group := self._next_group()) is not None:
            self._send_step(group)
        if decoding and self.mix:
            self._send_prefill_beside()  # several: after the steps, which carry chunks

    def _send_prefill_beside(self) -> None:
        """A chunk in a frame of its own beside decoding: one at a time, and none while
        prefilled rows wait to join a group or for their first token (that comes first).
        With one rank every chunk goes so; with several (they ride in the steps) only
        while a rank would idle otherwise (fewer frames in the ring than ranks), or a
        scored prompt's (its reply is every position's, so it cannot ride in a step)."""
        if any(o.kind == FrameKind.CHUNK or o.chunk for o in self.outstanding) or not self._prefill_may_go():
            return
        if not self.mix or self.admission.next_scored or len(self.outstanding) < self.depth:
            self._send_prefill(beside=True)

    def _prefill_may_go(self) -> bool:
        """No prefill while prefilled rows wait to join a group or for their first token (it comes first)."""
        return not self.ready and not any(o.first for o in self.outstanding)

    def _send_prefill(self, beside: bool = False) -> bool:
        """The next chunk in a frame of its own; `beside` decoding rows, within the step budget."""
        batch = self.admission.send_next(columns=self.budget.columns if beside else None)
        if batch is None:
            return False
        if beside and self.budget.bounded:
            self.budget.sent(self.admission.last_tokens)
        if batch.width:  # a chunk went (a batch of one-token prompts has none)
            self.expect(Outstanding(FrameKind.CHUNK, list(batch.members), batch.slot))
        if batch.done:
            self._prefilled(batch)
        return True

    def _prefilled(self, batch: PrefillBatch) -> None:
        """`batch` is in the ring but its rows' last tokens: its rows wait to join a
        group. Rows cancelled while it was sent (already finished) go now."""
        live = [i for i, s in enumerate(batch.members) if not s.finished]
        if not live:
            self.pipeline.release(batch.slot)
            return
        if len(live) < len(batch.members):
            self.pipeline.filter(batch.slot, live)
            batch.members = [batch.members[i] for i in live]
        self.ready.append(batch)

    def _next_group(self) -> Optional[Group]:
        """An idle group to step, after moving prefilled sequences into it. A group
        takes newcomers up to its share of every running sequence, so groups stay
        even (and a batch's rows join at once)."""
        running = sum(len(g.members) for g in self.groups) + sum(len(b.members) for b in self.ready)
        share = min(self.group_cap, -(-running // len(self.groups)))
        for group in sorted((g for g in self.groups if not g.busy), key=lambda g: len(g.members)):
            while self.ready and len(group.members) < share:
                batch = self.ready[0]
                k = min(len(batch.members), share - len(group.members))
                self.pipeline.join(group.slot, batch.slot, list(range(k)))
                group.members += batch.members[:k]
                batch.members = batch.members[k:]
                if not batch.members:
                    self.ready.popleft()
            if group.members:
                return group
        return None

    def _send_step(self, group: Group, tokens: Optional[mx.array] = None) -> None:
        """Send `group`'s decode step; with several ranks, with the next prefill chunk in
        its frame if one waits (chunked prefill, as vLLM and Sarathi-Serve mix them): the
        chunk's tokens share the step's pass over the expert weights, and the running rows
        go on decoding while prompts prefill, one chunk per step at most."""
        ahead = tokens is not None  # the lookahead (_receive): the previous step's tokens not accepted yet
        if tokens is None:
            verifying = self.verifier.send(group)
            if verifying:
                group.busy = True
                for frame in verifying:
                    self.expect(frame)
                return
            tokens = mx.array([s.next_token for s in group.members], dtype=mx.uint32)
        first = any(s.awaiting_first for s in group.members)
        carried = []

        def carry(chunk: mx.array, chunk_slot: int) -> None:
            self.pipeline.send_mixed(tokens[:, None], group.slot, chunk, chunk_slot)
            carried.extend(self.admission.current.members)  # the chunk's batch's rows

        batch = None
        if (self.mix and not first and self._prefill_may_go() and self.admission.pending
                and not self.admission.next_scored):
            batch = self.admission.send_next(carry, self.budget.columns)
            self.budget.sent(self.admission.last_tokens if carried else 0)
        if not carried:
            self.pipeline.send(tokens[:, None], Reply.LAST, group.slot,
                               next_length=self.verifier.length_after_step(group) if ahead else 0)
        group.busy = True
        self.expect(Outstanding(FrameKind.STEP, list(group.members), group.slot, group, first=first, chunk=carried,
                                 rows=tokens.shape[0]))
        if batch is not None and batch.done:
            self._prefilled(batch)

    def expect(self, frame: Outstanding) -> None:
        """`frame` was sent; its reply comes in order. With one rank the reply is
        already here, lazily: sample from it now and start the device on it, so the
        host builds the next frame while this one computes (as mlx-lm's generate
        overlaps its steps)."""
        if frame.kind == FrameKind.STEP and (h := self.pipeline.take_local_reply()) is not None:
            frame.picked = self._pick(frame.sequences, h)
            try:
                with self.clock.part("launch"):
                    mx.async_eval(*frame.picked)
            except Exception as e:  # its reply is NO_MEMORY where MLX could not allocate
                self.pipeline.refuse_reply(frame.slot, e)
                frame.picked = None
        self.outstanding.append(frame)

    def _drop_cancelled(self) -> None:
        self.admission.drop_cancelled(lambda seq: self.finish(seq, "cancelled"))
        for batch in list(self.ready):
            keep = [i for i, s in enumerate(batch.members) if not s.handle.cancelled]
            if len(keep) < len(batch.members):
                for i in sorted(set(range(len(batch.members))) - set(keep)):
                    self.finish(batch.members[i], "cancelled", batch.slot, i)
                self.pipeline.filter(batch.slot, keep)
                batch.members = [batch.members[i] for i in keep]
                if not keep:
                    self.ready.remove(batch)

    # -- receiving ------------------------------------------------------------

    def _receive(self, lookahead: bool = True) -> None:
        frame = self.outstanding.popleft()
        if frame.kind == FrameKind.VERIFY:
            return self._apply(frame, self.verifier.receive(frame, more=lookahead))
        # A step's reply taken ahead: the next step is built on it before it comes (Pipeline.recv_ahead).
        ahead = self.pipeline.recv_ahead(frame.rows) if frame.kind == FrameKind.STEP and not frame.picked else None
        if ahead is not None:
            frame.picked = self._pick(frame.sequences, ahead.payload)
        elif frame.picked is None:
            header, h = self.pipeline.recv()
            if header.op == Op.NO_MEMORY:  # a rank could not run it (memory_guard.py)
                return self.fail_frame(frame, h)
            if frame.kind == FrameKind.CHUNK:
                if h is not None:  # every position (Reply.ALL): a prompt being scored
                    frame.sequences[0].logits.prompt.add(self.pipeline.stage.head, h)
                return
            frame.picked = self._pick(frame.sequences, h)
        tokens, chosen, top = frame.picked
        # The rows in the slot now, in order: those not finished, as with lookahead a step is sent before
        # the previous one's tokens are looked at, so rows that finished there were in this step too (and
        # were filtered out of the caches since; so are rows a NO_MEMORY reply ended: fail_frame).
        in_slot = [(i, s) for i, s in enumerate(frame.sequences) if not s.finished]
        # Rows whose first token this is (their last prompt token was this step's input).
        fresh = {id(s) for _, s in in_slot if s.awaiting_first}
        group, local = frame.group, self.pipeline.transport is None
        if (lookahead and not self.ready and not fresh
                and not all(s.ends_at_next_token for _, s in in_slot)
                and not any(s.logits.processors or (s.logits.constraint and local) for _, s in in_slot)
                and not self.verifier.speculates(group)):
            # Lookahead (as mlx-lm's generate): the group's next step goes now, on the
            # tokens just sampled, still on the device; they are looked at while it runs.
            # A row that finishes here costs one wasted row-step. Not when every row
            # reaches max_tokens with this token (the step would only delay a waiting
            # prompt), nor while rows wait to join a group (they join between steps), nor
            # with logits processors (their next draw needs this token in the history),
            # nor with a grammar on one rank (its reply is picked at once; over a ring its
            # mask is made from this token while the step runs), nor on a row's first token
            # (the prefix cache keeps its caches as they are: its whole prompt), nor where
            # the next step may verify drafts (they follow from this token).
            rows = [i for i, _ in in_slot]
            with self.clock.part("build"):
                self._send_step(group, tokens if len(rows) == len(frame.sequences) else tokens[mx.array(rows)])
        else:
            group = None
        if ahead is not None and self._reply_failed(frame, ahead, sent_next=group is not None):
            return
        if not self._evaluated(frame, (tokens, chosen, *(top or ())), sent_next=group is not None):
            return
        self.clock.steps += 1
        self.budget.replied(frame.group.slot)  # the group's tokens are here: its interval ends
        keep = self._accept(frame, in_slot, tokens, chosen, top)
        if len(keep) < len(in_slot):
            self.pipeline.filter(frame.slot, keep)
        kept = [in_slot[row][1] for row in keep]
        prepare_masks([s.logits.constraint for s in kept], [s.generated for s in kept])  # while the ring runs
        with self.clock.part("prefix"):
            self.prefix.prefilled([(seq, row) for row, seq in enumerate(kept) if id(seq) in fresh], frame.slot)
        frame.group.members = kept
        frame.group.busy = group is not None  # its next step is in the ring
        if not kept:
            self.budget.idle(frame.group.slot)

    def _apply(self, frame: Outstanding, verdict: Optional[Verdict]) -> None:
        """What the Verifier decided about a verification frame's reply (None: a cancelled frame's)."""
        if verdict is None:
            return
        if verdict.no_memory is not None:
            return self.fail_frame(frame, verdict.no_memory)
        if verdict.error is not None:
            return self.failed_here(frame, verdict.error)
        if verdict.finished is not None:
            self.finish(frame.sequences[0], verdict.finished, frame.slot, 0)
            self.pipeline.filter(frame.slot, [])
            frame.group.members = []
        for sent in verdict.sent:
            self.expect(sent)
        frame.group.busy = verdict.in_ring

    def _accept(self, frame: Outstanding, in_slot: list, tokens: mx.array, chosen: mx.array, top) -> List[int]:
        """Each row's token (evaluated) to its sequence; rows that finish end here. The rows kept."""
        with self.clock.part("accept"):
            tops = top_logprobs(frame.sequences, top)
            tokens, chosen = tokens.tolist(), chosen.tolist()
            keep, ended = [], []
            for row, (i, seq) in enumerate(in_slot):
                reason = seq.accept(tokens[i], chosen[i], tops[i])
                if reason is None:
                    keep.append(row)
                else:
                    ended.append((seq, row, reason))
        self.finish_rows(ended, frame.slot)
        return keep

    def _pick(self, sequences: List[Sequence], h: mx.array) -> tuple:
        """(next tokens, their log-probabilities, the top candidates or None), lazily,
        from the last rank's output. Tokens are drawn from what the logits processors
        make of the logits; the logprobs reported are the model's."""
        with self.clock.part("sample"):
            return self._sampled(sequences, h)

    def _sampled(self, sequences: List[Sequence], h: mx.array) -> tuple:
        logits = self.pipeline.stage.head(h)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = draw(sequences, shaped_logprobs(sequences, logits, logprobs))
        # Everything read after the eval is shaped here: an op on it made after the
        # eval would queue behind the lookahead step sent meanwhile, and wait for it.
        chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
        return tokens, chosen, top_candidates(sequences, logprobs)

    def finish(self, seq: Sequence, reason: str, slot: Optional[int] = None, row: int = 0) -> None:
        """End `seq`; `slot` and `row`: where its caches still are (None: nowhere whole)."""
        if slot is None:
            seq.finish(reason)
            self.sequences -= 1
        else:
            self.finish_rows([(seq, row, reason)], slot)

    def finish_rows(self, ended: List[tuple], slot: int) -> None:
        """End each (seq, row, reason) of `ended`, rows of `slot` (their caches stored first, together)."""
        if not ended:
            return
        with self.clock.part("prefix"):
            self.prefix.snapshot([(seq, row) for seq, row, _ in ended], slot)
        for seq, _, reason in ended:
            seq.finish(reason)
            self.sequences -= 1

    # -- a frame that failed ---------------------------------------------------
    # A frame that comes back NO_MEMORY (memory_guard.py: a rank could not allocate for it, or it
    # raised there), or whose reply rank 0 cannot evaluate, fails: ranks before the one that failed
    # ran it and ranks after did not, so its rows' caches no longer agree. Each of its sequences
    # ends with an error naming the cause, and its rows leave wherever they are now (a decode
    # group, a prefilled batch waiting to join one, the batch being sent) through the ordinary
    # cache ops, as a cancellation's would, so every rank drops them. The ring and every other
    # sequence go on.

    def fail_frame(self, frame: Outstanding, payload: mx.array) -> None:
        """`frame` came back NO_MEMORY with `payload` (or failed here: failed_here)."""
        message = describe(payload)
        doomed = [s for s in frame.sequences + list(frame.chunk) if not s.finished]
        ids = {id(s) for s in doomed}
        for group in self.groups:
            group.members = self._without(group.slot, group.members, ids)
        for batch in list(self.ready):
            batch.members = self._without(batch.slot, batch.members, ids)
            if not batch.members:
                self.ready.remove(batch)
        self.admission.abandon(ids)
        if frame.group is not None:
            frame.group.busy = False  # this was its step in the ring
        for seq in doomed:
            seq.finish("error", error=message)
            self.sequences -= 1

    def failed_here(self, frame: Outstanding, e: Exception, sent_next: bool = False) -> None:
        """Rank 0's evaluation of `frame`'s reply raised `e`: the frame fails where MLX could not
        allocate (Apple GPUs and CUDA raise; this CPU's allocator cannot); anything else is raised
        again. The step built on it meanwhile (`sent_next`) keeps its group busy until its reply
        is read and dropped."""
        if not allocation_failed(e):
            raise e
        self.fail_frame(frame, self.pipeline.guard.own_failure())
        if sent_next:
            frame.group.busy = True

    def _reply_failed(self, frame: Outstanding, ahead, sent_next: bool) -> bool:
        """Check a step's reply received ahead (Pipeline.recv_ahead) once it has come: whether it
        is NO_MEMORY in place of hidden states (the frame then fails). The step built on it
        meanwhile (`sent_next`) is in the ring: its rows have finished by then, so its reply is
        read and dropped, and the group stays busy until it comes."""
        header = self.pipeline.reply_header(ahead)
        if header.op != Op.NO_MEMORY:
            assert header.op == Op.FORWARD and header.payload_shape() == ahead.payload.shape, header
            return False
        self.fail_frame(frame, ahead.payload_as(header))
        if sent_next:
            frame.group.busy = True
        return True

    def _evaluated(self, frame: Outstanding, arrays, sent_next: bool = False) -> bool:
        """Evaluate rank 0's part of `frame`'s reply (the head and the sampler; with one rank the
        whole frame); whether it was (failed_here otherwise)."""
        try:
            with self.pipeline.stats.computing():  # rank 0 waits for its own computation (RankStats)
                mx.eval(*arrays)
            return True
        except Exception as e:
            self.failed_here(frame, e, sent_next)
            return False

    def _without(self, slot: int, members: List[Sequence], ids: set) -> List[Sequence]:
        """`members` of `slot` but those in `ids`, whose rows leave its caches on every rank."""
        keep = [i for i, s in enumerate(members) if id(s) not in ids]
        if len(keep) < len(members):
            self.pipeline.filter(slot, keep)  # none kept: the slot is dropped
        return [members[i] for i in keep]
