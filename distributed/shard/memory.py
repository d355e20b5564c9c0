"""How much memory a rank has, and what fits in it.

What a rank may use is measured before loading (usable_memory_bytes) and exchanged at
start-up (gather_memory); ranks on one host share it. `--memory-limit BYTES|auto` sets the
figure a rank plans with: without the flag, its share of its host's memory, and MLX is left
unbounded; with it, BYTES (or, for `auto`, that same share), every size chosen at start
(--max-batch, the prefix cache, `--max-context auto`) comes out of it, and MLX is told:
`set_memory_limit` to the figure and `set_cache_limit` to the margin the plans leave free, so
freed buffers kept for reuse never grow into memory planned for weights and caches. (On Apple
GPUs the limit holds the working set; MLX's CPU backend takes it as a hint.)

How many sequences' KV caches fit beside the weights (kv_budget: the default --max-batch;
longest_context: `--max-context auto`): each rank's figure, less a reserve (DEFAULT_MARGIN) and
its weights, is what its KV caches may take. One sequence costs its layers' caches at a target
context (a sliding layer keeps at most its window). The tightest rank bounds the batch; bytes
set aside first (a prefix cache) come out of every rank's share.
"""

import re
import socket
import subprocess
import sys
from argparse import ArgumentTypeError
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

from .sizes import model_sizes

DEFAULT_MARGIN = 0.10  # of each rank's memory planned for nobody: activations, the runtime, and the OS's own share



def usable_memory_bytes() -> int:
    """Bytes the model may use on this machine.

    macOS: Metal's recommended working set (about 75% of RAM: what the GPU may
    wire without the system swapping), else the RAM size. MLX's CUDA build: the
    GPU's free memory. Otherwise (Linux, CPU): MemAvailable.
    """
    try:
        import mlx.core as mx

        if mx.cuda.is_available():
            info = mx.device_info()
            return int(info.get("free_memory") or info["total_memory"])
    except (AttributeError, KeyError):  # an mlx without mx.cuda or these keys: the host's figure
        pass
    if sys.platform == "darwin":
        try:
            import mlx.core as mx

            if mx.metal.is_available():
                return int(mx.device_info()["max_recommended_working_set_size"])
        except Exception:  # an older mlx without device_info: use the RAM size
            pass
        out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot tell this machine's memory: no MemAvailable in /proc/meminfo")


