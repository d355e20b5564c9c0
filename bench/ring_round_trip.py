"""The link alone: round trips of one decode step's frame between two ranks of the ring
backend, through this runner's transport (transport/mx_p2p.py, its waits included), with no
computation. What a decode step over a ring of two cannot go below, beside its computation:

    python bench/ring_round_trip.py [--hidden 128] [--trips 300]

prints the median round trip in ms. bench_decode.py runs it beside its ring configurations
and reports the ceiling it sets: one token per (one-process time per token + a round trip).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, ROOT, kill_groups, start_ranks  # noqa: E402

WARM_UP = 20


def child(hidden: int, trips: int) -> None:
    import mlx.core as mx
    from distributed.transport import Header, Op, Reply
    from distributed.transport.mx_p2p import MxPointToPoint

    t = MxPointToPoint(mx.distributed.init(backend="ring", strict=True))
    h = mx.ones((1, 1, hidden), dtype=mx.float32)
    times = []
    for i in range(WARM_UP + trips + 1):
        if t.rank == 1:
            header, payload = t.recv()
            if header.op == Op.STOP:
                t.send(header)
                break
            t.send(Header.for_payload(Op.FORWARD, payload, reply=Reply.LAST), payload)
            continue
        if i == WARM_UP + trips:
            t.send(Header(Op.STOP))
            t.recv()
            break
        tic = time.perf_counter()
        t.send(Header.for_payload(Op.FORWARD, h, reply=Reply.LAST), h)
        _, h = t.recv()
        if i >= WARM_UP:
            times.append(time.perf_counter() - tic)
    t.close()
    if t.rank == 0:
        print(json.dumps({"round_trip_ms": statistics.median(times) * 1e3}))


def measure(hidden: int, trips: int = 300, env: dict = None, timeout: float = 120) -> float:
    """Median round trip in ms, two ranks started here (as bench_decode's "direct" rings)."""
    env = dict(env or os.environ)  # the repo first, then whatever else the caller's path holds (a GPU's MLX)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    procs, hostfile = start_ranks([PY, __file__, "--child", str(hidden), str(trips)], 2, env,
                                  rank0=dict(stdout=subprocess.PIPE, text=True),
                                  others=dict(stdout=subprocess.DEVNULL))
    try:
        out, _ = procs[0].communicate(timeout=timeout)
        return json.loads(out.strip().splitlines()[-1])["round_trip_ms"]
    finally:
        kill_groups(procs, grace=0)
        os.unlink(hostfile)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--trips", type=int, default=300)
    p.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child)
    else:
        print(f"round trip, hidden {args.hidden}: {measure(args.hidden, args.trips):.3f} ms")
