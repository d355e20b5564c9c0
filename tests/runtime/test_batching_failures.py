"""Rank 0 running out of memory in its own evaluation: the request(s) it was evaluating end
with an error naming memory, the others and the ring go on, and the next request is exact.

MLX raises where it cannot allocate on Apple GPUs ("[metal::malloc] Unable to allocate")
and CUDA; on this CPU it cannot (its kernels write through the failed malloc's null buffer:
memory_guard.py). So these tests raise Metal's own error at the very evaluation where MLX
would, once, and check what the runner makes of it. The real thing ran on a GPU (docs/failures.md).
"""

import mlx.core as mx
import pytest
from mlx_lm.utils import load_tokenizer

from distributed.runtime import batching
from distributed.runtime.memory_guard import OUT_OF_MEMORY
from distributed.runtime.request import FinishEvent, GenerationRequest, TokenEvent
from distributed.runtime.request import RING_RESET
from distributed.runtime.scheduler import RingUnavailable, Scheduler
from reference import mlx_lm_greedy
from stages import in_process_pipeline

METAL = "[metal::malloc] Unable to allocate 1073741824 bytes"
A = [(3 * i + 5) % 250 + 1 for i in range(21)]
B = [(7 * i + 2) % 250 + 1 for i in range(9)]
C = [(11 * i + 1) % 250 + 1 for i in range(30)]


class FailsOnce:
    """`fn` that raises Metal's allocation error on its `at`-th call (counting from 1)."""

    def __init__(self, fn, at: int):
        self.fn, self.at, self.calls = fn, at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError(METAL)
        return self.fn(*args, **kwargs)


class MlxWith:
    """mlx.core with one function replaced, as a module sees it."""

    def __init__(self, **replaced):
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(mx, name)


def run(path, split, prompts, max_tokens=12, max_batch=16):
    pipeline, _ = in_process_pipeline(path, split)
    scheduler = Scheduler(pipeline, load_tokenizer(path), prefill_step_size=8, max_batch=max_batch)
    return scheduler, [scheduler.submit(GenerationRequest(list(p), max_tokens=max_tokens)) for p in prompts]


def outcome(handle):
    events = list(handle.events())
    finish = events[-1]
    assert isinstance(finish, FinishEvent)
    return [e.token_id for e in events if isinstance(e, TokenEvent)], finish


def assert_memory_error(finish):
    assert finish.finish_reason == "error" and finish.error.startswith(f"{OUT_OF_MEMORY} on rank 0"), finish.error


def assert_serves_exactly(scheduler, path, prompt=C):
    handle = scheduler.submit(GenerationRequest(list(prompt), max_tokens=12))
    scheduler.run_pending()
    assert scheduler.failure is None
    tokens, finish = outcome(handle)
    assert tokens == mlx_lm_greedy(path, prompt, 12, 8)[0] and finish.finish_reason == "length"
    assert scheduler.pipeline.caches.slots == {}
    for handler in getattr(scheduler.pipeline.transport, "handlers", []):
        assert handler.__self__.caches.slots == {}  # every rank dropped them


def test_one_rank_decode_step_that_cannot_allocate_fails_its_request(hf_checkpoint, monkeypatch):
    scheduler, [a] = run(hf_checkpoint, (8,), [A])
    failing = FailsOnce(mx.async_eval, at=4)  # the batcher starts each step's device work so
    monkeypatch.setattr(batching, "mx", MlxWith(async_eval=failing))
    scheduler.run_pending()
    tokens, finish = outcome(a)
    assert_memory_error(finish)
    assert 0 < len(tokens) < 12 and tokens == mlx_lm_greedy(hf_checkpoint, A, 12, 8)[0][:len(tokens)]
    assert scheduler.pipeline.stats.report()["memory_refused_frames"] == 1
    assert_serves_exactly(scheduler, hf_checkpoint)


