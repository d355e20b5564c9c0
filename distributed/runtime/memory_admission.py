"""Rank 0's admission by memory (--memory-limit): a prompt waits in the queue until it fits
beside the running sequences, and one that cannot fit even alone is refused before prefill.

Every rank's guard (memory_guard.py) refuses a frame whose allocations do not fit beside
what is in use, and a refused frame costs every request in it. So rank 0 reserves memory
for each admitted sequence on every rank, at its whole length (prompt and max_tokens,
within the context): its KV caches, which it holds while it runs, and as much again for a
frame's allocations over them (a prefill chunk's sliding-layer caches are rebuilt whole and
a full layer's grow by a copy: memory_guard.frame_bytes), with one prefill chunk's
activations. Batches and decode groups pad their rows to the longest (mlx-lm's batch
caches), so n sequences reserve n times the longest's. A rank's room is its limit less its
weights, what was set aside (the prefix cache) and half the margin (what else it keeps
meanwhile, as sizing.py leaves it to prefill chunks: prefill_chunks.py).
"""

from typing import List, Optional, Sequence

from ..shard.kv_budget import CACHE_STEP
from ..shard.memory_plan import DEFAULT_MARGIN
from ..shard.sizes import dtype_bytes, model_args, model_sizes
from .memory_guard import OUT_OF_MEMORY, activation_bytes


class MemoryAdmission:
    def __init__(self, config: dict, ranks: Sequence[dict], limits: Sequence[int], chunk: int, max_context: int,
                 set_aside_bytes: int = 0, chunk_budget=None):
        self.sizes, self.args, self.itemsize = model_sizes(config), model_args(config), dtype_bytes(config)
        self.layers = [tuple(r["layers"]) for r in ranks]
        self.limits = list(limits)
        self.room = [max(0, limit - r["parameter_bytes"] - set_aside_bytes - int(limit * DEFAULT_MARGIN) // 2)
                     for r, limit in zip(ranks, limits)]
        self.chunk, self.max_context = chunk, max_context
        self.chunk_budget = chunk_budget  # a ChunkBudget every prefill chunk's activations fit
        self.running: List = []  # admitted sequences (pruned once finished)

    def tokens(self, request) -> int:
        """A request's whole length: what its caches hold when it ends."""
        return min(self.max_context, len(request.prompt_ids) + len(request.resume_ids) + request.max_tokens)

    def needs(self, lengths: List[int]) -> List[int]:
        """Each rank's reservation for sequences of these whole lengths running together."""
        longest = -(-max(lengths) // CACHE_STEP) * CACHE_STEP
        activations = activation_bytes(self.args, min(self.chunk, longest), longest, self.itemsize)
        if self.chunk_budget is not None:  # each chunk is cut to fit it (prefill_chunks.py)
            activations = min(activations, self.chunk_budget.bytes)
        return [2 * len(lengths) * self.sizes.cache_bytes(start, end, longest) + activations
                for start, end in self.layers]

    def refusal(self, request) -> Optional[str]:
        """Why `request` cannot run even alone (None: it can), naming the rank and the bytes."""
        n = self.tokens(request)
        for rank, (need, room) in enumerate(zip(self.needs([n]), self.room)):
            if need > room:
                mib = lambda b: f"{b / 2**20:.1f} MiB"
                return (f"{OUT_OF_MEMORY} on rank {rank}: the request ({n} tokens with max_tokens) needs "
                        f"{mib(need)} for its caches and frames, above the {mib(room)} its --memory-limit of "
                        f"{mib(self.limits[rank])} leaves beside the weights; refused before prefill")
        return None

    def admits(self, seq) -> bool:
        """Whether `seq` fits beside the sequences running now."""
        self.running = [s for s in self.running if not s.finished]
        lengths = [self.tokens(s.request) for s in self.running + [seq]]
        return all(need <= room for need, room in zip(self.needs(lengths), self.room))

    def admit(self, seq) -> None:
        self.running.append(seq)
