"""A multi-turn chat's time to first token with the prefix cache and without it.

    python bench/bench_chat.py [--quick | --model PATH] [--ranks 1,2] [--turns N] [--first-tokens N]
                               [--message-tokens N] [--max-tokens N] [--reps N] [--json-out PATH]

Real `run_trinity.py --serve` servers on this machine (the fp32 checkpoint of
bench/common.py; --quick: the small one; --model: any checkpoint, e.g. the GPU's Trinity-Mini
shape from bench_gpu.py --phases make), P ranks each (started as mlx.launch would, without
its relay loop): one with the prefix cache (its default size), one with --prefix-cache-bytes 0,
both up at once. A chat over gRPC with the chat template: the first user message is a long
document (--first-tokens), each later one about --message-tokens, and every request carries
the whole history (as OpenAI clients do), which grows to about --first-tokens + turns *
(message + reply). Each turn goes to the server with the cache, then to the one without, back
to back (an idle server sleeps), so both see the same load on a shared machine. TTFT of a turn
= from the call to its first streamed token, at the client; medians over --reps chats, each
with a first message of its own. Each server first answers a short unrelated request, so turn
1 pays no warm-up. Reported per turn: prompt tokens, tokens restored from the cache, TTFT with
and without it, TTFT(turn k, cached) / TTFT(turn 1) and cached / uncached; the greedy replies
must be the same with and without the cache. Hits and bytes: the summary line rank 0 of the
server with the cache prints as it stops.
"""

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from common import FULL, PY, QUICK, RUN, bench_env, checkpoint, free_ports, kill_groups, start_ranks, wait_serving  # noqa: E402
from distributed.serving.proto import generation_pb2 as pb  # noqa: E402
from distributed.serving.proto import generation_pb2_grpc as pb_grpc  # noqa: E402

WORDS = ("ring rank layer cache token prefix window expert router batch stage frame hidden state "
         "model chunk decode prefill reply turn").split()


def text(tokens: int, seed: int) -> str:
    """About `tokens` tokens of plain ASCII words (the byte tokenizer: one token a byte)."""
    # Words drawn from a generator seeded by `seed`: another seed shares no prefix longer than
    # a word or two (a rotation of one list would repeat whenever the seeds differ by its length).
    rng, words, n = random.Random(seed), [], 0
    while n < tokens:
        word = rng.choice(WORDS)
        words.append(word)
        n += len(word) + 1
    return " ".join(words)[:tokens]


def chat_turn(stub, messages, max_tokens: int) -> dict:
    request = pb.GenerateRequest(messages=[pb.ChatMessage(**m) for m in messages], max_tokens=max_tokens,
                                 temperature=0.0)
    out = {"token_ids": [], "text": "", "first": None}
    sent = time.perf_counter()
    for response in stub.Generate(request, timeout=1800):
        if response.token_ids and out["first"] is None:
            out["first"] = time.perf_counter()
        out["token_ids"] += list(response.token_ids)
        out["text"] += response.text
        if response.finish_reason:
            out["prompt_tokens"], out["cached_tokens"] = response.usage.prompt_tokens, response.usage.cached_tokens
    out["ttft_s"] = (out["first"] or time.perf_counter()) - sent  # no token at all: the end
    return out


class Server:
    """run_trinity.py --serve as `ranks` processes; rank 0's output goes to a log file."""

    def __init__(self, model, ranks: int, cache: bool):
        port, = free_ports(1)
        cmd = [PY, RUN, "--model", str(model), "--serve", f"127.0.0.1:{port}", "--max-tokens-cap", "100000",
               *([] if cache else ["--prefix-cache-bytes", "0"])]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-chat-", suffix=".log", delete=False)
        self.devnull = open(os.devnull, "w")
        self.procs, self.hostfile = start_ranks(cmd, ranks, bench_env(), rank0={"stdout": self.log, "stderr": self.log},
                                                others={"stdout": self.devnull, "stderr": self.log})
        self.channel = None
        try:
            self.channel, _ = wait_serving(f"127.0.0.1:{port}", self.procs)
        except BaseException:
            self.stop()
            raise
        self.stub = pb_grpc.GenerationStub(self.channel)
        chat_turn(self.stub, [{"role": "user", "content": "warm up"}], 4)

    def stop(self) -> str:
        """Stop every rank; returns rank 0's prefix-cache summary line (None if none)."""
        if self.channel is not None:
            self.channel.close()
        kill_groups(self.procs, grace=15)
        if self.hostfile:
            os.unlink(self.hostfile)
        self.devnull.close()
        lines = re.findall(r"prefix cache: \d+ entries.*", Path(self.log.name).read_text())
        os.unlink(self.log.name)
        return lines[-1] if lines else None


