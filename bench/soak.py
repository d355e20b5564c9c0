"""Soak: local ranks serving gRPC under random load for a while; memory, errors, wrong outputs.

    python bench/soak.py [--minutes 30] [--ranks 4] [--clients 4] [--model PATH] [--out soak.json]

Starts `python -m launch run --single-host RANKS -- run_trinity.py --serve 127.0.0.1:PORT`
(the embedded tiny model unless --model), waits for SERVING, then for --minutes
several client threads send random requests:
  - random prompts: token ids (lengths 1..--max-prompt, a pool of prompts reused
    so references are shared, plus fresh ones) and some text prompts;
    random max_tokens 1..--max-new;
  - 10% cancelled mid-stream (after a random number of tokens);
  - 5% invalid (temperature < 0, top_p 0 or > 1, min_p > 1, top_k < 0, a token id
    outside the vocabulary, a prompt longer than the context, max_tokens above
    the server's cap): each must get INVALID_ARGUMENT, and the server keeps serving;
  - of the rest, 70% greedy, 30% sampled (temperature, top_p, top_k, min_p, seed).
Greedy streams (and the tokens a cancelled greedy stream got) are compared with
one-device mlx-lm on the same checkpoint (as tests/reference.py does; computed
once per prompt in this process, memoized): a different token is a wrong output,
unless the reference's top two log-probabilities at that step are within
--tie-tolerance (a near tie, where float rounding may pick either: counted apart).
Sampled streams are checked for shape (lengths, finish reason, ids in the vocabulary).

Every --sample-every seconds each rank's resident memory (VmRSS from
/proc/PID/status) is recorded, and the launcher's CPU time. GetModelInfo's
per-rank peak_memory_bytes is recorded at the start and the end. The report gives
each rank's memory at marks (0/10/20/30 min on a 30-minute soak) and its slope in
MiB/min after --warmup-minutes (default: the first third). --probe-memory also
logs, inside each rank, MLX's memory in use and cached and malloc's in use and
free (bench/rank_probe), to tell a leak from allocator behaviour. At the end the
launcher gets SIGTERM (a clean stop) and must leave no rank behind.

Prints a table (time, RSS per rank) and a summary; writes JSON to --out. Exits 1
if there was any unexpected error, wrong output, a rank or launcher that died, or
a process left behind. The load and its checks are in soak_load.py, the
measurements of processes and the report in soak_report.py.
"""

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from distributed.serving.proto import generation_pb2 as pb  # noqa: E402
from distributed.serving.proto import generation_pb2_grpc as pb_grpc  # noqa: E402
from soak_load import Reference, Soak, Stats  # noqa: E402
from soak_report import (  # noqa: E402
    alive,
    cpu_seconds,
    memory_trend,
    print_report,
    probe_summary,
    rss_bytes,
)

STARTED = re.compile(r"launch: started rank (\d+) \(pid (\d+)\)")
SERVING = health_pb2.HealthCheckResponse.SERVING


def free_port() -> int:
    import socket

    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port")


