"""What verifying K drafts costs: one pass over K + 1 positions against a pass over one.

    python bench/bench_verify.py --model PATH [--context 512] [--max-k 8] [--reps 30] [--out PATH]

One process, one stage holding every layer (P=1: the cost is the model's, not the ring's).
After a prefill of --context prompt tokens, each pass feeds K + 1 positions (the last token
and K drafts) with every position's logits, as a verification frame does, then trims the K
drafts again (Op.TRIM's trim_newest), so every pass starts from the same history. A MoE
layer reads the experts of every position's top-k: more positions read more experts, which
is what sets how many drafts pay. Reported: median ms per pass, and its ratio to K = 0; a
draft accepted with probability a is worth it while (1 + a + ... + a^K) > that ratio.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from distributed.runtime.caches import trim_newest  # noqa: E402
from distributed.runtime.pipeline import Pipeline  # noqa: E402
from distributed.shard.config import read_config  # noqa: E402
from distributed.shard.loader import load_stage  # noqa: E402
from distributed.transport import Reply  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--context", type=int, default=512, help="prompt tokens before the passes")
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument("--reps", type=int, default=30, help="timed passes per K (after 3 untimed)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "verify.json"))
    args = p.parse_args()
    config = read_config(args.model)
    layers = config["num_hidden_layers"]
    if args.context + 1 >= config.get("sliding_window", 1 << 30):
        sys.exit(f"--context must stay below the sliding window ({config['sliding_window']}): the K = 0 pass "
                 "is undone with mlx-lm's trim, which a wrapped window ignores")
    pipeline = Pipeline(load_stage(args.model, 0, layers, True))
    vocab = pipeline.stage.args.vocab_size
    prompt = mx.array([[(i * 37 + 11) % min(vocab, 251) for i in range(args.context)]], dtype=mx.uint32)
    mx.eval(pipeline.logits(prompt, Reply.LAST))
    caches = pipeline.caches.get(0)
    rows = []
    for k in range(args.max_k + 1):
        tokens = mx.array([[(j * 13 + 5) % min(vocab, 251) for j in range(k + 1)]], dtype=mx.uint32)
        times = []
        for rep in range(args.reps + 3):
            tic = time.perf_counter()
            mx.eval(pipeline.logits(tokens, Reply.ALL))
            if rep >= 3:
                times.append(time.perf_counter() - tic)
            for cache in caches:
                if k:
                    trim_newest(cache, k + 1)  # back to the same history every pass
                else:
                    cache.trim(1)
        rows.append({"k": k, "positions": k + 1, "ms": 1000 * statistics.median(times),
                     "ms_range": [1000 * min(times), 1000 * max(times)]})
    base = rows[0]["ms"]
    for row in rows:
        row["ratio"] = row["ms"] / base
    device = str(mx.default_device())
    print(f"{args.model}: {layers} layers, context {args.context}, device {device}, median of {args.reps}")
    print(f"{'K':>3}{'positions':>11}{'ms/pass':>10}{'ratio':>8}{'range ms':>16}")
    for r in rows:
        print(f"{r['k']:>3}{r['positions']:>11}{r['ms']:>10.2f}{r['ratio']:>8.2f}"
              f"{'%.2f-%.2f' % tuple(r['ms_range']):>16}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "context": args.context, "device": device, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