def run_chats(model, ranks: int, args) -> dict:
    """--reps chats, each turn sent to the server with the cache and then to the one
    without (back to back, so both see the same load on a shared machine)."""
    servers = {}
    try:
        for cache in (True, False):
            servers[cache] = Server(model, ranks, cache)
        chats = []
        for rep in range(args.reps):
            messages = [{"role": "user", "content": text(args.first_tokens, 100 * rep) + " Summarise."}]
            turns = []
            for turn in range(args.turns):
                on, off = (chat_turn(servers[cache].stub, messages, args.max_tokens) for cache in (True, False))
                turns.append({"on": on, "off": off, "same_tokens": on["token_ids"] == off["token_ids"]})
                print(f"  P={ranks} chat {rep + 1} turn {turn + 1}: {on['prompt_tokens']} prompt tokens, "
                      f"{on['cached_tokens']} cached; TTFT {on['ttft_s'] * 1e3:.0f} ms with the cache, "
                      f"{off['ttft_s'] * 1e3:.0f} ms without", flush=True)
                messages += [{"role": "assistant", "content": on["text"]},
                             {"role": "user", "content": text(args.message_tokens, 100 * rep + turn + 1)}]
            chats.append(turns)
    finally:
        summary = {cache: server.stop() for cache, server in servers.items()}
    return {"chats": chats, "summary": summary.get(True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the small checkpoint")
    p.add_argument("--model", type=Path, help="a checkpoint folder instead of bench/common.py's")
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--first-tokens", type=int, default=1200, help="tokens of the first user message")
    p.add_argument("--message-tokens", type=int, default=40, help="tokens of each later user message")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens of each reply")
    p.add_argument("--reps", type=int, default=2, help="chats (each with its own first message); medians")
    p.add_argument("--json-out")
    args = p.parse_args()
    model = args.model or checkpoint(QUICK if args.quick else FULL)
    print(f"{model.name}, {args.turns} turns: first message {args.first_tokens} tokens, then "
          f"{args.message_tokens}; replies {args.max_tokens} tokens, greedy", flush=True)
    results = {ranks: run_chats(model, ranks, args) for ranks in [int(r) for r in args.ranks.split(",")]}
    for ranks, r in results.items():
        chats = r["chats"]
        same = all(t["same_tokens"] for chat in chats for t in chat)

        def ttft(turn, cache):  # median over the chats
            return statistics.median(chat[turn][cache]["ttft_s"] for chat in chats)

        first = ttft(0, "on")
        print(f"\nP={ranks}, median of {len(chats)} chat(s); same greedy replies with and without the cache: "
              f"{'yes' if same else 'NO'}")
        print(f"{'turn':>4}{'prompt':>8}{'cached':>8}{'TTFT on ms':>12}{'TTFT off ms':>13}{'on/turn1':>10}{'on/off':>8}")
        for k in range(args.turns):
            on = chats[0][k]["on"]
            print(f"{k + 1:>4}{on['prompt_tokens']:>8}{on['cached_tokens']:>8}{ttft(k, 'on') * 1e3:>12.1f}"
                  f"{ttft(k, 'off') * 1e3:>13.1f}{ttft(k, 'on') / first:>10.3f}{ttft(k, 'on') / ttft(k, 'off'):>8.3f}")
        last = args.turns - 1
        print(f"last turn: cached / turn 1 x{ttft(last, 'on') / first:.3f}, cached / uncached "
              f"x{ttft(last, 'on') / ttft(last, 'off'):.3f} (target: a next turn <= 0.25 x the first)")
        print(r["summary"])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"model": model.name, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "results": results},
                                                  indent=2))


if __name__ == "__main__":
    main()
