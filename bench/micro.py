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
