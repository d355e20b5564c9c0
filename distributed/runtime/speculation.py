"""Speculative decoding through the ring: a drafter proposes the next K tokens, one
verification frame carries the last token and the K drafts (K + 1 positions) through
every stage, and rank 0 samples each position from the target's logits, accepting
drafts while they equal what it drew (mlx-lm's speculative_generate_step rule: every
token streamed is the target's own draw, so greedy output is the same token for token
and sampled output keeps the target's distribution). The caches of every rank then
drop the positions of the rejected drafts (Op.TRIM: caches.trim_newest).

Drafters: prompt lookup (n-gram matching over the prompt and the text so far, as
HF transformers' prompt_lookup_num_tokens and vLLM's ngram method do) and a draft model
(draft_model.py); with both, a lookup match wins (it copies text the sequence already
holds) and the model drafts otherwise. A drafter only proposes; it never changes what
is streamed. How many drafts a pass carries adapts per sequence (HF transformers'
heuristic schedule): two more after a pass whose drafts all held, one fewer otherwise,
between 1 and --num-draft-tokens.

Verification frames as rank 0's Batcher sends and receives them (Verifier), and drafting
ahead: frames of one sequence that follow each other around the ring. A one-row group that
speculates sends its last token and its drafts as one frame of K + 1 positions; its reply
judges them. With several ranks, the frame leaves rank 0 idle until
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
only while odds ** n >= AHEAD_ODDS (python -m bench speculation --ring-ceiling: at 1/2, drafts
with one wrong in 4 lost 15-25% against one frame at a time; docs/command-line.md has the figures).
"""

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import mlx.core as mx

from ..transport import Op, Reply
from .caches import is_batch
from .frames import DEFAULT_DRAFT_TOKENS, FrameKind, Outstanding

FIRST_DRAFTS = 4  # drafts of a sequence's first pass; then it adapts (most: frames.DEFAULT_DRAFT_TOKENS)


@dataclass
class SpeculationOptions:
    """What the server speculates with (the command line's --prompt-lookup, --draft-model,
    --num-draft-tokens)."""

    prompt_lookup: bool = False
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS
    max_ngram: int = 3  # longest suffix of the history matched earlier in it
    min_ngram: int = 2  # shortest: one token alone predicts too little
    draft: Any = None  # the draft model's Stage (every layer), loaded on rank 0
    measured: bool = True  # pause where passes cost more than plain steps (PassClock); False: never
    ahead: bool = True  # draft frames ahead of those in the ring (Verifier); False: one at a time

    @property
    def enabled(self) -> bool:
        return (self.prompt_lookup or self.draft is not None) and self.num_draft_tokens > 0


def make_drafter(options: SpeculationOptions, sequences: int = 1):
    """The drafter `options` ask for (None: no speculation); `sequences`: how many may
    speculate at once (one-row groups: one per rank at most), whose draft caches are kept."""
    if not options.enabled:
        return None
    drafters = [PromptLookupDrafter(options)] if options.prompt_lookup else []
    if options.draft is not None:
        from .draft_model import ModelDrafter

        drafters.append(ModelDrafter(options.draft, sequences))
    return drafters[0] if len(drafters) == 1 else FirstProposal(drafters)


class FirstProposal:
    """Several drafters: the first that proposes anything."""

    def __init__(self, drafters):
        self.drafters = drafters

    def propose(self, seq, k: int, after: Sequence[int] = ()) -> List[int]:
        for drafter in self.drafters:
            drafts = drafter.propose(seq, k, after)
            if drafts:
                return drafts
        return []


def prompt_lookup(history: List[int], k: int, max_ngram: int = 3, min_ngram: int = 2) -> List[int]:
    """Up to k tokens that followed the latest earlier occurrence of the history's last
    n tokens (the longest min_ngram <= n <= max_ngram that occurs), or none."""
    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        suffix = history[-n:]
        # The latest match first: recent text predicts the continuation best.
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == suffix:
                follow = history[start + n:start + n + k]
                if follow:
                    return follow
    return []


class PromptLookupDrafter:
    """Drafts for a sequence from its own prompt and generated text (no model)."""

    def __init__(self, options: Optional["SpeculationOptions"] = None):
        options = options or SpeculationOptions()
        self.max_ngram, self.min_ngram = options.max_ngram, options.min_ngram

    def propose(self, seq, k: int, after: Sequence[int] = ()) -> List[int]:
        history = list(seq.request.prompt_ids) + seq.generated + list(after)
        return prompt_lookup(history, k, self.max_ngram, self.min_ngram)


