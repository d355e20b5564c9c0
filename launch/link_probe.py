"""The links as the run will see them: run on every rank of a ring that `trinity-launch doctor`
starts the way `trinity-launch run` would (same backend, hosts, ssh), with mx.distributed only.

    python -m launch.link_probe '{"hidden": 2048, "trips": 40, "groups": [2]}'

For each pair of consecutive ranks (i, i + 1), in turn while the others wait: the median (and
fastest) round trip of one decode step's frame (the transport's fixed size, header and inline
hidden state: distributed/transport/base.py's FRAME_BYTES) sent i -> i + 1 and back, and the
bandwidth of a bulk frame sent the same way (two transfers, less the small round trip); then
the median of one all_sum of a hidden state (float32, `hidden` values) over every rank (what a
tensor group's layer pays twice), and with "groups" (tensor sizes T < N, on a backend that splits
groups: MPI) the same inside each group of T consecutive ranks. Rank 0 prints one JSON line;
the others print nothing.
"""

import json
import statistics
import sys
import time

WARM_UP = 5
BULK_VALUES = 1 << 18  # 1 MiB of float32
BULK_TRIPS = 3


def ping_pong(x, me: int, a: int, b: int, group) -> float:
    """One trip of x from a to b and back, timed on a (0.0 elsewhere)."""
    import mlx.core as mx

    tic = time.perf_counter()
    if me == a:
        mx.eval(mx.distributed.send(x, b, group=group))
        mx.eval(mx.distributed.recv_like(x, b, group=group))
    elif me == b:
        y = mx.distributed.recv_like(x, a, group=group)
        mx.eval(y)
        mx.eval(mx.distributed.send(y, a, group=group))
    return time.perf_counter() - tic


def trips_s(x, me: int, a: int, b: int, group, trips: int) -> list:
    times = [ping_pong(x, me, a, b, group) for _ in range(WARM_UP + trips)]
    return sorted(times[WARM_UP:])


def measure_pair(me: int, a: int, b: int, group, trips: int):
    """(median round trip s, fastest round trip s, bulk bytes/s) of a -> b, on a; zeros elsewhere.
    The fastest trip is the link's own; the median adds what the hosts' load adds."""
    import mlx.core as mx

    from distributed.transport.base import FRAME_BYTES

    small = trips_s(mx.zeros((FRAME_BYTES,), dtype=mx.uint8), me, a, b, group, trips)
    bulk = mx.ones((BULK_VALUES,), dtype=mx.float32)
    big = min(ping_pong(bulk, me, a, b, group) for _ in range(BULK_TRIPS + 1))
    if me != a:
        return 0.0, 0.0, 0.0
    rate = 2 * BULK_VALUES * 4 / (big - small[0]) if big > small[0] else 0.0  # 0: lost in the noise
    return statistics.median(small), small[0], rate


def all_reduce_s(group, hidden: int, trips: int) -> tuple:
    """(median, fastest) seconds of one all_sum of a hidden state over `group`."""
    import mlx.core as mx

    x = mx.ones((1, 1, hidden), dtype=mx.float32)
    times = []
    for _ in range(WARM_UP + trips):
        tic = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=group))
        times.append(time.perf_counter() - tic)
    return statistics.median(times[WARM_UP:]), min(times[WARM_UP:])


def group_all_reduces(group, sizes: list, hidden: int, trips: int) -> list:
    """For each tensor size T (1 < T < N, a backend that splits groups: MPI), the all_sum of a
    hidden state inside each group of T consecutive ranks: [{"ranks", "all_reduce_ms",
    "all_reduce_min_ms"}], on rank 0."""
    import mlx.core as mx

    me, n = group.rank(), group.size()
    out = []
    for size in sizes:
        mine = all_reduce_s(group.split(me // size), hidden, trips)
        times = mx.zeros((n // size, 2), dtype=mx.float32)
        if me % size == 0:
            times[me // size] = mx.array(mine)
        times = mx.distributed.all_sum(times, group=group)  # each group's first rank's figures, to rank 0
        out += [{"ranks": list(range(g * size, (g + 1) * size)), "all_reduce_ms": median * 1e3,
                 "all_reduce_min_ms": fastest * 1e3}
                for g, (median, fastest) in enumerate(times.tolist())]
    return out


def main() -> None:
    import mlx.core as mx

    options = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    hidden, trips = int(options.get("hidden", 2048)), int(options.get("trips", 40))
    group = mx.distributed.init(strict=True)
    me, n = group.rank(), group.size()
    groups = group_all_reduces(group, options.get("groups", []), hidden, trips)
    rows = mx.zeros((n, 3), dtype=mx.float32)
    for a in range(n if n > 2 else 1):  # two ranks: one pair
        rtt, fastest, rate = measure_pair(me, a, (a + 1) % n, group, trips)
        if me == a:
            rows[a] = mx.array([rtt, fastest, rate / 1e6])
    rows = mx.distributed.all_sum(rows, group=group)  # every initiator's row, to rank 0
    reduce_s, reduce_min_s = all_reduce_s(group, hidden, trips)
    mx.eval(rows)
    if me == 0:
        pairs = [{"from": a, "to": (a + 1) % n, "rtt_ms": float(rows[a, 0]) * 1e3, "rtt_min_ms": float(rows[a, 1]) * 1e3,
                  "mbit_s": float(rows[a, 2]) * 8}
                 for a in range(n if n > 2 else 1)]
        print(json.dumps({"links": {"pairs": pairs, "all_reduce_ms": reduce_s * 1e3,
                                    "all_reduce_min_ms": reduce_min_s * 1e3, "groups": groups,
                                    "hidden": hidden, "ranks": n}}), flush=True)


if __name__ == "__main__":
    main()
