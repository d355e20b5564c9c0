"""Failover soak: streams keep running through the launcher's router while ranks are killed.

    python bench/soak_failover.py [--minutes 10] [--kill-every 120] [--streams 4] [--ranks 3] [--model PATH]

Starts `python -m launch run --single-host RANKS --restart N -- run_trinity.py --serve
127.0.0.1:PORT` (the router in front of rank 0; the embedded tiny model unless --model),
computes the undisturbed output of each distinct request once (a pool of greedy and
seeded-sampled requests of several lengths, run before any kill), then for --minutes
keeps --streams client streams going (each a random request of the pool) while a random
rank of the current ring is SIGKILLed every --kill-every seconds. Each finished stream
is compared with its undisturbed output (tokens and text): a difference is a wrong
output; an error is a client-visible error. The pause per kill is what clients saw: for
each kill, the longest gap between two tokens of any stream that spanned it. At the end
the launcher gets SIGTERM and must leave no rank behind.

Prints the figures and writes them as JSON with --out; exits 1 on any error, wrong
output or process left behind.
"""

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from distributed.serving.proto import generation_pb2 as pb  # noqa: E402
from distributed.serving.proto import generation_pb2_grpc as pb_grpc  # noqa: E402
from soak import STARTED, stop, wait_serving  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--kill-every", type=float, default=120.0, metavar="S", help="seconds between kills")
    p.add_argument("--streams", type=int, default=4, help="concurrent client streams")
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--model", help="checkpoint folder (default: the embedded tiny model)")
    p.add_argument("--max-new", type=int, default=200, help="longest max_tokens of the pool")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the figures as JSON here")
    return p.parse_args()


def request_pool(rng: random.Random, max_new: int):
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (1, 4, 9, 17, 33)]
    pool = []
    for i, prompt in enumerate(prompts):
        for sampled in (False, True):
            fields = dict(token_ids=prompt, max_tokens=rng.randrange(max_new // 4, max_new + 1))
            if sampled:
                fields.update(temperature=0.8, top_p=0.95, seed=1000 + i)
            pool.append(fields)
    return pool


def run_stream(stub, fields):
    """(tokens, text, finish, token arrival times, error)."""
    tokens, text, times, finish = [], "", [], None
    try:
        for r in stub.Generate(pb.GenerateRequest(**fields), timeout=600):
            if r.token_ids:
                times.append(time.monotonic())
            tokens += r.token_ids
            text += r.text
            finish = r.finish_reason or finish
        return tokens, text, finish, times, None
    except grpc.RpcError as e:
        return tokens, text, finish, times, f"{e.code().name}: {e.details()}"


def latest_ranks(log: Path) -> dict:
    attempts = []
    for rank, pid in STARTED.findall(log.read_text(errors="replace")):
        if rank == "0":
            attempts.append({})
        attempts[-1][int(rank)] = int(pid)
    return attempts[-1] if attempts else {}


def main() -> None:
    args = parse_args()
    rng = random.Random(args.seed)
    kills_planned = int(args.minutes * 60 / args.kill_every) + 1
    port = random.randrange(20000, 32000)
    log = Path(tempfile.mkstemp(prefix="soak-failover-", suffix=".log")[1])
    model = ["--model", args.model] if args.model else []
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "launch", "run", "--single-host", str(args.ranks), "--restart",
             str(kills_planned + 2), "--grace", "3", "--restart-delay", "0.2", "--", "run_trinity.py", *model,
             "--serve", f"127.0.0.1:{port}", "--max-context", "2048", "--peer-timeout", "2"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub, health = pb_grpc.GenerationStub(channel), health_pb2_grpc.HealthStub(channel)
    seen_pids = set()
    try:
        wait_serving(health, proc, log, timeout=300)
        pool = request_pool(rng, args.max_new)
        print(f"soak: {len(pool)} distinct requests, undisturbed outputs first", file=sys.stderr)
        refs = []
        for fields in pool:
            tokens, text, finish, _, error = run_stream(stub, fields)
            if error:
                sys.exit(f"soak: the undisturbed run failed: {error}")
            refs.append((tokens, text, finish))
        results, lock, stop_at = [], threading.Lock(), time.monotonic() + args.minutes * 60

        def client(seed: int):
            crng = random.Random(seed)
            while time.monotonic() < stop_at:
                i = crng.randrange(len(pool))
                tokens, text, finish, times, error = run_stream(stub, pool[i])
                with lock:
                    results.append(dict(request=i, ok=error is None and (tokens, text, finish) == refs[i],
                                        error=error, times=times, tokens=len(tokens)))

        clients = [threading.Thread(target=client, args=(args.seed + c,), daemon=True) for c in range(args.streams)]
        for c in clients:
            c.start()
        kills = []
        next_kill = time.monotonic() + args.kill_every
        while time.monotonic() < stop_at:
            time.sleep(0.2)
            if time.monotonic() >= next_kill and time.monotonic() < stop_at - 10:
                ranks = latest_ranks(log)
                seen_pids.update(ranks.values())
                rank = rng.randrange(args.ranks)
                os.kill(ranks[rank], signal.SIGKILL)
                kills.append((time.monotonic(), rank))
                print(f"soak: killed rank {rank} at {len(kills)} kill(s)", file=sys.stderr)
                next_kill += args.kill_every
        for c in clients:
            c.join(timeout=900)
        seen_pids.update(latest_ranks(log).values())
    finally:
        channel.close()
        status, _ = stop(proc)
    pauses = []
    for at, _ in kills:
        gaps = [b - a for r in results for a, b in zip(r["times"], r["times"][1:]) if a <= at <= b]
        if gaps:
            pauses.append(max(gaps))
    time.sleep(2)
    left = sorted(p for p in seen_pids | {int(p) for _, p in STARTED.findall(log.read_text())}
                  if Path(f"/proc/{p}").exists())
    errors = [r["error"] for r in results if r["error"]]
    wrong = [r for r in results if r["error"] is None and not r["ok"]]
    report = dict(minutes=args.minutes, kill_every_s=args.kill_every, streams=args.streams, ranks=args.ranks,
                  kills=[rank for _, rank in kills], requests=len(results), errors=errors, wrong_outputs=len(wrong),
                  tokens=sum(r["tokens"] for r in results),
                  pause_median_s=statistics.median(pauses) if pauses else None,
                  pause_worst_s=max(pauses) if pauses else None, pauses_s=[round(p, 2) for p in pauses],
                  launcher_status=status, processes_left=left, log=str(log))
    print(f"soak: {len(results)} requests ({report['tokens']} tokens), {len(kills)} kills "
          f"(ranks {report['kills']}): {len(errors)} client-visible errors, {len(wrong)} wrong outputs; pause per "
          f"kill median {report['pause_median_s'] or 0:.1f} s, worst {report['pause_worst_s'] or 0:.1f} s; "
          f"launcher exit {status}; processes left {left}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    sys.exit(1 if errors or wrong or left or status != 0 else 0)


if __name__ == "__main__":
    main()