MAX_PAUSE = 32  # tokens
PROBE = 4  # plain tokens timed after a sequence's first pass, to compare the two
COSTLY_PAUSE = 16  # plain tokens after a pass that cost more per token than plain steps (doubling: back_off)
MAX_COSTLY_PAUSE = 256
DECAY = 0.5  # PassClock: the weight of the sums so far at each new observation


class PassClock:
    """What a sequence's tokens cost, measured on rank 0's clock: seconds per token of its
    verification passes (from the token before the pass, drafting included, to the pass's
    last token) and of its plain steps (from one token to the next, with the lookahead a
    pass forgoes). Speculation pays only while passes cost less. Each is a ratio of decayed
    sums (time over tokens, the older half as much at each new observation), so a pass of
    one token weighs a fifth of a pass of five: an average of per-pass rates made one
    rejected pass outweigh several that held, and paused passes that paid (the tiny editor,
    with OpenBLAS: 7 passes in 80 tokens where 19 paid)."""

    def __init__(self):
        self.measured = True  # False: never compared (SpeculationOptions.measured)
        self.last: Optional[float] = None  # when its last token was accepted
        self.pass_start: Optional[float] = None
        self.pending = 0  # tokens of the judged pass not accepted yet
        self.tokens = 0  # the judged pass's tokens
        self.spec_time = self.spec_tokens = self.plain_time = self.plain_tokens = 0.0
        self.costly = 0  # passes in a row that cost more than plain steps

    def drafting(self) -> None:
        self.pass_start = self.last

    def judged(self, tokens: int) -> None:
        self.pending = self.tokens = tokens

    def token(self, now: float) -> None:
        if self.pending:
            self.pending -= 1
            if not self.pending and self.pass_start is not None:
                self.spec_time = DECAY * self.spec_time + now - self.pass_start
                self.spec_tokens = DECAY * self.spec_tokens + self.tokens
        elif self.last is not None:
            self.plain_time = DECAY * self.plain_time + now - self.last
            self.plain_tokens = DECAY * self.plain_tokens + 1
        self.last = now

    @property
    def spec(self) -> Optional[float]:
        return self.spec_time / self.spec_tokens if self.spec_tokens else None

    @property
    def plain(self) -> Optional[float]:
        return self.plain_time / self.plain_tokens if self.plain_tokens else None

    @property
    def costs_more(self) -> bool:
        return self.spec is not None and self.plain is not None and self.spec > self.plain


@dataclass
class SpeculationState:
    """One sequence's speculation: its back-off, its draft count, what its passes cost, and its
    verification frames in the ring (Verifier)."""

    pause: int = 0  # tokens to decode without drafts (back_off)
    misses: int = 0  # passes in a row whose drafts all missed
    empty: int = 0  # proposals in a row that found nothing to draft
    k: int = 0  # drafts its next pass may carry (adapt; 0: not yet set)
    clock: PassClock = field(default_factory=PassClock)  # what its passes and plain steps cost
    in_flight: list = field(default_factory=list)  # its verification frames in the ring, oldest first
    all_held: bool = False  # its last pass's drafts all held: frames may be drafted ahead
    ahead_odds: float = 0.5  # that a frame drafted ahead holds (Verifier)

    def back_off(self, accepted: Optional[int]) -> None:
        """After a pass (`accepted` drafts) or a step that found nothing to propose (None): a
        sequence whose drafts all missed decodes its next 2, 4, ... 32 tokens plainly (with the
        lookahead that a verification frame forgoes), so text that does not repeat costs little;
        a hit resets that. Nothing to propose skips 1, 2, 4, ... 32 tokens, one more doubling for
        each proposal in a row that found nothing (a step that may verify drafts forgoes the
        lookahead, so text where lookup never matches would pay that on every other token: on an
        H200 ring of two, 48.6 against 55.6 tok/s with one token skipped each time). By measured
        cost (PassClock): after its first pass a sequence decodes PROBE tokens plainly to time
        them, and while its passes cost more per token than plain steps it decodes COSTLY_PAUSE
        tokens plainly between passes, twice as many after each such pass in a row, up to
        MAX_COSTLY_PAUSE (each pass after a pause measures again; one that pays resets it): a
        drafter that never pays costs a few passes, not one every 16 tokens (with the bundled
        draft on held-out text that was 13 passes in 200 tokens, 18-26% slower at P = 3 and 4)."""
        if accepted is None:
            self.empty += 1
            self.pause = min(2 ** (self.empty - 1), MAX_PAUSE)
        elif accepted:
            self.misses = 0
        else:
            self.misses += 1
            self.pause = min(2 ** self.misses, MAX_PAUSE)
        clock = self.clock
        if accepted is not None and clock.measured:
            if clock.plain is None:
                self.pause = max(self.pause, PROBE)
            elif clock.costs_more:
                clock.costly += 1
                self.pause = max(self.pause, min(COSTLY_PAUSE * 2 ** (clock.costly - 1), MAX_COSTLY_PAUSE))
            else:
                clock.costly = 0

    def adapt(self, drafted: int, accepted: int, most: int) -> None:
        """The next pass drafts two more after all `drafted` held, one fewer otherwise."""
        self.k = min(most, self.k + 2) if accepted == drafted else max(1, self.k - 1)


