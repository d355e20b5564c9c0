"""Soak: local ranks serving gRPC under random load for a while; memory, errors, wrong outputs.

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
MiB/min after --warmup-minutes (default: the first third). At the end the
launcher gets SIGTERM (a clean stop) and must leave no rank behind.

Prints a table (time, RSS per rank) and a summary; writes JSON to --out. Exits 1
if there was any unexpected error, wrong output, a rank or launcher that died, or
a process left behind. The load and its checks are in soak_load.py, the
measurements of processes and the report in soak_report.py. --smoke: 2 ranks,
2 clients, 20 seconds.
"""

import logging
import os
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

from bench.harness import ROOT, bench_env, flags, free_ports, out_path, save, shrink
from bench.soak_load import Reference, Soak, Stats
from bench.soak_report import alive, cpu_seconds, memory_trend, print_report, rss_bytes
from distributed.serving.proto import generation_pb2 as pb
from distributed.serving.proto import generation_pb2_grpc as pb_grpc

log = logging.getLogger("bench")

STARTED = re.compile(r"launch: started rank (\d+) \(pid (\d+)\)")
SERVING = health_pb2.HealthCheckResponse.SERVING


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


def add_arguments(p) -> None:
    flags(p, smoke=False, out=None, model=None, ranks=[4])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=4, help="concurrent client threads")
    p.add_argument("--log", help="launcher and rank output (default: a temporary file, kept)")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between memory samples")
    p.add_argument("--warmup-minutes", type=float,
                   help="memory slopes are taken after this (default: the first third of the soak)")
    p.add_argument("--max-prompt", type=int, default=300, help="longest random prompt (tokens)")
    p.add_argument("--max-new", type=int, default=48, help="largest random max_tokens (at least 4)")
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
            log.info(f"soak: {last_report - start:.0f} s: {dict(stats.counts)}")
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


def main(args) -> None:
    from distributed.shard.tiny_checkpoint import default_checkpoint

    shrink(args, ranks=[2], clients=2, minutes=1 / 3, sample_every=5.0)
    if args.max_new < 4:
        sys.exit("--max-new must be at least 4")
    args.ranks = args.ranks[0]
    model = Path(args.model) if args.model else default_checkpoint()
    address = f"127.0.0.1:{free_ports(1)[0]}"
    log_path = Path(args.log) if args.log else Path(tempfile.mkstemp(prefix="trinity-soak-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "launch", "run", "--single-host", str(args.ranks), "--restart", str(args.restart),
           *args.launch_arg, "--", "run_trinity.py", "--model", str(model), "--serve", address, *args.serve_arg]
    log.info(f"soak: {' '.join(cmd)}\nsoak: log {log_path}")
    with open(log_path, "w") as out:
        launcher = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=bench_env(), cwd=ROOT,
                                    start_new_session=True)
        channel, run = grpc.insecure_channel(address), {}
        try:
            run = soak(args, model, channel, launcher, log_path)
        finally:
            channel.close()
            run["launcher_status"], run["stop_s"] = stop(launcher)
    results = check_the_end(args, run, log_path)
    print_report(results)
    print(f"wrote {save(out_path(args, 'soak'), results)}")
    sys.exit(1 if results["errors"] or results["wrong_outputs"] else 0)


def soak(args, model: Path, channel, launcher: subprocess.Popen, log_path: Path) -> dict:
    """Serving, then the clients for --minutes; what was measured, up to the launcher's stop."""
    stub, health = pb_grpc.GenerationStub(channel), health_pb2_grpc.HealthStub(channel)
    t0 = time.monotonic()
    wait_serving(health, launcher, log_path, args.startup_timeout)
    startup_s = time.monotonic() - t0
    pids = rank_pids(log_path, args.ranks)
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
    log.info(f"soak: serving after {startup_s:.1f} s; rank pids {pids}; {args.clients} clients for {args.minutes:g} min")
    reference, stats, start = Reference(model, args.max_new), Stats(), time.monotonic()
    load = Soak(args, stub, info, reference, stats, start + args.minutes * 60)
    samples = drive(args, load, stats, health, launcher, pids, start)
    soak_s = time.monotonic() - start
    try:
        still_serving = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
    except grpc.RpcError:
        still_serving = False
    if not still_serving:
        stats.error("health is not SERVING at the end")
    dead = [r for r, pid in pids.items() if not alive(pid)]
    if dead:
        stats.error(f"rank(s) {dead} died during the soak")
    return {"model": str(model), "startup_s": startup_s, "soak_s": soak_s, "stats": stats, "rank_pids": pids,
            "references_computed": reference.computed, "samples": samples,
            "model_info_peak_memory_start": [r.peak_memory_bytes for r in sorted(info.ranks, key=lambda r: r.rank)],
            "model_info_peak_memory_end": model_info_memory(stub)}


def check_the_end(args, run: dict, log_path: Path) -> dict:
    """After the launcher's stop: nothing left behind, no restart; the results."""
    stats, pids, samples = run.pop("stats"), run["rank_pids"], run["samples"]
    time.sleep(0.5)
    orphans = [pid for pid in pids.values() if alive(pid)]
    if orphans:
        stats.error(f"rank process(es) {orphans} still running after the launcher exited")
        for pid in orphans:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
    if run["launcher_status"] != 0:
        stats.error(f"the launcher's exit status after SIGTERM was {run['launcher_status']}")
    restarts = log_path.read_text().count("restarting the whole ring")
    if restarts:
        stats.error(f"the launcher restarted the ring {restarts} time(s)")
    c = stats.counts
    kinds = ("ok_greedy", "ok_sampled", "cancelled", "invalid_rejected", "errors", "wrong_outputs", "near_tie_divergences")
    first, last = samples[0], samples[-1]
    warmup_s = (args.minutes / 3 if args.warmup_minutes is None else args.warmup_minutes) * 60
    return {"settings": vars(args), **run, "counts": dict(c), **{k: c[k] for k in kinds},
            "requests": sum(c[k] for k in kinds), "ok": c["ok_greedy"] + c["ok_sampled"],
            "error_messages": stats.errors, "wrong": stats.wrong, "near_ties": stats.near_ties[:20],
            "max_logprob_diff": stats.max_logprob_diff, "rss_first": first["rss"], "rss_last": last["rss"],
            "rss_growth": [None if a is None or b is None else b - a for a, b in zip(first["rss"], last["rss"])],
            "rss_peak": [max((s["rss"][r] or 0) for s in samples) for r in range(args.ranks)],
            **memory_trend(samples, args.ranks, run["soak_s"], warmup_s),
            "restarts": restarts, "orphans": orphans, "log": str(log_path)}
