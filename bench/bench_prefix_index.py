"""Rank 0's prefix-cache index: host time per request as the index fills, this checkout vs another.

    python bench/bench_prefix_index.py [--baseline DIR] [--sizes 100,1000,4000] [--requests 200]

Per request, what the batcher asks of the index (runtime/prefix_cache.py): a lookup at admission
(find), then two stores (covered, and insert unless covered): the prompt but its last token once
prefilled, the prompt and its generated tokens when it finishes. Two workloads, each with the index
first filled to every --sizes entries by such requests (untimed): `distinct`, 128-token prompts
with nothing in common and 64 generated tokens; `chat`, a 500-token system prompt shared by every
prompt, 40 tokens of its own and 64 generated. Reported: microseconds per request (the mean over
--requests requests), and with --baseline DIR (e.g. `git worktree add --detach DIR <commit>`), the
same for DIR's index, measured in a child process that imports DIR's code, and the ratio.
No model, no ring: the index alone (its lookups run on rank 0's scheduler thread, between steps).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
SYSTEM = 500  # tokens of the chat workload's shared system prompt


def index_class():
    from distributed.runtime.prefix_cache import Entry, PrefixIndex  # (where prefix_index.py was, it imports them)

    return Entry, PrefixIndex


def requests(workload: str, seed: int):
    """Endless (prompt, generated) token arrays of the workload."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 50000, SYSTEM, dtype=np.int32)
    while True:
        own = rng.integers(0, 50000, 128 if workload == "distinct" else 40, dtype=np.int32)
        prompt = own if workload == "distinct" else np.concatenate([system, own])
        yield prompt, rng.integers(0, 50000, 64, dtype=np.int32)


def run_request(index, Entry, prompt, generated, next_id: int) -> int:
    """What the batcher asks of the index for one request; returns the next entry id."""
    index.find(prompt)
    for tokens in (prompt[:-1], np.concatenate([prompt, generated])):
        if not index.covered(tokens):
            index.insert(Entry(next_id, tokens, True, [len(tokens)]))
            next_id += 1
    return next_id


def measure(sizes, count: int) -> dict:
    Entry, PrefixIndex = index_class()
    out = {}
    for workload in ("distinct", "chat"):
        index, next_id, made = PrefixIndex(1 << 62, 1), 0, requests(workload, 0)
        for size in sizes:
            while len(index.entries) < size:
                next_id = run_request(index, Entry, *next(made), next_id)
            batch = [next(made) for _ in range(count)]
            start = time.perf_counter()
            for prompt, generated in batch:
                next_id = run_request(index, Entry, prompt, generated, next_id)
            out[f"{workload} {size}"] = (time.perf_counter() - start) / count * 1e6
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", help="another checkout, measured the same way")
    p.add_argument("--sizes", default="100,1000,4000", help="index sizes (entries) to measure at")
    p.add_argument("--requests", type=int, default=200, help="timed requests per size")
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child: JSON on stdout
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.measure:
        print(json.dumps(measure(sizes, args.requests)))
        return
    sys.path[:0] = [str(ROOT), str(BENCH)]
    from common import run_json_child

    this = measure(sizes, args.requests)
    base = None
    if args.baseline:
        env = dict(os.environ, PYTHONPATH=str(Path(args.baseline).resolve()))
        cmd = [sys.executable, str(BENCH / "bench_prefix_index.py"), "--measure", "--sizes", args.sizes,
               "--requests", str(args.requests)]
        base = run_json_child(cmd, env, timeout=3600)
        if "error" in base:
            sys.exit(f"baseline {args.baseline}: {base['error']}")
    print(f"{'workload':<10} {'entries':>7} {'this us/request':>16}" + (f" {'baseline':>10} {'x base':>7}" if base else ""))
    for key, us in this.items():
        workload, size = key.split()
        row = f"{workload:<10} {size:>7} {us:>16.0f}"
        if base:
            row += f" {base[key]:>10.0f} {us / base[key]:>7.3f}"
        print(row)


if __name__ == "__main__":
    main()
