"""Rank 0 tells every other rank of a tensor-parallel group what it is about to run.

Tensor parallelism (shard/tensor.py) has no ring: every rank runs every frame on its slice,
and the all_sums inside the sharded layers pair up only if every rank builds the same graphs
in the same order. Rank 0 broadcasts each frame's header and int32 values (token ids, a cache
op's operands) before computing it; the others replay it (runtime/tensor.py).

A broadcast is an all_sum (every backend has it: ring, MPI, JACCL, NCCL) of a fixed-size
int32 buffer, rank 0's data against the others' zeros, evaluated at once: one collective per
frame where its values fit inline (a decode step's token ids do), a second one for the rest
(a prompt chunk's), whose size the first announces.
"""

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from .base import Header

INLINE = 64 - 1 - Header.SIZE  # values in the first buffer (with the count and the header): 64 int32 in all


class Broadcast:
    def __init__(self, group):
        self.group = group
        self.rank, self.size = group.rank(), group.size()

    def _sum(self, a: mx.array) -> List[int]:
        out = mx.distributed.all_sum(a, group=self.group)
        mx.eval(out)
        return out.tolist()

    def send(self, header: Header, values: Optional[Sequence[int]] = None) -> None:
        """Rank 0: `header` and `values` to every other rank (returns once they are on their way)."""
        values = [] if values is None else [int(v) for v in values]
        first = [len(values)] + list(header.to_array().tolist()) + values[:INLINE]
        self._sum(mx.array(first + [0] * (1 + Header.SIZE + INLINE - len(first)), dtype=mx.int32))
        if len(values) > INLINE:
            self._sum(mx.array(values[INLINE:], dtype=mx.int32))

    def recv(self) -> Tuple[Header, List[int]]:
        """Another rank: the next header and values rank 0 sends (blocks until it does)."""
        first = self._sum(mx.zeros((1 + Header.SIZE + INLINE,), dtype=mx.int32))
        count = first[0]
        header = Header(*first[1:1 + Header.SIZE])
        values = first[1 + Header.SIZE:1 + Header.SIZE + min(count, INLINE)]
        if count > INLINE:
            values += self._sum(mx.zeros((count - INLINE,), dtype=mx.int32))
        return header, values

    def send_payload(self, payload: mx.array) -> None:
        """Rank 0 of the group: a frame's hidden states (after send() of its header)."""
        mx.eval(mx.distributed.all_sum(payload, group=self.group))

    def recv_payload(self, shape, dtype) -> mx.array:
        """Another rank: the hidden states that send_payload() sends, as the header announced them."""
        out = mx.distributed.all_sum(mx.zeros(shape, dtype=dtype), group=self.group)
        mx.eval(out)
        return out

    def gather_rows(self, row: mx.array) -> mx.array:
        """Every rank's int32 row (1, 1, width), stacked in rank order: (1, size, width) on every rank."""
        table = mx.zeros((self.size, row.shape[-1]), dtype=mx.int32)
        table[self.rank] = row.reshape(-1)
        out = mx.distributed.all_sum(table, group=self.group)
        mx.eval(out)
        return out[None]