@dataclass
class SpeculationStats:
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of those, streamed
    passes: int = 0  # verification frames judged
    cancelled: int = 0  # frames drafted ahead on drafts that did not hold, dropped unjudged (Verifier)

    def as_dict(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "passes": self.passes, "cancelled": self.cancelled}


def draft_count(seq, options: SpeculationOptions) -> int:
    """How many drafts the sequence's next pass asks for (FIRST_DRAFTS before its first, then as it adapts)."""
    return seq.spec.k or min(FIRST_DRAFTS, options.num_draft_tokens)


def propose(drafter, options: SpeculationOptions, seq) -> List[int]:
    """The drafter's tokens for `seq`'s next pass: never more than it can still take after
    the token the pass gives anyway; nothing to propose backs off one token."""
    seq.spec.k = draft_count(seq, options)
    seq.spec.clock.measured = options.measured
    k = min(seq.spec.k, seq.request.max_tokens - seq.count - 1)
    drafts = drafter.propose(seq, k) if k > 0 else []
    if drafts and seq.logits.constraint is not None:  # what the grammar forbids cannot be accepted
        drafts = seq.logits.constraint.valid_prefix(seq.generated, drafts)
    if k > 0 and not drafts:
        seq.spec.back_off(None)
    if drafts:
        seq.spec.empty = 0
        seq.spec.clock.drafting()
    return drafts


def propose_ahead(drafter, options: SpeculationOptions, seq, assumed: List[int], room: int) -> List[int]:
    """A frame to send behind those in the ring (Verifier): the token that follows
    `assumed` (what they verify, if all of it holds), then its drafts, `room` tokens at
    most; nothing to propose is no frame (no back-off: the frames in the ring decide)."""
    k = min(seq.spec.k + 1, room)
    return drafter.propose(seq, k, assumed) if k > 0 else []


def judge(head, seq, drafts: List[int], h: mx.array, most: int = DEFAULT_DRAFT_TOKENS):
    """A verification frame's reply `h` (1, K + 1, hidden): the tokens to stream (the
    target's draws up to the first that differs from its draft, that one included), their
    logprobs and top logprobs; the sequence backs off if no draft held, and its next
    pass drafts up to `most`."""
    logits = head(h)[0]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if seq.greedy and not seq.logits.shapes:  # every position's draw, logprob and top logprobs in one evaluation
        picked, best = mx.argmax(logprobs, axis=-1), mx.max(logprobs, axis=-1)
        top = seq.logits.top_of(logprobs)
        mx.eval(picked, best, *(top or ()))
        tokens = _until_mismatch(picked.tolist(), drafts)
        chosen = best.tolist()[:len(tokens)]
        tops = _tops(top, len(tokens))
    else:
        mx.eval(logprobs)
        tokens = draws(seq, logits, logprobs, drafts)
        chosen, tops = reported(seq, logprobs, tokens)
    seq.spec.clock.judged(len(tokens))
    seq.spec.back_off(len(tokens) - 1)
    seq.spec.adapt(len(drafts), len(tokens) - 1, most)
    return tokens, chosen, tops


