"""What the launcher's router costs: the same streams against rank 0's own front end and
through the router (launch/router/), one invocation.

    python bench/bench_router.py [--ranks 2] [--streams 1,16,64] [--prompt-len 16]
                                 [--max-tokens 64] [--rounds 3] [--model PATH] [--out PATH]

Both servers run `run_trinity.py --serve` on --ranks ranks of this machine, one after the
other (never both at once): "rank 0" is `python -m launch run --single-host R --no-router`
(rank 0 serves the clients itself), "router" is `python -m launch run --single-host R`
(the launcher serves them and forwards to rank 0). For each stream count: --rounds rounds
of that many greedy streams released together (distinct raw token-id prompts); aggregate
tok/s = generated tokens / (last end - first sent), TTFT p50 at the client; medians over
the rounds, after an untimed round of that many streams (a batch shape's first use compiles). The tokens must be the same through both (checked). Every process is ended
on any exit.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from common import PY, bench_env, concurrent_streams, free_ports, kill_groups, stream_prompts, wait_serving  # noqa: E402
from distributed.serving.proto import generation_pb2_grpc as pb_grpc  # noqa: E402


def measure(router: bool, args) -> dict:
    target = f"127.0.0.1:{free_ports(1)[0]}"
    cmd = [PY, "-m", "launch", "run", "--single-host", str(args.ranks), *([] if router else ["--no-router"]), "--",
           PY, str(ROOT / "run_trinity.py"), "--serve", target, "--max-batch", str(max(args.streams)),
           "--max-queue", str(max(64, max(args.streams))), *(["--model", args.model] if args.model else [])]
    log = tempfile.NamedTemporaryFile("w+", prefix="bench-router-", suffix=".log")
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=bench_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    channel = None
    try:
        channel, _ = wait_serving(target, [launcher])
        stub = pb_grpc.GenerationStub(channel)
        concurrent_streams(stub, stream_prompts(2, args.prompt_len, "warm"), 4, 600)  # warm-up
        rows = []
        for n in args.streams:
            # Untimed first: a batch shape's first use compiles kernels (on the GPU, for seconds).
            concurrent_streams(stub, stream_prompts(n, args.prompt_len, f"warm-{n}"), 8, 600)
            rounds = [concurrent_streams(stub, stream_prompts(n, args.prompt_len, f"router-{n}-{r}"),
                                         args.max_tokens, 600) for r in range(args.rounds)]
            failed = [r["error"] for r in rounds if "error" in r]
            if failed:
                raise RuntimeError(failed[0])
            rows.append({"streams": n, "aggregate_tps": statistics.median(r["aggregate_tps"] for r in rounds),
                         "ttft_p50_s": statistics.median(statistics.median(r["ttfts_s"]) for r in rounds),
                         "token_ids": [r["token_ids"] for r in rounds]})
        return {"router": router, "rows": rows}
    except BaseException:
        log.seek(0)
        print(log.read()[-3000:], file=sys.stderr)
        raise
    finally:
        if channel is not None:
            channel.close()
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        kill_groups([launcher], grace=5)
        log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", help="checkpoint (default: run_trinity.py's embedded tiny model)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "router.json")
    args = p.parse_args()
    direct, routed = measure(False, args), measure(True, args)
    print(f"{args.ranks} ranks, {args.prompt_len}-token prompts, {args.max_tokens} greedy tokens, "
          f"median of {args.rounds} rounds")
    print(f"{'streams':>7} {'rank 0 tok/s':>13} {'router tok/s':>13} {'ratio':>6} {'TTFT p50 rank 0':>16} "
          f"{'router':>8}  same tokens")
    for a, b in zip(direct["rows"], routed["rows"]):
        same = "yes" if a["token_ids"] == b["token_ids"] else "NO"
        print(f"{a['streams']:>7} {a['aggregate_tps']:>13.1f} {b['aggregate_tps']:>13.1f} "
              f"{b['aggregate_tps'] / a['aggregate_tps']:>6.2f} {a['ttft_p50_s'] * 1e3:>14.1f}ms "
              f"{b['ttft_p50_s'] * 1e3:>6.1f}ms  {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                    "direct": direct, "router": routed}, indent=1))
    print(f"raw numbers: {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
