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
with one wrong in 4 lost 15-25% against one frame at a time; README has the figures).
"""

from typing import List

import mlx.core as mx

from ..transport import Op, Reply
from .caches import is_batch
from .frames import Outstanding
from .memory_failure import fail_frame, failed_here
from .speculation import draft_count, judge, propose, propose_ahead

ODDS_WEIGHT = 0.25  # of each pass in a sequence's odds that a frame ahead holds
AHEAD_ODDS = 0.8  # the odds a frame ahead must have (see above)


def speculates(batcher, group) -> bool:
    """Whether `group`'s next step may verify drafts: one row (plain caches, which trim),
    past its first token, speculation on for the server and the request, not backing off."""
    seq = group.members[0] if batcher.drafter is not None and len(group.members) == 1 else None
    return bool(seq and seq.request.speculative and not seq.awaiting_first and not seq.draft_pause
                and not is_batch(batcher.pipeline.caches.get(group.slot)))


def send_verify(batcher, group) -> bool:
    """Draft for `group`'s next step and send its verification frame, then frames ahead of
    it where they may go; False: nothing to propose (decode one token as usual)."""
    if not speculates(batcher, group):
        return False
    seq = group.members[0]
    drafts = propose(batcher.drafter, batcher.speculation, seq)
    if not drafts:
        return False
    _send(batcher, group, seq.next_token, drafts)
    extend(batcher, group)
    return True


def extend(batcher, group) -> None:
    """Send frames ahead of `group`'s frames in the ring, up to one per rank (see above)."""
    seq = group.members[0]
    while _may_go_ahead(batcher, seq):
        # What the frames in the ring verify, if all of it holds: the oldest one's drafts,
        # then each later one's inputs (its guessed first token, its drafts).
        assumed = seq.in_flight[0].drafts + [t for f in seq.in_flight[1:] for t in f.inputs]
        room = seq.request.max_tokens - seq.count - _fed(seq)  # tokens the next frame may still give
        proposal = propose_ahead(batcher.drafter, batcher.speculation, seq, assumed, room)
        if len(proposal) < 2:  # a guess and a draft at least: a one-token update rotates a window in place,
            return  # where caches.keeping cannot keep what a rejection takes back
        _send(batcher, group, proposal[0], proposal[1:])


def _may_go_ahead(batcher, seq) -> bool:
    """Whether another frame of `seq` may go behind those in the ring (see above)."""
    return (batcher.speculation.ahead and len(seq.in_flight) < batcher.pipeline.num_ranks and seq.all_held
            and seq.ahead_odds ** len(seq.in_flight) >= AHEAD_ODDS and seq.greedy and not seq.logits.shapes
            and seq.logits.constraint is None and not seq.draft_pause)


def _fed(seq) -> int:
    """Positions `seq`'s frames in the ring feed (as many tokens as they give where all holds)."""
    return sum(len(f.inputs) for f in seq.in_flight)


def _send(batcher, group, first: int, drafts: List[int]) -> None:
    """One frame: `first` (the last token, or a guessed one) and its drafts."""
    seq = group.members[0]
    keep = _fed(seq)  # positions a rejection may still take back
    batcher.pipeline.send(mx.array([[first, *drafts]], dtype=mx.uint32), Reply.ALL, group.slot, keep)
    group.busy = True
    frame = Outstanding("verify", [seq], group.slot, group, drafts=drafts, inputs=[first, *drafts])
    seq.in_flight.append(frame)
    batcher._expect(frame)


def receive_verify(batcher, frame, more: bool = True) -> None:
    """Stream the target's draws up to the first that differs from its draft (that one
    included: it is the step's own token), then drop the rejected drafts' positions (and
    those of the frames ahead, where their assumptions failed) from every rank's caches:
    they hold the row's history up to its last token fed. `more`: frames ahead may be sent."""
    header, h = batcher.pipeline.recv()
    if frame.cancelled:  # drafted ahead on drafts that did not hold: its positions are gone
        return
    seq, drafts = frame.sequences[0], frame.drafts
    seq.in_flight.pop(0)
    if header.op == Op.NO_MEMORY:  # a rank could not run it (memory_guard.py)
        _cancel_ahead(seq, batcher.spec_stats)
        return fail_frame(batcher, frame, h)
    try:
        with batcher.pipeline.stats.computing():
            tokens, chosen, tops = judge(batcher.pipeline.stage.head, seq, drafts, h,
                                         batcher.speculation.num_draft_tokens)
    except Exception as e:  # MLX could not allocate it (memory_failure.py)
        _cancel_ahead(seq, batcher.spec_stats)
        return failed_here(batcher, frame, e)
    stats = batcher.spec_stats
    stats.passes += 1
    stats.drafted += len(drafts)
    stats.accepted += len(tokens) - 1
    seq.all_held = len(tokens) == len(drafts) + 1
    reason, last = None, 0
    for last, token in enumerate(tokens):
        reason = seq.accept(token, chosen[last], tops[last])
        if reason is not None:
            break
    held = reason is None and seq.all_held and seq.in_flight and seq.in_flight[0].inputs[0] == tokens[-1]
    outcome = bool(held) if seq.in_flight else seq.all_held  # what became of a frame ahead, or would have
    seq.ahead_odds += ODDS_WEIGHT * (outcome - seq.ahead_odds)
    # Kept: positions 0..last, the inputs before the last token accepted, which the next
    # step feeds (a finished row's caches hold its tokens but the last, as the prefix cache
    # expects); and the frames ahead where their assumptions held.
    dropped = len(drafts) - last + (0 if held else _cancel_ahead(seq, stats))
    batcher.pipeline.trim(frame.slot, dropped, _next_length(batcher, seq) if reason is None and not held else 0)
    if reason is not None:
        batcher._finish(seq, reason, frame.slot, 0)
        batcher.pipeline.filter(frame.slot, [])
        frame.group.members = []
    if held:
        seq.pass_clock.drafting()  # the next frame's tokens cost from here on
        if more:
            extend(batcher, frame.group)
    frame.group.busy = bool(held)


def verifies_after_step(batcher, group) -> int:
    """A step sent ahead (batching.py's lookahead: before the token of the step before it is
    accepted): the positions of the verification frame expected to follow it, for the other
    ranks to build ahead (Pipeline.send), where the sequence's back-off runs out with that
    token; 0: none expected."""
    seq = group.members[0] if len(group.members) == 1 else None
    return _frame_length(batcher, seq, 2) if seq is not None and seq.draft_pause == 1 else 0


def _next_length(batcher, seq) -> int:
    """The positions of the sequence's next frame as far as rank 0 can tell after judging a
    pass, for the other ranks to build it ahead (Pipeline.trim): a step where it backs off,
    else its next verification frame; 0: not known."""
    return 1 if seq.draft_pause else _frame_length(batcher, seq, 0)


def _frame_length(batcher, seq, later: int) -> int:
    """K + 1 for the verification frame the sequence drafts once `later` more tokens are
    accepted, where the drafter proposes all K it is asked for (a draft model: prompt lookup
    may find fewer); 0: not known."""
    if not getattr(batcher.drafter, "proposes_all", False) or not seq.request.speculative:
        return 0
    k = min(draft_count(seq, batcher.speculation), seq.request.max_tokens - seq.count - later - 1)
    return k + 1 if k > 0 else 0


def _cancel_ahead(seq, stats) -> int:
    """Cancel the sequence's frames still in the ring; the positions they fed."""
    fed = _fed(seq)
    stats.cancelled += len(seq.in_flight)
    for f in seq.in_flight:
        f.cancelled = True
    seq.in_flight = []
    return fed
