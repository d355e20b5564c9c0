"""Tensor parallelism (--tensor-parallel-size) on this machine: all-reduce latency, and one
stream's decode speed against one process and against the pipeline.

    python bench/bench_tensor.py [--reps N] [--iters N] [--blas reference|openblas] [--only allreduce|decode]
                                 [--prompt-len N] [--decode-tokens N] [--json-out PATH]
                                 [--mini PATH [--smoke]] [--no-mpi]

allreduce: two local ranks all_sum a float32 vector of each width (the tiny test model's 64,
the bench model's 512, Trinity-Mini's 2048, Trinity-Large's 3072 (its config) and a decode step's
4096) --iters times (after 100 warm-up rounds), each evaluated alone as a layer's all_sum is; the median
and p90 per all_sum, over the ring backend (ranks started as mlx.launch does, without its output
loop) and over MPI where `mpirun` is found (Debian's Open MPI started directly).

decode: bench_decode.py's float32 checkpoint (hidden 512, 16 layers, 32 experts, 807 MiB),
one greedy generation per configuration in interleaved rounds, each in fresh processes:
  mlx-lm (1 process)   the reference
  runner P=1           one process (this machine's cores, as the two ranks share them)
  runner ring P=2      the pipeline: layers split, ring backend
  runner tensor T=2    every rank 1/2 of every layer, ring backend
  runner mpi P=2       the pipeline over MPI (where mpirun is found)
  runner tensor T=2 mpi   tensor T=2 over MPI
Medians of decode tok/s and the ratios to mlx-lm and to runner P=1 from this invocation.

--mini PATH: decode on bench_gpu.py's Trinity-Mini-shaped checkpoint instead (random weights,
4-bit, router 8-bit; 14.7 GB; built at PATH once), e.g. on the GPU machine, where the ranks all
share the one GPU and the ring backend's all_sums run on the CPU stream (device / GPU named in
the results). --smoke shrinks it (with experts wide enough for T = 2's whole 4-bit groups) to
check the script on a CPU in seconds. --no-mpi: leave out MPI even where mpirun is found.
Results: a table on stdout, JSON to --json-out (default bench/results/tensor.json).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import FULL, PY, ROOT, bench_env, checkpoint, kill_groups, prompt_ids, start_ranks  # noqa: E402
import bench_gpu  # noqa: E402
from bench_decode import run_once  # noqa: E402

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
    cmd = [PY, __file__, "--allreduce-child", str(iters)]
    if backend == "ring":
        procs, hostfile = start_ranks(cmd, 2, env, rank0=dict(stdout=subprocess.PIPE, text=True),
                                      others=dict(stdout=subprocess.DEVNULL))
        try:
            out, _ = procs[0].communicate(timeout=600)
        finally:
            kill_groups(procs)
            os.unlink(hostfile)
    else:
        mpirun = "/usr/bin/mpirun" if Path("/usr/bin/mpirun").exists() else shutil.which("mpirun")
        proc = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", *cmd],
                              capture_output=True, text=True, timeout=600, cwd=ROOT,
                              env=dict(env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
        out = proc.stdout
    line = next(l for l in out.splitlines() if l.startswith("{"))
    return json.loads(line)


def mini_checkpoint(path: Path, smoke: bool) -> Path:
    """bench_gpu.py's Trinity-Mini-shaped 4-bit checkpoint (its SMOKE shape with smoke)."""
    if smoke:  # T = 2 needs each rank's share of a sharded-to-all input to be whole groups of 64
        bench_gpu.MINI.update(bench_gpu.SMOKE, moe_intermediate_size=128)
    bench_gpu.make(path)
    return path


