"""Tensor parallelism at run time (--tensor-parallel-size T).

T = the number of ranks: rank 0 drives the scheduler exactly as one rank does: a TensorPipeline
is a Pipeline with no transport and one stage holding every layer, sharded (shard/tensor.py). The
sharded layers' all_sums pair up only if every rank runs the same graphs in the same order, so
before each frame and each cache op rank 0 broadcasts it (transport/broadcast.py) and the other
ranks replay it in lockstep (TensorFollower): cache ops on their SlotCaches, FORWARD frames through
their stage (embedding included; no head, no sampling). Rank 0 evaluates each frame before the
next broadcast, so the collectives come in the same order everywhere.

T < N (N / T groups of T ranks, on backends that split a group): each group is a pipeline stage
holding its layers sharded; the groups' first ranks form the ring (rank 0's TensorPipeline with a
transport, TensorStageWorker elsewhere) and each broadcasts what it runs (hidden states included)
to the other ranks of its group, which replay it as above.
"""

import logging
import threading
from contextlib import contextmanager
from typing import List, Optional, Sequence

import mlx.core as mx

from ..shard.loader import parameter_bytes
from ..shard.stage import Stage
from ..shard.tensor import release_group
from ..transport import Header, Op, Reply, Transport
from ..transport.broadcast import Broadcast
from . import rank_info
from .caches import CACHE_OPS, SlotCaches, keeping
from .memory_guard import MemoryGuard
from .pipeline import Frame, Pipeline, RankStats, StageWorker

log = logging.getLogger(__name__)


def _info_row(stage: Stage, rank: int) -> mx.array:
    row = rank_info.encode_row(rank, stage.start, stage.end, stage.first, parameter_bytes(stage))
    row[..., 4] = int(rank == 0)  # a first stage's ranks all embed; rank 0 alone runs the head
    return row


def tensor_share(stage: Stage, rank: int, size: int) -> dict:
    """What rank `rank` of a tensor group of `size` holds of each layer (every group's layers are
    shaped alike): its query and KV heads, and of every routed expert its slice of the width."""
    attn = stage.layers[0].self_attn  # n_heads / n_kv_heads: this rank's, once sharded
    share = {"rank": rank, "size": size, "heads": [rank * attn.n_heads, (rank + 1) * attn.n_heads],
             "kv_heads": [rank * attn.n_kv_heads, (rank + 1) * attn.n_kv_heads], "experts": 0, "expert_width": None}
    moe = next((layer.mlp for layer in stage.layers if hasattr(layer.mlp, "experts")), None)
    if moe is not None:  # SwitchGLU's gate_proj: (experts, this rank's width, hidden)
        experts, width = moe.experts.gate_proj.weight.shape[:2]
        share.update(experts=experts, expert_width=[rank * width, (rank + 1) * width])
    return share


def evaluated(h: mx.array, caches: list, last_stage: bool, reply: Reply) -> list:
    """What every rank of a group evaluates for a frame: the stage's output and its caches, or,
    for a prompt chunk whose output nobody reads (the last stage, reply NONE or ACK), the caches
    alone, as one rank does (Pipeline.send): the last layer's attention output and MLP, and their
    all_sums, are skipped on every rank alike. On the embedded model, whose last layer is a
    full-attention one, that is a third of a 16k-token prefill."""
    states = [c.state for c in caches]
    return states if last_stage and reply in (Reply.NONE, Reply.ACK) else [h, states]


def group_loaded(broadcast: Broadcast, here: bool) -> bool:
    """Whether every rank of the tensor group read its share of an entry from disk."""
    return bool(broadcast.gather_rows(mx.array([[[int(here)]]], dtype=mx.int32)).min().item())


