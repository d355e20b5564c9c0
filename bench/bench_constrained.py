"""Aggregate decode with half the streams schema-constrained against none constrained.

    python bench/bench_constrained.py [--ranks 2] [--streams 8,32] [--max-tokens 64] [--reps 3]
                                      [--model PATH] [--out PATH]

One server (run_trinity.py --serve, --ranks processes of the ring backend started here as
mlx.launch would, --max-batch the largest stream count), the embedded default model unless
--model. For each stream count n, rounds alternate between
  none    n greedy gRPC Generate streams, released together, no constraint
  half    the same n streams, every second one with a JSON schema (json_schema)
and aggregate tok/s = generated tokens / (last stream's end - first request sent); the median
of --reps rounds each, and half / none. The schema (an array of at least 60 short strings)
cannot close within --max-tokens, so every stream generates exactly --max-tokens tokens in
both rounds (checked), and each constrained output starts as the schema requires.
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from common import PY, ROOT, RUN, bench_env, free_ports, kill_groups, start_ranks, wait_serving

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 60,
                                                      "items": {"type": "string", "maxLength": 12}}},
          "required": ["items"], "additionalProperties": False}


def no_fields(i: int) -> dict:
    return {}


def half_constrained(i: int) -> dict:
    """Every second stream's extra GenerateRequest fields: the schema."""
    return {"json_schema": json.dumps(SCHEMA)} if i % 2 else {}


def round_of(stub, n: int, max_tokens: int, fields_of, timeout: float, prompt_of=None) -> dict:
    """n greedy Generate streams released together, stream i with the fields fields_of(i)
    and the prompt prompt_of(i): aggregate tok/s, each stream's tokens, the schema's texts."""
    from distributed.serving.proto import generation_pb2 as pb

    barrier, runs = threading.Barrier(n), [None] * n
    prompt_of = prompt_of or (lambda i: f"Stream {i}: list some words.")

    def one(i):
        extra = fields_of(i)
        request = pb.GenerateRequest(prompt=prompt_of(i), chat_template=True, max_tokens=max_tokens, **extra)
        barrier.wait()
        sent, text, tokens = time.perf_counter(), "", 0
        try:
            for response in stub.Generate(request, timeout=timeout):
                tokens += len(response.token_ids)
                text += response.text
            runs[i] = {"sent": sent, "done": time.perf_counter(), "tokens": tokens, "text": text,
                       "schema": "json_schema" in extra}
        except Exception as e:  # reported with the result
            runs[i] = {"error": f"{type(e).__name__}: {e}"}

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} streams failed: {errors[0]}")
    wall = max(r["done"] for r in runs) - min(r["sent"] for r in runs)
    return {"tok_s": sum(r["tokens"] for r in runs) / wall, "tokens": [r["tokens"] for r in runs],
            "texts": [r["text"] for r in runs if r["schema"]], "all_texts": [r["text"] for r in runs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--streams", default="8,32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--model", default=str(ROOT / "distributed" / "shard" / "tiny_model"))
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "constrained.json"))
    args = p.parse_args()
    counts = [int(s) for s in args.streams.split(",")]

    from distributed.serving.proto import generation_pb2_grpc as pb_grpc

    port = free_ports(1)[0]
    cmd = [PY, RUN, "--model", args.model, "--serve", f"127.0.0.1:{port}", "--max-batch", str(max(counts)),
           "--max-tokens-cap", str(args.max_tokens)]
    logs = [open(os.devnull, "w") for _ in range(args.ranks)]
    procs, hostfile = start_ranks(cmd, args.ranks, bench_env(), rank0={"stdout": logs[0], "stderr": logs[0]},
                                  others=[{"stdout": f, "stderr": f} for f in logs[1:]])
    rows = []
    try:
        channel, _ = wait_serving(f"127.0.0.1:{port}", procs)
        stub = pb_grpc.GenerationStub(channel)
        for n in counts:  # warm-up at each batch size, both paths: kernels compiled, the grammar tokenizer built
            round_of(stub, n, 8, no_fields, args.timeout)
            round_of(stub, n, 8, half_constrained, args.timeout)
        for n in counts:
            results = {"none": [], "half": []}
            for _ in range(args.reps):
                for name in ("none", "half"):
                    fields_of = half_constrained if name == "half" else no_fields
                    results[name].append(round_of(stub, n, args.max_tokens, fields_of, args.timeout))
            for r in results["half"]:
                assert all(t.startswith('{"items":["') for t in r["texts"]), r["texts"][:1]
                assert all(k == args.max_tokens for k in r["tokens"]), r["tokens"]
            none = statistics.median(r["tok_s"] for r in results["none"])
            half = statistics.median(r["tok_s"] for r in results["half"])
            rows.append({"streams": n, "none_tok_s": none, "half_tok_s": half, "ratio": half / none,
                         "rounds": {k: [r["tok_s"] for r in v] for k, v in results.items()}})
        channel.close()
    finally:
        kill_groups(procs)
        if hostfile:
            os.unlink(hostfile)
    print(f"{Path(args.model).name}, P={args.ranks}, {args.max_tokens} greedy tokens per stream, median of {args.reps}")
    print(f"{'streams':>7} {'none tok/s':>11} {'half tok/s':>11} {'half/none':>10}")
    for r in rows:
        print(f"{r['streams']:>7} {r['none_tok_s']:>11.1f} {r['half_tok_s']:>11.1f} {r['ratio']:>10.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