def draws(seq, logits: mx.array, logprobs: mx.array, drafts: List[int]) -> List[int]:
    """The target's token at each verified position (logits, logprobs: (K + 1, vocab)),
    as far as they go: up to the first that differs from its draft, included. Draws
    from what the sequence's logits processors and grammar make of each position's logits,
    with the history of the tokens accepted before it, as decoding one at a time would."""
    if not seq.logits.shapes:
        picked = mx.argmax(logprobs, axis=-1) if seq.greedy else seq.sample(logprobs)
        tokens = picked.tolist()
        return _until_mismatch(tokens, drafts)
    tokens, history = [], list(seq.generated)
    for i in range(len(drafts) + 1):
        row = seq.logits.process(logits[i:i + 1], history + tokens)
        row = row - mx.logsumexp(row, axis=-1, keepdims=True)
        token = (mx.argmax(row, axis=-1) if seq.greedy else seq.sample(row)).item()
        tokens.append(token)
        if i == len(drafts) or token != drafts[i]:
            break
    return tokens


def _until_mismatch(tokens: List[int], drafts: List[int]) -> List[int]:
    for i, draft in enumerate(drafts):
        if tokens[i] != draft:
            return tokens[:i + 1]
    return tokens[:len(drafts) + 1]


def reported(seq, logprobs: mx.array, tokens: List[int]):
    """(logprob of each token, its top logprobs or None) at the verified positions."""
    n = len(tokens)
    chosen = mx.take_along_axis(logprobs[:n], mx.array(tokens)[:, None], axis=-1)[:, 0]
    top = seq.logits.top_of(logprobs[:n])
    mx.eval(chosen, *(top or ()))
    return chosen.tolist(), _tops(top, n)


def _tops(top, n: int) -> List[Optional[list]]:
    """The first n positions' top logprobs as streamed ((token, logprob) pairs), or None each."""
    if top is None:
        return [None] * n
    return [list(zip(i, v)) for i, v in zip(top[0][:n].tolist(), top[1][:n].tolist())]


ODDS_WEIGHT = 0.25  # of each pass in a sequence's odds that a frame ahead holds
AHEAD_ODDS = 0.8  # the odds a frame ahead must have (see above)


@dataclass
class Verdict:
    """What the Verifier made of a verification frame's reply, for the Batcher to apply (it alone
    changes groups): the frame failed (`no_memory`: a rank's NO_MEMORY payload; `error`: rank 0's
    own evaluation raised), or the sequence `finished` with that reason (its row leaves the group),
    and whether the group's frames are still `in_ring`, with the frames `sent` ahead meanwhile."""

    no_memory: Optional[mx.array] = None
    error: Optional[Exception] = None
    finished: Optional[str] = None
    in_ring: bool = False
    sent: List = field(default_factory=list)


