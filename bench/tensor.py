"""Tensor parallelism (--tensor-parallel-size) on this machine: all-reduce latency, and one
stream's decode speed against one process and against the pipeline.

allreduce: two local ranks all_sum a float32 vector of each width (the tiny test model's 64,
the bench model's 512, Trinity-Mini's 2048, Trinity-Large's 3072 (its config) and a decode step's
4096) --iters times (after 100 warm-up rounds), each evaluated alone as a layer's all_sum is; the median
and p90 per all_sum, over the ring backend (ranks started as mlx.launch does, without its output
loop) and over MPI where `mpirun` is found (Debian's Open MPI started directly).

decode: the decode subcommand's float32 checkpoint (hidden 512, 16 layers, 32 experts, 807 MiB),
one greedy generation per configuration in interleaved rounds, each in fresh processes:
  mlx-lm (1 process)   the reference
  runner P=1           one process (this machine's cores, as the two ranks share them)
  runner ring P=2      the pipeline: layers split, ring backend
  runner tensor T=2    every rank 1/2 of every layer, ring backend
  runner mpi P=2       the pipeline over MPI (where mpirun is found)
  runner tensor T=2 mpi   tensor T=2 over MPI
Medians of decode tok/s and the ratios to mlx-lm and to runner P=1 from this invocation.

--mini PATH: decode on Trinity-Mini's shape instead (random weights,
4-bit, router 8-bit; 14.7 GB; built at PATH once), e.g. on the GPU machine, where the ranks all
share the one GPU and the ring backend's all_sums run on the CPU stream (device / GPU named in
the results). --smoke: --mini's shape shrunk (experts wide enough for T = 2's whole 4-bit groups), 100 all_sums, one
round of 8 tokens, to check the subcommand on a CPU. --no-mpi: leave out MPI even where mpirun is found.
"""

import logging
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.decode import run_once
from bench.harness import (FULL, MINI, MINI_SMOKE, PY, ROOT, bench_env, checkpoint, flags, make_mini, mpirun,
                           out_path, prompt_ids, run_ranks, save, shrink)

log = logging.getLogger("bench")

WIDTHS = [64, 512, 2048, 3072, 4096]


def allreduce_child(iters: int) -> None:
    import mlx.core as mx

    group = mx.distributed.init()
    out = {"backend_size": group.size(), "widths": {}}
    for width in WIDTHS:
        x = mx.ones((1, 1, width), dtype=mx.float32)
        times = []
        for i in range(100 + iters):
            t = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x, group=group))
            if i >= 100:
                times.append(time.perf_counter() - t)
        times.sort()
        out["widths"][str(width)] = {"median_ms": 1e3 * statistics.median(times),
                                     "p90_ms": 1e3 * times[int(0.9 * len(times))], "n": len(times)}
    if group.rank() == 0:
        print(json.dumps(out), flush=True)