def share_by_host(memories: Sequence[int], hosts: Sequence[str]) -> List[int]:
    """Ranks on one machine share it: each gets an equal part of the smallest figure seen there."""
    out = []
    for host in hosts:
        same = [m for m, h in zip(memories, hosts) if h == host]
        out.append(min(same) // len(same))
    return out


def gather_memory(group, nbytes: Optional[int] = None, host: Optional[str] = None) -> List[int]:
    """Every rank's usable memory in rank order, shared between ranks on the same host.

    A collective: every rank of `group` must call it, before loading (all_sum, so it
    works on every backend, NCCL included).
    """
    from ..rows import columns_text, gather_rows, join_int, split_int, text_columns

    nbytes = usable_memory_bytes() if nbytes is None else int(nbytes)
    rows = gather_rows(group, split_int(nbytes) + text_columns(host or socket.gethostname()))
    memories = [join_int(r[0], r[1]) for r in rows]
    hosts = [columns_text(r[2:]) for r in rows]
    return share_by_host(memories, hosts)


AUTO = "auto"
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_memory_limit(text: str) -> Union[int, str]:
    """`auto`, or a byte count: digits with an optional K, M, G or T (binary units, an
    optional trailing "B" or "iB"). Raises argparse's ArgumentTypeError naming the text."""
    if text.strip().lower() == AUTO:
        return AUTO
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not match:
        raise ArgumentTypeError(f"expected bytes (e.g. 24G) or auto, got {text!r}")
    value = int(float(match.group(1)) * _UNITS[match.group(2)])
    if value <= 0:
        raise ArgumentTypeError(f"must be above 0, got {text!r}")
    return value


def limited(share_bytes: int, limit: Union[int, str, None]) -> int:
    """The figure a rank plans with: its host share, or the explicit limit."""
    return share_bytes if limit is None or limit == AUTO else int(limit)


def cache_bound(limit_bytes: int, margin: float = DEFAULT_MARGIN) -> int:
    """The buffer cache's bound under `limit_bytes`: the margin the plans leave free."""
    return int(limit_bytes * margin)


def apply_memory_limit(limit_bytes: Optional[int]) -> Optional[dict]:
    """Hold MLX to `limit_bytes` (None: leave it as it is); returns what was set. (Each rank's
    MemoryGuard is given the same figure: MLX's CPU allocator never reads it.)"""
    if limit_bytes is None:
        return None
    import mlx.core as mx

    mx.set_memory_limit(int(limit_bytes))
    mx.set_cache_limit(cache_bound(limit_bytes))
    return {"memory_limit_bytes": int(limit_bytes), "cache_limit_bytes": cache_bound(limit_bytes)}


DEFAULT_CONTEXT = 4096  # tokens per sequence the default batch size plans for
CACHE_STEP = 256  # mlx-lm's KVCache grows by this many tokens at a time
MAX_BATCH = 256  # beyond this a bigger batch buys nothing on the ring (and the queue holds the rest)


@dataclass
class KvBudget:
    max_batch: int
    context: int  # tokens per sequence planned for
    tightest_rank: int
    free_bytes: List[int]  # per rank: left for KV caches after the weights and the reserve
    sequence_bytes: List[int]  # per rank: one sequence's caches at `context`

    def describe(self) -> str:
        r = self.tightest_rank
        return (f"{self.max_batch} sequences of {self.context} tokens (rank {r}: "
                f"{self.free_bytes[r] / 2**30:.2f} GiB free for KV caches, "
                f"{self.sequence_bytes[r] / 2**20:.1f} MiB a sequence)")


def kv_budget(config: dict, ranks: Sequence[dict], memory_bytes: Sequence[int], context: int,
              set_aside_bytes: int = 0, margin: float = DEFAULT_MARGIN) -> KvBudget:
    """`ranks`: rows as in rank_info (`layers`, `parameter_bytes`); `memory_bytes`: each rank's
    usable memory before loading, in the same order."""
    sizes = model_sizes(config)
    free, per_sequence = [], []
    for row, memory in zip(ranks, memory_bytes):
        start, end = row["layers"]
        free.append(max(0, int(memory * (1 - margin)) - row["parameter_bytes"] - set_aside_bytes))
        per_sequence.append(max(1, sizes.cache_bytes(start, end, context)))
    fits = [f // s for f, s in zip(free, per_sequence)]
    tightest = min(range(len(fits)), key=fits.__getitem__)
    return KvBudget(max(1, min(MAX_BATCH, fits[tightest])), context, tightest, free, per_sequence)


@dataclass
class ContextFit:
    context: int  # tokens a sequence (prompt + generation)
    batch: int  # sequences planned for at once
    tightest_rank: int
    free_bytes: int  # on that rank: left for KV caches after the weights, the reserve and what was set aside

    def describe(self) -> str:
        return (f"{self.context} tokens for each of {self.batch} sequences (rank {self.tightest_rank}: "
                f"{self.free_bytes / 2**30:.2f} GiB free for KV caches)")


def longest_context(config: dict, ranks: Sequence[dict], memory_bytes: Sequence[int], batch: int, limit: int,
                    set_aside_bytes: int = 0, margin: float = DEFAULT_MARGIN) -> ContextFit:
    """`--max-context auto`: the longest context, up to `limit`, at which `batch` sequences'
    caches fit beside the weights on every rank (0: not even one token does)."""
    sizes = model_sizes(config)
    fits = []
    for row, memory in zip(ranks, memory_bytes):
        start, end = row["layers"]
        free = max(0, int(memory * (1 - margin)) - row["parameter_bytes"] - set_aside_bytes)
        lo, hi = 0, limit  # the answer is in [lo, hi]; cache bytes only grow with the context
        while lo < hi:
            mid = (lo + hi + 1) // 2
            allocated = -(-mid // CACHE_STEP) * CACHE_STEP
            lo, hi = (mid, hi) if batch * sizes.cache_bytes(start, end, allocated) <= free else (lo, mid - 1)
        fits.append((lo, free))
    tightest = min(range(len(fits)), key=lambda r: fits[r][0])
    return ContextFit(fits[tightest][0], batch, tightest, fits[tightest][1])
