"""Admission under load: N short prompts sent at once vs one alone, over gRPC.

    python bench/bench_admission.py [--baseline DIR] [--ps 1,2] [--streams 32] [--prompt-len 8]
                                    [--max-tokens 16] [--reps 5] [--rounds 3] [--max-batch 32]
                                    [--model PATH | --tiny] [--blas reference|openblas] [--out PATH]
                                    [--runner-arg=--flag=value ...]

One invocation, one checkpoint (bench/common.py's fp32 QUICK model; --tiny: the tests' tiny model,
hidden 64, 8 layers; or --model), greedy, raw
token-id prompts. For each P in --ps, a real `run_trinity.py --serve` on 127.0.0.1 (P rank processes
of the ring backend, started as bench/common.py's start_ranks does), then, at the gRPC client:

  warm-up     untimed: one request, then one round of --streams at once (a batch shape's first
              use pays MLX's kernel compilation).
  alone       --reps requests one after another (each a new --prompt-len prompt, --max-tokens):
              TTFT = request sent to first token; the median.
  at once     --rounds rounds of --streams threads released together, each stream a prompt
              the server has not seen: every stream's TTFT (median and p99 over all rounds) and the
              aggregate tok/s of each round = generated tokens / (last stream's end - first sent).
  ratio       median TTFT at once / median TTFT alone (issue 13's target: <= 6).

Every timed prompt is new to the server, so its prefix cache restores nothing.

--baseline DIR runs the same measurements against the run_trinity.py of another checkout (e.g.
`git worktree add --detach /tmp/base-adm <commit>`: the code before batched admission) in the same
invocation, each server alone on the machine, and prints both. Each round's stream 0 is asked
again alone afterwards: its tokens must be the same; with --baseline, every stream's tokens must
equal the baseline's.
Raw numbers go to --out (default bench/results/admission.json). Every server process is ended
(process group SIGTERM, then SIGKILL) on any exit.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

from common import (PY, QUICK, ROOT, bench_env, checkpoint, concurrent_streams, free_ports, grpc_generate,  # noqa: E402
                    kill_groups, start_ranks, stream_prompts, wait_serving)


TINY = dict(hidden_size=64, num_hidden_layers=8)  # tiny_checkpoint's defaults: the tests' model


def at_once(stub, prompts: list, max_tokens: int, timeout: float) -> dict:
    """common.py's streams released together; a failed stream fails the run."""
    out = concurrent_streams(stub, prompts, max_tokens, timeout)
    if "error" in out:
        raise RuntimeError(out["error"])
    return {"ttft_s": [t for t in out["ttfts_s"] if t is not None], "tokens": out["token_ids"],
            "aggregate_tps": out["aggregate_tps"]}


