"""One long prompt alone: prefill speed on one rank pinned to one core against a ring of ranks each
pinned to a core of its own, this checkout's runner and (--old) a checkout from before a prompt alone
in a ring was cut into 4·P chunks.

  P=1         run_trinity.py --prompt-ids IDS --max-tokens 1 --json, one process, `taskset -c CORE0`
  ring P=N    the same as N ranks started here (MLX_RANK / MLX_HOSTFILE, harness.run_ranks), rank r
              under `taskset -c CORE_r`
  ... @old    the same command from a `git worktree` of --old (default 1d3b084^), removed afterwards
  P=1 same chunks   P=1 with --prefill-step-size the ring's chunk (where it differs from P=1's): how much
              of a ring's gain is its smaller chunks, not its stages working at once
  P=1 side by side  as many P=1 processes as the ring has ranks, at once, one per core, each with the
              prompt: their summed tok/s over P=1's is what this machine's cores allow any ring

Prefill tok/s = prompt tokens / time to the first token inside rank 0 (the runner's JSON, after
loading). Each prompt is alone in a fresh process (max_tokens 1); configurations interleave per
round (--reps), medians are reported, each with the load average when it started. OpenBLAS is
preloaded with OPENBLAS_NUM_THREADS=1 (--blas). The ratio: ring over P=1 of the same invocation
(target 1.7x for two ranks). --smoke: 1024- and 2048-token prompts, no --old.
"""

import logging
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from distributed.runtime.frames import CHUNKS_PER_STAGE, MIN_CHUNK, PREFILL_STEP_SIZE

from bench.harness import PY, ROOT, bench_env, concurrent, flags, int_list, out_path, run_ranks, save, shrink

log = logging.getLogger("bench")

# Rank r runs under taskset -c (the r-th of the comma-separated cores in $1); MLX_RANK is unset at P=1.
PIN = 'cores="$1"; shift; core=$(echo "$cores" | cut -d, -f$(( ${MLX_RANK:-0} + 1 ))); exec taskset -c "$core" "$@"'


def add_arguments(p) -> None:
    flags(p, smoke=False, out=None, model=None, reps=1, blas="openblas", timeout=900.0, ranks=[1, 2])
    p.add_argument("--prompt-lens", type=int_list, default=[4096, 16384], help="prompt lengths (default 4096,16384)")
    p.add_argument("--cores", default="0,1", help="core of rank 0, 1, ... (default 0,1)")
    p.add_argument("--old", default="1d3b084^", metavar="REV", help="also this revision's runner, from a git "
                   "worktree (default 1d3b084^, before the 4·P chunks; 'none': skip)")
    p.add_argument("--old-p1", action="store_true", help="also P=1 of --old (its P=1 path did not change)")
    p.add_argument("--no-same-chunks", action="store_true", help="skip 'P=1 same chunks': P=1 with the chunk size "
                   "the largest ring cuts the prompt into (--prefill-step-size), which tells pipelining apart "
                   "from what smaller chunks cost or save on one core")
    p.add_argument("--no-side-by-side", action="store_true", help="skip 'P=1 side by side': as many P=1 processes "
                   "as the largest ring has ranks, at once, one on each core (each prompt alone in its process): "
                   "their summed tok/s over P=1's is what this machine's cores allow a ring (shared caches, memory "
                   "bandwidth, a hypervisor's cores)")
    p.add_argument("--runner-arg", action="append", default=[], metavar="ARG",
                   help="more run_trinity.py arguments (repeatable), e.g. --runner-arg=--prefill-step-size=1024")


def prompt(n: int) -> str:
    import random

    rng = random.Random(f"prefill-stages:{n}")
    return ",".join(str(rng.randrange(10, 250)) for _ in range(n))


