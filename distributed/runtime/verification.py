"""Verification frames (speculation.py) as rank 0's Batcher sends and receives them, and
drafting ahead: frames of one sequence that follow each other around the ring.

A one-row group that speculates sends its last token and its drafts as one frame of K + 1
positions; its reply judges them. With several ranks, the frame leaves rank 0 idle until
its reply comes back (and the ranks after it idle before it arrives). Drafting ahead
(PipeInfer's asynchronous speculation) fills that: while a frame is in the ring, rank 0
drafts the next one as if every draft of the frames before it holds, guessing their bonus
token too (the drafter's next token is the next frame's first input), and sends it behind
them, up to one frame per rank in the ring. A frame whose assumptions held (the frame
before accepted every draft, and drew the guessed token) is judged as any other; one that
did not is cancelled: every rank drops the positions of the frames behind the rejection
(one TRIM after them, which the ring keeps in order), and their replies are read and
dropped. The tokens streamed are the target's draws either way.

Only where it cannot change what is streamed: greedy rows without logits processors or a
grammar (their next draw depends only on the tokens verified before it), and only after a
pass whose drafts all held. A frame that holds saves a round trip; a cancelled one still
costs every rank its positions and delays the frames behind it. So each sequence keeps the
odds that a frame ahead holds (a moving average of what became of its frames ahead, and
of its other passes' drafts all holding, an upper bound), and the n-th frame ahead goes
only while odds ** n >= AHEAD_ODDS (bench_speculation.py --ring-ceiling: at 1/2, drafts
with one wrong in 4 lost 15-25% against one frame at a time; docs/command-line.md has the figures).
"""

from typing import List

import mlx.core as mx

from ..transport import Op, Reply
from .caches import is_batch
from .frames import FrameKind, Outstanding
from .speculation import SpeculationOptions, SpeculationStats, draft_count, judge, make_drafter, propose, propose_ahead

ODDS_WEIGHT = 0.25  # of each pass in a sequence's odds that a frame ahead holds
AHEAD_ODDS = 0.8  # the odds a frame ahead must have (see above)