def measure(root: Path, ranks: int, args, model: str) -> dict:
    from distributed.serving.proto import generation_pb2_grpc as pb_grpc

    target = f"127.0.0.1:{free_ports(1)[0]}"
    cmd = [PY, str(root / "run_trinity.py"), "--model", model, "--serve", target, "--max-batch", str(args.max_batch),
           "--max-queue", str(max(64, args.streams)), "--max-tokens-cap", str(max(4096, args.max_tokens)),
           *args.runner_arg]
    env = dict(bench_env(args.blas), PYTHONPATH=str(root))
    log = tempfile.NamedTemporaryFile("w+", prefix="bench-admission-", suffix=".log")
    procs, hostfile, channel = [], None, None
    try:
        procs, hostfile = start_ranks(cmd, ranks, env, rank0=dict(stdout=log, stderr=log),
                                      others=dict(stdout=log, stderr=log))
        channel, _ = wait_serving(target, procs, args.timeout)
        stub = pb_grpc.GenerationStub(channel)
        # Every timed prompt is new to the server (its prefix cache would otherwise serve
        # a repeated one), and an untimed round at the full width first: a batch shape's
        # first use pays MLX's kernel compilation (hundreds of ms here).
        warm = stream_prompts(args.streams, args.prompt_len, "warm-up")
        grpc_generate(stub, warm[0], 4, args.timeout)
        at_once(stub, warm, 4, args.timeout)
        alone = [grpc_generate(stub, p, args.max_tokens, args.timeout)
                 for p in stream_prompts(args.reps, args.prompt_len, "alone")]
        prompts = [stream_prompts(args.streams, args.prompt_len, f"admission-{r}") for r in range(args.rounds)]
        rounds = [at_once(stub, p, args.max_tokens, args.timeout) for p in prompts]
        # Batched = alone: each round's stream 0 again, by itself (from the cache now: exact too).
        again = [grpc_generate(stub, p[0], args.max_tokens, args.timeout)["token_ids"] for p in prompts]
    except Exception:
        log.seek(0)
        print(f"P={ranks} ({root}) failed; the ranks' output ends:\n{log.read()[-3000:]}", file=sys.stderr)
        raise
    finally:
        if channel is not None:
            channel.close()
        kill_groups(procs)
        log.close()
        if hostfile:
            os.unlink(hostfile)
    alone_ttft = statistics.median(r["first"] - r["sent"] for r in alone)
    ttfts = sorted(t for r in rounds for t in r["ttft_s"])
    p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
    median = statistics.median(ttfts)
    return {"root": str(root), "ranks": ranks, "alone_ttft_s": alone_ttft, "at_once_median_ttft_s": median,
            "at_once_p99_ttft_s": p99, "ratio": median / alone_ttft,
            "aggregate_tps": [r["aggregate_tps"] for r in rounds], "ttfts_s": [r["ttft_s"] for r in rounds],
            "tokens": [r["tokens"] for r in rounds],
            "stream0_equals_alone": all(r["tokens"][0] == a for r, a in zip(rounds, again))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", type=Path, help="another checkout's run_trinity.py to measure the same way")
    p.add_argument("--ps", default="1,2", help="rank counts")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--reps", type=int, default=5, help="alone requests (median)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of --streams at once")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--model", help="checkpoint (default: bench/common.py's fp32 QUICK model)")
    p.add_argument("--tiny", action="store_true", help="the tests' tiny model (tiny_checkpoint's defaults, seed 0)")
    p.add_argument("--timeout", type=float, default=600, help="seconds: server start-up, each request")
    p.add_argument("--blas", choices=["reference", "openblas"], default="reference")
    p.add_argument("--out", type=Path, default=BENCH / "results" / "admission.json")
    p.add_argument("--runner-arg", action="append", default=[], metavar="ARG",
                   help="passed on to every run_trinity.py (repeatable), e.g. --runner-arg=--prefill-batch-tokens=64")
    args = p.parse_args()
    if args.baseline and not (args.baseline / "run_trinity.py").exists():
        sys.exit(f"--baseline {args.baseline}: no run_trinity.py there")
    model = args.model or str(checkpoint(TINY if args.tiny else QUICK))
    roots = [("this", ROOT)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    results = []
    for ranks in [int(x) for x in args.ps.split(",")]:
        for name, root in roots:
            print(f"P={ranks} {name} ({root}) ...", file=sys.stderr, flush=True)
            results.append(dict(measure(root, ranks, args, model), name=name))
    print(f"{args.streams} prompts of {args.prompt_len} tokens at once vs one alone, {args.max_tokens} new tokens each, "
          f"--max-batch {args.max_batch}, model {model}"
          + (f", runner args {' '.join(args.runner_arg)}" if args.runner_arg else ""))
    print(f"{'P':>2} {'code':9} {'alone':>9} {'median':>9} {'p99':>9} {'ratio':>6} {'agg tok/s':>10}  checks")
    for r in results:
        checks = "ok" if r["stream0_equals_alone"] else "MISMATCH"
        base = next((b for b in results if b["name"] == "baseline" and b["ranks"] == r["ranks"]), None)
        if base is not None and r is not base:
            checks += ", = baseline" if r["tokens"] == base["tokens"] else ", tokens DIFFER from baseline"
        print(f"{r['ranks']:>2} {r['name']:9} {r['alone_ttft_s'] * 1e3:7.1f}ms {r['at_once_median_ttft_s'] * 1e3:7.1f}ms "
              f"{r['at_once_p99_ttft_s'] * 1e3:7.1f}ms {r['ratio']:5.1f}x {statistics.median(r['aggregate_tps']):10.1f}  {checks}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    print(f"raw numbers: {args.out}")


if __name__ == "__main__":
    main()