class Verifier:
    """The batcher's verification frames: it drafts and sends them and judges their replies, and
    returns what it sent and decided (Outstanding frames, Verdicts); the Batcher applies it."""

    def __init__(self, pipeline, options: SpeculationOptions):
        self.pipeline, self.options = pipeline, options
        # Drafts for one-row groups (anything with propose(seq, k, after): speculation.py); None: no speculation.
        self.drafter = make_drafter(options, sequences=pipeline.num_ranks)
        self.stats = SpeculationStats()

    def speculates(self, group) -> bool:
        """Whether `group`'s next step may verify drafts: one row (plain caches, which trim),
        past its first token, speculation on for the server and the request, not backing off."""
        seq = group.members[0] if self.drafter is not None and len(group.members) == 1 else None
        return bool(seq and seq.request.speculative and not seq.awaiting_first and not seq.spec.pause
                    and not is_batch(self.pipeline.caches.get(group.slot)))

    def send(self, group) -> List:
        """Draft for `group`'s next step and send its verification frame, then frames ahead of
        it where they may go: the frames sent (none: nothing to propose, decode one token as usual)."""
        if not self.speculates(group):
            return []
        seq = group.members[0]
        drafts = propose(self.drafter, self.options, seq)
        if not drafts:
            return []
        return [self._send_frame(group, seq.next_token, drafts), *self._extend(group)]

    def _extend(self, group) -> List:
        """Send frames ahead of `group`'s frames in the ring, up to one per rank (see above)."""
        seq, sent = group.members[0], []
        while self._may_go_ahead(seq):
            # What the frames in the ring verify, if all of it holds: the oldest one's drafts,
            # then each later one's inputs (its guessed first token, its drafts).
            assumed = seq.spec.in_flight[0].drafts + [t for f in seq.spec.in_flight[1:] for t in f.inputs]
            room = seq.request.max_tokens - seq.count - _fed(seq)  # tokens the next frame may still give
            proposal = propose_ahead(self.drafter, self.options, seq, assumed, room)
            if len(proposal) < 2:  # a guess and a draft at least: a one-token update rotates a window in place,
                break  # where caches.keeping cannot keep what a rejection takes back
            sent.append(self._send_frame(group, proposal[0], proposal[1:]))
        return sent

    def _may_go_ahead(self, seq) -> bool:
        """Whether another frame of `seq` may go behind those in the ring (see above)."""
        spec = seq.spec
        return (self.options.ahead and len(spec.in_flight) < self.pipeline.num_ranks and spec.all_held
                and spec.ahead_odds ** len(spec.in_flight) >= AHEAD_ODDS and seq.greedy and not seq.logits.shapes
                and seq.logits.constraint is None and not spec.pause)

    def _send_frame(self, group, first: int, drafts: List[int]) -> Outstanding:
        """One frame: `first` (the last token, or a guessed one) and its drafts."""
        seq = group.members[0]
        keep = _fed(seq)  # positions a rejection may still take back
        self.pipeline.send(mx.array([[first, *drafts]], dtype=mx.uint32), Reply.ALL, group.slot, keep)
        frame = Outstanding(FrameKind.VERIFY, [seq], group.slot, group, drafts=drafts, inputs=[first, *drafts])
        seq.spec.in_flight.append(frame)
        return frame

    def receive(self, frame, more: bool = True) -> Optional[Verdict]:
        """Stream the target's draws up to the first that differs from its draft (that one
        included: it is the step's own token), then drop the rejected drafts' positions (and
        those of the frames ahead, where their assumptions failed) from every rank's caches:
        they hold the row's history up to its last token fed. `more`: frames ahead may be sent.
        None: the frame was cancelled (drafted ahead on drafts that did not hold)."""
        header, h = self.pipeline.recv()
        if frame.cancelled:  # its positions are gone
            return None
        seq, drafts, stats = frame.sequences[0], frame.drafts, self.stats
        seq.spec.in_flight.pop(0)
        if header.op == Op.NO_MEMORY:  # a rank could not run it (memory_guard.py)
            _cancel_ahead(seq, stats)
            return Verdict(no_memory=h)
        try:
            with self.pipeline.stats.computing():
                tokens, chosen, tops = judge(self.pipeline.stage.head, seq, drafts, h, self.options.num_draft_tokens)
        except Exception as e:  # MLX could not allocate it
            _cancel_ahead(seq, stats)
            return Verdict(error=e)
        stats.passes += 1
        self.pipeline.stats.clock.steps += 1
        stats.drafted += len(drafts)
        stats.accepted += len(tokens) - 1
        seq.spec.all_held = len(tokens) == len(drafts) + 1
        reason, last = None, 0
        for last, token in enumerate(tokens):
            reason = seq.accept(token, chosen[last], tops[last])
            if reason is not None:
                break
        return self._judged(frame, seq, tokens, last, reason, more)

    def _judged(self, frame, seq, tokens: List[int], last: int, reason, more: bool) -> Verdict:
        """After a pass's tokens are accepted up to `last`: trim what was rejected, and send
        frames ahead where those in the ring held; the sequence finishes if `reason`."""
        spec = seq.spec
        held = reason is None and spec.all_held and spec.in_flight and spec.in_flight[0].inputs[0] == tokens[-1]
        outcome = bool(held) if spec.in_flight else spec.all_held  # what became of a frame ahead, or would have
        spec.ahead_odds += ODDS_WEIGHT * (outcome - spec.ahead_odds)
        # Kept: positions 0..last, the inputs before the last token accepted, which the next
        # step feeds (a finished row's caches hold its tokens but the last, as the prefix cache
        # expects); and the frames ahead where their assumptions held.
        dropped = len(frame.drafts) - last + (0 if held else _cancel_ahead(seq, self.stats))
        self.pipeline.trim(frame.slot, dropped, self._next_length(seq) if reason is None and not held else 0)
        verdict = Verdict(finished=reason, in_ring=bool(held))
        if held:
            spec.clock.drafting()  # the next frame's tokens cost from here on
            if more:
                verdict.sent = self._extend(frame.group)
        return verdict

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
