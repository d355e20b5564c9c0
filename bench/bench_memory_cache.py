"""Serving tok/s with memory held (--memory-limit: every frame checked against it, MLX's buffer cache
bounded to its margin, the prefill chunk cut to fit) against unbounded, on the same weights.

    python bench/bench_memory_cache.py [--memory-limit 512M] [--streams 8,64] [--prompt-len 32]
        [--max-tokens 32] [--reps 3] [--ranks 2] [--max-context 512] [--timeout S]

Two servers run side by side for the whole invocation (run_trinity.py --serve over a P-rank ring on
127.0.0.1, bench/load_servers.py), identical but for --memory-limit. Each round measures, for every
stream count, one batch of that many greedy streams released together on each server (order
alternating round by round, so drift on a shared machine falls on both), after one untimed warm-up
batch each; aggregate tok/s = generated tokens / (last stream's end - first request sent)
(common.concurrent_streams). Printed: each run's tok/s, the median of --reps, and bounded /
unbounded; the target is >= 0.97x. Every process started is gone when it returns.
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QUICK, bench_env, checkpoint, stream_prompts  # noqa: E402
from load_servers import GrpcClient, RunnerServer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--memory-limit", default="512M")
    p.add_argument("--streams", default="8,64")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args()
    streams = [int(s) for s in a.streams.split(",")]
    model = checkpoint(QUICK)
    common = ["--model", str(model), "--max-batch", str(max(streams)), "--max-queue", str(max(streams)),
              "--max-context", str(a.max_context), "--prefix-cache-bytes", "0"]
    env = bench_env()
    configs = {"bounded": common + ["--memory-limit", a.memory_limit], "unbounded": common}
    tps = {(name, n): [] for name in configs for n in streams}
    with RunnerServer(a.ranks, "ring", configs["bounded"], env, False, a.timeout, name="bounded") as bounded, \
            RunnerServer(a.ranks, "ring", configs["unbounded"], env, False, a.timeout, name="unbounded") as unbounded:
        clients = {"bounded": GrpcClient(bounded, a.timeout), "unbounded": GrpcClient(unbounded, a.timeout)}
        for name, client in clients.items():  # warm-up, untimed
            for n in streams:
                client.batch(stream_prompts(n, a.prompt_len, f"warm:{name}:{n}"), a.max_tokens)
        for rep in range(a.reps):
            order = list(configs) if rep % 2 == 0 else list(reversed(configs))
            for n in streams:
                for name in order:
                    run = clients[name].batch(stream_prompts(n, a.prompt_len, f"{rep}:{name}:{n}"), a.max_tokens)
                    tps[name, n].append(run["aggregate_tps"])
                    print(f"rep {rep} {name:9s} {n:3d} streams: {run['aggregate_tps']:8.1f} tok/s "
                          f"({run['tokens']} tokens in {run['wall_s']:.2f} s)", flush=True)
    print(f"\n--memory-limit {a.memory_limit}, P={a.ranks}, prompt {a.prompt_len}, {a.max_tokens} tokens a stream, "
          f"median of {a.reps}:")
    for n in streams:
        b, u = statistics.median(tps["bounded", n]), statistics.median(tps["unbounded", n])
        print(f"{n:3d} streams: bounded {b:8.1f} tok/s, unbounded {u:8.1f} tok/s, bounded/unbounded {b / u:.3f}x")


if __name__ == "__main__":
    main()
