"""Rank 0's part when a frame comes back NO_MEMORY (memory_guard.py): its requests end.

The frame's rows (a decode step's group, a prefill chunk's batch, or both in one mixed
frame) are lost: ranks before the one that refused it ran it and ranks after did not,
so their caches no longer agree. Each such sequence ends with an error naming memory,
and its rows leave wherever they are now (a decode group, a prefilled batch waiting to
join one, the batch being sent) through the ordinary cache ops, as a cancellation's
would, so every rank drops them. Every other sequence and the ring go on.
"""

from typing import List

import mlx.core as mx

from ..transport import Op
from .memory_guard import allocation_failed, describe


def fail_frame(batcher, frame, payload: mx.array) -> None:
    """`frame` (frames.Outstanding) came back NO_MEMORY with `payload`."""
    message = describe(payload)
    doomed = [s for s in frame.sequences + list(frame.chunk) if not s.finished]
    ids = {id(s) for s in doomed}
    pipeline = batcher.pipeline
    for group in batcher.groups:
        group.members = _without(pipeline, group.slot, group.members, ids)
    for batch in list(batcher.ready):
        batch.members = _without(pipeline, batch.slot, batch.members, ids)
        if not batch.members:
            batcher.ready.remove(batch)
    current = batcher.admission.current
    if current is not None and any(id(s) in ids for s in current.members):
        pipeline.release(current.slot)  # after its chunks still in the ring; a chunk covers every row
        batcher.admission.current = None
    if frame.group is not None:
        frame.group.busy = False  # this was its step in the ring
    for seq in doomed:
        seq.finish("error", error=message)
        batcher.sequences -= 1


def reply_failed(batcher, frame, ahead, sent_next: bool) -> bool:
    """Check a step's reply received ahead (Pipeline.recv_ahead) once it has come: whether
    it is NO_MEMORY in place of hidden states, the frame then failed as fail_frame does.
    The step built on it meanwhile (`sent_next`) is in the ring: its rows have finished by
    then, so its reply is read and dropped, and the group stays busy until it comes."""
    header = batcher.pipeline.reply_header(ahead)
    if header.op != Op.NO_MEMORY:
        assert header.op == Op.FORWARD and header.payload_shape() == ahead.payload.shape, header
        return False
    fail_frame(batcher, frame, ahead.payload_as(header))
    if sent_next:
        frame.group.busy = True
    return True


def evaluated(batcher, frame, arrays, sent_next: bool = False) -> bool:
    """Evaluate rank 0's part of `frame`'s reply (the head and the sampler; with one rank
    the whole frame). Where MLX cannot allocate it (Apple GPUs and CUDA raise; this CPU's
    allocator cannot), the frame fails as a NO_MEMORY reply's does, and the step built on
    it meanwhile (`sent_next`) keeps its group busy until its reply is read and dropped.
    Whether it was evaluated."""
    try:
        with batcher.pipeline.stats.computing():  # rank 0 waits for its own computation (RankStats)
            mx.eval(*arrays)
        return True
    except Exception as e:
        failed_here(batcher, frame, e, sent_next)
        return False


def failed_here(batcher, frame, e: Exception, sent_next: bool = False) -> None:
    """Rank 0's evaluation of `frame`'s reply raised `e`: the frame fails where MLX could
    not allocate (see evaluated); anything else is raised again."""
    if not allocation_failed(e):
        raise e
    fail_frame(batcher, frame, batcher.pipeline.guard.own_failure())
    if sent_next:
        frame.group.busy = True


def fail_everything(batcher, error: Exception) -> None:
    """MLX could not allocate where no one frame is to blame (rank 0's evaluation outside
    the frames above): every admitted request ends with an error naming memory, every
    rank drops their caches, the replies still owed are read and dropped, and the ring
    and the queue go on."""
    batcher.reset(describe(batcher.pipeline.guard.own_failure()) + f" ({error})")


def _without(pipeline, slot: int, members: List, ids: set) -> List:
    """`members` of `slot` but those in `ids`, whose rows leave its caches on every rank."""
    keep = [i for i, s in enumerate(members) if id(s) not in ids]
    if len(keep) < len(members):
        pipeline.filter(slot, keep)  # none kept: the slot is dropped
    return [members[i] for i in keep]
