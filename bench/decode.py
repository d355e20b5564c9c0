"""Single-stream decode and prefill speed: one-process mlx-lm against this runner, each configuration a
fresh process, one greedy generation of the same deterministic prompt ids.

  mlx-lm                mlx_lm.utils.load + generate_step, one process
  runner P=1            run_trinity.py --json
  runner --stages P     run_trinity.py --stages P --json (P stages, one process)
  runner ring P         mlx.launch -n P run_trinity.py --json (ring backend)
  runner ring P direct  the same ranks started here, without mlx.launch's relay loop (which keeps a core busy)
  runner mpi P          mpirun --oversubscribe -np P (where mpirun is found)

With a ring of two in the table each round also times the link alone (`micro round-trip`) and the
table ends with the ceiling it sets: one token per (runner P=1's time per token + a round trip).
--baseline-root runs another checkout's runner configurations too (' @base') in the same rounds.
Prefill tok/s = prompt tokens / time to first token; decode tok/s = (tokens - 1) / time from the
first token to the last, both inside the process after loading. Rounds interleave the
configurations (--reps); medians and the ratio to mlx-lm of the same invocation. The checkpoint:
float32 AFMoE, hidden 512, 16 layers, 32 experts, 1024-token prompt, 64 steps (--smoke: hidden 128,
6 layers, 128-token prompt, 16 steps, P <= 2, one round).
"""

import logging
import json
import os
import statistics
import time
from pathlib import Path

from bench.harness import (FULL, PY, ROOT, SMALL, bench_env, checkpoint, flags, load_mlx_lm, make_mini, mpirun,
                           out_path, prompt_ids, run_ranks, save)

log = logging.getLogger("bench")


def add_arguments(p) -> None:
    flags(p, smoke=False, out=None, model=None, reps=None, blas="reference", timeout=900.0,
          ranks=None)
    p.add_argument("--make-mini", metavar="PATH", help="Trinity-Mini's shape, random 4-bit weights, made at PATH")
    p.add_argument("--prompt-len", type=int, help="default 1024 (--smoke 128)")
    p.add_argument("--decode-tokens", type=int, help="default 64 (--smoke 16)")
    p.add_argument("--baseline-root", metavar="CHECKOUT", help="also run this checkout's runner configurations")
    p.add_argument("--only", help="comma-separated substrings: only the configurations naming one (mlx-lm always runs)")
    p.add_argument("--extra", default="", help="more runner arguments for every runner configuration, quoted")
    p.add_argument("--mlx-lm-child", nargs=3, metavar=("MODEL", "IDS", "MAX_TOKENS"), help="(one mlx-lm run)")


def mlx_lm_child(model: str, ids: str, max_tokens: int) -> None:
    """One mlx-lm generation, reported with the runner's JSON keys."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, _ = load_mlx_lm(model)
    prompt = mx.array([int(t) for t in ids.split(",")], dtype=mx.uint32)
    tokens, tic = [], time.perf_counter()
    for token, _ in generate_step(prompt, model, max_tokens=max_tokens):
        tokens.append(int(token))
        if len(tokens) == 1:
            first = time.perf_counter()
    done = time.perf_counter()
    print(json.dumps({"prefill_tokens_per_sec": prompt.size / (first - tic),
                      "generation_tokens_per_sec": (len(tokens) - 1) / (done - first), "token_ids": tokens}))


def configs(ranks: list, root: Path = ROOT, tag: str = "") -> dict:
    """Name -> (command prefix, ranks started here); None is mlx-lm. `root`: whose runner runs."""
    runner = [PY, str(root / "run_trinity.py")]
    launch = str(Path(PY).parent / "mlx.launch")
    mpi = mpirun()
    allow_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    ps = [p for p in ranks if p > 1]
    out = {} if tag else {"mlx-lm (1 process)": (None, 1)}
    out["runner P=1"] = (runner, 1)
    out.update({f"runner --stages {p}": (runner + ["--stages", str(p)], 1) for p in ps})
    out.update({f"runner ring P={p}": ([launch, "-n", str(p)] + runner, 1) for p in ps})
    out.update({f"runner ring P={p} direct": (runner, p) for p in ps})
    if mpi:
        out.update({f"runner mpi P={p}": ([mpi, *allow_root, "--oversubscribe", "-np", str(p)] + runner, 1)
                    for p in ps})
    return {name + tag if prefix else name: (prefix, ranks) for name, (prefix, ranks) in out.items()}


def run_once(prefix, ranks: int, model: Path, ids: str, max_tokens: int, env: dict, timeout: float) -> dict:
    """One generation: prefix None is mlx-lm (a child of this module)."""
    if prefix is None:
        cmd = [PY, "-m", "bench", "decode", "--mlx-lm-child", str(model), ids, str(max_tokens)]
    else:
        cmd = prefix + ["--model", str(model), "--prompt-ids", ids, "--max-tokens", str(max_tokens), "--json"]
    r = run_ranks(cmd, ranks, env, timeout)
    keep = ("prefill_tokens_per_sec", "generation_tokens_per_sec", "token_ids", "loadavg", "exit_code", "error")
    return {k: r[k] for k in keep if k in r}


def summarize(runs: dict) -> dict:
    """Per configuration: medians, the range, and ratios and tokens against mlx-lm's."""
    results = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        row = results[name] = {"runs": rs, "ok_runs": len(ok)}
        if ok:
            for key in ("prefill_tokens_per_sec", "generation_tokens_per_sec"):
                row[key] = statistics.median(r[key] for r in ok)
            row["generation_range"] = [min(r["generation_tokens_per_sec"] for r in ok),
                                       max(r["generation_tokens_per_sec"] for r in ok)]
    base = results["mlx-lm (1 process)"]
    ref = next((r["token_ids"] for r in base["runs"] if "error" not in r), None)
    for row in results.values():
        for key in ("prefill_tokens_per_sec", "generation_tokens_per_sec"):
            if key in row:
                row[key.split("_")[0] + "_ratio"] = row[key] / base[key] if key in base else float("nan")
        ok = [r for r in row["runs"] if "error" not in r]
        # The runner drops EOS and stops there; mlx-lm's generate_step does not.
        row["same_tokens_as_mlx_lm"] = bool(ok and ref) and all(r["token_ids"] == ref[:len(r["token_ids"])] for r in ok)
    return results