def test_one_rank_prefill_chunk_that_cannot_allocate_fails_its_request(hf_checkpoint, monkeypatch):
    scheduler, [a] = run(hf_checkpoint, (8,), [A])
    caches = scheduler.pipeline.caches
    monkeypatch.setattr(caches, "evaluate", FailsOnce(caches.evaluate, at=2))  # A's second chunk
    scheduler.run_pending()
    tokens, finish = outcome(a)
    assert_memory_error(finish)
    assert tokens == []
    assert_serves_exactly(scheduler, hf_checkpoint)


def test_a_reply_rank_0_cannot_evaluate_fails_its_group_and_the_other_goes_on(hf_checkpoint, monkeypatch):
    """Two stages, two decode groups: one request in each. Rank 0's head and sampler over
    one group's reply cannot allocate; the other group's request gets every greedy token."""
    scheduler, handles = run(hf_checkpoint, (3, 5), [A, B])
    monkeypatch.setattr(batching, "mx", MlxWith(eval=FailsOnce(mx.eval, at=6)))
    scheduler.run_pending()
    (ta, fa), (tb, fb) = outcome(handles[0]), outcome(handles[1])
    failed, served = ((fa, ta, A), (fb, tb, B)) if fa.finish_reason == "error" else ((fb, tb, B), (fa, ta, A))
    assert_memory_error(failed[0])
    assert failed[1] == mlx_lm_greedy(hf_checkpoint, failed[2], 12, 8)[0][:len(failed[1])]
    assert served[0].finish_reason == "length" and served[1] == mlx_lm_greedy(hf_checkpoint, served[2], 12, 8)[0]
    assert_serves_exactly(scheduler, hf_checkpoint)


def test_an_allocation_failure_outside_any_one_frame_ends_the_running_requests_not_the_queue(
        hf_checkpoint, monkeypatch):
    """Rank 0 cannot allocate where no one frame is to blame: the admitted requests end
    naming memory, every rank drops their caches, and the queued one is served exactly."""
    scheduler, (a, b, c) = run(hf_checkpoint, (3, 5), [A, B, C], max_batch=2)
    batcher = scheduler.batcher
    monkeypatch.setattr(batcher, "_fill", FailsOnce(batcher._fill, at=5))
    scheduler.run_pending()
    assert scheduler.failure is None
    for handle in (a, b):
        assert_memory_error(outcome(handle)[1])
    tokens, finish = outcome(c)
    assert tokens == mlx_lm_greedy(hf_checkpoint, C, 12, 8)[0] and finish.finish_reason == "length"
    assert_serves_exactly(scheduler, hf_checkpoint, B)


def test_any_other_error_in_a_step_resets_the_ring_and_it_serves_on(hf_checkpoint, monkeypatch):
    """An error that is not memory's, where no one row is to blame: the running requests end
    naming a reset, every rank drops every slot, and the ring serves the next request exactly."""
    scheduler, [a, b] = run(hf_checkpoint, (3, 5), [A, B])

    def broken(*args):
        raise RuntimeError("[recv] connection reset by peer")

    monkeypatch.setattr(batching, "mx", MlxWith(eval=broken))
    scheduler.run_pending()
    monkeypatch.undo()
    assert scheduler.failure is None
    for handle in (a, b):
        finish = outcome(handle)[1]
        assert finish.finish_reason == "error" and finish.error.startswith(RING_RESET) and "RuntimeError" in finish.error
    assert_serves_exactly(scheduler, hf_checkpoint)


def test_a_ring_that_cannot_be_reset_is_down_and_the_loop_ends(hf_checkpoint, monkeypatch):
    """When the reset fails too (the link is gone), nothing stays half-alive: every request
    ends naming the failure, new ones are refused, and serve_forever returns (the process exits)."""
    scheduler, [a] = run(hf_checkpoint, (3, 5), [A])

    def broken(*args):
        raise RuntimeError("[recv] connection reset by peer")

    monkeypatch.setattr(batching, "mx", MlxWith(eval=broken))
    monkeypatch.setattr(scheduler.pipeline, "clear", broken)
    scheduler.serve_forever()  # returns: the loop ended
    assert scheduler.failure is not None and "connection reset" in scheduler.failure
    assert outcome(a)[1].finish_reason == "error"
    with pytest.raises(RingUnavailable):
        scheduler.submit(GenerationRequest(list(B), max_tokens=4))
