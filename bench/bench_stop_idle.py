"""Idle CPU per rank of a serving ring, and seconds until every process is gone after each way of stopping it.

    python bench/bench_stop_idle.py [--model PATH] [--ranks 2] [--launcher mlx.launch|launch-run]
                                    [--mlx-launch-args "--backend nccl"] [--paths NAME ...] [--seconds 10]

For each stop path (tests/stop_paths.py's STOP_PATHS; default: all): start
`run_trinity.py --serve` as N ranks (mlx.launch on its default ports, or
`python -m launch run --single-host N`), wait for "serving", run one short
generation (so the ring has served and gone idle), read each rank's and the
launcher's CPU seconds (utime + stime from /proc) twice, --seconds apart, then
stop the ring that way and time until no process of it is left. Linux only.
The speed of a stop is a measurement, not a test: tests/startup/test_lifecycle.py
asserts that every process is gone and the ports are free.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from stop_paths import (  # noqa: E402
    MLX_LAUNCH_PORTS,
    RUN,
    STOP_PATHS,
    Launch,
    free_port,
    mlx_launch,
    ports_in_use,
    tagged,
)

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rank_of(pid: int):
    for var in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if var.startswith(b"MLX_RANK=") and b"run_trinity" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return int(var[9:])
    return None


def idle_cpu(launch: Launch, seconds: float) -> dict:
    """CPU seconds per 10 s of wall time: each rank, and the launcher with its other processes."""
    def sample():
        out = {}
        for pid in tagged(launch.tag):
            try:
                rank = rank_of(pid)
                key = "launcher" if rank is None else f"rank {rank}"
                out[key] = out.get(key, 0.0) + cpu_seconds(pid)
            except OSError:
                continue
        return out

    before, tic = sample(), time.monotonic()
    time.sleep(seconds)
    after, wall = sample(), time.monotonic() - tic
    return {k: round((v - before.get(k, 0.0)) * 10 / wall, 3) for k, v in sorted(after.items())}


def one_request(port: int) -> None:
    import grpc

    from distributed.serving.proto import generation_pb2 as pb
    from distributed.serving.proto import generation_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(token_ids=[1, 2, 3], max_tokens=8), timeout=600))


def run_path(args, how: str) -> dict:
    port = free_port()
    serve = ["--serve", f"127.0.0.1:{port}"] + (["--model", args.model] if args.model else [])
    if args.launcher == "mlx.launch":
        cmd = [mlx_launch(), *args.mlx_launch_args.split(), "-n", str(args.ranks), sys.executable, RUN, *serve]
    else:
        cmd = [sys.executable, "-m", "launch", "run", "--single-host", str(args.ranks), "--", RUN, *serve]
    launch = Launch(cmd)
    try:
        launch.wait_for(r"^serving ", timeout=900)
        one_request(port)
        time.sleep(args.settle)
        cpu = idle_cpu(launch, args.seconds)
        tic = time.monotonic()
        STOP_PATHS[how](launch)
        gone = launch.wait_gone(60)
        busy = ports_in_use([port] + (MLX_LAUNCH_PORTS if args.launcher == "mlx.launch" else []))
        return {"path": how, "idle_cpu_s_per_10s": cpu, "gone_after_s": None if gone is None else round(gone, 2),
                "left": tagged(launch.tag), "ports_in_use": busy, "launcher_status": launch.proc.poll(),
                "stopped_in_s": round(time.monotonic() - tic, 2)}
    finally:
        launch.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint (default: the embedded tiny model)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--launcher", choices=["mlx.launch", "launch-run"], default="mlx.launch")
    p.add_argument("--mlx-launch-args", default="", help='e.g. "--backend nccl"')
    p.add_argument("--paths", nargs="+", choices=list(STOP_PATHS), default=list(STOP_PATHS))
    p.add_argument("--seconds", type=float, default=10.0, help="idle CPU window")
    p.add_argument("--settle", type=float, default=2.0, help="pause after the request before measuring")
    p.add_argument("--json-out")
    args = p.parse_args()
    results = []
    for how in args.paths:
        print(f"{how} ...", file=sys.stderr, flush=True)
        results.append(run_path(args, how))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    keys = sorted({k for r in results for k in r["idle_cpu_s_per_10s"]})
    print(f"{args.launcher} {args.mlx_launch_args} with {args.ranks} ranks; idle CPU s per 10 s ({args.seconds:g} s "
          f"window, {os.cpu_count()} cores)")
    print(f"{'stop path':42}{'gone after s':>13}" + "".join(f"{k:>10}" for k in keys))
    for r in results:
        gone = "NOT GONE" if r["gone_after_s"] is None else f"{r['gone_after_s']:.2f}"
        print(f"{r['path']:42}{gone:>13}" + "".join(f"{r['idle_cpu_s_per_10s'].get(k, 0):10.3f}" for k in keys))
    print(json.dumps(results))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