class TensorPipeline(Pipeline):
    def __init__(self, stage: Stage, group, transport: Optional[Transport] = None, waker=None, peer_reports=dict,
                 memory_limit: Optional[int] = None, watchdog=None, disk=None):
        super().__init__(stage, transport, waker, peer_reports, memory_limit, disk, time_sends=False)
        self.broadcast = Broadcast(group)
        self.tensor_size = group.size()
        self.watchdog = watchdog

    @contextmanager
    def _collectives(self):
        """A collective that fails (a rank of the group died: the ring backend's "connection to a
        peer was lost") waits for the watchdog's verdict, as a guarded transport's call does: with
        one, the watchdog reports the ring down and ends the process (the launcher restarts it, its
        router replays the requests), rather than this frame failing as an internal error."""
        try:
            yield
        except Exception:
            if self.watchdog is not None and self.watchdog.verdict(self.watchdog.peer_timeout + 2.0) is not None:
                threading.Event().wait()
            raise

    def _tell(self, header: Header, values: Sequence[int] = ()) -> None:
        if self._parked:
            self.waker(self._parked)
            self._parked = 0
        with self._collectives():
            self.broadcast.send(header, values)

    def _tell_others(self, op: Op, slot: int, arg: int = 0, values: Sequence[int] = ()) -> None:
        self._tell(Header(op, slot=slot, arg=arg), values)
        super()._tell_others(op, slot, arg, values)  # the ring's next stage, if any

    def trim(self, slot: int, n: int, next_length: int = 0) -> None:
        if n > 0:
            self._tell(Header(Op.TRIM, slot=slot, arg=n))
        super().trim(slot, n, next_length)

    def send(self, tokens: mx.array, reply: Reply, slot: int = 0, keep: int = 0, next_length: int = 0) -> None:
        refused = self.guard.verdict([(tokens.shape[0], tokens.shape[1], slot)], self._itemsize)
        if refused is not None:
            return self._refuse(Header(Op.FORWARD, reply, slot), refused)
        self._tell(Header(Op.FORWARD, reply, slot, tokens.shape[0], tokens.shape[1], arg=keep),
                   tokens.reshape(-1).tolist())
        caches = self.caches.get(slot)
        with keeping(caches, keep), self.caches.tapped(slot, tokens.shape[1]) as staged:
            h = self.stage(self.stage.embed(tokens), staged)
        self.stats.forward_frames += 1
        out = h if self.transport is not None or reply != Reply.LAST else h[:, -1:, :]
        # Evaluated now, before anything else is broadcast (or sent: a send is evaluated on a
        # stream of its own): the other ranks run this frame's all_sums now. (A failure here,
        # allocation included, would leave them mid-frame: it fails the ring, which the watchdog reports.)
        with self.stats.computing(), self._collectives():
            mx.eval(evaluated(out, caches, self.transport is None, reply))
        if self.transport is not None:
            self._sent(Header.for_payload(Op.FORWARD, h, reply=reply, slot=slot, arg=keep, next_length=next_length), h)
        elif reply == Reply.ACK:
            self._local.append((Header(Op.FORWARD, Reply.ACK, slot), None))
        elif reply != Reply.NONE:
            self._local.append((Header(Op.FORWARD, reply, slot), out))

    def send_mixed(self, tokens: mx.array, slot: int, chunk: mx.array, chunk_slot: int) -> None:
        """The step and the chunk as two frames (the step's reply is the one owed)."""
        self.send(tokens, Reply.LAST, slot)
        self.send(chunk, Reply.NONE, chunk_slot)

    def recv_ahead(self, rows: int):
        return None  # a step built on a reply not yet come would run its all_sums out of order

    def park(self) -> None:
        """The other ranks block on the watchdog's channel, not in the next broadcast."""
        if self.waker is None or self._parked:
            return
        with self._collectives():
            self.broadcast.send(Header(Op.PARK, arg=self._parks + 1))
        if self.transport is not None:
            return super().park()
        self._parks += 1
        self._parked = self._parks

    def clear(self) -> None:
        self._tell(Header(Op.CLEAR))
        super().clear()

    def _load_here(self, entry: int, tokens: List[int], cut: int) -> bool:
        self._tell(Header(Op.LOAD, arg=cut), [entry, 1] + list(tokens))
        with self._collectives():
            return group_loaded(self.broadcast, self.caches.load(entry, tokens, cut))

    def rank_info(self) -> List[dict]:
        self._tell(Header(Op.INFO))
        with self._collectives():
            table = self.broadcast.gather_rows(_info_row(self.stage, 0))
        if self.transport is not None:
            self._send(Header.for_payload(Op.INFO, table), table)
            _, table = self.transport.recv()
        rows = rank_info.decode_rows(table)
        for row in rows:
            row["tensor"] = tensor_share(self.stage, row["rank"] % self.tensor_size, self.tensor_size)
        return rows

    def close(self) -> None:
        if self.broadcast is not None:
            self._tell(Header(Op.STOP))
            self.broadcast = None
            super().close()
            release_group(self.stage)


