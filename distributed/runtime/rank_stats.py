"""What a rank counts about its own work, for rank 0's metrics: forward frames (and
how many carried a prefill chunk beside a decode step), the time of its own forward computation, the bytes its KV caches hold,
and MLX's memory figures (active, buffer cache, peak) with the frames refused for lack of memory (memory_guard.py).

Other ranks evaluate each frame apart from its send (which may wait for the next
rank) and do nothing else meanwhile: their time is their whole computation. Rank
0 adds no wait: its frames run while its host streams tokens (the batcher's
lookahead), so it counts from when it sends work of its own (dispatched()) until
it sees all of it done (its wait before each reply, which would wait for that work
anyway: computing(drains=True)). That is exact while rank 0 waits for its
computation; while its host work outlasts it, it counts until the host looks (an
upper bound). Waits for work not in flight count as they are (the head and
sampling, one rank's prompt chunks; with --stages N every stage's layers are
computed within rank 0's waits).

Plain numbers, written by the thread that runs the ring and read by another (a
scrape on rank 0; on other ranks the watchdog's heartbeat, which carries them to
rank 0), so the ring never waits for metrics.
"""

import time
from contextlib import contextmanager
from typing import Optional

import mlx.core as mx

from .caches import SlotCaches
from .memory_guard import MemoryGuard


class RankStats:
    def __init__(self, caches: SlotCaches, guard: Optional[MemoryGuard] = None):
        self.caches, self.guard = caches, guard
        self.forward_seconds = 0.0
        self.forward_frames = 0
        self.mixed_frames = 0  # of those, decode steps that carried a prefill chunk (Stage.mixed)
        self._since: Optional[float] = None  # rank 0: since when work of its own is in flight

    def dispatched(self) -> None:
        """Rank 0 started work of its own without waiting for it."""
        if self._since is None:
            self._since = time.perf_counter()

    @contextmanager
    def computing(self, drains: bool = False):
        """Time a wait for this rank's own computation; `drains`: all of it in flight."""
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            if self._since is None:
                self.forward_seconds += end - start
            elif drains:
                self.forward_seconds += end - self._since
                self._since = None

    def report(self) -> dict:
        """A snapshot, safe to take from another thread (the slots may change meanwhile)."""
        slots = list(self.caches.slots.values())
        entries = list(self.caches.entries.values())
        return {
            "forward_seconds": self.forward_seconds,
            "forward_frames": self.forward_frames,
            "mixed_frames": self.mixed_frames,
            "kv_cache_bytes": sum(c.nbytes for caches in slots for c in caches),
            "prefix_cache_bytes": sum(c.nbytes for caches in entries for c in caches),
            "active_memory_bytes": mx.get_active_memory(),
            "cache_memory_bytes": mx.get_cache_memory(),
            "peak_memory_bytes": mx.get_peak_memory(),
            "memory_refused_frames": self.guard.refused if self.guard is not None else 0,
        }