class Verifier:
    """The batcher's verification frames. It reaches the batcher only through `batch`'s public
    methods: expect(frame) (a frame was sent), finish(seq, reason, slot, row), fail_frame(frame,
    payload) and failed_here(frame, error)."""

    def __init__(self, pipeline, options: SpeculationOptions, batch):
        self.pipeline, self.options, self.batch = pipeline, options, batch
        # Drafts for one-row groups (anything with propose(seq, k, after): speculation.py); None: no speculation.
        self.drafter = make_drafter(options, sequences=pipeline.num_ranks)
        self.stats = SpeculationStats()

    def speculates(self, group) -> bool:
        """Whether `group`'s next step may verify drafts: one row (plain caches, which trim),
        past its first token, speculation on for the server and the request, not backing off."""
        seq = group.members[0] if self.drafter is not None and len(group.members) == 1 else None
        return bool(seq and seq.request.speculative and not seq.awaiting_first and not seq.spec.pause
                    and not is_batch(self.pipeline.caches.get(group.slot)))

    def send(self, group) -> bool:
        """Draft for `group`'s next step and send its verification frame, then frames ahead of
        it where they may go; False: nothing to propose (decode one token as usual)."""
        if not self.speculates(group):
            return False
        seq = group.members[0]
        drafts = propose(self.drafter, self.options, seq)
        if not drafts:
            return False
        self._send_frame(group, seq.next_token, drafts)
        self._extend(group)
        return True

    def _extend(self, group) -> None:
        """Send frames ahead of `group`'s frames in the ring, up to one per rank (see above)."""
        seq = group.members[0]
        while self._may_go_ahead(seq):
            # What the frames in the ring verify, if all of it holds: the oldest one's drafts,
            # then each later one's inputs (its guessed first token, its drafts).
            assumed = seq.spec.in_flight[0].drafts + [t for f in seq.spec.in_flight[1:] for t in f.inputs]
            room = seq.request.max_tokens - seq.count - _fed(seq)  # tokens the next frame may still give
            proposal = propose_ahead(self.drafter, self.options, seq, assumed, room)
            if len(proposal) < 2:  # a guess and a draft at least: a one-token update rotates a window in place,
                return  # where caches.keeping cannot keep what a rejection takes back
            self._send_frame(group, proposal[0], proposal[1:])

    def _may_go_ahead(self, seq) -> bool:
        """Whether another frame of `seq` may go behind those in the ring (see above)."""
        spec = seq.spec
        return (self.options.ahead and len(spec.in_flight) < self.pipeline.num_ranks and spec.all_held
                and spec.ahead_odds ** len(spec.in_flight) >= AHEAD_ODDS and seq.greedy and not seq.logits.shapes
                and seq.logits.constraint is None and not spec.pause)

    def _send_frame(self, group, first: int, drafts: List[int]) -> None:
        """One frame: `first` (the last token, or a guessed one) and its drafts."""
        seq = group.members[0]
        keep = _fed(seq)  # positions a rejection may still take back
        self.pipeline.send(mx.array([[first, *drafts]], dtype=mx.uint32), Reply.ALL, group.slot, keep)
        group.busy = True
        frame = Outstanding(FrameKind.VERIFY, [seq], group.slot, group, drafts=drafts, inputs=[first, *drafts])
        seq.spec.in_flight.append(frame)
        self.batch.expect(frame)

    def receive(self, frame, more: bool = True) -> None:
        """Stream the target's draws up to the first that differs from its draft (that one
        included: it is the step's own token), then drop the rejected drafts' positions (and
        those of the frames ahead, where their assumptions failed) from every rank's caches:
        they hold the row's history up to its last token fed. `more`: frames ahead may be sent."""
        header, h = self.pipeline.recv()
        if frame.cancelled:  # drafted ahead on drafts that did not hold: its positions are gone
            return
        seq, drafts, stats = frame.sequences[0], frame.drafts, self.stats
        seq.spec.in_flight.pop(0)
        if header.op == Op.NO_MEMORY:  # a rank could not run it (memory_guard.py)
            _cancel_ahead(seq, stats)
            return self.batch.fail_frame(frame, h)
        try:
            with self.pipeline.stats.computing():
                tokens, chosen, tops = judge(self.pipeline.stage.head, seq, drafts, h, self.options.num_draft_tokens)
        except Exception as e:  # MLX could not allocate it
            _cancel_ahead(seq, stats)
            return self.batch.failed_here(frame, e)
        stats.passes += 1
        stats.drafted += len(drafts)
        stats.accepted += len(tokens) - 1
        seq.spec.all_held = len(tokens) == len(drafts) + 1
        reason, last = None, 0
        for last, token in enumerate(tokens):
            reason = seq.accept(token, chosen[last], tops[last])
            if reason is not None:
                break
        self._judged(frame, seq, tokens, last, reason, more)

    def _judged(self, frame, seq, tokens: List[int], last: int, reason, more: bool) -> None:
        """After a pass's tokens are accepted up to `last`: trim what was rejected, finish the
        sequence if `reason`, and send frames ahead where those in the ring held."""
        spec = seq.spec
        held = reason is None and spec.all_held and spec.in_flight and spec.in_flight[0].inputs[0] == tokens[-1]
        outcome = bool(held) if spec.in_flight else spec.all_held  # what became of a frame ahead, or would have
        spec.ahead_odds += ODDS_WEIGHT * (outcome - spec.ahead_odds)
        # Kept: positions 0..last, the inputs before the last token accepted, which the next
        # step feeds (a finished row's caches hold its tokens but the last, as the prefix cache
        # expects); and the frames ahead where their assumptions held.
        dropped = len(frame.drafts) - last + (0 if held else _cancel_ahead(seq, self.stats))
        self.pipeline.trim(frame.slot, dropped, self._next_length(seq) if reason is None and not held else 0)
        if reason is not None:
            self.batch.finish(seq, reason, frame.slot, 0)
            self.pipeline.filter(frame.slot, [])
            frame.group.members = []
        if held:
            spec.clock.drafting()  # the next frame's tokens cost from here on
            if more:
                self._extend(frame.group)
        frame.group.busy = bool(held)

    def length_after_step(self, group) -> int:
        """A step sent ahead (batching.py's lookahead: before the token of the step before it is
        accepted): the positions of the verification frame expected to follow it, for the other
        ranks to build ahead (Pipeline.send), where the sequence's back-off runs out with that
        token; 0: none expected."""
        seq = group.members[0] if len(group.members) == 1 else None
        return self._frame_length(seq, 2) if seq is not None and seq.spec.pause == 1 else 0

    def _next_length(self, seq) -> int:
        """The positions of the sequence's next frame as far as rank 0 can tell after judging a
        pass, for the other ranks to build it ahead (Pipeline.trim): a step where it backs off,
        else its next verification frame; 0: not known."""
        return 1 if seq.spec.pause else self._frame_length(seq, 0)

    def _frame_length(self, seq, later: int) -> int:
        """K + 1 for the verification frame the sequence drafts once `later` more tokens are
        accepted, where the drafter proposes all K it is asked for (a draft model: prompt lookup
        may find fewer); 0: not known."""
        if not getattr(self.drafter, "proposes_all", False) or not seq.request.speculative:
            return 0
        k = min(draft_count(seq, self.options), seq.request.max_tokens - seq.count - later - 1)
        return k + 1 if k > 0 else 0


def _fed(seq) -> int:
    """Positions `seq`'s frames in the ring feed (as many tokens as they give where all holds)."""
    return sum(len(f.inputs) for f in seq.spec.in_flight)


def _cancel_ahead(seq, stats) -> int:
    """Cancel the sequence's frames still in the ring; the positions they fed."""
    fed = _fed(seq)
    stats.cancelled += len(seq.spec.in_flight)
    for f in seq.spec.in_flight:
        f.cancelled = True
    seq.spec.in_flight = []
    return fed
