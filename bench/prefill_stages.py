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
  tensor T=N  (--tensor) the ring of N started the same way with --tensor-parallel-size N: one tensor
              group, each rank half (1/N) of every layer's heads and experts, an all_sum over the ring
              after attention and after the MLP; a prompt alone goes in P=1's chunks (one stage). Its
              ranks evaluate every layer's output for a prompt chunk, the last layer's included (its
              all_sums must pair: runtime/tensor.py), where P=1 evaluates the last layer's KV cache only:
              on the embedded model, whose last layer is full attention, at 16,384 tokens (2,048-token
              chunks) that is 31.0 CPU s of layers to split against P=1's 20.4, so at most 1.31x P=1

Prefill tok/s = prompt tokens / time to the first token inside rank 0 (the runner's JSON, after
loading). Each prompt is alone in a fresh process (max_tokens 1); configurations interleave per
round (--reps), medians are reported, each with the load average when it started. OpenBLAS is
preloaded with OPENBLAS_NUM_THREADS=1 (--blas). The ratio: ring over P=1 of the same invocation
(target 1.7x for two ranks). --smoke: 1024- and 2048-token prompts, no --old. Each run also records
each rank's CPU seconds (user + sys of its whole process, loading included: `cpu_s` in the JSON).

--layer-costs: each decoder layer's CPU seconds over the prompt alone, in one process on CORE0, at
P=1's chunk and at each ring's, evaluated as the runner does: every layer's output, but the last
layer's KV cache only (the last rank, and P=1, evaluate a prompt chunk's caches, not its hidden
states: Reply.NONE), so a full-attention last layer costs almost nothing until the last token.
From them: each rank's share under the runner's even split and under the best contiguous split,
and the most a ring can gain over P=1 (P=1's sum over the largest rank's; also with P=1 at the
ring's chunks), which no scheduling of the chunks can beat. On the embedded model at 16,384 tokens one full-attention layer (its quadratic
attention) is half of P=1's work, and a contiguous split cannot cut a layer.
"""

import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from distributed.runtime.frames import CHUNKS_PER_STAGE, MIN_CHUNK, PREFILL_STEP_SIZE

from bench.harness import PY, ROOT, bench_env, concurrent, flags, int_list, out_path, run_ranks, save, shrink

log = logging.getLogger("bench")

# Rank r runs under taskset -c (the r-th of the comma-separated cores in $1); MLX_RANK is unset at P=1.
# With $PREFILL_STAGES_CPU set, the shell writes its child's CPU times there (`times`: user, sys) as it exits.
PIN = ('cores="$1"; shift; core=$(echo "$cores" | cut -d, -f$(( ${MLX_RANK:-0} + 1 ))); '
       'if [ -z "$PREFILL_STAGES_CPU" ]; then exec taskset -c "$core" "$@"; fi; '
       'taskset -c "$core" "$@"; rc=$?; times > "$PREFILL_STAGES_CPU/rank${MLX_RANK:-0}"; exit $rc')


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
    p.add_argument("--tensor", action="store_true", help="also 'tensor T=N' for each ring: the same N ranks, "
                   "each on its core, with --tensor-parallel-size N (one tensor group splitting every layer, "
                   "the full-attention layer's heads included)")
    p.add_argument("--layer-costs", action="store_true", help="also each layer's CPU seconds in one process at "
                   "P=1's chunk and each ring's, each rank's share and the most a ring can gain over P=1 "
                   "(see above)")


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


def cpu_seconds(folder: str, ranks: int) -> list:
    """Each rank's CPU seconds (user + sys) as PIN's `times` wrote them; None where none was written."""
    out = []
    for r in range(ranks):
        try:
            children = Path(folder, f"rank{r}").read_text().splitlines()[1]
            out.append(round(sum(int(m) * 60 + float(s) for m, s in re.findall(r"(\d+)m([\d.]+)s", children)), 2))
        except (OSError, IndexError, ValueError):
            out.append(None)
    return out


def run_one(root: Path, ranks: int, cores: str, ids: str, args, env: dict, extra: list = ()) -> dict:
    cmd = ["sh", "-c", PIN, "sh", cores, PY, str(root / "run_trinity.py"), "--prompt-ids", ids, "--max-tokens", "1",
           "--json", *(["--model", args.model] if args.model else []), *args.runner_arg, *extra]
    with tempfile.TemporaryDirectory(prefix="prefill-stages-cpu-") as folder:
        r = run_ranks(cmd, ranks, dict(env, PREFILL_STAGES_CPU=folder), args.timeout)
        cpu = cpu_seconds(folder, ranks)
    r = {k: r[k] for k in ("prefill_tokens_per_sec", "token_ids", "loadavg", "exit_code", "error") if k in r}
    return dict(r, cpu_s=cpu)


def configs_of(args, old) -> dict:
    """Name -> (checkout, ranks, tensor-parallel size)."""
    configs = {}
    for p in args.ranks:
        name = "P=1" if p == 1 else f"ring P={p}"
        configs[name] = (ROOT, p, 1)
        if p == 1 and max(args.ranks) > 1 and not args.no_same_chunks:
            configs["P=1 same chunks"] = (ROOT, 1, 1)
        if p == 1 and max(args.ranks) > 1 and not args.no_side_by_side:
            configs["P=1 side by side"] = (ROOT, 1, 1)
        if p > 1 and args.tensor:
            configs[f"tensor T={p}"] = (ROOT, p, p)
        if old and (p > 1 or args.old_p1):
            configs[f"{name} @old"] = (old, p, 1)
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
            for name, (root, p, t) in configs.items():
                if name == "P=1 side by side":
                    r = side_by_side(root, cores, ids, args, env)
                elif name == "P=1 same chunks":
                    if ring_chunk(n, max(args.ranks), step) == step:
                        continue  # P=1's own chunks: the P=1 row
                    chunk = ring_chunk(n, max(args.ranks), step)
                    r = dict(run_one(root, 1, cores[0], ids, args, env, ["--prefill-step-size", str(chunk)]),
                             chunk=chunk)
                elif t > 1:  # one tensor group: one stage, P=1's chunks
                    r = dict(run_one(root, p, ",".join(cores[:p]), ids, args, env,
                                     ["--tensor-parallel-size", str(t)]), chunk=ring_chunk(n, 1, step))
                else:
                    r = dict(run_one(root, p, ",".join(cores[:p]), ids, args, env),
                             chunk=ring_chunk(n, p if root == ROOT else 1, step))
                runs[n][name].append(r)
                tps = r.get("prefill_tokens_per_sec")
                log.info(f"[{rep + 1}/{args.reps}] {n} tokens, {name}: " + (
                    f"{tps:.1f} tok/s (load {r['loadavg']:.2f})" if tps else r.get("error", "failed")[:500]))
    return runs


def layer_costs_here(model: str, n: int, chunk: int) -> list:
    """(In the worker process) CPU seconds of each layer over prompt(n) but its last token, in chunks of
    `chunk`, each layer fed the previous one's outputs: its output evaluated, but the last layer's caches
    only (as the last rank and P=1 evaluate a prompt chunk). Layer 0's includes the embedding."""
    import mlx.core as mx

    from distributed.shard.config import read_config
    from distributed.shard.loader import load_stage

    layers = read_config(Path(model))["num_hidden_layers"]
    ids = [int(t) for t in prompt(n).split(",")][:-1]
    hs, costs = None, []
    for i in range(layers):
        stage = load_stage(Path(model), i, i + 1, i == 0)
        caches, last, outs = stage.make_cache(), i == layers - 1, []
        start = time.process_time()
        for k, off in enumerate(range(0, len(ids), chunk)):
            h = stage.embed(mx.array(ids[off:off + chunk])[None]) if i == 0 else hs[k]
            y = stage(h, caches)
            mx.eval([c.state for c in caches] if last else [y, [c.state for c in caches]])
            outs.append(y)
        costs.append(time.process_time() - start)
        hs = outs
    return costs