def allreduce(backend: str, iters: int, env: dict) -> dict:
    cmd = [PY, "-m", "bench", "tensor", "--allreduce-child", str(iters)]
    if backend == "ring":
        return run_ranks(cmd, 2, env, timeout=600)
    proc = subprocess.run([mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", "2", *cmd],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))


def add_arguments(p) -> None:
    flags(p, smoke=False, out=None, reps=3, blas="reference", timeout=900.0)
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--only", choices=["allreduce", "decode"])
    p.add_argument("--mini", metavar="PATH", help="decode on Trinity-Mini's shape, 4-bit, made at PATH once")
    p.add_argument("--no-mpi", action="store_true", help="leave out MPI even where mpirun is found")
    p.add_argument("--allreduce-child", type=int, help="(a rank of the all-reduce measurement)")


def main(args) -> None:
    if args.allreduce_child:
        return allreduce_child(args.allreduce_child)
    shrink(args, iters=100, reps=1, decode_tokens=8, prompt_len=16,
           mini=str(Path(tempfile.gettempdir()) / "trinity-bench" / "mini-smoke-t2"))
    env = bench_env(args.blas)
    mpi = None if args.no_mpi else mpirun()
    results = {}
    if args.only in (None, "allreduce"):
        results["allreduce"] = {"ring": allreduce("ring", args.iters, env)}
        if mpi:
            results["allreduce"]["mpi"] = allreduce("mpi", args.iters, env)
        for backend, r in results["allreduce"].items():
            for width, s in r["widths"].items():
                print(f"all_sum float32 x{width:>5} {backend:4}: median {s['median_ms']:.4f} ms, "
                      f"p90 {s['p90_ms']:.4f} ms ({s['n']})", flush=True)
    if args.only in (None, "decode"):
        results["decode"] = decode(args, env, mpi)
    out = out_path(args, "tensor")
    if out.exists():  # --only: keep the other part of an earlier run
        results = {**{k: v for k, v in json.loads(out.read_text()).items() if k in ("allreduce", "decode")}, **results}
    print(f"wrote {save(out, results, vars(args))}")


def decode(args, env: dict, mpi) -> dict:
    """One stream's decode: mlx-lm, P=1, the ring's pipeline and tensor parallelism (and both over MPI)."""
    model = make_mini(Path(args.mini), dict(MINI_SMOKE, moe_intermediate_size=128) if args.smoke else MINI) \
        if args.mini else checkpoint(FULL)
    runner = [PY, str(ROOT / "run_trinity.py")]
    allow = ["--allow-run-as-root", "--oversubscribe", "-np", "2"]
    table = {"mlx-lm (1 process)": (None, 1), "runner P=1": (runner, 1), "runner ring P=2": (runner, 2),
             "runner tensor T=2": (runner + ["--tensor-parallel-size", "2"], 2)}
    if mpi:  # the pipeline over MPI too: what the backend gives apart from the split
        table["runner mpi P=2"] = ([mpi, *allow] + runner, 1)
        table["runner tensor T=2 mpi"] = ([mpi, *allow] + runner + ["--tensor-parallel-size", "2"], 1)
    ids = ",".join(map(str, prompt_ids(args.prompt_len)))
    runs = {name: [] for name in table}
    for rep in range(args.reps):
        for name, (prefix, ranks) in table.items():
            t = time.perf_counter()
            r = run_once(prefix, ranks, model, ids, args.decode_tokens + 1,
                         dict(env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"), args.timeout)
            runs[name].append(r)
            status = r.get("error") or (f"prefill {r['prefill_tokens_per_sec']:.1f} tok/s, decode "
                                        f"{r['generation_tokens_per_sec']:.2f} tok/s")
            log.info(f"[{rep + 1}/{args.reps}] {name}: {status} ({time.perf_counter() - t:.0f} s)")
    rows = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        row = {"runs": rs}
        if ok:
            row["generation_tokens_per_sec"] = statistics.median(r["generation_tokens_per_sec"] for r in ok)
            row["prefill_tokens_per_sec"] = statistics.median(r["prefill_tokens_per_sec"] for r in ok)
        rows[name] = row
    ref = next((r["token_ids"] for r in runs["mlx-lm (1 process)"] if "error" not in r), None)
    for name, row in rows.items():
        row["tokens_equal_mlx_lm"] = all(r.get("token_ids") == ref for r in row["runs"] if "error" not in r)
        for base, key in (("mlx-lm (1 process)", "ratio_to_mlx_lm"), ("runner P=1", "ratio_to_runner_p1"),
                          ("runner ring P=2", "ratio_to_ring_p2")):
            if "generation_tokens_per_sec" in row and "generation_tokens_per_sec" in rows[base]:
                row[key] = row["generation_tokens_per_sec"] / rows[base]["generation_tokens_per_sec"]
    sizes = json.loads((model / "config.json").read_text())
    sizes = {k: v for k, v in sizes.items() if isinstance(v, (int, float, str))}
    result = {"model": str(model), "model_sizes": sizes, "prompt_tokens": args.prompt_len,
              "decode_tokens": args.decode_tokens, "reps": args.reps, "configs": rows}
    print(f"\ndecode, {args.prompt_len}-token prompt, {args.decode_tokens} tokens, median of {args.reps}:")
    x = lambda row, key: f"x{row[key]:.2f}" if key in row else "  -  "  # noqa: E731 (a base that failed)
    for name, row in rows.items():
        if "generation_tokens_per_sec" not in row:
            print(f"  {name:24} failed: {row['runs'][0].get('error', '')[-300:]}")
            continue
        print(f"  {name:24} {row['generation_tokens_per_sec']:7.2f} tok/s  {x(row, 'ratio_to_mlx_lm')} mlx-lm  "
              f"{x(row, 'ratio_to_runner_p1')} P=1  {x(row, 'ratio_to_ring_p2')} ring P=2  "
              f"tokens equal: {row['tokens_equal_mlx_lm']}")
    return result
