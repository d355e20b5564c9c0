"""Rank 0's view of the ring: one forward pass through every stage.

Rank 0 embeds and runs the first layers, sends the hidden state on, and gets
the last rank's output back for the tail (final norm and lm_head). With one
rank there is no transport and everything runs here.
"""

from typing import Dict, List, Optional

import mlx.core as mx

from . import rank_info
from .shard.loader import parameter_bytes
from .shard.stage import Stage
from .transport import Header, Op, Reply, Transport


class Pipeline:
    def __init__(self, stage: Stage, transport: Optional[Transport] = None):
        assert stage.first, "rank 0 holds the first stage"
        self.stage = stage
        self.transport = transport
        self.caches: Dict[int, List] = {}
        self.offsets: Dict[int, int] = {}

    @property
    def num_ranks(self) -> int:
        return 1 if self.transport is None else self.transport.size

    def reset(self, slot: int = 0) -> None:
        """Start a new sequence in `slot`: fresh caches on every rank."""
        self.caches[slot] = self.stage.make_cache()
        self.offsets[slot] = 0
        if self.transport is not None:
            self.transport.send(Header(Op.RESET, slot=slot))

    def release(self, slot: int = 0) -> None:
        """Free `slot`'s caches on every rank (a request finished or was cancelled)."""
        self.caches.pop(slot, None)
        self.offsets.pop(slot, None)
        if self.transport is not None:
            self.transport.send(Header(Op.RESET, slot=slot))

    def forward(self, tokens: mx.array, reply: Reply, slot: int = 0) -> Optional[mx.array]:
        """Run tokens (batch, length) through all stages; return the final hidden
        states asked for by `reply` (None for Reply.NONE)."""
        cache = self.caches[slot]
        h = self.stage(self.stage.embed(tokens), cache)
        offset = self.offsets[slot]
        self.offsets[slot] += tokens.shape[1]
        if self.transport is None:
            if reply == Reply.NONE:
                mx.eval([c.state for c in cache])
                return None
            return h[:, -1:, :] if reply == Reply.LAST else h
        self.transport.send(Header.for_payload(Op.FORWARD, h, reply=reply, slot=slot, offset=offset), h)
        if reply == Reply.NONE:
            # Nothing comes back, so rank 0 goes straight on to the next chunk
            # while later ranks still work on this one.
            return None
        _, h = self.transport.recv()
        return h

    def logits(self, tokens: mx.array, reply: Reply = Reply.LAST, slot: int = 0) -> mx.array:
        return self.stage.head(self.forward(tokens, reply, slot))

    def rank_info(self) -> List[dict]:
        """One row per rank: host, layers, embed/head, peak memory, parameter bytes."""
        s = self.stage
        table = rank_info.encode_row(0, s.start, s.end, True, parameter_bytes(s))
        if self.transport is not None:
            self.transport.send(Header.for_payload(Op.INFO, table), table)
            _, table = self.transport.recv()
        return rank_info.decode_rows(table)

    def close(self) -> None:
        """Stop the other ranks; returns once the STOP frame has gone round."""
        if self.transport is not None:
            self.transport.send(Header(Op.STOP))
            self.transport.recv()
            self.transport.close()
            self.transport = None


def in_process_pipeline(stages: List[Stage]) -> "Pipeline":
    """Single-host mode (--stages N): stage 0 here, the others behind an in-process ring."""
    from .transport.local import LocalRing
    from .worker import StageWorker

    workers = [StageWorker(stage, i + 1, len(stages)).handle for i, stage in enumerate(stages[1:])]
    return Pipeline(stages[0], LocalRing(workers) if workers else None)