def print_table(results: dict, reps: int) -> None:
    print(f"{'config':<26}{'prefill tok/s':>14}{'ratio':>8}{'decode tok/s':>14}{'ratio':>8}{'decode range':>15}"
          "  tokens=mlx-lm")
    for name, row in results.items():
        if "prefill_tokens_per_sec" not in row:
            print(f"{name:<26}  failed: {row['runs'][0].get('error', '')[:200]}")
            continue
        print(f"{name:<26}{row['prefill_tokens_per_sec']:>14.1f}{row['prefill_ratio']:>8.2f}"
              f"{row['generation_tokens_per_sec']:>14.2f}{row['generation_ratio']:>8.2f}"
              f"{'%.1f-%.1f' % tuple(row['generation_range']):>15}  {'yes' if row['same_tokens_as_mlx_lm'] else 'NO'}"
              + ("" if row["ok_runs"] == reps else f"  ({row['ok_runs']}/{reps} runs ok)")
              + ("  (a rank aborted after its output)" if any(r.get("exit_code") for r in row["runs"]) else ""))


def ceiling(results: dict, trips: list):
    """The ring of two's ceiling at runner P=1's speed, printed; None without both figures."""
    one, ring = results.get("runner P=1", {}), results.get("runner ring P=2 direct", {})
    if not trips or "generation_tokens_per_sec" not in one or "generation_tokens_per_sec" not in ring:
        return None
    trip, p1 = statistics.median(trips), one["generation_tokens_per_sec"]
    top = 1 / (1 / p1 + trip / 1e3)
    print(f"ring round trip (the link alone, median of {len(trips)}): {trip:.3f} ms; ceiling for ring P=2 at runner "
          f"P=1's speed: {top:.1f} tok/s ({top / p1:.2f}x P=1); ring P=2 is "
          f"{ring['generation_tokens_per_sec'] / p1:.2f}x P=1, {ring['generation_tokens_per_sec'] / top:.2f}x the ceiling")
    return top


def main(args) -> None:
    if args.mlx_lm_child:
        model, ids, n = args.mlx_lm_child
        return mlx_lm_child(model, ids, int(n))
    from bench.micro import round_trip

    start = time.perf_counter()
    reps = args.reps or (1 if args.smoke else 3)
    prompt_len = args.prompt_len or (128 if args.smoke else 1024)
    decode = args.decode_tokens or (16 if args.smoke else 64)
    model = make_mini(Path(args.make_mini)) if args.make_mini else Path(args.model) if args.model else \
        checkpoint(SMALL if args.smoke else FULL)
    ids = ",".join(map(str, prompt_ids(prompt_len)))
    env = bench_env(args.blas)
    ranks = args.ranks or ([1, 2] if args.smoke else [1, 2, 3])
    table = configs(ranks)
    if args.baseline_root:
        table.update(configs(ranks, Path(args.baseline_root).resolve(), " @base"))
    if args.only:
        table = {n: c for n, c in table.items() if c[0] is None or any(w in n for w in args.only.split(","))}
    table = {n: (prefix + args.extra.split() if prefix else prefix, p) for n, (prefix, p) in table.items()}
    runs, trips = {name: [] for name in table}, []
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    for rep in range(reps):  # interleaved rounds: drift and neighbours' load hit every config alike
        if "runner ring P=2 direct" in table:
            trips.append(round_trip(hidden, env=env))
            log.info(f"[{rep + 1}/{reps}] ring round trip: {trips[-1]:.3f} ms")
        for name, (prefix, p) in table.items():
            t = time.perf_counter()
            r = run_once(prefix, p, model, ids, decode + 1, env, args.timeout)
            runs[name].append(r)
            status = r.get("error") or (f"prefill {r['prefill_tokens_per_sec']:.1f} tok/s, decode "
                                        f"{r['generation_tokens_per_sec']:.2f} tok/s, load {r['loadavg']:.1f}")
            log.info(f"[{rep + 1}/{reps}] {name}: {status} ({time.perf_counter() - t:.0f} s)")
    results = summarize(runs)
    config = json.loads((model / "config.json").read_text())
    mib = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
    print(f"\nAFMoE {model.name}: hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
          f"{config['num_experts']} experts (top {config['num_experts_per_tok']}), {mib:.0f} MiB; prompt "
          f"{prompt_len} tokens, {decode} decode steps; median of {reps}; BLAS: {args.blas}")
    print_table(results, reps)
    top = ceiling(results, trips)
    print(f"wall time {time.perf_counter() - start:.0f} s")
    link = {"round_trip_ms": trips, "ring_p2_ceiling_tokens_per_sec": top} if trips else None
    settings = dict(vars(args), prompt_len=prompt_len, decode_tokens=decode, reps=reps, checkpoint=str(model))
    print(f"wrote {save(out_path(args, 'decode'), {'results': results, 'link': link}, settings)}")
