"""Micro-benchmarks, each one piece alone: the ring's link (round-trip), a verification pass (verify),
rank 0's prefix-cache index (prefix-index).

round-trip    one decode step's frame there and back between two ranks of the ring backend, through
              this runner's transport (its waits included), no computation: what a decode step over a
              ring of two cannot go below, beside its computation (decode reports the ceiling it sets)
verify        one process, one stage holding every layer: after a prefill of --context tokens, a pass
              over K + 1 positions (the last token and K drafts, every position's logits, as a
              verification frame) against a pass over one, K = 0..--max-k, each trimmed again so every
              pass starts from the same history. A draft accepted with probability a pays while
              1 + a + ... + a^K exceeds that ratio
disk-entry    one rank's disk-tier entry of Trinity-Mini's shape (32 layers, 3 sliding then 1 full, 4 KV
              heads of 128, window 2,048, bf16; random values, no model) of --tokens tokens: written by the
              disk tier, then read back, the page cache dropped first where the kernel lets it, as a
              restore of all but its last token and of half of it reads it (only the ranges they need),
              against every array of it read whole (what a restore read before) and the file's bytes
              read alone: seconds, and bytes per token on disk
prefix-index  what the batcher asks of the index per request (a lookup at admission, then two stores),
              in microseconds, as the index fills to --sizes entries: `distinct` 128-token prompts, and
              `chat` ones sharing a 500-token system prompt; --baseline DIR: the same for another
              checkout's index (e.g. `git worktree add --detach DIR COMMIT`)
"""

import json
import statistics
import subprocess
import sys
import time

from bench.harness import PY, ROOT, bench_env, flags, out_path, run_ranks, save, shrink

WARM_UP = 20
SYSTEM = 500  # tokens of the chat workload's shared system prompt


def add_arguments(p) -> None:
    subs = p.add_subparsers(dest="what", required=True, metavar="WHAT")
    trip = subs.add_parser("round-trip", help="the ring's link alone")
    trip.add_argument("--hidden", type=int, default=128, help="the frame's width")
    trip.add_argument("--trips", type=int, default=300)
    trip.add_argument("--child", action="store_true", help="(a rank of the measurement)")
    trip.set_defaults(parser=trip, run=lambda a: print_trip(a) if not a.child else trip_child(a.hidden, a.trips))
    verify = subs.add_parser("verify", help="a pass over K + 1 positions against one")
    flags(verify, model=None, reps=30, out=None, smoke=False)
    verify.add_argument("--context", type=int, default=512, help="prompt tokens before the passes")
    verify.add_argument("--max-k", type=int, default=8)
    verify.set_defaults(parser=verify, run=verify_main)
    entry = subs.add_parser("disk-entry", help="a disk-tier entry written and read back")
    flags(entry, reps=3, out=None, smoke=False)
    entry.add_argument("--tokens", type=int, default=32768)
    entry.set_defaults(parser=entry, run=disk_entry_main)
    index = subs.add_parser("prefix-index", help="the prefix-cache index's host time per request")
    flags(index, out=None, smoke=False)
    index.add_argument("--baseline", metavar="DIR", help="another checkout, measured the same way")
    index.add_argument("--sizes", default="100,1000,4000", help="index sizes (entries) to measure at")
    index.add_argument("--requests", type=int, default=200, help="timed requests per size")
    index.set_defaults(parser=index, run=index_main)


def trip_child(hidden: int, trips: int) -> None:
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


def round_trip(hidden: int, trips: int = 300, env: dict = None, timeout: float = 120) -> float:
    """Median round trip in ms, two ranks started here."""
    cmd = [PY, "-m", "bench", "micro", "round-trip", "--hidden", str(hidden), "--trips", str(trips), "--child"]
    r = run_ranks(cmd, 2, env or bench_env(), timeout)
    if "error" in r:
        raise RuntimeError(f"round trip: {r['error']}")
    return r["round_trip_ms"]


def print_trip(args) -> None:
    print(f"round trip, hidden {args.hidden}: {round_trip(args.hidden, args.trips):.3f} ms")


