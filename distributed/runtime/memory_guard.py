"""Memory while the ring runs, from one estimate of what a frame allocates (frame_bytes):
each rank's guard against its --memory-limit (MemoryGuard), rank 0's admission by memory
(MemoryAdmission), and how long a prefill chunk may be under a memory budget (ChunkBudget).

MLX holds the limit only where its allocator does (on Apple GPUs an allocation past it
waits for running work, then raises); its CPU allocator records the limit and never
reads it (mlx/backend/no_gpu/allocator.cpp), so a rank past its limit there just grows,
and where malloc itself fails (MLX 0.32.4, under RLIMIT_AS) MLX does not raise: its
kernel writes through the null buffer and the process dies of SIGSEGV.
So every rank checks each FORWARD frame before it builds it: what the frame's evaluation
allocates (frame_bytes: attention scores, the layers' other activations, KV cache
growth) beside the bytes in use now must fit the limit. A frame that does not fit is not
run: the rank passes a NO_MEMORY frame on in its place, which reaches rank 0 as that
frame's reply, and rank 0 ends the frame's requests (Batcher.fail_frame). Nothing ran, so
this rank's caches stay whole; it frees its buffer cache and treats the frame's slots as
doomed: frames on them already in the ring are not run either (a prefill chunk riding in
a decode step is dropped from it, the step runs) until rank 0's cache ops drop those
slots. An allocation MLX itself refuses (a RuntimeError out of an evaluation) takes the
same path. Rank 0 checks its own frames alike; with one rank the NO_MEMORY frame is the
frame's reply at once (Pipeline._refuse). An allocation MLX refuses in rank 0's own
evaluation fails the frame it was evaluating (Pipeline._sent, Batcher.failed_here),
or, outside any one frame, the requests running (Scheduler._recover). Rank 0
admits a prompt only where its caches and frames fit (MemoryAdmission, below); this check
holds where that estimate falls short. Without --memory-limit nothing is checked.

Rank 0's admission by memory (--memory-limit): a prompt waits in the queue until it fits
beside the running sequences, and one that cannot fit even alone is refused before prefill.
Every rank's guard refuses a frame whose allocations do not fit beside what is in use, and a
refused frame costs every request in it. So rank 0 reserves memory
for each admitted sequence on every rank, at its whole length (prompt and max_tokens,
within the context): its KV caches, which it holds while it runs, and as much again for a
frame's allocations over them (a prefill chunk's sliding-layer caches are rebuilt whole and
a full layer's grow by a copy: frame_bytes), with one prefill chunk's
activations. Batches and decode groups pad their rows to the longest (mlx-lm's batch
caches), so n sequences reserve n times the longest's. A rank's room is its limit less its
weights, what was set aside (the prefix cache) and half the margin (what else it keeps
meanwhile, as sizing.py leaves it to prefill chunks: ChunkBudget).

How many prompt columns the next prefill chunk may carry under a memory budget: under
--memory-limit or --max-context auto, a chunk's activations must fit half the margin the
plans leave on each rank (sizing.py). What a chunk allocates grows with the context it attends
to (its attention scores: rows x columns x the positions before it and its own), so the budget
is applied chunk by chunk, at that chunk's own context: a long prompt's early chunks stay as
long as --prefill-step-size allows and only the late ones shrink. Sized once at the longest
context instead, every chunk was as short as the last one may be: on an H200 under a 12 GiB
limit, 32-token chunks for Trinity-Mini's 131,072-token context, and a 2,048-token prompt took
38 s to prefill against 1.5 s without the limit.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from ..shard.memory import CACHE_STEP, DEFAULT_MARGIN
from ..shard.sizes import dtype_bytes, kv_bytes_per_token, model_args, model_sizes
from ..shard.stage import Stage
from ..transport import Header, Op
from .caches import SlotCaches
from .request import OUT_OF_MEMORY, REQUEST_FAILED

# A NO_MEMORY payload's `needed` where the frame raised for another reason than memory (a bug, or
# input no check caught): its rows end as memory's do, the slot doomed alike, and the ring goes on.
FRAME_ERROR = -1
_ALLOCATION_ERRORS = ("unable to allocate", "out of memory", "bad_alloc", "bad alloc")
_KIB = 1024

Part = Tuple[int, int, int]  # (rows, length, slot) of one batch in a frame


def is_out_of_memory(error: Optional[str]) -> bool:
    """A request's error says it ran out of memory (gRPC RESOURCE_EXHAUSTED, HTTP 507)."""
    return bool(error) and error.startswith(OUT_OF_MEMORY)