def wait_serving(health, launcher: subprocess.Popen, log_path: Path, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if launcher.poll() is not None:
            sys.exit(f"soak: the launcher exited ({launcher.returncode}) before serving:\n"
                     + log_path.read_text()[-4000:])
        try:
            if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    sys.exit(f"soak: not SERVING after {timeout:.0f} s:\n" + log_path.read_text()[-4000:])


def rank_pids(log_path: Path, ranks: int) -> Dict[int, int]:
    pids = {int(r): int(p) for r, p in STARTED.findall(log_path.read_text())}
    if sorted(pids) != list(range(ranks)):
        sys.exit(f"soak: expected {ranks} 'launch: started rank' lines in the launcher log, got {pids}")
    return pids


def model_info_memory(stub) -> Optional[List[int]]:
    try:
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
        return [r.peak_memory_bytes for r in sorted(info.ranks, key=lambda r: r.rank)]
    except grpc.RpcError:
        return None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--clients", type=int, default=4, help="concurrent client threads")
    p.add_argument("--model", help="checkpoint folder (default: the embedded tiny model)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--log", help="launcher and rank output (default: a temporary file, kept)")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between memory samples")
    p.add_argument("--warmup-minutes", type=float,
                   help="memory slopes are taken after this (default: the first third of the soak)")
    p.add_argument("--max-prompt", type=int, default=300, help="longest random prompt (tokens)")
    p.add_argument("--max-new", type=int, default=48, help="largest random max_tokens")
    p.add_argument("--pool", type=int, default=24, help="prompts reused across requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0, help="deadline of each request (s)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--tie-tolerance", type=float, default=1e-4,
                   help="a greedy divergence where mlx-lm's top two logprobs are closer than this is a near tie")
    p.add_argument("--logprob-tolerance", type=float, default=1e-3)
    p.add_argument("--restart", type=int, default=0, help="launch run --restart N (a restart is still an error here)")
    p.add_argument("--launch-arg", action="append", default=[], help="extra `launch run` flag (repeatable)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra run_trinity.py flag (repeatable)")
    p.add_argument("--probe-memory", action="store_true",
                   help="log MLX's and malloc's memory inside each rank (bench/rank_probe) and summarize it")
    args = p.parse_args()
    if args.max_new < 4:
        p.error("--max-new must be at least 4")
    return args


def drive(args, soak: Soak, stats: Stats, health, launcher: subprocess.Popen, pids: Dict[int, int],
          start: float) -> List[dict]:
    """Run the clients until time is up (or the ring breaks), sampling memory; returns the samples."""
    samples = []
    stop_sampling = threading.Event()

    def sample():
        samples.append({"t": round(time.monotonic() - start, 1),
                        "rss": [rss_bytes(pids[r]) for r in range(args.ranks)],
                        "launcher_cpu_s": cpu_seconds(launcher.pid),
                        "rank_cpu_s": [cpu_seconds(pids[r]) for r in range(args.ranks)],
                        "requests": sum(stats.counts[k] for k in ("ok_greedy", "ok_sampled", "cancelled",
                                                                   "invalid_rejected", "errors", "wrong_outputs",
                                                                   "near_tie_divergences"))})

    def sampler():
        while not stop_sampling.wait(args.sample_every):
            sample()

    sample()
    threads = [threading.Thread(target=soak.client, args=(i,), name=f"client-{i}") for i in range(args.clients)]
    threading.Thread(target=sampler, name="sampler", daemon=True).start()
    for t in threads:
        t.start()
    last_report = time.monotonic()
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(timeout=1)
        if time.monotonic() > soak.end and not soak.time_up.is_set():
            soak.cut_in_flight()
        if time.monotonic() - last_report > 60:
            last_report = time.monotonic()
            print(f"soak: {last_report - start:.0f} s: {dict(stats.counts)}", file=sys.stderr, flush=True)
        if launcher.poll() is not None:
            stats.error(f"the launcher exited ({launcher.returncode}) during the soak")
            soak.broken.set()
        elif stats.counts["errors"] and not soak.broken.is_set():
            try:
                serving = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING
            except grpc.RpcError:
                serving = False
            if not serving:
                stats.error("health turned NOT_SERVING during the soak: stopping early")
                soak.broken.set()
    stop_sampling.set()
    sample()
    return samples


def stop(launcher: subprocess.Popen):
    """A clean stop: SIGTERM to the launcher, which stops the ring and must leave nothing behind.
    Returns (exit status or what went wrong, seconds it took)."""
    tic = time.monotonic()
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
    try:
        status = launcher.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        status = "did not exit within 60 s of SIGTERM (killed)"
    return status, time.monotonic() - tic


def main() -> None:
    args = parse_args()
    from distributed.shard.tiny_checkpoint import default_checkpoint

    model = Path(args.model) if args.model else default_checkpoint()
    address = f"127.0.0.1:{free_port()}"
    log_path = Path(args.log) if args.log else Path(tempfile.mkstemp(prefix="trinity-soak-", suffix=".log")[1])
    log = open(log_path, "w")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    probe_dir = Path(f"{log_path}.probe")
    if args.probe_memory:  # every rank imports rank_probe/sitecustomize.py at start-up
        probe_dir.mkdir(exist_ok=True)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench" / "rank_probe"), env["PYTHONPATH"]])
        env["TRINITY_MEMPROBE_DIR"] = str(probe_dir)
    cmd = [sys.executable, "-m", "launch", "run", "--single-host", str(args.ranks), "--restart", str(args.restart),
           *args.launch_arg, "--",
           "run_trinity.py", "--model", str(model), "--serve", address, *args.serve_arg]
    print(f"soak: {' '.join(cmd)}\nsoak: log {log_path}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.GenerationStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    try:
        wait_serving(health, launcher, log_path, args.startup_timeout)
        startup_s = time.monotonic() - t0
        pids = rank_pids(log_path, args.ranks)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
        peak_start = [r.peak_memory_bytes for r in sorted(info.ranks, key=lambda r: r.rank)]
        print(f"soak: serving on {address} after {startup_s:.1f} s; rank pids {pids}; "
              f"{args.clients} clients for {args.minutes:g} min", file=sys.stderr, flush=True)
        reference = Reference(model, args.max_new)
        stats = Stats()
        start = time.monotonic()
        soak = Soak(args, stub, info, reference, stats, start + args.minutes * 60)
        samples = drive(args, soak, stats, health, launcher, pids, start)
        soak_s = time.monotonic() - start
        try:
            still_serving = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
        except grpc.RpcError:
            still_serving = False
        if not still_serving:
            stats.error("health is not SERVING at the end")
        peak_end = model_info_memory(stub)
        dead = [r for r, pid in pids.items() if not alive(pid)]
        if dead:
            stats.error(f"rank(s) {dead} died during the soak")
    finally:
        channel.close()
        launcher_status, stop_s = stop(launcher)
        log.close()
    time.sleep(0.5)
    orphans = [pid for pid in pids.values() if alive(pid)]
    if orphans:
        stats.error(f"rank process(es) {orphans} still running after the launcher exited")
        for pid in orphans:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
    if launcher_status != 0:
        stats.error(f"the launcher's exit status after SIGTERM was {launcher_status}")
    restarts = log_path.read_text().count("restarting the whole ring")
    if restarts:
        stats.error(f"the launcher restarted the ring {restarts} time(s)")

    c = stats.counts
    ok = c["ok_greedy"] + c["ok_sampled"]
    total = ok + c["cancelled"] + c["invalid_rejected"] + c["errors"] + c["wrong_outputs"] + c["near_tie_divergences"]
    first, last = samples[0], samples[-1]
    growth = [None if a is None or b is None else b - a for a, b in zip(first["rss"], last["rss"])]
    warmup_s = (args.minutes / 3 if args.warmup_minutes is None else args.warmup_minutes) * 60
    results = {
        "settings": {k: v for k, v in vars(args).items()},
        "model": str(model),
        "startup_s": startup_s,
        "soak_s": soak_s,
        "counts": dict(c),
        "ok_greedy": c["ok_greedy"],
        "ok_sampled": c["ok_sampled"],
        "cancelled": c["cancelled"],
        "invalid_rejected": c["invalid_rejected"],
        "requests": total,
        "ok": ok,
        "errors": c["errors"],
        "wrong_outputs": c["wrong_outputs"],
        "near_tie_divergences": c["near_tie_divergences"],
        "error_messages": stats.errors,
        "wrong": stats.wrong,
        "near_ties": stats.near_ties[:20],
        "max_logprob_diff": stats.max_logprob_diff,
        "references_computed": reference.computed,
        "rank_pids": pids,
        "samples": samples,
        "rss_first": first["rss"],
        "rss_last": last["rss"],
        "rss_growth": growth,
        "rss_peak": [max((s["rss"][r] or 0) for s in samples) for r in range(args.ranks)],
        **memory_trend(samples, args.ranks, soak_s, warmup_s),
        "probe": probe_summary(probe_dir, args.ranks, warmup_s) if args.probe_memory else None,
        "model_info_peak_memory_start": peak_start,
        "model_info_peak_memory_end": peak_end,
        "launcher_status": launcher_status,
        "restarts": restarts,
        "stop_s": stop_s,
        "orphans": orphans,
        "log": str(log_path),
    }
    print_report(results)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.out}")
    sys.exit(1 if c["errors"] or c["wrong_outputs"] else 0)


if __name__ == "__main__":
    main()