def verify_main(args) -> None:
    import mlx.core as mx

    from bench.harness import SMALL, checkpoint
    from distributed.runtime.caches import trim_newest
    from distributed.runtime.pipeline import Pipeline
    from distributed.shard.config import read_config
    from distributed.shard.loader import load_stage
    from distributed.transport import Reply

    model = args.model or str(checkpoint(SMALL) if args.smoke else ROOT / "distributed" / "shard" / "tiny_model")
    shrink(args, context=32, reps=3, max_k=2)
    context, reps, max_k = args.context, args.reps, args.max_k
    config = read_config(model)
    if context + 1 >= config.get("sliding_window", 1 << 30):
        sys.exit(f"--context must stay below the sliding window ({config['sliding_window']}): the K = 0 pass "
                 "is undone with mlx-lm's trim, which a wrapped window ignores")
    pipeline = Pipeline(load_stage(model, 0, config["num_hidden_layers"], True))
    vocab = min(pipeline.stage.args.vocab_size, 251)
    mx.eval(pipeline.logits(mx.array([[(i * 37 + 11) % vocab for i in range(context)]], dtype=mx.uint32), Reply.LAST))
    caches = pipeline.caches.get(0)
    rows = []
    for k in range(max_k + 1):
        tokens = mx.array([[(j * 13 + 5) % vocab for j in range(k + 1)]], dtype=mx.uint32)
        times = []
        for rep in range(reps + 3):
            tic = time.perf_counter()
            mx.eval(pipeline.logits(tokens, Reply.ALL))
            if rep >= 3:
                times.append(time.perf_counter() - tic)
            for cache in caches:
                trim_newest(cache, k + 1) if k else cache.trim(1)  # back to the same history every pass
        rows.append({"k": k, "positions": k + 1, "ms": 1000 * statistics.median(times),
                     "ms_range": [1000 * min(times), 1000 * max(times)]})
    for row in rows:
        row["ratio"] = row["ms"] / rows[0]["ms"]
    print(f"{model}: {config['num_hidden_layers']} layers, context {context}, median of {reps}")
    print(f"{'K':>3}{'positions':>11}{'ms/pass':>10}{'ratio':>8}{'range ms':>16}")
    for r in rows:
        print(f"{r['k']:>3}{r['positions']:>11}{r['ms']:>10.2f}{r['ratio']:>8.2f}{'%.2f-%.2f' % tuple(r['ms_range']):>16}")
    print(f"wrote {save(out_path(args, 'verify'), {'rows': rows}, dict(vars(args), model=model))}")


