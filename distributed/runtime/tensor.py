"""Tensor parallelism at run time (--tensor-parallel-size T, T = the number of ranks).

Rank 0 drives the scheduler exactly as one rank does: a TensorPipeline is a Pipeline with no
transport and one stage holding every layer, sharded (shard/tensor.py). The sharded layers'
all_sums pair up only if every rank runs the same graphs in the same order, so before each
frame and each cache op rank 0 broadcasts it (transport/broadcast.py) and the other ranks
replay it in lockstep (TensorFollower): cache ops on their SlotCaches, FORWARD frames through
their stage (embedding included; no head, no sampling). Rank 0 evaluates each frame before the
next broadcast, so the collectives come in the same order everywhere.
"""

import logging
from typing import List, Optional, Sequence

import mlx.core as mx

from ..shard.loader import parameter_bytes
from ..shard.stage import Stage
from ..shard.tensor import release_group
from ..transport import Header, Op, Reply
from ..transport.broadcast import Broadcast
from . import rank_info
from .caches import CACHE_OPS, SlotCaches, keeping
from .memory_guard import MemoryGuard
from .pipeline import Pipeline
from .rank_stats import RankStats

log = logging.getLogger(__name__)


def _info_row(stage: Stage, rank: int) -> mx.array:
    row = rank_info.encode_row(rank, stage.start, stage.end, True, parameter_bytes(stage))
    row[..., 4] = int(rank == 0)  # every rank embeds; rank 0 alone runs the head
    return row


class TensorPipeline(Pipeline):
    def __init__(self, stage: Stage, group):
        super().__init__(stage, None)
        self.broadcast = Broadcast(group)
        self.tensor_size = group.size()
        self.time_sends = False

    def _tell(self, header: Header, values: Sequence[int] = ()) -> None:
        if self._parked:
            self.waker(self._parked)
            self._parked = 0
        self.broadcast.send(header, values)

    def _tell_others(self, op: Op, slot: int, arg: int = 0, values: Sequence[int] = ()) -> None:
        self._tell(Header(op, slot=slot, arg=arg), values)

    def trim(self, slot: int, n: int, next_length: int = 0) -> None:
        if n > 0:
            self._cache_op(Op.TRIM, slot, n)

    def send(self, tokens: mx.array, reply: Reply, slot: int = 0, keep: int = 0, next_length: int = 0) -> None:
        refused = self.guard.verdict([(tokens.shape[0], tokens.shape[1], slot)], self._itemsize)
        if refused is not None:
            return self._refuse(Header(Op.FORWARD, reply, slot), refused)
        self._tell(Header(Op.FORWARD, reply, slot, tokens.shape[0], tokens.shape[1], arg=keep),
                   tokens.reshape(-1).tolist())
        caches = self.caches.get(slot)
        with keeping(caches, keep):
            h = self.stage(self.stage.embed(tokens), caches)
        self.stats.forward_frames += 1
        out = h[:, -1:, :] if reply == Reply.LAST else h
        # Evaluated now, before anything else is broadcast: the other ranks run this frame's
        # all_sums now. (A failure here, allocation included, would leave them mid-frame: it
        # fails the ring, which the watchdog reports.)
        with self.stats.computing():
            mx.eval(out, [c.state for c in caches])
        if reply == Reply.ACK:
            self._local.append((Header(Op.FORWARD, Reply.ACK, slot), None))
        elif reply != Reply.NONE:
            self._local.append((Header(Op.FORWARD, reply, slot), out))

    def send_mixed(self, tokens: mx.array, slot: int, chunk: mx.array, chunk_slot: int) -> None:
        raise NotImplementedError("tensor parallelism has no ring to mix frames in (the batcher mixes with one rank "
                                  "never)")

    def park(self) -> None:
        """The other ranks block on the watchdog's channel, not in the next broadcast."""
        if self.waker is None or self._parked:
            return
        self._parks += 1
        self.broadcast.send(Header(Op.PARK, arg=self._parks))
        self._parked = self._parks

    def clear(self) -> None:
        super().clear()
        self._tell(Header(Op.CLEAR))

    def rank_info(self) -> List[dict]:
        self._tell(Header(Op.INFO))
        rows = rank_info.decode_rows(self.broadcast.gather_rows(_info_row(self.stage, 0)))
        for row in rows:
            row["tensor"] = {"rank": row["rank"], "size": self.tensor_size}
        return rows

    def close(self) -> None:
        if self.broadcast is not None:
            self._tell(Header(Op.STOP))
            self.broadcast = None
            release_group(self.stage)


class TensorFollower:
    """A rank other than 0: replay rank 0's frames and cache ops on this rank's slice."""

    def __init__(self, stage: Stage, group, wait_wake=None):
        self.stage = stage
        self.rank = group.rank()
        self.broadcast = Broadcast(group)
        self.wait_wake = wait_wake
        self.caches = SlotCaches(stage)
        self.guard = MemoryGuard(stage, self.caches, self.rank)
        self.stats = RankStats(self.caches, self.guard)

    def serve(self) -> None:
        """Until rank 0 sends STOP."""
        while True:
            header, values = self.broadcast.recv()
            op = header.op
            if op == Op.FORWARD:
                tokens = mx.array(values, dtype=mx.int32).reshape(header.batch, header.length)
                caches = self.caches.get(header.slot)
                with self.stats.computing():
                    with keeping(caches, header.arg):
                        h = self.stage(self.stage.embed(tokens), caches)
                    mx.eval(h, [c.state for c in caches])
                self.stats.forward_frames += 1
            elif op in CACHE_OPS:
                self.caches.apply(op, header.slot, header.arg, values)
                self.guard.settle()
            elif op == Op.CLEAR:
                self.caches.clear()
                self.guard.settle()
            elif op == Op.INFO:
                self.broadcast.gather_rows(_info_row(self.stage, self.rank))
            elif op == Op.PARK:
                if self.wait_wake is not None:
                    self.wait_wake(header.arg)
            elif op == Op.STOP:
                return
            else:
                raise ValueError(f"rank {self.rank} received unknown op {op}")
