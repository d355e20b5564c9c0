"""Memory soak: two servers of 2 ranks each on this host, held to --memory-limit, under a mixed load.

    python bench/soak_memory.py [--minutes 3] [--limit 7000000] [--clients 3] [--out soak_memory.json]

Starts two `python -m launch run --single-host 2 -- run_trinity.py --serve ... --http ...`
rings on the embedded tiny model, both at --memory-limit --limit and --max-batch 2: "planned"
with --max-context auto (the context its memory holds), "overcommitted" with the model's whole
context (2048), more than the limit holds. For --minutes, --clients threads a server send
greedy prompts of random lengths: short, up to the planned context, and on the overcommitted
ring some of 1,800 tokens, which cannot fit even alone ("too big"). Every --sample-every
seconds each server's /metrics is scraped: each rank's MLX peak against its limit and its
buffer cache against its bound (the limit's margin). A request may fail only if it is too
big (RESOURCE_EXHAUSTED naming memory); any other failure, a rank past its limit, or a cache
past its bound is reported, and exits 1. At the end both launchers get SIGTERM and must
leave no rank behind.
"""

import argparse
import http.client
import json
import os
import random
import re
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
from distributed.shard.memory_limit import cache_bound  # noqa: E402
from soak import free_port, stop, wait_serving  # noqa: E402

TOO_BIG = 1800  # prompt tokens the overcommitted ring cannot hold at the default limit, even alone
SAMPLE = re.compile(r'^trinity_rank_memory_(active|cache|peak|limit)_bytes\{[^}]*rank="(\d+)"[^}]*\} (\S+)$', re.M)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--limit", type=int, default=7_000_000, help="--memory-limit of every rank (bytes)")
    p.add_argument("--clients", type=int, default=3, help="client threads a server")
    p.add_argument("--sample-every", type=float, default=5.0, metavar="S")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the figures as JSON here")
    return p.parse_args()


class Ring:
    def __init__(self, name: str, limit: int, max_context: str):
        self.name, self.grpc, self.http = name, f"127.0.0.1:{free_port()}", ("127.0.0.1", free_port())
        self.log_path = Path(tempfile.mkstemp(prefix=f"trinity-soak-memory-{name}-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "launch", "run", "--single-host", "2", "--no-router", "--",
               "run_trinity.py", "--serve", self.grpc, "--http", f"{self.http[0]}:{self.http[1]}",
               "--memory-limit", str(limit), "--max-context", max_context, "--max-batch", "2",
               "--prefix-cache-bytes", "0"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        self.launcher = subprocess.Popen(cmd, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, env=env,
                                         cwd=ROOT, start_new_session=True)
        channel = grpc.insecure_channel(self.grpc)
        self.stub, self.health = pb_grpc.GenerationStub(channel), health_pb2_grpc.HealthStub(channel)
        self.worst = {}  # rank -> the largest figures seen (active, cache, peak) and the limit
        self.outcomes = {}  # (too big, outcome) -> count
        self.unexpected = []  # failures of requests that fit alone

    def scrape(self) -> None:
        conn = http.client.HTTPConnection(*self.http, timeout=30)
        conn.request("GET", "/metrics")
        for kind, rank, value in SAMPLE.findall(conn.getresponse().read().decode()):
            figures = self.worst.setdefault(int(rank), {})
            figures[kind] = max(figures.get(kind, 0), int(float(value)))

    def request(self, prompt, too_big: bool) -> None:
        try:
            for _ in self.stub.Generate(pb.GenerateRequest(token_ids=prompt, max_tokens=8), timeout=300):
                pass
            outcome = "served"
        except grpc.RpcError as e:
            outcome = f"{e.code().name}: {e.details().split(':')[0]}"
            if not (too_big and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED):
                self.unexpected.append(f"{len(prompt)} tokens: {e.code().name}: {e.details()}")
        key = ("too big" if too_big else "fits alone", outcome)
        self.outcomes[key] = self.outcomes.get(key, 0) + 1


def load(ring: Ring, context: int, rng: random.Random, until: float) -> None:
    while time.monotonic() < until:
        too_big = ring.name == "overcommitted" and rng.random() < 0.15
        n = TOO_BIG if too_big else rng.choice([rng.randint(1, 64), rng.randint(64, context // 2),
                                                 rng.randint(context // 2, context - 8)])
        ring.request([3 + (rng.randrange(90) + j) % 90 for j in range(n)], too_big)


def main() -> None:
    args = parse_args()
    rings = [Ring("planned", args.limit, "auto"), Ring("overcommitted", args.limit, "2048")]
    ok, report = False, None
    try:
        for ring in rings:
            wait_serving(ring.health, ring.launcher, ring.log_path, 300)
        # the planned ring's context, and the same bound for the other's prompts that fit alone
        context = rings[0].stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60).max_context
        until = time.monotonic() + args.minutes * 60
        rng = random.Random(args.seed)
        threads = [threading.Thread(target=load, args=(r, context, random.Random(rng.random()), until))
                   for r in rings for _ in range(args.clients)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            for ring in rings:
                ring.scrape()
            time.sleep(args.sample_every)
        for t in threads:
            t.join()
        for ring in rings:
            ring.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)  # every rank has reported since
            ring.scrape()
        report = {"minutes": args.minutes, "limit": args.limit, "cache_bound": cache_bound(args.limit),
                  "context": context, "rings": {}}
        ok = True
        for ring in rings:
            within = all(f["peak"] <= args.limit and f["cache"] <= cache_bound(args.limit) for f in ring.worst.values())
            ok = ok and within and not ring.unexpected
            report["rings"][ring.name] = {"ranks": ring.worst, "within": within, "unexpected": ring.unexpected,
                                          "outcomes": {f"{k[0]}: {k[1]}": v for k, v in ring.outcomes.items()}}
            print(f"{ring.name}: " + "; ".join(
                f"rank {r} peak {f['peak'] / 2**20:.2f} of {f['limit'] / 2**20:.2f} MiB, cache at most "
                f"{f['cache'] / 2**20:.2f} of {cache_bound(args.limit) / 2**20:.2f} MiB" for r, f in sorted(ring.worst.items())))
            print(f"{ring.name}: " + ", ".join(f"{k}: {v}" for k, v in report["rings"][ring.name]["outcomes"].items())
                  + (f"; UNEXPECTED: {ring.unexpected}" if ring.unexpected else "; no unexpected failure"))
    finally:
        for ring in rings:
            status, _ = stop(ring.launcher)
            if status != 0:
                print(f"{ring.name}: launcher ended with {status}", file=sys.stderr)
                ok = False
    left = subprocess.run(["pgrep", "-f", "|".join(r.grpc for r in rings)], capture_output=True, text=True).stdout
    if left.strip():
        print(f"left behind: {left.split()}", file=sys.stderr)
        ok = False
    if report is not None and args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