class TensorStageWorker(StageWorker):
    """The first rank of a later stage's group (T < N): a ring worker that broadcasts each frame
    it runs to the other ranks of its group before running it."""

    def __init__(self, stage: Stage, rank: int, size: int, group, world_rank: int, wait_wake=None,
                 memory_limit: Optional[int] = None, disk=None):
        super().__init__(stage, rank, size, wait_wake, memory_limit, disk)
        self.broadcast = Broadcast(group)
        self.world_rank = world_rank

    def handle(self, header: Header, payload: Optional[mx.array]) -> Optional[Frame]:
        if header.op == Op.FORWARD:
            self.broadcast.send(header)
            self.broadcast.send_payload(payload)
        elif header.op in CACHE_OPS:
            self.broadcast.send(header, [] if payload is None else payload.reshape(-1).tolist())
        elif header.op == Op.INFO:
            self.broadcast.send(header)
            table = mx.concatenate([payload, self.broadcast.gather_rows(_info_row(self.stage, self.world_rank))],
                                   axis=1)
            return Header.for_payload(Op.INFO, table), table
        elif header.op in (Op.CLEAR, Op.STOP, Op.PARK):
            self.broadcast.send(header)
        elif header.op == Op.LOAD:
            self.broadcast.send(header, payload.reshape(-1).tolist())
        return super().handle(header, payload)

    def _load_here(self, entry: int, tokens: List[int], cut: int) -> bool:
        return group_loaded(self.broadcast, self.caches.load(entry, tokens, cut))

    def _forward_plain(self, header: Header, h: mx.array) -> Optional[Frame]:
        """StageWorker's, evaluated as the group's other ranks evaluate it (`evaluated`), so that
        their all_sums pair. (No memory verdict here: the other ranks run the frame already.)"""
        caches = self.caches.get(header.slot)
        with keeping(caches, header.arg), self.caches.tapped(header.slot, header.length) as staged:
            h = self.stage(h, staged)
        mx.eval(evaluated(h, caches, self.is_last, header.reply))
        if self.is_last:
            if header.reply in (Reply.NONE, Reply.ACK):
                return None if header.reply == Reply.NONE else (Header(Op.FORWARD, Reply.ACK, header.slot), None)
            if header.reply == Reply.LAST:
                h = h[:, -1:, :]
        return Header.for_payload(Op.FORWARD, h, reply=header.reply, slot=header.slot, arg=header.arg,
                                  next_length=header.next_length), h

    def build_ahead(self, transport, frame):
        return None  # its all_sums would run out of order with the broadcasts


class TensorFollower:
    """A rank other than its group's first: replay that rank's frames and cache ops on this
    rank's slice."""

    def __init__(self, stage: Stage, group, wait_wake=None, world_rank: Optional[int] = None,
                 memory_limit: Optional[int] = None, disk=None):
        self.stage = stage
        self.rank = group.rank() if world_rank is None else world_rank
        self.broadcast = Broadcast(group)
        self.wait_wake = wait_wake
        self.caches = SlotCaches(stage, disk)
        self.guard = MemoryGuard(stage, self.caches, self.rank, memory_limit)
        self.stats = RankStats(self.caches, self.guard)

    def serve(self) -> None:
        """Until the group's first rank sends STOP."""
        while True:
            header, values = self.broadcast.recv()
            op = header.op
            if op == Op.FORWARD:
                if header.width:  # a later stage: the hidden states the ring brought
                    h = self.broadcast.recv_payload(header.payload_shape(), header.payload_dtype())
                else:
                    h = self.stage.embed(mx.array(values, dtype=mx.int32).reshape(header.batch, header.length))
                caches = self.caches.get(header.slot)
                with self.stats.computing():
                    with keeping(caches, header.arg), self.caches.tapped(header.slot, header.length) as staged:
                        h = self.stage(h, staged)
                    mx.eval(evaluated(h, caches, self.stage.end == self.stage.args.num_hidden_layers, header.reply))
                self.stats.forward_frames += 1
            elif op in CACHE_OPS:
                self.caches.apply(op, header.slot, header.arg, values)
                self.guard.settle()
            elif op == Op.CLEAR:
                self.caches.clear()
                self.guard.settle()
            elif op == Op.INFO:
                self.broadcast.gather_rows(_info_row(self.stage, self.rank))
            elif op == Op.LOAD:  # (entry, -, tokens...); arg: the tokens to restore
                group_loaded(self.broadcast, self.caches.load(values[0], values[2:], header.arg))
            elif op == Op.PARK:
                if self.wait_wake is not None:
                    self.wait_wake(header.arg)
            elif op == Op.STOP:
                self.caches.close()
                return
            else:
                raise ValueError(f"rank {self.rank} received unknown op {op}")