def layer_costs(model: str, n: int, chunk: int, core: str, env: dict, timeout: float) -> list:
    """layer_costs_here in a fresh process pinned to `core`."""
    code = ("import json, sys; from bench.prefill_stages import layer_costs_here; "
            "print(json.dumps(layer_costs_here(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))")
    out = subprocess.run(["taskset", "-c", core, PY, "-c", code, model, str(n), str(chunk)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"layer costs ({n} tokens, chunks of {chunk}) failed: {out.stderr[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def best_split(costs: list, ranks: int) -> list:
    """Layers per rank, contiguous, minimising the largest rank's sum (every rank one layer at least)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[r][e]: (largest sum, split) for layers [0, e) over r ranks
    best = {(1, e): (prefix[e], [e]) for e in range(1, n + 1)}
    for r in range(2, ranks + 1):
        for e in range(r, n + 1):
            best[(r, e)] = min(((max(best[(r - 1, s)][0], prefix[e] - prefix[s]), best[(r - 1, s)][1] + [e - s])
                                for s in range(r - 1, e)), key=lambda t: t[0])
    return best[(ranks, n)][1]


def measure_layer_costs(args, cores: list, env: dict) -> dict:
    """prompt length -> per chunk size the layers' costs, and per ring its ranks' shares and bound."""
    from distributed.shard.plan import even_split
    from distributed.shard.tiny_checkpoint import DEFAULT_MODEL

    model, step = args.model or str(DEFAULT_MODEL), step_of(args)
    out = {}
    for n in args.prompt_lens:
        chunks = {p: ring_chunk(n, p, step) for p in sorted(set(args.ranks) | {1})}
        costs = {c: layer_costs(model, n, c, cores[0], env, args.timeout) for c in sorted(set(chunks.values()))}
        p1 = sum(costs[chunks[1]])
        rings = {}
        for p in (p for p in args.ranks if p > 1):
            c = costs[chunks[p]]
            rings[p] = {}
            for name, split in (("even", even_split(len(c), p)), ("best", best_split(c, p))):
                bounds = [sum(split[:r]) for r in range(p + 1)]
                shares = [sum(c[bounds[r]:bounds[r + 1]]) for r in range(p)]
                rings[p][name] = {"split": split, "rank_cpu_s": shares,
                                  "bound_x_p1": p1 / max(shares), "bound_x_same_chunks": sum(c) / max(shares)}
        out[str(n)] = {"chunks": chunks, "layer_cpu_s": {str(c): v for c, v in costs.items()}, "p1_cpu_s": p1,
                       "rings": {str(p): r for p, r in rings.items()}}
        log.info(f"{n} tokens, layer costs (CPU s): " + ", ".join(
            f"chunk {c}: " + " ".join(f"{x:.2f}" for x in v) for c, v in costs.items()))
    return out


def print_layer_costs(costs: dict) -> None:
    print("\nlayer costs (one process on CORE0; CPU s; the last layer: its caches only)")
    for n, row in costs.items():
        for c, v in row["layer_cpu_s"].items():
            print(f"{n:>7}  chunk {c:>5}: " + " ".join(f"{x:6.2f}" for x in v) + f"   sum {sum(v):6.2f}")
        for p, ring in row["rings"].items():
            for name, r in ring.items():
                print(f"{n:>7}  ring P={p} ({row['chunks'][int(p)]}-token chunks), {name} split "
                      f"{','.join(map(str, r['split']))}: ranks " + " / ".join(f"{x:.2f}" for x in r["rank_cpu_s"])
                      + f" CPU s: at most {r['bound_x_p1']:.2f}x P=1 ({row['p1_cpu_s']:.2f}), "
                      f"{r['bound_x_same_chunks']:.2f}x P=1 at the same chunks")


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
    print(f"{'prompt':>7}  {'config':<18}{'chunk':>6}{'prefill tok/s':>14}{'x P=1':>8}{'load':>7}  token=P=1"
          f"  CPU s per rank")
    for n, rows in results.items():
        for name, row in rows.items():
            tps = row["prefill_tokens_per_sec"]
            loads = [r["loadavg"] for r in row["runs"] if "loadavg" in r]
            if tps is None:
                print(f"{n:>7}  {name:<18}  failed: {row['runs'][0].get('error', '')[:300]}")
                continue
            cpus = [r["cpu_s"] for r in row["runs"] if r.get("cpu_s") and None not in r["cpu_s"]]
            cpu = " / ".join(f"{statistics.median(c):.1f}" for c in zip(*cpus)) if cpus else "-"
            print(f"{n:>7}  {name:<18}{row['runs'][0]['chunk']:>6}{tps:>14.1f}{(row['x_p1'] or float('nan')):>8.2f}"
                  f"{statistics.median(loads):>7.2f}  {'yes' if row['same_token_as_p1'] else 'NO':<9}  {cpu}")


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
    costs = measure_layer_costs(args, cores, env) if args.layer_costs else None
    if costs:
        print_layer_costs(costs)
    settings = dict(vars(args), old_tree=str(old) if old else None)
    print(f"wrote {save(out_path(args, 'prefill_stages'), dict(results=results, layer_costs=costs), settings)}")
