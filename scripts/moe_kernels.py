"""What one routed-expert layer of Trinity-Mini's shape (4-bit, group 64) costs on this device for B
rows of one decode step, by the way the rows reach the experts' weights (issue 57, item 2):

- `sorted`:   mlx-lm's SwitchGLU: the B*k (row, expert) pairs sorted by expert when there are 64 or more,
              then one gather_qmm per projection with sorted_indices (what a batched step runs today);
- `unsorted`: the same without sorting;
- `packed`:   each expert's rows packed into a (experts, capacity, hidden) block, capacity = B (no host
              sync: a row can choose an expert once), one batched gather_qmm per projection over all
              experts; more arithmetic on empty places, every expert's weights read once
              (distributed/shard/experts.py, Experts.run_packed);
- `dense_sorted`: the sorted pairs on the weights dequantized to bf16 for the call, one gather_mm per
              projection (Experts.run_dense);
- `dense_packed`: the packed block on dequantized weights, one batched matmul per projection
              (Experts.run_packed, dense);
- `dequantize`: dequantizing the three projections alone.

Milliseconds per layer call, median of --reps after warm-up, with the largest difference from `sorted`.

    PYTHONPATH=. python scripts/moe_kernels.py --rows 1,8,16,32,64,128 [--reps 50] [--variants sorted,packed,...]
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
import mlx.nn as nn

from distributed.shard.experts import Experts, dequantized


def layer(hidden: int, inner: int, experts: int, dtype) -> Experts:
    glu = Experts(hidden, inner, experts)
    glu.update(nn.utils.tree_map(lambda a: a.astype(dtype), glu.parameters()))
    nn.quantize(glu, group_size=64, bits=4)
    mx.eval(glu.parameters())
    return glu


def project(proj, x, idx):
    return mx.gather_qmm(x, proj["weight"], proj["scales"], proj.get("biases"), rhs_indices=idx, transpose=True,
                         group_size=proj.group_size, bits=proj.bits)


def unsorted(glu, x, inds):
    x = mx.expand_dims(x, (-2, -3))
    h = glu.activation(project(glu.up_proj, x, inds), project(glu.gate_proj, x, inds))
    return project(glu.down_proj, h, inds).squeeze(-2)


def way(packed=range(0), dense=range(0), dense_block=range(0)):
    """The Experts layer with these token ranges for one call (restored after)."""
    def run(glu, x, inds):
        glu.packed, glu.dense, glu.dense_block = packed, dense, dense_block
        try:
            return glu(x, inds)
        finally:
            glu.packed = glu.dense = glu.dense_block = range(0)
    return run


EVERY = range(1, 1 << 31)
VARIANTS = {"sorted": way(), "unsorted": unsorted, "packed": way(packed=EVERY), "dense_sorted": way(dense=EVERY),
            "dense_packed": way(dense=EVERY, dense_block=EVERY),
            "dequantize": lambda glu, x, inds: [dequantized(p) for p in (glu.up_proj, glu.gate_proj, glu.down_proj)]}


def timed(fn, reps: int) -> float:
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def dense_from(results: list) -> int:
    """The fewest rows from which dense_sorted beats what runs now (packed to 2,048 rows, then sorted)
    at every larger count measured; 0: nowhere."""
    start = 0
    for r in sorted(results, key=lambda r: -r["rows"]):
        now = r["packed_ms"] if r["rows"] <= 2048 else r["sorted_ms"]
        if r["dense_sorted_ms"] >= now:
            break
        start = r["rows"]
    return start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,8,16,32,64,128")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inner", type=int, default=1024)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--variants", default="sorted,packed")
    p.add_argument("--json")
    p.add_argument("--dense-from", metavar="JSON", help="print dense_from() of an earlier --json, and exit")
    args = p.parse_args()
    if args.dense_from:
        with open(args.dense_from) as f:
            return print(dense_from(json.load(f)))
    dtype = getattr(mx, args.dtype)
    glu = layer(args.hidden, args.inner, args.experts, dtype)
    variants = {n: VARIANTS[n] for n in args.variants.split(",")}
    out = []
    for rows in map(int, args.rows.split(",")):
        x = mx.random.normal((rows, args.hidden), key=mx.random.key(rows)).astype(dtype)
        scores = mx.random.uniform(shape=(rows, args.experts), key=mx.random.key(rows + 1))
        inds = mx.argpartition(-scores, kth=args.k - 1, axis=-1)[:, :args.k].astype(mx.uint32)
        reference = VARIANTS["sorted"](glu, x, inds)
        r = {"rows": rows, "device": str(mx.default_device())}
        for name, fn in variants.items():
            r[f"{name}_ms"] = round(timed(lambda: fn(glu, x, inds), args.reps), 3)
            got = fn(glu, x, inds)
            if name == "dequantize":
                continue
            r[f"{name}_max_diff"] = float(mx.abs(got.astype(mx.float32) - reference.astype(mx.float32)).max())
        print(json.dumps(r), flush=True)
        out.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
