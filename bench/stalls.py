"""A long prompt beside decoding streams, with the token budget per step on and off (issue 57).

A server (the embedded model unless --model; P=--ranks, started here; its ranks' prefix caches off,
so each round's prompt is prefilled) decodes --streams streams (short prompts, until stopped); once
they all stream, one --prompt-len-token prompt arrives (max_tokens 1). Per round: the streams'
largest gap between tokens while the prompt prefills, their median gap outside it, and the prompt's
TTFT; with --alone, the same prompt's TTFT with nothing decoding. Settings: `off` (no flag) and each
--setting (runner flags, default `--itl-target-ms 50`), rounds interleaved (--reps). Greedy first
tokens of the prompt are compared across settings.
"""

import logging
import statistics
import time

from bench.harness import bench_env, flags, out_path, percentile, save, shrink
from bench.prefix_cache import CacheServer, _load, generate, prompt_of, start_streams

log = logging.getLogger("bench")
STREAM_PROMPT = 64


def add_arguments(p) -> None:
    flags(p, smoke=False, out=None, model=None, ranks=[1], blas="openblas", timeout=600.0)
    p.add_argument("--streams", type=int, default=8, help="decoding streams (default 8)")
    p.add_argument("--prompt-len", type=int, default=4000, help="the arriving prompt's tokens (default 4000)")
    p.add_argument("--setting", action="append", default=None, metavar="FLAGS",
                   help="runner flags measured against none (repeatable; default: --itl-target-ms 50)")
    p.add_argument("--reps", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--alone", action="store_true", help="also the prompt's TTFT with nothing decoding")


def one_round(args, runner_args: list, env: dict, flags_: list, rep: int) -> dict:
    out = {"flags": " ".join(flags_)}
    with CacheServer(args.ranks[0], runner_args + flags_ + ["--prefix-cache-bytes", "0"], env,
                     ["none"] * args.ranks[0], args.timeout) as server:
        generate(server, [3] + prompt_of(511, f"warm-{rep}"), 1, args.timeout)
        prompt = prompt_of(args.prompt_len, f"long-{rep}")
        if args.alone:
            out["alone_ttft_s"] = generate(server, prompt_of(args.prompt_len, f"alone-{rep}"), 1, args.timeout)["ttft_s"]
        stop, streams, threads = start_streams(server, [[3] + prompt_of(STREAM_PROMPT - 1, f"s{k}-{rep}")
                                                        for k in range(args.streams)], tokens=3)
        try:
            sent = time.perf_counter()
            r = generate(server, prompt, 1, args.timeout)
            end = sent + r["ttft_s"]
            time.sleep(0.5)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        out["status_budget"] = server.status()["requests"].get("step_budget")
    gaps = [(a, b) for s in streams for a, b in zip(s["times"], s["times"][1:])]
    during = [b - a for a, b in gaps if a < end and b > sent]
    outside = [b - a for a, b in gaps if not (a < end and b > sent)]
    out.update(ttft_s=r["ttft_s"], token=r["tokens"][:1], max_gap_ms=1e3 * max(during, default=0),
               p99_gap_during_ms=1e3 * (percentile(during, 99) or 0), median_gap_ms=1e3 * statistics.median(outside),
               gaps_during=len(during), loadavg=_load(), errors=[s["error"] for s in streams if "error" in s])
    log.info(f"  P={args.ranks[0]} {out['flags'] or 'off'} (round {rep + 1}): prompt TTFT {out['ttft_s']:.2f} s, "
             f"largest gap {out['max_gap_ms']:.0f} ms ({len(during)} gaps during it), median gap outside "
             f"{out['median_gap_ms']:.1f} ms, load {out['loadavg']}")
    return out


def main(args) -> None:
    shrink(args, prompt_len=600, streams=2, reps=1)
    settings = [[]] + [s.split() for s in (args.setting or ["--itl-target-ms 50"])]
    env = bench_env(args.blas)
    if args.blas == "openblas":
        env["OPENBLAS_NUM_THREADS"] = "1"
    runner_args = ["--model", args.model] if args.model else []
    rounds = []
    for rep in range(args.reps):
        for flags_ in (settings if rep % 2 == 0 else settings[::-1]):
            rounds.append(one_round(args, runner_args, env, flags_, rep))
    summary = {}
    for flags_ in settings:
        mine = [r for r in rounds if r["flags"] == " ".join(flags_)]
        summary[" ".join(flags_) or "off"] = {
            k: statistics.median(r[k] for r in mine) for k in ("ttft_s", "max_gap_ms", "p99_gap_during_ms",
                                                               "median_gap_ms", *(["alone_ttft_s"] if args.alone else []))}
    tokens = {r["flags"]: r["token"] for r in rounds}
    print(f"\nP={args.ranks[0]}, {args.streams} streams, a {args.prompt_len}-token prompt arriving (medians of {args.reps}):")
    for name, s in summary.items():
        alone = f", alone {s['alone_ttft_s']:.2f} s ({s['ttft_s'] / s['alone_ttft_s']:.2f}x)" if args.alone else ""
        print(f"  {name:24} prompt TTFT {s['ttft_s']:.2f} s{alone}; largest gap {s['max_gap_ms']:.0f} ms, p99 during "
              f"{s['p99_gap_during_ms']:.0f} ms; median gap outside {s['median_gap_ms']:.1f} ms")
    print(f"  first tokens: {tokens}")
    print(f"wrote {save(out_path(args, 'stalls'), {'rounds': rounds, 'summary': summary}, vars(args))}")
