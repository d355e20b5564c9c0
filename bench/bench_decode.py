"""Single-stream decode and 1k-token prefill speed: one-process mlx-lm vs this runner.

    python bench/bench_decode.py [--quick] [--json-out PATH] [--reps N] [--blas reference|openblas]
                                 [--model PATH] [--baseline-root CHECKOUT] [--only NAME,...] [--extra=ARGS]

Builds (once, cached in $TMPDIR/trinity-bench/) a float32 AFMoE checkpoint (hidden 512,
16 layers, 32 experts, 807 MiB) and times, each configuration in a fresh process, one
greedy generation from the same deterministic prompt ids (1024 tokens, then 64 decode steps):
  mlx-lm              mlx_lm.utils.load + mlx_lm.generate.generate_step, one process
  runner P=1          python run_trinity.py --json
  runner --stages P   python run_trinity.py --stages P --json       (P stages, one process)
  runner ring P       mlx.launch -n P python run_trinity.py --json  (ring backend)
  runner ring P direct  the same ranks started by this script (MLX_HOSTFILE, MLX_RANK):
                      the ring backend without mlx.launch, whose I/O loop keeps a core busy
  runner mpi P        mpirun --oversubscribe -np P python run_trinity.py --json  (MPI backend)
With a ring of two in the table, each round also times the link alone (ring_round_trip.py:
a step's frame there and back through this runner's transport, no computation), and the
table ends with the ceiling it sets: one token per (runner P=1's time per token + a round
trip), and how close ring P=2 comes to it.
--baseline-root runs the runner's configurations of another checkout too (' @base'), in the
same rounds; --extra=--prompt-lookup adds runner flags; --model times a given checkpoint.
Prefill tok/s = prompt tokens / time to first token; decode tok/s = (tokens - 1) / time
from the first token to the last. Both are measured inside the process after loading, so
start-up is excluded. Configurations run in interleaved rounds (--reps, default 3); the
table shows medians and the ratio to mlx-lm from the same invocation. --quick: a small
model, 128-token prompt, 16 steps, P <= 2, one round (about 30-50 s here).

--blas openblas preloads the system OpenBLAS (apt-get install libopenblas0) into every
process: on Linux the MLX CPU wheel links a reference BLAS, which makes prefill slow
(the full run takes ~45 min on 2 cores with it, ~8 min with OpenBLAS).
Results: a table on stdout, JSON to --json-out (default bench/results/decode.json).
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
from common import (FULL, PY, QUICK, ROOT, bench_env, checkpoint, kill_groups, load_mlx_lm,  # noqa: E402
                    prompt_ids, start_ranks)
import ring_round_trip  # noqa: E402


def mlx_lm_child(model: str, ids: str, max_tokens: int) -> None:
    """One mlx-lm generation, reported with the runner's JSON keys."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, _ = load_mlx_lm(model)
    prompt = mx.array([int(t) for t in ids.split(",")], dtype=mx.uint32)
    tokens = []
    tic = time.perf_counter()
    for token, _ in generate_step(prompt, model, max_tokens=max_tokens):
        tokens.append(int(token))
        if len(tokens) == 1:
            first = time.perf_counter()
    done = time.perf_counter()
    print(json.dumps({"prefill_tokens_per_sec": prompt.size / (first - tic),
                      "generation_tokens_per_sec": (len(tokens) - 1) / (done - first),
                      "token_ids": tokens}))


