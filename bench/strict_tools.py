"""Strict tool arguments under tool_choice "auto": what the lazy grammar costs a batch.

One server (run_trinity.py --serve … --http …, a ring of --ranks processes) of --model: by default a
checkpoint whose greedy reply is get_weather calls one after the other until max_tokens (a bigram
chain, tests/tool_checkpoint.py: the json_tools form, whose call markers are added tokens, so a strict
tool's lazy grammar is built; each call 8 tokens, its JSON cut as the grammar allows it, so the
grammar changes no token). Rounds alternate between
  loose   n concurrent chat completions with one tool (strict: false), tool_choice "auto"
  strict  the same n with the tool strict: true (its arguments held to the schema once the model
          opens a call: a grammar that allows free text until the tool-call token, then the call)
and aggregate tok/s = completion tokens / (last reply - first request sent), median of --reps rounds
each, and strict / loose (and the median of each strict round over the loose one before it, which
shares more of what a busy machine does meanwhile; and, where /proc tells it, tokens a second of the
ranks' CPU time, which other work on the machine leaves as it is). Like for like: the same prompts,
greedy, every reply max_tokens long and made of tool calls in both (the run says if not). (The
embedded model's markers are no added tokens: strict changes nothing there.)
"""

import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.harness import ROOT, Server, bench_env, concurrent, flags, out_path, save, shrink

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}


# One call, cut into added tokens where the grammar would have it cut: where it forces text
# ({"city": "), llguidance allows the tokens that text is tokenized into.
CALL = ['{"name": "get_weather", "arguments": ', '{"city": "', "Par", "is", '"}}']


def add_arguments(p) -> None:
    flags(p, smoke=False, out=None, ranks=[2], streams=[8], max_tokens=128, reps=3, timeout=600.0,
          model="tools")


def tool_checkpoint() -> Path:
    """A checkpoint whose greedy reply is "<tool_call>" CALL "</tool_call>\\n", again and again."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tool_checkpoint import TOOL_TEMPLATE, _chain_checkpoint

    links = ["\n", "<tool_call>", *CALL, "</tool_call>", "\n"]  # the prompt ends in "\n": a call, "\n", a call…
    return _chain_checkpoint(Path(tempfile.mkdtemp(prefix="strict-tools-")), links[1:-1], TOOL_TEMPLATE, links)


def chat(address: str, i: int, strict: bool, max_tokens: int) -> tuple:
    """One chat completion: (sent, done, completion tokens, tool calls)."""
    tool = {**TOOL, "function": {**TOOL["function"], "strict": strict}}
    body = {"messages": [{"role": "user", "content": f"Stream {i}: find the word list."}],
            "tools": [tool], "tool_choice": "auto", "temperature": 0, "max_tokens": max_tokens}
    request = urllib.request.Request(f"http://{address}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    sent = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as reply:
        answer = json.loads(reply.read())
    calls = answer["choices"][0]["message"].get("tool_calls") or []
    return sent, time.perf_counter(), answer["usage"]["completion_tokens"], len(calls)


def cpu_seconds(server: Server):
    """User and system CPU time the ranks (every thread) took so far; None without /proc (macOS)."""
    try:
        stats = [Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split() for p in server.procs]
    except OSError:
        return None
    return sum(int(s[11]) + int(s[12]) for s in stats) / os.sysconf("SC_CLK_TCK")  # utime, stime


def round_of(server: Server, n: int, strict: bool, max_tokens: int) -> tuple:
    """(aggregate tok/s, tokens, tool calls, the ranks' CPU seconds) of n chats released together."""
    address, cpu = server.http, cpu_seconds(server)
    runs = concurrent([lambda i=i: chat(address, i, strict, max_tokens) for i in range(n)])
    failed = [r["error"] for r in runs if isinstance(r, dict)]
    if failed:
        raise RuntimeError(failed[0])
    tokens = sum(r[2] for r in runs)
    cpu = cpu_seconds(server) - cpu if cpu is not None else None
    return tokens / (max(r[1] for r in runs) - min(r[0] for r in runs)), tokens, sum(r[3] for r in runs), cpu


def wait_http(server: Server, timeout: float = 60) -> None:
    """HTTP answers a moment after gRPC turns SERVING."""
    end = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{server.http}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            if time.monotonic() > end or server.dead():
                raise RuntimeError(server.why("HTTP never answered"))
        time.sleep(0.1)


def measure(server: Server, streams: int, args) -> dict:
    """Rounds alternating loose and strict after a warm-up of each (kernels, the grammar's tokenizer)."""
    for strict in (False, True):
        round_of(server, streams, strict, 8)
    rounds = {"loose": [], "strict": []}
    for _ in range(args.reps):
        for name in rounds:
            rounds[name].append(round_of(server, streams, name == "strict", args.max_tokens))
    loose, strict = (statistics.median(r[0] for r in rounds[k]) for k in ("loose", "strict"))
    # Each strict round over the loose one just before it: what a busy machine shares between the two.
    paired = statistics.median(s[0] / l[0] for l, s in zip(rounds["loose"], rounds["strict"]))
    print(f"P={server.ranks}, {streams} streams, {args.max_tokens} tokens at most, median of {args.reps}: "
          f"loose {loose:.1f} tok/s, strict {strict:.1f} tok/s, strict/loose {strict / loose:.3f} "
          f"(paired rounds: {paired:.3f})", flush=True)
    cpu = None
    if rounds["loose"][0][3] is not None:  # other work on a busy machine takes wall time, not the ranks' CPU time
        cpu = statistics.median(r[1] / r[3] for r in rounds["strict"]) / statistics.median(
            r[1] / r[3] for r in rounds["loose"])
        print(f"  tokens a second of the ranks' CPU time: strict/loose {cpu:.3f} (medians of rounds)", flush=True)
    if {r[1:3] for r in rounds["loose"]} != {r[1:3] for r in rounds["strict"]} or not rounds["loose"][0][2]:
        print("  not like for like: the rounds differ in tokens or tool calls (or made none)", rounds)
    return {"ranks": server.ranks, "streams": streams, "loose_tok_s": loose, "strict_tok_s": strict,
            "ratio": strict / loose, "paired_ratio": paired, "cpu_ratio": cpu, "rounds": rounds}


def main(args) -> None:
    shrink(args, streams=[2], max_tokens=16, reps=1)
    model = str(tool_checkpoint()) if args.model == "tools" else args.model
    rows = []
    for ranks in args.ranks:
        with Server(ranks, ["--model", model, "--max-batch", str(max(args.streams))], bench_env(),
                    timeout=args.timeout, http=True) as server:
            wait_http(server)
            rows += [measure(server, n, args) for n in args.streams]
    print(f"wrote {save(out_path(args, 'strict_tools'), {'rows': rows}, vars(args))}")
