"""Speculation under load: aggregate decode tok/s with speculation on against off, one server.

    python bench/bench_speculation_load.py [--ranks 2] [--streams 1,8,32] [--max-tokens 64] [--reps 3]
                                           [--spec-args "--draft-model D --prompt-lookup"] [--out PATH]

One server (run_trinity.py --serve, --ranks processes of the ring backend started here, the
embedded model, --max-batch the largest stream count) with speculation on (--spec-args;
default: the bundled draft model and prompt lookup). For each stream count n, rounds
alternate between
  off   n greedy gRPC Generate streams released together, each with speculative: false
  on    the same n streams, speculating where the server does (one-row groups)
aggregate tok/s = generated tokens / (last stream's end - first request sent), the median of
--reps rounds each, and on / off; the texts must be the same in both (greedy). The prompts
are held-out text (as bench_speculation's), one paragraph per stream.
"""

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path

from bench_constrained import no_fields, round_of
from bench_speculation import prompts
from common import PY, ROOT, RUN, bench_env, free_ports, kill_groups, start_ranks, wait_serving

DRAFT = ROOT / "distributed" / "shard" / "tiny_draft"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--spec-args", default=f"--draft-model {DRAFT} --prompt-lookup")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "speculation_load.json"))
    args = p.parse_args()
    counts = [int(s) for s in args.streams.split(",")]
    texts = prompts(every=True)

    from distributed.serving.proto import generation_pb2_grpc as pb_grpc

    port = free_ports(1)[0]
    cmd = [PY, RUN, "--serve", f"127.0.0.1:{port}", "--max-batch", str(max(counts)),
           "--max-tokens-cap", str(args.max_tokens), *shlex.split(args.spec_args)]
    logs = [open(os.devnull, "w") for _ in range(args.ranks)]
    procs, hostfile = start_ranks(cmd, args.ranks, bench_env(), rank0={"stdout": logs[0], "stderr": logs[0]},
                                  others=[{"stdout": f, "stderr": f} for f in logs[1:]])
    off = lambda i: {"speculative": False}  # noqa: E731
    prompt_of = lambda i: texts[i % len(texts)]  # noqa: E731
    rows = []
    try:
        channel, _ = wait_serving(f"127.0.0.1:{port}", procs)
        stub = pb_grpc.GenerationStub(channel)
        for n in counts:  # warm-up at each batch size, both paths
            for fields_of in (off, no_fields):
                round_of(stub, n, 8, fields_of, args.timeout, prompt_of)
        for n in counts:
            results = {"off": [], "on": []}
            for _ in range(args.reps):
                for name, fields_of in (("off", off), ("on", no_fields)):
                    results[name].append(round_of(stub, n, args.max_tokens, fields_of, args.timeout, prompt_of))
            same = all(r["all_texts"] == results["off"][0]["all_texts"] for rs in results.values() for r in rs)
            tps = {k: statistics.median(r["tok_s"] for r in v) for k, v in results.items()}
            rows.append({"streams": n, "off_tok_s": tps["off"], "on_tok_s": tps["on"], "ratio": tps["on"] / tps["off"],
                         "same_texts": same, "rounds": {k: [r["tok_s"] for r in v] for k, v in results.items()}})
        channel.close()
    finally:
        kill_groups(procs)
        if hostfile:
            os.unlink(hostfile)
    print(f"embedded model, P={args.ranks}, {args.spec_args}, {args.max_tokens} greedy tokens per stream, "
          f"median of {args.reps}")
    print(f"{'streams':>7} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>8}  same texts")
    for r in rows:
        print(f"{r['streams']:>7} {r['off_tok_s']:>10.1f} {r['on_tok_s']:>10.1f} {r['ratio']:>8.3f}  "
              f"{'yes' if r['same_texts'] else 'NO'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