def mini_entry(tokens: int, layers: int = 32, every: int = 4, heads: int = 4, dim: int = 128, window: int = 2048):
    """caches.Stored of Trinity-Mini's shape after `tokens` recorded tokens (random bf16)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from distributed.runtime.caches import Stored

    caches, log = [], []
    for i in range(layers):
        k, v = (mx.random.normal((1, heads, tokens, dim)).astype(mx.bfloat16) for _ in "kv")
        if (i + 1) % every == 0:
            c = KVCache()
            c.keys, c.values, c.offset = k, v, tokens
            log.append(None)
        else:
            c = RotatingKVCache(window)
            c.keys, c.values = k[..., -window:, :], v[..., -window:, :]
            c.offset, c._idx = tokens, min(tokens, window)
            log.append((k, v))
        caches.append(c)
    mx.eval([(c.keys, c.values) for c in caches], [kv for kv in log if kv])
    return Stored(caches, log, tokens)


def drop_page_cache(path) -> None:
    import os

    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # gVisor and some others ignore it
    finally:
        os.close(fd)


def disk_entry_main(args) -> None:
    import tempfile
    from pathlib import Path

    import mlx.core as mx
    import numpy as np

    from distributed.runtime import disk_cache
    from distributed.runtime.caches import Stored, entry_key

    shrink(args, tokens=1024, reps=1)
    n = args.tokens
    stored = mini_entry(n)
    tokens = np.arange(n, dtype=np.int32)
    with tempfile.TemporaryDirectory() as folder:
        disk = disk_cache.DiskCache(Path(folder), 1 << 40, "0" * 64)
        caches, meta = stored.on_disk()
        key = entry_key(tokens)
        tic = time.perf_counter()
        assert disk.put(key, tokens, caches, meta)
        disk.flush(600)
        path = disk.sub / disk_cache.file_name(key)
        out = {"tokens": n, "file_bytes": path.stat().st_size, "bytes_per_token": path.stat().st_size / n,
               "write_s": time.perf_counter() - tic, "device": str(mx.default_device()), "rounds": []}

        def timed(read):
            drop_page_cache(path)
            tic = time.perf_counter()
            got = read()
            return time.perf_counter() - tic, got

        for _ in range(args.reps):
            row = {}
            for name, cut in (("all_but_one", n - 1), ("half", n // 2)):
                seconds, got = timed(lambda: disk.read(key, lambda f: Stored.from_file(f, len(stored.caches), cut)))
                mx.eval([c.state for c in got.cut(cut)])
                row[name] = {"s": seconds, "ram_bytes": got.nbytes}
            row["whole_s"], _ = timed(lambda: disk.get(key))
            row["file_read_s"], _ = timed(lambda: len(path.read_bytes()))
            out["rounds"].append(row)
            print(f"all but one {row['all_but_one']['s']:.3f} s ({row['all_but_one']['ram_bytes'] / 2**20:.0f} MiB), "
                  f"half {row['half']['s']:.3f} s, whole {row['whole_s']:.3f} s, the file's bytes alone "
                  f"{row['file_read_s']:.3f} s")
        disk.close()
    print(f"{n} tokens: {out['file_bytes'] / 2**20:.1f} MiB on disk ({out['bytes_per_token']:.0f} B/token), "
          f"written in {out['write_s']:.2f} s")
    print(f"wrote {save(out_path(args, 'disk_entry'), out, vars(args))}")


def index_requests(workload: str, seed: int):
    """Endless (prompt, generated) token arrays of the workload."""
    import numpy as np

    rng = np.random.default_rng(seed)
    system = rng.integers(0, 50000, SYSTEM, dtype=np.int32)
    while True:
        own = rng.integers(0, 50000, 128 if workload == "distinct" else 40, dtype=np.int32)
        yield (own if workload == "distinct" else np.concatenate([system, own])), rng.integers(0, 50000, 64)


def index_timings(sizes: list, count: int) -> dict:
    """Microseconds per request at each size, per workload (the checkout first on sys.path is measured)."""
    import numpy as np

    from distributed.runtime.prefix_cache import Entry, PrefixIndex

    def request(index, prompt, generated, next_id: int) -> int:
        index.find(prompt)
        for tokens in (prompt[:-1], np.concatenate([prompt, generated])):
            if not index.covered(tokens):
                index.insert(Entry(next_id, tokens, True, [len(tokens)]))
                next_id += 1
        return next_id

    out = {}
    for workload in ("distinct", "chat"):
        index, next_id, made = PrefixIndex(1 << 62, 1), 0, index_requests(workload, 0)
        for size in sizes:
            while len(index.entries) < size:
                next_id = request(index, *next(made), next_id)
            batch = [next(made) for _ in range(count)]
            start = time.perf_counter()
            for prompt, generated in batch:
                next_id = request(index, prompt, generated, next_id)
            out[f"{workload} {size}"] = (time.perf_counter() - start) / count * 1e6
    return out


def index_main(args) -> None:
    shrink(args, sizes="10,50", requests=20)
    sizes, count = [int(s) for s in args.sizes.split(",")], args.requests
    this, base = index_timings(sizes, count), None
    if args.baseline:  # run from the other checkout, so that its distributed/ comes first on sys.path
        code = (f"import sys, json; sys.path.insert(1, {str(ROOT)!r}); from bench.micro import index_timings; "
                f"print(json.dumps(index_timings({sizes}, {count})))")
        proc = subprocess.run([PY, "-c", code], cwd=args.baseline, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"baseline {args.baseline}: {proc.stderr[-1500:]}")
        base = json.loads(proc.stdout.splitlines()[-1])
    print(f"{'workload':<10} {'entries':>7} {'this us/request':>16}" + (f" {'baseline':>10} {'x base':>7}" if base else ""))
    for key, us in this.items():
        workload, size = key.split()
        print(f"{workload:<10} {size:>7} {us:>16.0f}" + (f" {base[key]:>10.0f} {us / base[key]:>7.3f}" if base else ""))
    print(f"wrote {save(out_path(args, 'prefix_index'), {'this': this, 'baseline': base}, vars(args))}")
