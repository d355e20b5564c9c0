"""The HTTP front end's own cost, before and after a change to it, in one invocation (issue 46:
http.server's thread per connection against uvicorn's event loop):

    python bench/bench_http.py --before /tmp/before [--after /tmp/after] [--clients 1,8,32]
                               [--seconds 8] [--max-tokens 1] [--out bench/results/http_front_end.json]

--before is a checkout (e.g. `git worktree add /tmp/before <commit>`) whose run_trinity.py is
the "before"; "after" is --after's (default: this checkout's). Each runs alone, one after the other, as a 1-rank
server of the embedded model: `run_trinity.py --serve 127.0.0.1:P --http 127.0.0.1:Q`
(--max-batch and --max-queue large enough that no client is ever refused). For each client
count: that many clients, each on one kept-alive connection, send `POST /v1/completions
{"prompt": "The", "max_tokens": N, "temperature": 0}` back to back for --seconds (after an
untimed second); requests/s and latency p50 / p99 at the client. --rounds alternates before
and after (each a fresh server) and reports medians, so a busy spell of a shared machine falls
on both. The clients are one asyncio
loop with raw HTTP/1.1, so they cost little of this machine's CPU beside the server's.

Then one 16 MiB prompt (a JSON body just under the 16 MiB limit): its status, the time to the
answer, and the server's peak memory (VmHWM) over its memory before it (VmRSS).
Every process is ended on any exit.
"""

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from common import free_ports  # noqa: E402

HUGE = 16 * 2**20 - 4096


def start(checkout: Path, log):
    grpc, http = free_ports(2)
    cmd = [sys.executable, str(checkout / "run_trinity.py"), "--serve", f"127.0.0.1:{grpc}", "--http",
           f"127.0.0.1:{http}", "--max-batch", "64", "--max-queue", "256"]
    env = dict(os.environ, PYTHONPATH=str(checkout))
    proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {Path(log.name).read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return proc, http
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the server did not come up")


async def one(reader, writer, request: bytes) -> float:
    t = time.perf_counter()
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(int(line.split(b":", 1)[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:"))
    body = await reader.readexactly(length)
    if status != 200:
        raise RuntimeError(f"{status}: {body[:300]!r}")
    return time.perf_counter() - t


async def load(port: int, clients: int, seconds: float, request: bytes) -> dict:
    latencies, stop = [], None

    async def client():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < warm_until:
                await one(reader, writer, request)
            while time.perf_counter() < stop:
                latencies.append(await one(reader, writer, request))
        finally:
            writer.close()

    warm_until = time.perf_counter() + 1.0
    stop = warm_until + seconds
    await asyncio.gather(*(client() for _ in range(clients)))
    latencies.sort()
    return {"clients": clients, "requests": len(latencies), "requests_per_s": round(len(latencies) / seconds, 1),
            "p50_ms": round(1000 * statistics.median(latencies), 2),
            "p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 2)}


def memory(pid: int) -> dict:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def huge_prompt(port: int, pid: int) -> dict:
    prompt = "hello world " * ((HUGE - 64) // 12)
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    before = memory(pid)
    t = time.perf_counter()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            status, reply = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, reply = e.code, e.read()
    seconds = time.perf_counter() - t
    after = memory(pid)
    return {"body_bytes": len(body), "status": status, "seconds": round(seconds, 2),
            "rss_before_mib": round(before["VmRSS"] / 2**20, 1), "peak_mib": round(after["VmHWM"] / 2**20, 1),
            "peak_over_before_mib": round((after["VmHWM"] - before["VmRSS"]) / 2**20, 1),
            "answer": reply.decode(errors="replace")[:300]}


def measure(name: str, checkout: Path, args) -> dict:
    log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-http-{name}-", suffix=".log")
    proc = None
    try:
        proc, port = start(checkout, log)
        body = json.dumps({"prompt": "The", "max_tokens": args.max_tokens, "temperature": 0}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        rows = []
        for clients in args.clients:
            rows.append(asyncio.run(load(port, clients, args.seconds, request)))
            print(name, rows[-1], flush=True)
        huge = huge_prompt(port, proc.pid)
        print(name, "16 MiB prompt:", huge, flush=True)
        return {"checkout": str(checkout), "load": rows, "huge_prompt": huge}
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def summary(rounds) -> dict:
    """Per client count, the median over rounds of requests/s, p50 and p99; the 16 MiB prompt's worst."""
    levels = []
    for rows in zip(*(r["load"] for r in rounds)):
        levels.append({"clients": rows[0]["clients"], **{key: statistics.median(row[key] for row in rows)
                                                          for key in ("requests_per_s", "p50_ms", "p99_ms")}})
    huge = max((r["huge_prompt"] for r in rounds), key=lambda h: h["peak_over_before_mib"])
    return {"load": levels, "huge_prompt": huge}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", type=Path, required=True, help="the checkout to compare against")
    p.add_argument("--after", type=Path, default=ROOT, help="the checkout measured after (default: this one)")
    p.add_argument("--clients", default="1,8,32")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="before and after alternated this many times (medians)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "http_front_end.json")
    args = p.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    runs = {"before": [], "after": []}
    for _ in range(args.rounds):  # alternated, so that a busy spell of this machine falls on both
        runs["before"].append(measure("before", args.before.resolve(), args))
        runs["after"].append(measure("after", args.after.resolve(), args))
    result = {"what": "POST /v1/completions {prompt: 'The', max_tokens: %d}, 1-rank server of the embedded model, "
                      "this CPU (%d cores)" % (args.max_tokens, os.cpu_count()),
              "seconds_per_level": args.seconds, "rounds": args.rounds,
              "load_average_at_end": os.getloadavg(),
              **{name: summary(rows) for name, rows in runs.items()}, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
