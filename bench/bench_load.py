"""Serving under load: mlx-lm batch_generate vs this runner over gRPC at P = 1, 2 ranks.

    python bench/bench_load.py [--smoke] [--model PATH | --make-mini PATH] [--out PATH]
        [--streams 1,8,32,64,128 | none] [--prompt-lens 8,128] [--max-tokens 128] [--ps 1,2]
        [--backend ring|nccl|mlx-launch-ring] [--gpu-per-rank] [--check N|all]
        [--long 2048,8192,32768] [--reps 3] [--prefill-step-size 2048] [--max-batch N]
        [--mixed] [--arrival-gap S] [--runner-arg=--flag=value ...] [--baseline DIR] [--blas reference|openblas] [--timeout S]

One invocation measures every configuration, one after another, on the same weights, greedy:

  mlx-lm        a child process (bench/load_mlx_lm.py): batch_generate's BatchGenerator with
                completion_batch_size = prefill_batch_size = the stream count (all batched at
                once), timed per step; generate_step for prompts alone and the long prompts
  runner P=k    run_trinity.py --serve on 127.0.0.1 (bench/load_servers.py): k = 1 is one
                process; k > 1 by --backend: `ring` starts the ranks here with MLX_HOSTFILE /
                MLX_RANK (point-to-point transport; --gpu-per-rank gives rank r
                CUDA_VISIBLE_DEVICES=r, and P=1 and mlx-lm GPU 0), `nccl` through
                `mlx.launch --backend nccl` (collective transport, one GPU per rank),
                `mlx-launch-ring` through `mlx.launch --backend ring` (to check that path on a CPU).
                Passed: --max-batch (default: the largest stream count, so that all streams
                decode together, as in mlx-lm), --max-queue (at least that), --prefill-step-size,
                then every --runner-arg (later flags win, e.g. --runner-arg=--max-batch=16 or
                --runner-arg=--prefix-cache-bytes=0).
  baseline P=k  with --baseline DIR: the same, with DIR/run_trinity.py (another checkout, e.g.
                `git worktree add --detach DIR main`), right after runner P=k, so that a code
                change is measured against its base on the same machine (GPU machines differ by
                several percent); the runner rows get "x base": their tok/s / the baseline's at
                the same P.

For each prompt length (--prompt-lens) and stream count (--streams): that many distinct
deterministic byte-token prompts (distinct per run too, so no prefix is shared with an earlier run)
sent at once, --max-tokens greedy tokens each, after an untimed warm-up batch of the same shape
(other prompts; MLX on CUDA compiles kernels per shape on first use, load_measure.py); for the runner
one gRPC Generate stream per thread, released together. Reported: aggregate tok/s = generated tokens / (last stream's end - first
request sent); TTFT p50 / p99 over the streams = request sent -> first token, at the client
(for mlx-lm: the call's start -> the step that yields the stream's first token). Exactness: the
first --check streams of each run are run again alone on the same configuration (default 4;
`all`), and their greedy tokens compared: counts are reported, never failed on (bf16 near-ties
on a GPU may differ); the runner's alone tokens are also compared with mlx-lm generate_step's.
--mixed: each stream's max_tokens spread evenly over [--max-tokens / 2, 3 --max-tokens / 2] (fixed
order, about the same total), so rows finish at different steps, as in real traffic; the alone
runs use each stream's own max_tokens.
--arrival-gap S: stream i is sent S * i seconds after the first instead of all at once, so prompts
arrive while others decode (their chunks ride in the decode steps: chunked prefill); the
inter-token latency (ITL p50 / p99 over every gap between a stream's tokens) shows how long the
running streams stall meanwhile. mlx-lm's batch call cannot take arrivals: it needs --no-mlx-lm;
compare with another checkout through --baseline.
--long: TTFT of each long prompt alone (max_tokens 1), median of --reps, after a warm-up.

Printed: one row per configuration x prompt length x stream count (tok/s, TTFT p50, p99, the
runners' ITL p50, p99, exact,
tok/s ratios runner / mlx-lm and P=k / P=1), TTFT p50 at 64 streams and TTFT p50 (32 at once) /
TTFT (1 alone) (the largest count measured where 64 or 32 is not), the long-prompt TTFTs and their
ratios. --out gets every raw number (each stream's TTFT and tokens), rewritten after every
configuration: default bench/results/load.json (--smoke: load_smoke.json). Every server process
group is ended (SIGTERM, then SIGKILL) on any exit; a server that dies is named with its log tail.

--smoke: the small fp32 checkpoint, 1 and 4 streams of 8-token prompts, 16 tokens, P = 1, 2 and a
64-token long prompt: checks the script (about a minute on 2 CPU cores). On a CPU the default
model is bench_decode.py's fp32 checkpoint (bench/common.py `checkpoint`, made once in
$TMPDIR/trinity-bench/); 4-bit weights are slow there.

On the GPU machine (see ../shared/DEVICE-MLX-CUDA.md for MLX there; `--make-mini` builds the
Trinity-Mini shape with random 4-bit weights once, with bench/bench_gpu.py's `make`, ~30 s; write
--out under $OUT to get the JSON back). One command may run 10 minutes: at the defaults one prompt
length of the three configurations takes about 7 to 10 minutes (the first process on a fresh
machine also compiles kernels, 100 to 200 s), so run one prompt length per command (short of time: drop 128
from --streams, or --check 1; --out keeps the configurations finished before a stop):

    # P=1 vs P=2 over NCCL (the collective transport)
    python3 bench/bench_load.py --make-mini /tmp/trinity-mini-shape-4bit --backend nccl \\
        --prompt-lens 128 --out $OUT/load_nccl_128.json
    python3 bench/bench_load.py --make-mini /tmp/trinity-mini-shape-4bit --backend nccl \\
        --prompt-lens 8 --out $OUT/load_nccl_8.json
    # P=2 over the ring backend (point-to-point), one GPU per rank
    python3 bench/bench_load.py --make-mini /tmp/trinity-mini-shape-4bit --backend ring --gpu-per-rank \\
        --prompt-lens 128 --out $OUT/load_ring_128.json
    # long prompts alone (no streams)
    python3 bench/bench_load.py --make-mini /tmp/trinity-mini-shape-4bit --backend nccl --streams none \\
        --long 2048,8192,32768 --prefill-step-size 2048 --out $OUT/load_long.json
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

from common import FULL, PY, QUICK, ROOT, bench_env, checkpoint, run_json_child  # noqa: E402
from load_measure import measure  # noqa: E402
from load_report import BASELINE, print_report, summarize  # noqa: E402
from load_servers import BACKENDS, GrpcClient, RunnerServer  # noqa: E402

DEFAULTS = dict(streams=[1, 8, 32, 64, 128], prompt_lens=[8, 128], max_tokens=128, ps=[1, 2], long=[], reps=3,
                check=4)
SMOKE = dict(streams=[1, 4], prompt_lens=[8], max_tokens=16, ps=[1, 2], long=[64], reps=1, check=None)
MAKE = "import sys; from pathlib import Path; sys.path.insert(0, 'bench'); from bench_gpu import make; make(Path(sys.argv[1]))"


def int_list(text: str) -> list:
    return [] if text.strip() == "none" else [int(x) for x in text.split(",") if x.strip()]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny config that checks the script in about a minute")
    p.add_argument("--model", help="checkpoint folder (default: bench/common.py's fp32 checkpoint)")
    p.add_argument("--make-mini", metavar="PATH", help="Trinity-Mini shape, random 4-bit weights: build it at PATH "
                   "if missing (bench/bench_gpu.py make) and use it")
    p.add_argument("--out", help="JSON file (default bench/results/load.json; --smoke: load_smoke.json)")
    p.add_argument("--streams", type=int_list, help="concurrent stream counts, or none (default 1,8,32,64,128)")
    p.add_argument("--prompt-lens", type=int_list, help="prompt lengths of the streams (default 8,128)")
    p.add_argument("--max-tokens", type=int, help="greedy tokens per stream (default 128)")
    p.add_argument("--mixed", action="store_true",
                   help="max_tokens spread over [max/2, 3 max/2] across the streams: rows finish at different steps")
    p.add_argument("--arrival-gap", type=float, default=0.0, metavar="S",
                   help="stream i arrives S * i seconds after the first, instead of all at once (prompts arriving "
                        "while others decode; runners only: needs --no-mlx-lm)")
    p.add_argument("--ps", type=int_list, help="runner rank counts (default 1,2)")
    p.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx-lm baseline (runner ratios only)")
    p.add_argument("--backend", choices=BACKENDS, default="ring", help="how P > 1 ranks start (default ring)")
    p.add_argument("--gpu-per-rank", action="store_true", help="ring: rank r gets CUDA_VISIBLE_DEVICES=r")
    p.add_argument("--check", type=lambda s: None if s == "all" else int(s),
                   help="streams of each run re-run alone to compare tokens (default 4; all)")
    p.add_argument("--long", type=int_list, help="long prompt lengths: TTFT alone (default: none)")
    p.add_argument("--reps", type=int, help="runs of each long prompt, median (default 3)")
    p.add_argument("--prefill-step-size", type=int, default=2048,
                   help="prompt chunk, mlx-lm and runner (default 2048, both programs' own default)")
    p.add_argument("--max-batch", type=int, help="run_trinity.py --max-batch (default: the largest stream count)")
    p.add_argument("--runner-arg", action="append", default=[], metavar="ARG",
                   help="extra run_trinity.py argument, e.g. --runner-arg=--prefix-cache-bytes=0 (repeatable)")
    p.add_argument("--baseline", type=Path, metavar="DIR",
                   help="another checkout: its run_trinity.py is measured too, after each P (runner / baseline)")
    p.add_argument("--blas", choices=["reference", "openblas"], default="reference",
                   help="openblas preloads the system OpenBLAS (CPU: much faster prefill on Linux)")
    p.add_argument("--timeout", type=float, default=1800,
                   help="seconds for a server to start and for each request; 4x for the whole mlx-lm child")
    args = p.parse_args()
    for key, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.check is None:
        args.check = max(args.streams or [0])
    if not args.streams and not args.long:
        p.error("nothing to measure: --streams none and no --long")
    for flag in ("streams", "prompt_lens", "ps", "long"):
        if any(v < 1 for v in getattr(args, flag)):
            p.error(f"--{flag.replace('_', '-')}: every value must be at least 1")
    if args.baseline and not (args.baseline / "run_trinity.py").exists():
        p.error(f"--baseline {args.baseline}: no run_trinity.py there")
    if args.streams and not args.prompt_lens:
        p.error("--prompt-lens: give at least one length")
    if args.arrival_gap < 0:
        p.error("--arrival-gap: must be at least 0")
    if args.arrival_gap and not args.no_mlx_lm:
        p.error("--arrival-gap needs --no-mlx-lm: mlx-lm's batch_generate takes every prompt at once")
    if args.model and args.make_mini:
        p.error("--model and --make-mini: give one")
    return args


def resolve_model(args, env) -> Path:
    if args.make_mini:
        path = Path(args.make_mini)
        if not (path / "config.json").exists():
            r = subprocess.run([PY, "-c", MAKE, str(path)], cwd=ROOT, env=env)
            if r.returncode:
                sys.exit(f"--make-mini: building {path} failed (exit {r.returncode})")
        return path
    if args.model:
        path = Path(args.model)
        if not (path / "config.json").exists():
            sys.exit(f"--model: no config.json in {path}")
        return path
    return checkpoint(QUICK if args.smoke else FULL)


def describe(model: Path, config: dict) -> str:
    q = config.get("quantization") or {}
    weights = f"{q['bits']}-bit" if q.get("bits") else config.get("torch_dtype", "float32")
    gib = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**30
    return (f"AFMoE {model.name}: hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
            f"{config.get('num_experts')} experts (top {config.get('num_experts_per_tok')}), {weights}, {gib:.2f} GiB")


def run_mlx_lm(spec: dict, env: dict, timeout: float) -> dict:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.write(fd, json.dumps(spec).encode())
    os.close(fd)
    try:
        return run_json_child([PY, str(BENCH / "load_mlx_lm.py"), path], env, timeout, relay_stderr=True)
    finally:
        os.unlink(path)


def run_runner(ranks: int, args, runner_args: list, env: dict, spec: dict, checkout: Path = ROOT) -> tuple:
    name = "runner" if checkout == ROOT else "baseline"
    server = RunnerServer(ranks, args.backend, runner_args, env, args.gpu_per_rank, args.timeout,
                          run=str(checkout / "run_trinity.py"), name=name)
    try:
        with server:
            out = measure(spec, GrpcClient(server, args.timeout), server.label)
            out["startup_s"] = server.startup_s
            if not server.dead():
                out.update(server.model_info())
    except RuntimeError as e:  # did not start: already named, with its log tail
        out = {"error": str(e)}
    out["command"] = server.label
    return server.label, out


def main() -> None:
    args = parse_args()
    # SIGTERM / SIGHUP end the run through the finally blocks that stop the servers.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda n, _: sys.exit(128 + n))
    start = time.perf_counter()
    env = bench_env(args.blas)
    model = resolve_model(args, env)
    config = json.loads((model / "config.json").read_text())
    context = config.get("max_position_embeddings") or 2**31
    for length in args.prompt_lens + args.long:
        most = round(args.max_tokens * 1.5) if args.mixed else args.max_tokens
        need = length + (most if length in args.prompt_lens else 1)
        if need > context:
            sys.exit(f"a {length}-token prompt needs {need} positions, beyond the model's context ({context})")
    max_batch = args.max_batch or max(args.streams or [1])
    runner_args = ["--model", str(model), "--max-tokens-cap", str(max(4096, 2 * args.max_tokens)),
                   "--max-queue", str(max(64, *args.streams or [1])), "--max-batch", str(max_batch),
                   "--prefill-step-size", str(args.prefill_step_size), *args.runner_arg]
    spec = {"model": str(model), "streams": args.streams, "prompt_lens": args.prompt_lens,
            "max_tokens": args.max_tokens, "mixed": args.mixed, "arrival_gap": args.arrival_gap, "check": args.check, "long": args.long, "reps": args.reps,
            "prefill_step_size": args.prefill_step_size}
    tokens = (f"{round(args.max_tokens / 2)} to {round(args.max_tokens * 1.5)} greedy tokens a stream (--mixed)"
              if args.mixed else f"{args.max_tokens} greedy tokens a stream")
    if args.arrival_gap:
        tokens += f", stream i arriving {args.arrival_gap} s x i after the first"
    header = (f"{describe(model, config)}; {tokens}; prefill step "
              f"{args.prefill_step_size}; runner: --max-batch {max_batch}, P>1 via {args.backend}"
              f"{' (a GPU per rank)' if args.gpu_per_rank else ''}; extra runner args: {args.runner_arg or 'none'}")
    print(header, file=sys.stderr, flush=True)

    results, loads = {}, {}
    out = Path(args.out or ROOT / "bench" / "results" / ("load_smoke.json" if args.smoke else "load.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = dict(vars(args), model=str(model), baseline=args.baseline and str(args.baseline), runner_args=runner_args, config=config, cpus=os.cpu_count(),
                    loadavg_at_start=loads)

    def save() -> dict:
        """After every configuration, so that a run stopped at a time limit keeps what it measured."""
        summary = summarize(results, spec)
        out.write_text(json.dumps({"settings": settings, "summary": summary, "results": results,
                                   "wall_s": time.perf_counter() - start}, indent=1))
        return summary

    if not args.no_mlx_lm:
        tic = time.perf_counter()
        loads[BASELINE] = os.getloadavg()[0]
        mlx_env = dict(env, CUDA_VISIBLE_DEVICES="0") if args.gpu_per_rank else env
        results[BASELINE] = run_mlx_lm(spec, mlx_env, args.timeout * 4)
        save()
        print(f"mlx-lm: {results[BASELINE].get('error') or 'done'} ({time.perf_counter() - tic:.0f} s)",
              file=sys.stderr, flush=True)
    checkouts = [ROOT] + ([args.baseline.resolve()] if args.baseline else [])
    for ranks in args.ps:
        for checkout in checkouts:
            tic, load = time.perf_counter(), os.getloadavg()[0]
            name, results[name] = run_runner(ranks, args, runner_args, env, spec, checkout)
            loads[name] = load
            save()
            print(f"{name}: {results[name].get('error', 'done').splitlines()[0]} ({time.perf_counter() - tic:.0f} s)",
                  file=sys.stderr, flush=True)

    summary = save()
    print(f"\n{header}\n{os.cpu_count()} CPUs, load average {min(loads.values()):.1f}-{max(loads.values()):.1f} "
          f"at the starts; wall time {time.perf_counter() - start:.0f} s")
    print_report(summary, results, spec)
    print(f"wrote {out}")

if __name__ == "__main__":
    main()
