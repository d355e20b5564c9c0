"""Strict tool arguments under tool_choice "auto": what the lazy grammar costs a batch.

    python bench/bench_strict_tools.py [--ranks 2] [--streams 8] [--max-tokens 64] [--reps 3] [--model PATH|tools]

One server (run_trinity.py --serve … --http …, a ring of --ranks processes started here as
mlx.launch would) of --model: by default the tests' tool checkpoint (tests/tool_checkpoint.py: its
weights answer with a get_weather call, in the json_tools form whose call markers are added tokens,
so a strict tool's lazy grammar is built; the embedded model's markers are not, and strict changes
nothing there). Rounds alternate between
  loose   n concurrent chat completions with one tool (strict: false), tool_choice "auto"
  strict  the same n with the tool strict: true (its arguments held to the schema once the model
          opens a call: a grammar that allows free text until the tool-call token)
and aggregate tok/s = completion tokens / (last reply - first request sent), median of --reps
rounds each, and strict / loose. Both send the same prompt (the tool in the template), greedy.
"""

import argparse
import json
import os
import statistics
import threading
import time
import urllib.request
from pathlib import Path

from common import PY, ROOT, RUN, bench_env, free_ports, kill_groups, start_ranks

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}


def tool_checkpoint() -> Path:
    import sys
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    from tool_checkpoint import make_tool_checkpoint

    return make_tool_checkpoint(Path(tempfile.mkdtemp(prefix="strict-tools-")))


def chat(port: int, i: int, strict: bool, max_tokens: int) -> int:
    tool = {**TOOL, "function": {**TOOL["function"], "strict": strict}}
    body = {"messages": [{"role": "user", "content": f"Stream {i}: find the word list."}],
            "tools": [tool], "tool_choice": "auto", "temperature": 0, "max_tokens": max_tokens}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())["usage"]["completion_tokens"]


def round_of(port: int, n: int, strict: bool, max_tokens: int) -> tuple:
    barrier, tokens, times = threading.Barrier(n), [0] * n, [None] * n

    def one(i):
        barrier.wait()
        sent = time.perf_counter()
        tokens[i] = chat(port, i, strict, max_tokens)
        times[i] = (sent, time.perf_counter())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (max(t[1] for t in times) - min(t[0] for t in times)), sum(tokens)


def wait_http(port: int, procs, timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert all(p.poll() is None for p in procs), "a rank exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server never served")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--model", default="tools", help="a checkpoint, or tools: the tests' tool checkpoint")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "strict_tools.json"))
    args = p.parse_args()
    model = str(tool_checkpoint()) if args.model == "tools" else args.model
    grpc_port, port = free_ports(2)
    cmd = [PY, RUN, "--model", model, "--serve", f"127.0.0.1:{grpc_port}", "--http", f"127.0.0.1:{port}", "--max-batch",
           str(args.streams)]
    logs = [open(os.devnull, "w") for _ in range(args.ranks)]
    procs, hostfile = start_ranks(cmd, args.ranks, bench_env(), rank0={"stdout": logs[0], "stderr": logs[0]},
                                  others=[{"stdout": f, "stderr": f} for f in logs[1:]])
    rounds = {"loose": [], "strict": []}
    try:
        wait_http(port, procs)
        for strict in (False, True):  # warm-up: kernels compiled, the grammar's tokenizer built
            round_of(port, args.streams, strict, 8)
        for _ in range(args.reps):
            for name in ("loose", "strict"):
                rounds[name].append(round_of(port, args.streams, name == "strict", args.max_tokens))
    finally:
        kill_groups(procs)
        if hostfile:
            os.unlink(hostfile)
    loose, strict = (statistics.median(r[0] for r in rounds[k]) for k in ("loose", "strict"))
    print(f"P={args.ranks}, {args.streams} streams, {args.max_tokens} tokens at most, median of {args.reps}: "
          f"loose {loose:.1f} tok/s, strict {strict:.1f} tok/s, strict/loose {strict / loose:.3f}")
    print("rounds (tok/s, tokens):", rounds)
    if {r[1] for r in rounds["loose"]} != {r[1] for r in rounds["strict"]}:
        print("not like for like: the strict rounds generated other tokens (the grammar changed the replies)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "loose_tok_s": loose, "strict_tok_s": strict,
                                          "ratio": strict / loose, "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
