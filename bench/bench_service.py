"""Time to first token and decode speed through gRPC vs the one-shot command line.

    python bench/bench_service.py [--quick] [--ranks P | --stages P] [--prompt-len N]
                                  [--max-tokens N] [--reps N] [--json-out PATH]

Same checkpoint as bench_decode.py (made once in $TMPDIR/trinity-bench/; --quick: the small
one), same deterministic prompt ids, greedy. Two ways to get one generation:
  cli     python run_trinity.py --prompt-ids … --json   (a fresh process each time; under
          mlx.launch -n P with --ranks P). TTFT = prompt tokens / its prefill tok/s, i.e.
          measured inside the process after loading; "wall" is the whole process.
  grpc    run_trinity.py --serve, then Generate from this process. TTFT = from the call to
          the first streamed token, as a client sees it (tokenizing, queueing, one RPC
          round trip included); decode tok/s = (tokens - 1) / (last token - first token)
          on the client; "server" columns are what the server reports in usage.
The first gRPC request after start-up ("cold") is shown apart from the --reps warm ones
(median). The CLI runs go first: an idle multi-rank server still uses CPU (the ring
backend polls), which would slow them.
"""

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from common import (  # noqa: E402
    FULL,
    PY,
    QUICK,
    RUN,
    bench_env,
    checkpoint,
    grpc_generate,
    kill_groups,
    prompt_ids,
    wait_serving,
)
from distributed.serving.proto import generation_pb2_grpc as pb_grpc  # noqa: E402


def free_port(n: int = 1) -> int:
    for base in range(42000, 60000, 97):
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port")


def command(args, ranks: int):
    if ranks == 1:
        return [PY, RUN, *args]
    return [str(Path(PY).parent / "mlx.launch"), "-n", str(ranks), "--starting-port", str(free_port(ranks)),
            PY, RUN, *args]


def cli_once(model, ids, max_tokens, extra, ranks) -> dict:
    tic = time.perf_counter()
    proc = subprocess.run(command(["--model", str(model), "--prompt-ids", ids, "--max-tokens", str(max_tokens),
                                   "--json", *extra], ranks), capture_output=True, text=True, env=bench_env(), timeout=600)
    wall = time.perf_counter() - tic
    if proc.returncode != 0:
        sys.exit(f"run_trinity.py failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout)
    n_prompt = len(out["prompt_token_ids"])
    return {"ttft_s": n_prompt / out["prefill_tokens_per_sec"], "decode_tps": out["generation_tokens_per_sec"],
            "tokens": len(out["token_ids"]), "wall_s": wall}


def grpc_once(stub, ids, max_tokens) -> dict:
    r = grpc_generate(stub, [int(t) for t in ids.split(",")], max_tokens, timeout=600)
    tokens, first, last, usage = len(r["token_ids"]), r["first"], r["last"], r["usage"]
    return {"ttft_s": first - r["sent"], "decode_tps": (tokens - 1) / (last - first) if tokens > 1 else 0.0,
            "tokens": tokens, "server_ttft_s": usage["prompt_tokens"] / usage["prefill_tokens_per_sec"],
            "server_decode_tps": usage["generation_tokens_per_sec"]}


def serve(model, extra, ranks):
    port = free_port()
    args = ["--model", str(model), "--serve", f"127.0.0.1:{port}", "--max-tokens-cap", "100000", *extra]
    proc = subprocess.Popen(command(args, ranks), env=bench_env(), stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        channel, startup = wait_serving(f"127.0.0.1:{port}", [proc])
    except RuntimeError as e:
        kill_groups([proc])
        sys.exit(str(e))
    return proc, channel, startup


def median(rows, key):
    return statistics.median(r[key] for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the small checkpoint")
    p.add_argument("--ranks", type=int, default=1, help="processes under mlx.launch (ring)")
    p.add_argument("--stages", type=int, default=1, help="stages inside one process")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json-out")
    args = p.parse_args()
    model = checkpoint(QUICK if args.quick else FULL)
    ids = prompt_ids(args.prompt_len)
    extra = ["--stages", str(args.stages)] if args.stages > 1 else []
    where = f"{args.ranks} rank(s)" + (f", {args.stages} stages" if args.stages > 1 else "")
    print(f"{model.name}, {where}, prompt {args.prompt_len} tokens, {args.max_tokens} new tokens, greedy",
          flush=True)

    cli = [cli_once(model, ids, args.max_tokens, extra, args.ranks) for _ in range(args.reps)]
    proc, channel, startup = serve(model, extra, args.ranks)
    try:
        stub = pb_grpc.GenerationStub(channel)
        cold = grpc_once(stub, ids, args.max_tokens)
        warm = [grpc_once(stub, ids, args.max_tokens) for _ in range(args.reps)]
    finally:
        channel.close()
        kill_groups([proc], grace=15)
    assert all(r["tokens"] == cli[0]["tokens"] for r in [cold, *warm, *cli]), "different token counts"

    result = {
        "model": model.name, "ranks": args.ranks, "stages": args.stages, "prompt_tokens": args.prompt_len,
        "max_tokens": args.max_tokens, "reps": args.reps,
        "cli": {"ttft_s": median(cli, "ttft_s"), "decode_tps": median(cli, "decode_tps"),
                "wall_s": median(cli, "wall_s")},
        "grpc_cold": cold,
        "grpc_warm": {k: median(warm, k) for k in ("ttft_s", "decode_tps", "server_ttft_s", "server_decode_tps")},
        "server_startup_s": startup,
    }
    c, g = result["cli"], result["grpc_warm"]
    print(f"{'':24}{'TTFT ms':>10}{'decode tok/s':>14}")
    print(f"{'cli (in process)':24}{c['ttft_s'] * 1e3:10.1f}{c['decode_tps']:14.1f}   wall {c['wall_s']:.2f} s a run")
    print(f"{'grpc cold (client)':24}{cold['ttft_s'] * 1e3:10.1f}{cold['decode_tps']:14.1f}   "
          f"server up in {startup:.2f} s")
    print(f"{'grpc warm (client)':24}{g['ttft_s'] * 1e3:10.1f}{g['decode_tps']:14.1f}")
    print(f"{'grpc warm (server)':24}{g['server_ttft_s'] * 1e3:10.1f}{g['server_decode_tps']:14.1f}")
    print(f"warm gRPC / cli: TTFT x{g['ttft_s'] / c['ttft_s']:.2f}, decode x{g['decode_tps'] / c['decode_tps']:.2f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