def ring_chunk(n: int, stages: int, step: int = PREFILL_STEP_SIZE) -> int:
    """The chunk a prompt of n tokens alone goes in on `stages` stages (batching.Prefill._step, one row)."""
    return min(step, max(-(-n // (CHUNKS_PER_STAGE * stages)), MIN_CHUNK)) if stages > 1 else step


def step_of(args) -> int:
    """--prefill-step-size as --runner-arg gives it (the last one), else the default."""
    step = PREFILL_STEP_SIZE
    for i, a in enumerate(args.runner_arg):
        if a.startswith("--prefill-step-size"):
            step = int(a.split("=", 1)[1]) if "=" in a else int(args.runner_arg[i + 1])
    return step


def run_one(root: Path, ranks: int, cores: str, ids: str, args, env: dict, extra: list = ()) -> dict:
    cmd = ["sh", "-c", PIN, "sh", cores, PY, str(root / "run_trinity.py"), "--prompt-ids", ids, "--max-tokens", "1",
           "--json", *(["--model", args.model] if args.model else []), *args.runner_arg, *extra]
    r = run_ranks(cmd, ranks, env, args.timeout)
    return {k: r[k] for k in ("prefill_tokens_per_sec", "token_ids", "loadavg", "exit_code", "error") if k in r}


def configs_of(args, old) -> dict:
    """Name -> (checkout, ranks)."""
    configs = {}
    for p in args.ranks:
        name = "P=1" if p == 1 else f"ring P={p}"
        configs[name] = (ROOT, p)
        if p == 1 and max(args.ranks) > 1 and not args.no_same_chunks:
            configs["P=1 same chunks"] = (ROOT, 1)
        if p == 1 and max(args.ranks) > 1 and not args.no_side_by_side:
            configs["P=1 side by side"] = (ROOT, 1)
        if old and (p > 1 or args.old_p1):
            configs[f"{name} @old"] = (old, p)
    return configs


def side_by_side(root: Path, cores: list, ids: str, args, env: dict) -> dict:
    """One P=1 process per core at once, each with the prompt: their summed tok/s."""
    both = concurrent([lambda k=k: run_one(root, 1, cores[k], ids, args, env) for k in range(max(args.ranks))])
    r = dict(both[0], each=both, chunk=step_of(args))
    if all("prefill_tokens_per_sec" in b for b in both):
        r["prefill_tokens_per_sec"] = sum(b["prefill_tokens_per_sec"] for b in both)
    return r


def measure(configs: dict, cores: list, args, env: dict) -> dict:
    """prompt length -> name -> runs, the configurations interleaved in each round."""
    runs = {n: {name: [] for name in configs} for n in args.prompt_lens}
    step = step_of(args)
    for rep in range(args.reps):
        for n in args.prompt_lens:
            ids = prompt(n)
            for name, (root, p) in configs.items():
                if name == "P=1 side by side":
                    r = side_by_side(root, cores, ids, args, env)
                elif name == "P=1 same chunks":
                    if ring_chunk(n, max(args.ranks), step) == step:
                        continue  # P=1's own chunks: the P=1 row
                    chunk = ring_chunk(n, max(args.ranks), step)
                    r = dict(run_one(root, 1, cores[0], ids, args, env, ["--prefill-step-size", str(chunk)]),
                             chunk=chunk)
                else:
                    r = dict(run_one(root, p, ",".join(cores[:p]), ids, args, env),
                             chunk=ring_chunk(n, p if root == ROOT else 1, step))
                runs[n][name].append(r)
                tps = r.get("prefill_tokens_per_sec")
                log.info(f"[{rep + 1}/{args.reps}] {n} tokens, {name}: " + (
                    f"{tps:.1f} tok/s (load {r['loadavg']:.2f})" if tps else r.get("error", "failed")[:500]))
    return runs


def summarize(runs: dict) -> dict:
    """Medians, the ratio to P=1 and whether each run's token is P=1's."""
    results = {}
    for n, by in runs.items():
        rows = results[str(n)] = {}
        for name, rs in by.items():
            ok = [r["prefill_tokens_per_sec"] for r in rs if "prefill_tokens_per_sec" in r]
            if rs:
                rows[name] = {"runs": rs, "prefill_tokens_per_sec": statistics.median(ok) if ok else None}
        base = rows.get("P=1", {}).get("prefill_tokens_per_sec")
        first = next((r["token_ids"] for r in by.get("P=1", []) if "token_ids" in r), None)
        for name, row in rows.items():
            tps = row["prefill_tokens_per_sec"]
            row["x_p1"] = tps / base if tps and base else None
            row["same_token_as_p1"] = all(r.get("token_ids") == first for r in row["runs"] if "token_ids" in r)
    return results


def print_table(results: dict, args) -> None:
    print(f"\n{args.model or 'the embedded model'}: one prompt alone, max_tokens 1, rank r on core r of "
          f"{args.cores}, OpenBLAS 1 thread; median of {args.reps}")
    print(f"{'prompt':>7}  {'config':<18}{'chunk':>6}{'prefill tok/s':>14}{'x P=1':>8}{'load':>7}  token=P=1")
    for n, rows in results.items():
        for name, row in rows.items():
            tps = row["prefill_tokens_per_sec"]
            loads = [r["loadavg"] for r in row["runs"] if "loadavg" in r]
            if tps is None:
                print(f"{n:>7}  {name:<18}  failed: {row['runs'][0].get('error', '')[:300]}")
                continue
            print(f"{n:>7}  {name:<18}{row['runs'][0]['chunk']:>6}{tps:>14.1f}{(row['x_p1'] or float('nan')):>8.2f}"
                  f"{statistics.median(loads):>7.2f}  {'yes' if row['same_token_as_p1'] else 'NO'}")


def main(args) -> None:
    shrink(args, prompt_lens=[1024, 2048], old="none")
    cores = args.cores.split(",")
    if max(args.ranks) > len(cores):
        raise SystemExit(f"--ranks {max(args.ranks)} needs as many --cores (have {args.cores})")
    env = bench_env(args.blas)
    env["OPENBLAS_NUM_THREADS"] = "1"
    old = None
    if args.old != "none":
        old = Path(tempfile.mkdtemp(prefix="trinity-bench-old-"))
        os.rmdir(old)
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.old], cwd=ROOT, check=True,
                       capture_output=True)
    try:
        runs = measure(configs_of(args, old), cores, args, env)
    finally:
        if old:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, capture_output=True)
            shutil.rmtree(old, ignore_errors=True)
            subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)
    results = summarize(runs)
    print_table(results, args)
    settings = dict(vars(args), old_tree=str(old) if old else None)
    print(f"wrote {save(out_path(args, 'prefill_stages'), {'results': results}, settings)}")