def allocation_failed(e: BaseException) -> bool:
    """MLX could not allocate (its malloc, Metal's or CUDA's out-of-memory error)."""
    return isinstance(e, (RuntimeError, MemoryError)) and any(w in str(e).lower() for w in _ALLOCATION_ERRORS)


def activation_bytes(args, length: int, context: int, itemsize: int) -> int:
    """An upper estimate of one row's activations in a layer, for `length` new tokens
    attending to `context` positions: its attention scores (float32) and its MLP's or
    experts' intermediates. Fitted to the tiny model on MLX's CPU backend, whose
    attention materialises the scores: 10-20% above the peak seen."""
    mlp = 3 * max(args.intermediate_size, (args.num_experts_per_tok + args.num_shared_experts)
                  * args.moe_intermediate_size)
    return int(args.num_attention_heads * length * context * 4 * 1.1) + length * (mlp + 12 * args.hidden_size) * itemsize


def frame_bytes(stage: Stage, caches: List, rows: int, length: int, itemsize: int) -> int:
    """What running `rows` x `length` tokens through `stage` after `caches` allocates, at
    most: the largest layer's activations and every layer's KV cache growth (a grown
    cache is copied whole, beside the new positions' zeros)."""
    a = stage.args
    kv_token = kv_bytes_per_token(a, itemsize)
    full_token = kv_bytes_per_token(a, itemsize, stage.kv_quantization)  # --kv-bits
    activations, kv = 0, 0
    for layer, cache in zip(stage.layers, caches):
        past = cache.size() if cache.keys is not None else 0
        if layer.use_sliding:
            past = min(past, a.sliding_window)
            kv += (past + length) * kv_token if length > 1 else 0
        elif cache.keys is None or past + length > tree_flatten(cache.keys)[0][1].shape[2]:
            grown = -(-length // CACHE_STEP) * CACHE_STEP  # mlx-lm's new zeros, then the whole cache concatenated
            kv += (past + 2 * grown) * full_token
        activations = max(activations, activation_bytes(a, length, past + length, itemsize))
    return rows * (activations + kv)


def figures(rank: int, needed: int, in_use: int, limit: int) -> mx.array:
    """A NO_MEMORY frame's payload (KiB; needed 0: MLX refused an allocation)."""
    return mx.array([rank, -(-needed // _KIB), in_use // _KIB, limit // _KIB], dtype=mx.int32).reshape(1, -1, 1)


def describe(payload: mx.array) -> str:
    """The one-line error of a NO_MEMORY frame's payload."""
    rank, needed, in_use, limit = payload.reshape(-1).tolist()
    if needed == FRAME_ERROR:
        return f"{REQUEST_FAILED}: rank {rank} could not run its frame (the rank's log has the error)"
    mib = lambda kib: f"{kib / _KIB:.1f} MiB"
    bound = f"its --memory-limit of {mib(limit)}" if limit else "no --memory-limit"
    if needed:
        return (f"{OUT_OF_MEMORY} on rank {rank}: the request's next frame needs {mib(needed)} beside "
                f"{mib(in_use)} in use, above {bound}; it was dropped, the server goes on")
    return f"{OUT_OF_MEMORY} on rank {rank}: MLX could not allocate with {mib(in_use)} in use ({bound})"


class MemoryGuard:
    def __init__(self, stage: Stage, caches: SlotCaches, rank: int, limit: Optional[int] = None):
        self.stage, self.caches, self.rank = stage, caches, rank
        self.limit = limit  # the bytes MLX is held to in this process (--memory-limit); None: nothing checked
        self.doomed: Dict[int, mx.array] = {}  # slot -> the payload of the failure that doomed it
        self.refused = 0  # frames refused here (metrics)

    def verdict(self, parts: List[Part], itemsize: int) -> Optional[mx.array]:
        """None: a frame of `parts` may run; else the NO_MEMORY payload to pass on instead."""
        doomed = next((self.doomed[s] for _, _, s in parts if s in self.doomed), None)
        if doomed is not None or self.limit is None:
            return doomed
        needed = sum(frame_bytes(self.stage, self.caches.get(s), r, n, itemsize) for r, n, s in parts)
        in_use = mx.get_active_memory()
        return None if in_use + needed <= self.limit else figures(self.rank, needed, in_use, self.limit)

    def failed(self, header: Header, payload: mx.array) -> Tuple[Header, mx.array]:
        """The frame `header` does not run here: its slots are doomed, the buffer cache is
        freed, and this is the NO_MEMORY frame to pass on in its place."""
        slots = {header.slot, header.chunk_slot} if header.mixed else {header.slot}
        self.refused += not slots <= set(self.doomed)  # a failure here, not a doomed slot's frame
        for slot in slots - set(self.doomed):
            self.caches.get(slot)  # it exists until rank 0 drops it, which ends the doom
            self.doomed[slot] = payload
        mx.clear_cache()
        return Header.for_payload(Op.NO_MEMORY, payload, reply=header.reply, slot=header.slot), payload

    def mlx_failed(self, header: Header, e: Exception) -> Tuple[Header, mx.array]:
        """Evaluating `header`'s frame raised `e`: MLX refused an allocation, or anything else
        (FRAME_ERROR); either way the frame's rows fail, not the ring."""
        if allocation_failed(e):
            return self.failed(header, self.mlx_figures())
        return self.failed(header, figures(self.rank, FRAME_ERROR * _KIB, 0, 0))

    def mlx_figures(self) -> mx.array:
        """The NO_MEMORY payload of an allocation MLX refused here (needed 0)."""
        return figures(self.rank, 0, mx.get_active_memory(), self.limit or 0)

    def own_failure(self) -> mx.array:
        """Rank 0 could not evaluate its own part of a reply (the head, the sampler): the
        frame fails (Batcher.failed_here); the buffer cache is freed. Its NO_MEMORY payload."""
        self.refused += 1
        mx.clear_cache()
        return self.mlx_figures()

    def settle(self) -> None:
        """After a cache op: slots rank 0 has dropped are no longer doomed."""
        for slot in [s for s in self.doomed if s not in self.caches.slots]:
            del self.doomed[slot]


def step_alone(header: Header, step: mx.array) -> Header:
    """A mixed frame's header without its chunk (the chunk's slot is doomed)."""
    return Header.for_payload(Op.FORWARD, step, reply=header.reply, slot=header.slot)


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
        if self.chunk_budget is not None:  # each chunk is cut to fit it (ChunkBudget)
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


class ChunkBudget:
    def __init__(self, config: dict, budget_bytes: int):
        self.args, self.itemsize, self.bytes = model_args(config), dtype_bytes(config), budget_bytes

    def activations(self, rows: int, columns: int, past: int) -> int:
        """What a chunk of `rows` x `columns` after `past` cached positions allocates, at most."""
        return activation_bytes(self.args, rows * columns, past + columns, self.itemsize)

    def columns(self, rows: int, past: int, most: int) -> int:
        """The longest chunk, up to `most` columns (1 at least), whose activations after `past`
        cached positions fit the budget."""
        return _longest(lambda n: self.activations(rows, n, past) <= self.bytes, most)

    def ending_at(self, context: int, most: int) -> int:
        """The longest one-row chunk that fits where it ends at `context` positions (the last
        chunk of a prompt that fills the context: the shortest a chunk gets)."""
        return _longest(lambda n: self.activations(1, n, max(0, context - n)) <= self.bytes, most)


def _longest(fits, most: int) -> int:
    """The largest n in [1, most] with fits(n) (1 if none): fits holds up to some n, not beyond."""
    lo, hi = 1, max(1, most)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
