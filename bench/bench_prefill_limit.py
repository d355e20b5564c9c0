"""Prefill time of long prompts on a P-rank ring with and without --memory-limit (issue 30's check
that the prefill chunk is cut at its own context, not at the model's longest).

    python bench/bench_prefill_limit.py --model /tmp/trinity-mini-shape-4bit --limit 12G \
        [--lengths 2048,8192,32768] [--ranks 2]

--limit none runs without a limit; run both in one invocation's session to compare. The model is
built as bench_gpu.py builds it (Trinity-Mini shape, 4-bit, random weights) if the folder is empty.
Printed: rank 0's prefill-chunk line, each prompt's time to its one token (the prompts share
prefixes, so each longer one prefills what the shorter left), health after each, whether two greedy
24-token runs agree, and each rank's peak memory. Every process started is gone when it returns.
"""

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import make  # noqa: E402
from common import bench_env, grpc_generate  # noqa: E402
from load_servers import RunnerServer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="/tmp/trinity-mini-shape-4bit")
    p.add_argument("--limit", default="12G", help="--memory-limit, or none")
    p.add_argument("--lengths", default="2048,8192,32768")
    p.add_argument("--ranks", type=int, default=2)
    a = p.parse_args()
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from distributed.serving.proto import generation_pb2_grpc as pb_grpc

    make(Path(a.model))
    args = ["--model", a.model] + ([] if a.limit == "none" else ["--memory-limit", a.limit])
    with RunnerServer(a.ranks, "ring", args, bench_env(), gpu_per_rank=False, timeout=500) as server:
        print(f"--memory-limit {a.limit}: serving in {server.startup_s:.1f} s", flush=True)
        for line in Path(server.logs[0]).read_text().splitlines():
            if re.search(r"prefill chunk", line):
                print("  rank 0:", line, flush=True)
        stub, health = pb_grpc.GenerationStub(server.channel), health_pb2_grpc.HealthStub(server.channel)
        vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
        for n in [int(s) for s in a.lengths.split(",")]:
            prompt = [(7 * i + 3) % min(150000, vocab - 10) + 10 for i in range(n)]
            tic = time.perf_counter()
            r = grpc_generate(stub, prompt, 1, timeout=500)
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
            print(f"  prompt {n}: {time.perf_counter() - tic:.2f} s, finish {r['finish_reason']}, "
                  f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}", flush=True)
        twice = [grpc_generate(stub, list(range(10, min(74, vocab))), 24)["token_ids"] for _ in range(2)]
        print(f"  greedy 24 tokens twice equal: {twice[0] == twice[1]}", flush=True)
        for rank in server.model_info()["ranks"]:
            print(f"  rank {rank['rank']} peak {rank['peak_memory_bytes'] / 2**20:,.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