def configs(max_ranks: int, root: Path = ROOT, tag: str = "") -> dict:
    """Name -> (command prefix, ranks this script starts itself). The runner's arguments
    are appended to the prefix; None is mlx-lm. `root`: the checkout whose runner runs
    (another one for a baseline: its names end in `tag`)."""
    runner = [PY, str(root / "run_trinity.py")]
    launch = str(Path(PY).parent / "mlx.launch")
    mpirun = shutil.which("mpirun")
    allow_root = ["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    ps = range(2, max_ranks + 1)
    out = {} if tag else {"mlx-lm (1 process)": (None, 1)}
    out["runner P=1"] = (runner, 1)
    out.update({f"runner --stages {p}": (runner + ["--stages", str(p)], 1) for p in ps})
    out.update({f"runner ring P={p}": ([launch, "-n", str(p)] + runner, 1) for p in ps})
    # The ring backend again, its ranks started here (MLX_HOSTFILE, MLX_RANK) as mlx.launch
    # does, but without mlx.launch's output-relaying loop, which keeps a core busy.
    out.update({f"runner ring P={p} direct": (runner, p) for p in ps})
    if mpirun:
        out.update({f"runner mpi P={p}": ([mpirun, *allow_root, "--oversubscribe", "-np", str(p)] + runner, 1)
                    for p in ps})
    return {name + tag if prefix else name: (prefix, ranks) for name, (prefix, ranks) in out.items()}


def run_once(prefix, ranks: int, model: Path, ids: str, max_tokens: int, env: dict, timeout: float) -> dict:
    if prefix is None:
        cmd = [PY, __file__, "--mlx-lm-child", str(model), ids, str(max_tokens)]
    else:
        cmd = prefix + ["--model", str(model), "--prompt-ids", ids, "--max-tokens", str(max_tokens), "--json"]
    load = os.getloadavg()[0]
    # Sessions of their own, so that a timeout ends a launcher and every rank it started.
    procs, hostfile = start_ranks(cmd, ranks, env,
                                  rank0=dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                                  others=dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    proc, helpers = procs[0], procs[1:]
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        for h in helpers:
            h.wait(timeout=60)
    except subprocess.TimeoutExpired:
        kill_groups(procs, grace=0)
        proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s", "loadavg": load}
    finally:
        if hostfile:
            os.unlink(hostfile)
    lines = [l for l in stdout.splitlines() if l.startswith("{")]
    if not lines:
        return {"error": f"exit {proc.returncode}: {(stderr or stdout).strip()[-400:]}", "loadavg": load}
    r = json.loads(lines[-1])
    out = {k: r[k] for k in ("prefill_tokens_per_sec", "generation_tokens_per_sec", "token_ids")}
    # Kept, but recorded: under mpirun a rank sometimes aborts at exit after printing its result.
    return dict(out, loadavg=load, exit_code=max([proc.returncode] + [h.returncode for h in helpers], key=abs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small model, short prompt, 1 rep (smoke test)")
    p.add_argument("--json-out", default=str(ROOT / "bench" / "results" / "decode.json"))
    p.add_argument("--reps", type=int, default=None, help="runs per configuration (default 3; --quick 1)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 1024 (--quick 128)")
    p.add_argument("--decode-tokens", type=int, default=None, help="default 64 (--quick 16)")
    p.add_argument("--max-ranks", type=int, default=None, help="largest P (default 3; --quick 2)")
    p.add_argument("--blas", choices=["reference", "openblas"], default="reference")
    p.add_argument("--timeout", type=float, default=900, help="seconds per process")
    p.add_argument("--model", help="this checkpoint instead of the generated one (e.g. bench_gpu.py's)")
    p.add_argument("--baseline-root", help="also run the runner's configurations from this checkout "
                   "(names end in ' @base'): ratios against another version in the same invocation")
    p.add_argument("--only", help="comma-separated substrings: run only the configurations naming one "
                   "(mlx-lm always runs: the ratios are to it)")
    p.add_argument("--extra", default="", help="more runner arguments for every runner configuration, "
                   "e.g. '--prompt-lookup' (quoted, split on spaces)")
    p.add_argument("--mlx-lm-child", nargs=3, metavar=("MODEL", "IDS", "MAX_TOKENS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mlx_lm_child:
        model, ids, n = args.mlx_lm_child
        return mlx_lm_child(model, ids, int(n))

    start = time.perf_counter()
    reps = args.reps or (1 if args.quick else 3)
    prompt_len = args.prompt_len or (128 if args.quick else 1024)
    decode = args.decode_tokens or (16 if args.quick else 64)
    sizes = QUICK if args.quick else FULL
    model = Path(args.model) if args.model else checkpoint(sizes)
    ids = prompt_ids(prompt_len)
    env = bench_env(args.blas)
    max_ranks = args.max_ranks or (2 if args.quick else 3)
    table = configs(max_ranks)
    if args.baseline_root:
        table.update(configs(max_ranks, Path(args.baseline_root).resolve(), " @base"))
    if args.only:
        wanted = args.only.split(",")
        table = {n: c for n, c in table.items() if c[0] is None or any(w in n for w in wanted)}
    extra = args.extra.split()
    table = {n: (prefix + extra if prefix else prefix, ranks) for n, (prefix, ranks) in table.items()}
    runs = {name: [] for name in table}
    link = "runner ring P=2 direct" in table
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    trips = []
    for rep in range(reps):  # interleaved rounds: drift and neighbours' load hit every config alike
        if link:
            trips.append(ring_round_trip.measure(hidden, env=env))
            print(f"[{rep + 1}/{reps}] ring round trip: {trips[-1]:.3f} ms", file=sys.stderr, flush=True)
        for name, (prefix, ranks) in table.items():
            t = time.perf_counter()
            r = run_once(prefix, ranks, model, ids, decode + 1, env, args.timeout)
            runs[name].append(r)
            if "error" in r:
                status = r["error"]
            else:
                status = (f"prefill {r['prefill_tokens_per_sec']:.1f} tok/s, decode "
                          f"{r['generation_tokens_per_sec']:.2f} tok/s, load {r['loadavg']:.1f}"
                          + (f" (exit {r['exit_code']} after its output)" if r["exit_code"] else ""))
            print(f"[{rep + 1}/{reps}] {name}: {status} ({time.perf_counter() - t:.0f} s)",
                  file=sys.stderr, flush=True)

    results = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        row = {"runs": rs, "ok_runs": len(ok)}
        if ok:
            row["prefill_tokens_per_sec"] = statistics.median(r["prefill_tokens_per_sec"] for r in ok)
            row["generation_tokens_per_sec"] = statistics.median(r["generation_tokens_per_sec"] for r in ok)
            row["generation_range"] = [min(r["generation_tokens_per_sec"] for r in ok),
                                       max(r["generation_tokens_per_sec"] for r in ok)]
            row["generated_tokens"] = len(ok[0]["token_ids"])
        results[name] = row
    base = results["mlx-lm (1 process)"]
    ref_tokens = next((r["token_ids"] for r in base["runs"] if "error" not in r), None)
    for row in results.values():
        for key in ("prefill_tokens_per_sec", "generation_tokens_per_sec"):
            if key in row:
                row[key.split("_")[0] + "_ratio"] = row[key] / base[key] if key in base else float("nan")
        ok = [r for r in row["runs"] if "error" not in r]
        # The runner drops EOS and stops there; mlx-lm's generate_step does not.
        row["same_tokens_as_mlx_lm"] = bool(ok and ref_tokens) and all(
            r["token_ids"] == ref_tokens[: len(r["token_ids"])] for r in ok)

    wall = time.perf_counter() - start
    loads = [r["loadavg"] for rs in runs.values() for r in rs]
    mib = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
    if args.model:
        sizes = json.loads((model / "config.json").read_text())
    print(f"\nAFMoE {model.name}: hidden {sizes['hidden_size']}, {sizes['num_hidden_layers']} layers, "
          f"{sizes['num_experts']} experts (top {sizes['num_experts_per_tok']}), {mib:.0f} MiB; prompt "
          f"{prompt_len} tokens, {decode} decode steps; median of {reps}; BLAS: {args.blas}; "
          f"{os.cpu_count()} CPUs, load average {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'config':<26}{'prefill tok/s':>14}{'ratio':>8}{'decode tok/s':>14}{'ratio':>8}{'decode range':>15}  tokens=mlx-lm")
    for name, row in results.items():
        if "prefill_tokens_per_sec" not in row:
            print(f"{name:<26}  failed: {row['runs'][0].get('error', '')[:200]}")
            continue
        print(f"{name:<26}{row['prefill_tokens_per_sec']:>14.1f}{row['prefill_ratio']:>8.2f}"
              f"{row['generation_tokens_per_sec']:>14.2f}{row['generation_ratio']:>8.2f}"
              f"{'%.1f-%.1f' % tuple(row['generation_range']):>15}  "
              f"{'yes' if row['same_tokens_as_mlx_lm'] else 'NO'}"
              + ("" if row["ok_runs"] == reps else f"  ({row['ok_runs']}/{reps} runs ok)")
              + ("  (a rank aborted after its output)" if any(r.get("exit_code") for r in row["runs"]) else ""))
    one, ring = results.get("runner P=1", {}), results.get("runner ring P=2 direct", {})
    ceiling = None
    if trips and "generation_tokens_per_sec" in one and "generation_tokens_per_sec" in ring:
        trip = statistics.median(trips)
        ceiling = 1 / (1 / one["generation_tokens_per_sec"] + trip / 1e3)
        print(f"ring round trip (the link alone, median of {len(trips)}): {trip:.3f} ms; ceiling for ring P=2 "
              f"at runner P=1's speed: {ceiling:.1f} tok/s ({ceiling / one['generation_tokens_per_sec']:.2f}x P=1); "
              f"ring P=2 is {ring['generation_tokens_per_sec'] / one['generation_tokens_per_sec']:.2f}x P=1, "
              f"{ring['generation_tokens_per_sec'] / ceiling:.2f}x the ceiling")
    print(f"wall time {wall:.0f} s")

    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = dict({k: v for k, v in sizes.items() if isinstance(v, (int, float, str))}, prompt_len=prompt_len, decode_tokens=decode, reps=reps, blas=args.blas,
                    quick=args.quick, checkpoint=str(model), cpus=os.cpu_count())
    link_row = {"round_trip_ms": trips, "ring_p2_ceiling_tokens_per_sec": ceiling} if trips else None
    out.write_text(json.dumps({"settings": settings, "results": results, "link": link_row, "wall_s": wall}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
