"""Throughput benchmark: one-process mlx-lm vs this runner served over gRPC at P = 1, 2, 3 ranks.

    python bench/bench_throughput.py [--quick] [--out PATH] [--ps 1,2,3] [--streams 1,4,8,16]
                                     [--max-tokens N] [--ttft-lens 512,2048] [--reps N]
                                     [--prefill-step-size N] [--blas reference|openblas]
                                     [--max-batch N] [--runner-arg=--flag=value ...]

One invocation, one checkpoint (bench_decode.py's fp32 AFMoE, made once in $TMPDIR/trinity-bench/;
--quick: the small one), greedy throughout, deterministic byte-token prompts. Measured:

  mlx-lm (one child process: mlx_lm.utils.load, then)
    generate_step   single-stream decode tok/s = (tokens - 1) / (last token - first token) on a
                    --decode-prompt-len prompt; TTFT for each --ttft-lens prompt = from the call
                    to the first yielded token (max_tokens 1)
    batch_generate  aggregate tok/s for each --streams count n: n distinct prompts
                    (--stream-prompt-len tokens each), --max-tokens each, one call;
                    aggregate = generated tokens / wall time of the call (prefill included)
  runner P=k        run_trinity.py --serve on 127.0.0.1, k rank processes of the ring backend
                    started here (MLX_HOSTFILE + MLX_RANK, not mlx.launch, whose I/O loop keeps a
                    core busy); every number is taken at the gRPC client (this process):
                    decode tok/s and TTFT as above (TTFT = request sent to first token);
                    aggregate for n streams = n threads, one Generate stream each, started
                    together, the same prompts and --max-tokens as batch_generate; aggregate =
                    generated tokens / (last stream's end - first request sent); also the mean
                    per-stream TTFT.
  memory            per rank: mx.get_peak_memory() after loading (GetModelInfo's
                    peak_memory_bytes; for mlx-lm taken the same way in the child) and the
                    process's VmHWM (/proc/PID/status peak RSS) after all its runs.

Before measuring, each configuration gets one warm-up generation. Decode and TTFT are the median
of --reps runs (default 3; --quick 1); aggregates are one run per stream count.

Checks: the runner's greedy single-stream tokens (decode and TTFT prompts) must equal mlx-lm
generate_step's for the same prompt (the runner stops at EOS, generate_step does not, so a
shorter runner output must end where mlx-lm emits EOS); a mismatch marks the row "NO" and
prints a warning. Streams are also compared with batch_generate's tokens for the same prompt
(reported, informational: batched float32 arithmetic may differ in the last bits).

Prints a table (one row per configuration) and the ratios issue 5's targets need; all raw numbers
go to --out (default bench/results/throughput.json; --quick: throughput_quick.json).
--quick: the small model, 16 new tokens, 1 rep (a couple of minutes on 2 cores).
Every server process is ended (its process group SIGTERMed, then SIGKILLed) on any exit.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

from common import (  # noqa: E402
    FULL,
    PY,
    QUICK,
    ROOT,
    RUN,
    bench_env,
    checkpoint,
    concurrent_streams,
    free_ports,
    grpc_generate,
    kill_groups,
    load_mlx_lm,
    log_tails,
    prompt_ids,
    run_json_child,
    start_ranks,
    stream_prompts,
    wait_serving,
)
from throughput_report import MIB, fmt_stream, print_table, ratios, summarize  # noqa: E402


# ---------------------------------------------------------------- prompts

def ids(text: str) -> list:
    return [int(t) for t in text.split(",")]


# ---------------------------------------------------------------- mlx-lm (child process)

def vmhwm_bytes(pid="self"):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def mlx_lm_child(spec_path: str) -> None:
    """Every mlx-lm measurement, in this (fresh) process; prints one JSON object."""
    import mlx.core as mx
    from mlx_lm.generate import batch_generate, generate_step

    spec = json.loads(Path(spec_path).read_text())
    pss = spec["prefill_step_size"]
    tic = time.perf_counter()
    model, tokenizer = load_mlx_lm(spec["model"])
    out = {"load_s": time.perf_counter() - tic, "mx_peak_load_bytes": mx.get_peak_memory()}

    def one(prompt, max_tokens):
        tokens, first, last = [], None, None
        tic = time.perf_counter()
        for token, _ in generate_step(mx.array(prompt, dtype=mx.uint32), model, max_tokens=max_tokens,
                                      prefill_step_size=pss):
            tokens.append(int(token))
            last = time.perf_counter()
            first = first or last
        return {"ttft_s": first - tic, "token_ids": tokens,
                "decode_tps": (len(tokens) - 1) / (last - first) if len(tokens) > 1 else None}

    def batch(prompts, max_tokens):
        tic = time.perf_counter()
        r = batch_generate(model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True,
                           prefill_step_size=pss)
        wall = time.perf_counter() - tic
        n = sum(len(t) for t in r.token_ids)
        s = r.stats
        return {"streams": len(prompts), "wall_s": wall, "tokens": n, "aggregate_tps": n / wall,
                "token_ids": r.token_ids, "stats": {"prompt_tps": s.prompt_tps, "generation_tps": s.generation_tps,
                                                    "decode_tps": s.decode_tps, "peak_memory_gb": s.peak_memory}}

    one(spec["warmup"], 4)
    batch([spec["warmup"]] * 2, 4)
    out["decode"] = [one(spec["decode_prompt"], spec["max_tokens"]) for _ in range(spec["reps"])]
    out["ttft"] = {str(n): [one(p, 1) for _ in range(spec["reps"])] for n, p in spec["ttft_prompts"].items()}
    out["batch"] = {str(n): batch(spec["stream_prompts"][:n], spec["max_tokens"]) for n in spec["streams"]}
    out["mx_peak_end_bytes"] = mx.get_peak_memory()
    out["vmhwm_bytes"] = vmhwm_bytes()
    print(json.dumps(out))


def run_mlx_lm(spec: dict, env: dict, timeout: float) -> dict:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.write(fd, json.dumps(spec).encode())
    os.close(fd)
    try:
        return run_json_child([PY, __file__, "--mlx-lm-child", path], env, timeout)
    finally:
        os.unlink(path)


# ---------------------------------------------------------------- the runner over gRPC

def single(r: dict) -> dict:
    n = len(r["token_ids"])
    u = r["usage"] or {}
    return {"ttft_s": r["first"] - r["sent"] if r["first"] is not None else None, "token_ids": r["token_ids"],
            "decode_tps": (n - 1) / (r["last"] - r["first"]) if n > 1 else None,
            "finish_reason": r["finish_reason"], "server_usage": u}


def run_runner(ranks: int, spec: dict, env: dict, runner_args: list, timeout: float) -> dict:
    from distributed.serving.proto import generation_pb2 as pb
    from distributed.serving.proto import generation_pb2_grpc as pb_grpc

    target = f"127.0.0.1:{free_ports(1)[0]}"
    cmd = [PY, RUN, "--model", spec["model"], "--serve", target, "--max-tokens-cap", "100000",
           "--prefill-step-size", str(spec["prefill_step_size"]), *runner_args]
    logdir = tempfile.mkdtemp(prefix="bench-throughput-")
    logs = [os.path.join(logdir, f"rank{r}.log") for r in range(ranks)]
    files = [open(path, "w") for path in logs]
    out = {"ranks": ranks, "command": cmd, "loadavg_start": os.getloadavg()[0]}
    procs, hostfile, channel = [], None, None
    try:
        stdio = [dict(stdout=f, stderr=subprocess.STDOUT) for f in files]
        procs, hostfile = start_ranks(cmd, ranks, env, rank0=stdio[0], others=stdio[1:])
        channel, out["startup_s"] = wait_serving(target, procs, timeout=timeout)
        stub = pb_grpc.GenerationStub(channel)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
        out["rank_map"] = [{"rank": r.rank, "layers": [r.layer_start, r.layer_end], "embed": r.embed,
                            "peak_memory_bytes": r.peak_memory_bytes, "parameter_bytes": r.parameter_bytes}
                           for r in info.ranks]
        grpc_generate(stub, spec["warmup"], 4, timeout)
        out["decode"] = [single(grpc_generate(stub, spec["decode_prompt"], spec["max_tokens"], timeout))
                         for _ in range(spec["reps"])]
        out["ttft"] = {str(n): [single(grpc_generate(stub, p, 1, timeout)) for _ in range(spec["reps"])]
                       for n, p in spec["ttft_prompts"].items()}
        out["streams"] = {}
        for n in spec["streams"]:
            out["streams"][str(n)] = concurrent_streams(stub, spec["stream_prompts"][:n], spec["max_tokens"], timeout)
            print(f"  runner P={ranks}: {n} streams {fmt_stream(out['streams'][str(n)])}", file=sys.stderr, flush=True)
        out["vmhwm_bytes"] = [vmhwm_bytes(p.pid) for p in procs]
        dead = [(r, p.returncode) for r, p in enumerate(procs) if p.poll() is not None]
        if dead:
            out["error"] = f"rank(s) exited during the run (rank, exit code): {dead}"
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e.details() if hasattr(e, 'details') else e}"
    finally:
        if channel is not None:
            channel.close()
        kill_groups(procs)
        if hostfile:
            os.unlink(hostfile)
        for f in files:
            f.close()
        if out.get("error") or any("error" in s for s in out.get("streams", {}).values()):
            out["log_tail"] = log_tails(logs)
        shutil.rmtree(logdir, ignore_errors=True)
    return out


# ---------------------------------------------------------------- main

def int_list(text: str) -> list:
    return [int(x) for x in text.split(",") if x.strip()]


def runner_has_flag(env: dict, flag: str) -> bool:
    r = subprocess.run([PY, RUN, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return flag in r.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small model, few tokens, 1 rep (smoke run)")
    p.add_argument("--out", help="JSON file (default bench/results/throughput.json; --quick: throughput_quick.json)")
    p.add_argument("--ps", type=int_list, default=[1, 2, 3], help="runner rank counts (default 1,2,3)")
    p.add_argument("--streams", type=int_list, default=[1, 4, 8, 16], help="concurrent streams (default 1,4,8,16)")
    p.add_argument("--max-tokens", type=int, help="new tokens per generation (default 64; --quick 16)")
    p.add_argument("--ttft-lens", type=int_list, default=[512, 2048], help="TTFT prompt lengths (default 512,2048)")
    p.add_argument("--decode-prompt-len", type=int, help="prompt of the single-stream decode run (default 128; --quick 64)")
    p.add_argument("--stream-prompt-len", type=int, help="prompt of each concurrent stream (default 128; --quick 32)")
    p.add_argument("--reps", type=int, help="runs of decode and of each TTFT, median (default 3; --quick 1)")
    p.add_argument("--prefill-step-size", type=int, default=512,
                   help="prompt chunk, the same for mlx-lm and the runner (default 512)")
    p.add_argument("--blas", choices=["reference", "openblas"], default="reference",
                   help="openblas preloads the system OpenBLAS into every process (much faster prefill on Linux)")
    p.add_argument("--max-batch", type=int, help="pass --max-batch N to run_trinity.py (default: its own default)")
    p.add_argument("--runner-arg", action="append", default=[], metavar="ARG",
                   help="extra run_trinity.py argument, e.g. --runner-arg=--transport=p2p (repeatable)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds: mlx-lm child, server start-up, each request")
    p.add_argument("--mlx-lm-child", metavar="SPEC", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mlx_lm_child:
        return mlx_lm_child(args.mlx_lm_child)
    # SIGTERM ends the run through the finally blocks that stop the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    start = time.perf_counter()
    sizes = QUICK if args.quick else FULL
    max_tokens = args.max_tokens or (16 if args.quick else 64)
    reps = args.reps or (1 if args.quick else 3)
    model = checkpoint(sizes)
    env = bench_env(args.blas)
    config = json.loads((model / "config.json").read_text())
    eos = config.get("eos_token_id")
    eos = set(eos if isinstance(eos, list) else [eos])
    spec = {
        "model": str(model), "max_tokens": max_tokens, "reps": reps, "prefill_step_size": args.prefill_step_size,
        "streams": args.streams, "warmup": stream_prompts(1, 16)[0],
        "decode_prompt": ids(prompt_ids(args.decode_prompt_len or (64 if args.quick else 128))),
        "ttft_prompts": {n: ids(prompt_ids(n)) for n in args.ttft_lens},
        "stream_prompts": stream_prompts(max(args.streams), args.stream_prompt_len or (32 if args.quick else 128)),
    }
    longest = max(len(x) for x in [spec["decode_prompt"], spec["stream_prompts"][0], *spec["ttft_prompts"].values()])
    if longest + max_tokens > config.get("max_position_embeddings", longest + max_tokens):
        sys.exit(f"a {longest}-token prompt + {max_tokens} tokens exceeds the model's context "
                 f"({config['max_position_embeddings']})")
    runner_args = list(args.runner_arg)
    has_max_batch = runner_has_flag(env, "--max-batch")
    if args.max_batch is not None:
        if not has_max_batch:
            sys.exit("--max-batch: this run_trinity.py has no --max-batch flag")
        runner_args += ["--max-batch", str(args.max_batch)]
    mib = sum(f.stat().st_size for f in model.glob("*.safetensors")) / MIB
    print(f"AFMoE fp32 {model.name}: hidden {sizes['hidden_size']}, {sizes['num_hidden_layers']} layers, "
          f"{sizes['num_experts']} experts (top {sizes['num_experts_per_tok']}), {mib:.0f} MiB; "
          f"{max_tokens} new tokens, greedy; BLAS {args.blas}; prefill step {args.prefill_step_size}; "
          f"run_trinity.py --max-batch: {'yes' if has_max_batch else 'no (concurrent streams served one at a time)'}",
          file=sys.stderr, flush=True)

    tic = time.perf_counter()
    load = os.getloadavg()[0]
    mlx = dict(run_mlx_lm(spec, env, args.timeout), loadavg_start=load)
    print(f"mlx-lm: {mlx.get('error') or 'done'} ({time.perf_counter() - tic:.0f} s)", file=sys.stderr, flush=True)
    runners = {}
    for ranks in args.ps:
        tic = time.perf_counter()
        runners[ranks] = run_runner(ranks, spec, env, runner_args, args.timeout)
        print(f"runner P={ranks}: {runners[ranks].get('error') or 'done'} ({time.perf_counter() - tic:.0f} s)",
              file=sys.stderr, flush=True)

    rows, warnings = summarize(mlx, runners, eos, spec)
    rat = ratios(rows, spec)
    wall = time.perf_counter() - start
    cpus = os.cpu_count()
    loads = [mlx["loadavg_start"]] + [r["loadavg_start"] for r in runners.values()]
    print(f"\nAFMoE fp32, hidden {sizes['hidden_size']}, {sizes['num_hidden_layers']} layers, {sizes['num_experts']} "
          f"experts, {mib:.0f} MiB; decode prompt {len(spec['decode_prompt'])} tokens, streams "
          f"{len(spec['stream_prompts'][0])}-token prompts, {max_tokens} new tokens, greedy; median of {reps}; "
          f"BLAS {args.blas}; {cpus} CPUs, load average {min(loads):.1f}-{max(loads):.1f} at the starts; "
          f"runner: ring backend, ranks started directly"
          + ("" if has_max_batch else "; run_trinity.py has no --max-batch (streams served one at a time)"))
    if "error" in mlx:
        print(f"mlx-lm failed: {mlx['error']}")
    print_table(rows, spec, rat)
    if any(p > (cpus or 1) for p in args.ps):
        print(f"  note: P > {cpus} CPUs oversubscribes this machine (the ring backend polls while it waits)")
    for w in warnings:
        print(f"WARNING: {w}")
    print(f"wall time {wall:.0f} s")

    out = Path(args.out or ROOT / "bench" / "results" / ("throughput_quick.json" if args.quick else "throughput.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = dict(sizes, checkpoint=str(model), max_tokens=max_tokens, reps=reps, ps=args.ps, streams=args.streams,
                    ttft_lens=args.ttft_lens, decode_prompt_len=len(spec["decode_prompt"]),
                    stream_prompt_len=len(spec["stream_prompts"][0]), prefill_step_size=args.prefill_step_size,
                    blas=args.blas, runner_args=runner_args, runner_has_max_batch=has_max_batch, quick=args.quick,
                    cpus=cpus)
    out.write_text(json.dumps({"settings": settings, "table": rows, "ratios": rat, "warnings": warnings,
                               "mlx_lm": mlx, "runner": {str(k): v for k, v in runners.items()}, "wall_s": wall},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