def machine(blas: str) -> dict:
    """Where this ran: CPUs, BLAS, MLX's default device and, where nvidia-smi answers, the GPU."""
    import mlx.core as mx

    out = {"cpus": os.cpu_count(), "blas": blas, "device": str(mx.default_device())}
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True)
        out["gpus"] = smi.stdout.strip().splitlines()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--blas", choices=["reference", "openblas"], default="reference")
    p.add_argument("--only", choices=["allreduce", "decode"])
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--mini", help="decode on bench_gpu.py's Trinity-Mini-shaped 4-bit checkpoint, made here once")
    p.add_argument("--smoke", action="store_true", help="with --mini: a tiny shape, to check the script on a CPU")
    p.add_argument("--no-mpi", action="store_true", help="leave out MPI even where mpirun is found")
    p.add_argument("--json-out", default=str(ROOT / "bench" / "results" / "tensor.json"))
    p.add_argument("--allreduce-child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.allreduce_child:
        return allreduce_child(args.allreduce_child)

    env = bench_env(args.blas)
    mpirun = None if args.no_mpi else "/usr/bin/mpirun" if Path("/usr/bin/mpirun").exists() else shutil.which("mpirun")
    results = {"machine": machine(args.blas), "command": " ".join(sys.argv),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"machine: {results['machine']}", flush=True)
    if args.only in (None, "allreduce"):
        results["allreduce"] = {"ring": allreduce("ring", args.iters, env)}
        if mpirun:
            results["allreduce"]["mpi"] = allreduce("mpi", args.iters, env)
        for backend, r in results["allreduce"].items():
            for width, s in r["widths"].items():
                print(f"all_sum float32 x{width:>5} {backend:4}: median {s['median_ms']:.4f} ms, "
                      f"p90 {s['p90_ms']:.4f} ms ({s['n']})", flush=True)
    if args.only in (None, "decode"):
        model = mini_checkpoint(Path(args.mini), args.smoke) if args.mini else checkpoint(FULL)
        runner = [PY, str(ROOT / "run_trinity.py")]
        allow = ["--allow-run-as-root", "--oversubscribe", "-np", "2"]
        table = {"mlx-lm (1 process)": (None, 1), "runner P=1": (runner, 1), "runner ring P=2": (runner, 2),
                 "runner tensor T=2": (runner + ["--tensor-parallel-size", "2"], 2)}
        if mpirun:  # the pipeline over MPI too: what the backend gives apart from the split
            table["runner mpi P=2"] = ([mpirun, *allow] + runner, 1)
            table["runner tensor T=2 mpi"] = ([mpirun, *allow] + runner + ["--tensor-parallel-size", "2"], 1)
        ids = prompt_ids(args.prompt_len)
        runs = {name: [] for name in table}
        for rep in range(args.reps):
            for name, (prefix, ranks) in table.items():
                t = time.perf_counter()
                r = run_once(prefix, ranks, model, ids, args.decode_tokens + 1,
                             dict(env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"), args.timeout)
                runs[name].append(r)
                status = r.get("error") or (f"prefill {r['prefill_tokens_per_sec']:.1f} tok/s, decode "
                                            f"{r['generation_tokens_per_sec']:.2f} tok/s")
                print(f"[{rep + 1}/{args.reps}] {name}: {status} ({time.perf_counter() - t:.0f} s)",
                      file=sys.stderr, flush=True)
        decode = {}
        for name, rs in runs.items():
            ok = [r for r in rs if "error" not in r]
            row = {"runs": rs}
            if ok:
                row["generation_tokens_per_sec"] = statistics.median(r["generation_tokens_per_sec"] for r in ok)
                row["prefill_tokens_per_sec"] = statistics.median(r["prefill_tokens_per_sec"] for r in ok)
            decode[name] = row
        ref = next(r["token_ids"] for r in runs["mlx-lm (1 process)"] if "error" not in r)
        for name, row in decode.items():
            row["tokens_equal_mlx_lm"] = all(r.get("token_ids") == ref for r in row["runs"] if "error" not in r)
            for base, key in (("mlx-lm (1 process)", "ratio_to_mlx_lm"), ("runner P=1", "ratio_to_runner_p1"),
                              ("runner ring P=2", "ratio_to_ring_p2")):
                if "generation_tokens_per_sec" in row and "generation_tokens_per_sec" in decode[base]:
                    row[key] = row["generation_tokens_per_sec"] / decode[base]["generation_tokens_per_sec"]
        sizes = json.loads((model / "config.json").read_text())
        sizes = {k: v for k, v in sizes.items() if isinstance(v, (int, float, str))}
        results["decode"] = {"model": str(model), "model_sizes": sizes, "prompt_tokens": args.prompt_len,
                             "decode_tokens": args.decode_tokens, "reps": args.reps, "configs": decode}
        print(f"\ndecode, {args.prompt_len}-token prompt, {args.decode_tokens} tokens, median of {args.reps}:")
        for name, row in decode.items():
            if "generation_tokens_per_sec" in row:
                print(f"  {name:24} {row['generation_tokens_per_sec']:7.2f} tok/s  x{row['ratio_to_mlx_lm']:.2f} mlx-lm  "
                      f"x{row['ratio_to_runner_p1']:.2f} P=1  x{row['ratio_to_ring_p2']:.2f} ring P=2  "
                      f"tokens equal: {row['tokens_equal_mlx_lm']}")
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    if Path(args.json_out).exists():  # --only: keep the other part of an earlier run
        earlier = json.loads(Path(args.json_out).read_text())
        results = {**earlier, **results}
    Path(args.json_out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
