"""Memory probe inside each rank, for `bench/soak.py --probe-memory` (a debugging aid, off by default).

Python imports `sitecustomize` at start-up from PYTHONPATH: with this folder on it and
TRINITY_MEMPROBE_DIR set, every `run_trinity.py` process (one per rank) appends one JSON line
every TRINITY_MEMPROBE_EVERY seconds (default 30) to DIR/rank<R>.jsonl:
  t (s since start), rss, mlx_active and mlx_cache (MLX's buffers in use and kept for reuse;
  the CPU backend caches up to 32 MiB), malloc_in_use and malloc_free (glibc's mallinfo2: what
  is allocated, MLX's CPU buffers cached or not included, and what its heaps keep free),
  jit_libs (kernels the CPU backend built and loaded, one shared library each), py_objects,
  threads; bytes unless said otherwise.
A leak shows as in-use memory that keeps growing (mlx_active, malloc_in_use beyond what
mlx_cache gained, py_objects, jit_libs); allocator behaviour as mlx_cache (up to its limit) or
malloc_free growing while the rest stays flat.
With TRINITY_MEMPROBE_TRACEMALLOC=1 it also traces Python allocations from its second sample on
and adds `top`: the ten largest growths since its fourth sample, by allocation site (tracing
slows the rank down).
"""

import os
import sys


def _rss():
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def _mallinfo2():
    """glibc's mallinfo2 as a function, made once (a ctypes class made per call would itself be
    garbage that piles up until a full collection); None where there is none."""
    try:
        import ctypes

        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]

        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
        mallinfo2.restype = Info
        return mallinfo2
    except (OSError, AttributeError):
        return None  # not glibc (macOS), or glibc before 2.33


def _mallinfo(mallinfo2):
    if mallinfo2 is None:
        return None, None
    info = mallinfo2()
    return info.uordblks + info.hblkhd, info.fordblks


def _jit_libs():
    try:
        with open("/proc/self/maps") as f:
            return len({line.split()[-1] for line in f
                        if line.rstrip().endswith(".so") and "/mlx/" in line and "site-packages" not in line})
    except OSError:
        return None


def _probe(folder, every, trace):
    import gc
    import json
    import threading
    import time

    if trace:
        import tracemalloc

        ignore = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)]
    path = os.path.join(folder, f"rank{os.environ.get('MLX_RANK', '0')}.jsonl")
    start, n, base, mallinfo2 = time.monotonic(), 0, None, _mallinfo2()
    while True:
        time.sleep(every)
        n += 1
        mx = sys.modules.get("mlx.core")
        in_use, free = _mallinfo(mallinfo2)
        row = {"t": round(time.monotonic() - start), "rss": _rss(),
               "mlx_active": mx.get_active_memory() if mx else None,
               "mlx_cache": mx.get_cache_memory() if mx else None,
               "malloc_in_use": in_use, "malloc_free": free, "jit_libs": _jit_libs(),
               "py_objects": len(gc.get_objects()), "threads": threading.active_count()}
        if trace and n == 2:  # not from the start: loading under tracemalloc takes far too long
            tracemalloc.start(8)
        elif trace and n > 2:
            snapshot = tracemalloc.take_snapshot().filter_traces(ignore)
            if n == 4:
                base = snapshot
            elif base is not None:
                row["top"] = [f"{s.size_diff:+d} B {s.count_diff:+d} blocks at " + " <- ".join(  # innermost first
                    f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(s.traceback))
                    for s in snapshot.compare_to(base, "traceback")[:10]]
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


if os.environ.get("TRINITY_MEMPROBE_DIR") and sys.argv[:1] and sys.argv[0].endswith("run_trinity.py"):
    import threading

    threading.Thread(target=_probe, name="memprobe", daemon=True,
                     args=(os.environ["TRINITY_MEMPROBE_DIR"], float(os.environ.get("TRINITY_MEMPROBE_EVERY", "30")),
                           os.environ.get("TRINITY_MEMPROBE_TRACEMALLOC") == "1")).start()
