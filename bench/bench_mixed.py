"""A decode step and a prompt chunk in one frame (Stage.mixed) against the two as frames of their
own, one after the other: the device time chunked prefill saves, or costs, per frame.

    python bench/bench_mixed.py --model PATH [--rows 1,16,64] [--chunks 1x127,16x127]
                                [--history 128] [--reps 5] [--out PATH]

For each decode group size (--rows: rows that have --history tokens each, merged into one batch
as the runner's groups are) and chunk shape (--chunks ROWSxCOLUMNS, fresh rows as a prefill
batch's): `apart` = the step, evaluated, then the chunk, evaluated; `mixed` = Stage.mixed of both,
evaluated; each the median of --reps after two untimed runs of the same shapes, and its first run
apart (MLX on CUDA compiles kernels per shape on first use: `apart` runs first in each row, so its
first run meets the row's new shapes, and `mixed`'s first run only those of the combined tokens).
The caches are copies of the same starting state, so every run does the same work. Printed: ms per
frame, mixed / apart, and the first runs; --out gets the rows.
"""

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import mlx.core as mx  # noqa: E402

from common import checkpoint, FULL  # noqa: E402
from distributed.runtime.caches import SlotCaches  # noqa: E402
from distributed.shard.loader import load_stage  # noqa: E402
from distributed.shard.config import read_config  # noqa: E402


def group_caches(stage, rows: int, history: int) -> list:
    """A decode group's caches: `rows` sequences of `history` tokens, merged (as the runner's)."""
    caches = SlotCaches(stage)
    for r in range(rows):
        ids = mx.array([[(r * 37 + 11 * i) % 200 + 1 for i in range(history)]], dtype=mx.uint32)
        stage(stage.embed(ids), caches.get(r + 1))
    if rows > 1:
        caches.merge(0, list(range(1, rows + 1)))
        out = caches.get(0)
    else:
        out = caches.get(1)
    mx.eval([c.state for c in out])
    return out


def timed(fn, reps: int) -> tuple:
    """(the first run, the median of `reps` after two more untimed ones), seconds."""
    times = []
    for i in range(reps + 3):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return times[0], statistics.median(times[3:])


def row(stage, rows: int, chunk: tuple, history: int, reps: int) -> dict:
    group = group_caches(stage, rows, history)
    step = stage.embed(mx.array([[7 + r % 50] for r in range(rows)], dtype=mx.uint32))
    prompt = stage.embed(mx.array([[(j * 13 + 5 * i) % 200 + 1 for i in range(chunk[1])] for j in range(chunk[0])],
                                  dtype=mx.uint32))
    mx.eval(step, prompt)

    def apart():
        g, c = copy.deepcopy(group), stage.make_cache()
        mx.eval(stage(step, g))
        mx.eval(stage(prompt, c), [x.state for x in c])

    def mixed():
        g, c = copy.deepcopy(group), stage.make_cache()
        outs = stage.mixed([(step, g), (prompt, c)])
        mx.eval(outs, [x.state for x in c])

    (a1, a), (m1, m) = timed(apart, reps), timed(mixed, reps)
    return {"rows": rows, "chunk": list(chunk), "apart_ms": a * 1e3, "mixed_ms": m * 1e3, "mixed_over_apart": m / a,
            "apart_first_ms": a1 * 1e3, "mixed_first_ms": m1 * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint folder (default: bench/common.py's fp32 checkpoint)")
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--chunks", default="1x127,16x127")
    p.add_argument("--history", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    path = Path(args.model) if args.model else checkpoint(FULL)
    config = read_config(path)
    stage = load_stage(path, 0, config["num_hidden_layers"], True, config)
    chunks = [tuple(int(x) for x in c.split("x")) for c in args.chunks.split(",")]
    out = []
    print(f"{path.name} on {mx.default_device()}: decode rows with {args.history} tokens of history each, "
          f"median of {args.reps}")
    print(f"{'rows':>5} {'chunk':>7} {'apart ms':>9} {'mixed ms':>9} {'mixed/apart':>12} {'first: apart':>13} "
          f"{'mixed':>7}")
    for rows in [int(r) for r in args.rows.split(",")]:
        for chunk in chunks:
            r = row(stage, rows, chunk, args.history, args.reps)
            out.append(r)
            print(f"{rows:>5} {'%dx%d' % chunk:>7} {r['apart_ms']:>9.1f} {r['mixed_ms']:>9.1f} "
                  f"{r['mixed_over_apart']:>12.2f} {r['apart_first_ms']:>13.1f} {r['mixed_first_ms']:>7.1f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": str(path), "device": str(mx.default_device()),
                                              "history": args.history, "reps": args.reps, "rows": out}, indent=1))


if __name__ == "__main__":
    main()
