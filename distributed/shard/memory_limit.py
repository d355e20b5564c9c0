"""`--memory-limit BYTES|auto`: the memory one rank plans with and MLX holds it to.

Without the flag a rank plans with its share of its host's memory (memory.py) and MLX
is left unbounded. With it, the rank's figure is BYTES (or, for `auto`, that same
share), every size chosen at start (--max-batch, the prefix cache, `--max-context
auto`) comes out of it, and MLX is told: `set_memory_limit` to the figure and
`set_cache_limit` to the margin the plans leave free, so freed buffers kept for reuse
never grow into memory planned for weights and caches. (On Apple GPUs the limit holds
the working set; MLX's CPU backend takes it as a hint.)
"""

import re
from argparse import ArgumentTypeError
from typing import Optional, Union

from .memory_plan import DEFAULT_MARGIN

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


_applied: Optional[int] = None  # the limit this process is held to (None: none given)


def applied_limit() -> Optional[int]:
    """The limit apply_memory_limit set in this process; None: MLX is unbounded here."""
    return _applied


def apply_memory_limit(limit_bytes: Optional[int]) -> Optional[dict]:
    """Hold MLX to `limit_bytes` (None: leave it as it is); returns what was set."""
    global _applied
    if limit_bytes is None:
        return None
    import mlx.core as mx

    _applied = int(limit_bytes)
    mx.set_memory_limit(int(limit_bytes))
    mx.set_cache_limit(cache_bound(limit_bytes))
    return {"memory_limit_bytes": int(limit_bytes), "cache_limit_bytes": cache_bound(limit_bytes)}
