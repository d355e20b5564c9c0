"""Prefill time of long prompts on a P-rank ring with and without --memory-limit: the prefill chunk
cut at its own context, not at the model's longest.

The model is Trinity-Mini's shape, 4-bit, random weights, built at --model if the folder is empty.
--limit none runs without a limit; run both in one session to compare. Printed: rank 0's prefill-chunk
line, each prompt's time to its one token (the prompts share prefixes, so each longer one prefills
what the shorter left), health after each, whether two greedy 24-token runs agree, and each rank's
peak memory. --smoke: a tiny shape of the same code, prompts of 64 and 256 tokens.
"""

import json
import re
import tempfile
import time
from pathlib import Path

from bench.harness import (MINI, MINI_SMOKE, Server, bench_env, flags, grpc_generate, int_list, make_mini, out_path,
                           save, shrink)


def add_arguments(p) -> None:
    flags(p, smoke=False, out=None, model="/tmp/trinity-mini-shape-4bit", ranks=[2], timeout=500.0)
    p.add_argument("--limit", default="12G", help="--memory-limit, or none")
    p.add_argument("--lengths", type=int_list, default=[2048, 8192, 32768], help="prompt lengths")


def main(args) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    shrink(args, model=str(Path(tempfile.gettempdir()) / "trinity-bench" / "mini-smoke"), lengths=[64, 256], limit="2G")
    model = make_mini(Path(args.model), MINI_SMOKE if args.smoke else MINI)
    limit = [] if args.limit == "none" else ["--memory-limit", args.limit]
    rows = []
    with Server(args.ranks[0], ["--model", str(model), *limit], bench_env(), timeout=args.timeout) as server:
        print(f"--memory-limit {args.limit}: serving in {server.startup_s:.1f} s", flush=True)
        chunk = [line for line in server.log().splitlines() if re.search(r"prefill chunk", line)]
        print("\n".join(f"  rank 0: {line}" for line in chunk), flush=True)
        stub, health = server.stub(), health_pb2_grpc.HealthStub(server.channel)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        for n in args.lengths:
            prompt = [(7 * i + 3) % min(150000, vocab - 10) + 10 for i in range(n)]
            tic = time.perf_counter()
            r = grpc_generate(stub, prompt, 1, timeout=args.timeout)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(
                health.Check(health_pb2.HealthCheckRequest(), timeout=10).status)
            rows.append({"prompt": n, "seconds": time.perf_counter() - tic, "finish": r["finish_reason"], "health": status})
            print(f"  prompt {n}: {rows[-1]['seconds']:.2f} s, finish {r['finish_reason']}, health {status}", flush=True)
        twice = [grpc_generate(stub, list(range(10, min(74, vocab))), 24)["token_ids"] for _ in range(2)]
        print(f"  greedy 24 tokens twice equal: {twice[0] == twice[1]}", flush=True)
        peaks = [rank["peak_memory_bytes"] for rank in server.model_info()["ranks"]]
        print("\n".join(f"  rank {r} peak {peak / 2**20:,.0f} MiB" for r, peak in enumerate(peaks)), flush=True)
    results = {"chunk_lines": chunk, "prompts": rows, "greedy_twice_equal": twice[0] == twice[1], "peak_bytes": peaks}
    print(f"wrote {save(out_path(args, 'prefill_limit'), results, vars(args))}")
