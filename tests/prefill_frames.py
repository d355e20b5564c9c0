"""What the batched-admission tests share (tests/runtime/test_batching_admission.py,
test_memory_guard.py, test_prefix_cache.py): prompts, a log of what rank 0 sends, and ways to
admit requests and check them against mlx-lm alone."""

import threading
from typing import List, NamedTuple, Tuple

from mlx_lm.utils import load_tokenizer

from distributed.runtime.scheduler import Scheduler
from distributed.runtime.request import TokenEvent
from distributed.transport import Reply
from reference import mlx_lm_greedy
from stages import in_process_pipeline

# Different lengths: shorter and longer than the 16-token window and than a 16-token prefill step.
PROMPTS = [[(k * i + 5 * k) % 250 + 1 for i in range(n)] for k, n in [(3, 5), (7, 17), (11, 40), (13, 70), (17, 9), (19, 33)]]
EOS_FIRST = [96, 2, 158]  # the tiny model's first greedy token after this prompt is EOS
STEP = 16


class Send(NamedTuple):
    """A forward frame rank 0 sent."""

    slot: int
    shape: Tuple[int, ...]
    reply: Reply
    in_ring: List  # the kinds of the frames then in the ring
    decoding: bool  # groups were decoding


class CacheOp(NamedTuple):
    op: int
    slot: int
    arg: int
    values: List[int]


class FirstTokens(NamedTuple):
    """A decode step that gives rows their first token."""

    index: int  # in FrameLog.sends
    rows: int  # the step's rows
    fresh: int  # those getting their first token


class FrameLog:
    """What rank 0 sends: each forward frame (slot, shape, reply, the kinds of frames then in the
    ring, whether groups were decoding; a mixed frame is logged as its chunk, then its step), each
    cache op (op, slot, arg, values), and each decode step that gives rows their first token (its
    index in sends, rows, those rows)."""

    def __init__(self, scheduler, on_send=None):
        self.sends, self.ops, self.first = [], [], []
        self.unserved = []  # at each prefill frame: rows prefilled earlier still without their first token
        self.mixed = []  # indices in sends of the chunks that rode in a decode step's frame (the step follows)
        pipeline, batcher = scheduler.pipeline, scheduler.batcher
        send, send_mixed, apply = pipeline.send, pipeline.send_mixed, pipeline.caches.apply

        def log(shape, reply, slot):
            decoding = any(g.members for g in batcher.groups)
            if slot >= self.ranks:
                self.unserved.append(sum(s.awaiting_first for g in batcher.groups for s in g.members)
                                     + sum(len(b.members) for b in batcher.ready))
            self.sends.append(Send(slot, tuple(shape), reply, [o.kind for o in batcher.outstanding], decoding))
            group = next((g for g in batcher.groups if g.slot == slot), None)
            fresh = sum(s.awaiting_first for s in group.members) if group else 0
            if fresh:
                self.first.append(FirstTokens(len(self.sends) - 1, shape[0], fresh))
            if on_send is not None:
                on_send(slot, shape, reply)

        def logged_send(tokens, reply, slot=0, *more, **hints):
            log(tokens.shape, reply, slot)
            return send(tokens, reply, slot, *more, **hints)

        def logged_send_mixed(tokens, slot, chunk, chunk_slot):
            self.mixed.append(len(self.sends))
            log(chunk.shape, Reply.ACK, chunk_slot)
            log(tokens.shape, Reply.LAST, slot)
            return send_mixed(tokens, slot, chunk, chunk_slot)

        def logged_apply(op, slot, arg, values):
            self.ops.append(CacheOp(op, slot, arg, list(values)))
            return apply(op, slot, arg, values)

        self.ranks = pipeline.num_ranks
        pipeline.send, pipeline.send_mixed, pipeline.caches.apply = logged_send, logged_send_mixed, logged_apply

    def prefill(self):
        return [s for s in self.sends if s.slot >= self.ranks]

    def first_rows(self):
        """Rows taking their first token in each decode step that has any, in order."""
        return [f.fresh for f in self.first]

    def order(self):
        """Each prefill batch's slot as its chunks go, and "first" for each step giving
        rows their first token (other steps left out; repeats merged)."""
        first = {f.index for f in self.first}
        marks = ["first" if i in first else s.slot for i, s in enumerate(self.sends) if i in first or s.slot >= self.ranks]
        return [m for i, m in enumerate(marks) if i == 0 or m != marks[i - 1]]

    def batch_rows(self):
        """Rows of each prefill batch, in order (from its first chunk)."""
        first_chunks = dict((s.slot, s.shape) for s in reversed(self.prefill()))
        return [shape[0] for shape in first_chunks.values()][::-1]


def admitted_together(scheduler, requests):
    """Submit while the scheduler loop is held, so every request is admitted in one turn."""
    started, release = threading.Event(), threading.Event()
    blocker = threading.Thread(target=scheduler.call, args=(lambda _: (started.set(), release.wait()),))
    blocker.start()
    started.wait(30)
    handles = [scheduler.submit(r) for r in requests]
    release.set()
    blocker.join()
    return handles


def run_admitted(scheduler, requests):
    """Start the loop, admit `requests` in one turn, take every request's events, stop."""
    scheduler.start()
    try:
        return [list(h.events()) for h in admitted_together(scheduler, requests)]
    finally:
        scheduler.close()


def tokens_of(events):
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def assert_alone(path, prompt, events, max_tokens):
    ref_tokens, ref_logprobs = mlx_lm_greedy(path, prompt, max_tokens, STEP)
    assert tokens_of(events) == ref_tokens
    logprobs = [e.logprob for e in events if isinstance(e, TokenEvent)]
    assert max((abs(a - b) for a, b in zip(logprobs, ref_logprobs)), default=0) < 1e-4


def assert_no_caches_left(pipeline):
    assert pipeline.caches.slots == {}
    for handler in getattr(pipeline.transport, "handlers", []):
        assert handler.__self__.caches.slots == {}


def scheduler_for(path, split, **kw):
    pipeline, _ = in_process_pipeline(path, split)
    kw = dict(dict(prefill_step_size=STEP, max_batch=6), **kw)
    return Scheduler(pipeline, load_tokenizer(path), **kw)
