"""Admission under load (issue 57): --streams short prompts sent at once against one alone, over gRPC.

A server (the embedded model unless --model; P from --ranks, started here) first takes an untimed
request and an untimed round at once (a batch shape's first use pays MLX's kernel compilation). Then,
per round: one prompt alone (TTFT: request sent to first token), and --streams prompts released
together (every stream's TTFT). Every timed prompt is new to the server, so its prefix cache restores
nothing. ratio = median TTFT at once / median TTFT alone (target: at most 6). Each round's stream 0 is
checked against the same prompt alone, its greedy tokens compared. Settings: `off` (no flag) and each
--setting (runner flags), servers one after another.
"""

import logging
import statistics

from distributed.runtime.loop_clock import per_step

from bench.harness import (Server, bench_env, concurrent_streams, flags, grpc_generate, out_path, percentile, save,
                           shrink, stream_prompts)

log = logging.getLogger("bench")


def add_arguments(p) -> None:
    flags(p, smoke=False, out=None, model=None, ranks=[1, 2], blas="openblas", timeout=600.0)
    p.add_argument("--streams", type=int, default=32, help="prompts sent at once (default 32)")
    p.add_argument("--prompt-len", type=int, default=8, help="tokens of each prompt (default 8)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each stream generates (default 16)")
    p.add_argument("--rounds", type=int, default=8, help="rounds, each one alone and one at once (default 8)")
    p.add_argument("--setting", action="append", default=[], metavar="FLAGS",
                   help="runner flags measured after none (repeatable)")


def measure(server: Server, args, name: str) -> dict:
    stub, out = server.stub(), {"alone_ttft_s": [], "at_once_ttft_s": [], "tps": [], "same_as_alone": [], "loop": []}
    grpc_generate(stub, stream_prompts(1, args.prompt_len, f"{name}-warm")[0], args.max_tokens, args.timeout)
    concurrent_streams(stub, stream_prompts(args.streams, args.prompt_len, f"{name}-warm"), args.max_tokens,
                       args.timeout)
    for rnd in range(args.rounds):
        alone = grpc_generate(stub, stream_prompts(1, args.prompt_len, f"{name}-alone-{rnd}")[0], args.max_tokens,
                              args.timeout)
        out["alone_ttft_s"].append(alone["first"] - alone["sent"])
        prompts = stream_prompts(args.streams, args.prompt_len, f"{name}-round-{rnd}")
        before = server.status()["loop"]
        run = concurrent_streams(stub, prompts, args.max_tokens, args.timeout)
        out["loop"].append(per_step(before, server.status()["loop"]))
        if "error" in run:
            raise RuntimeError(run["error"])
        out["at_once_ttft_s"] += run["ttfts_s"]
        out["tps"].append(run["aggregate_tps"])
        again = grpc_generate(stub, prompts[0], args.max_tokens, args.timeout)["token_ids"]
        out["same_as_alone"].append(again == run["token_ids"][0])
        log.info(f"  {name} round {rnd + 1}: alone {out['alone_ttft_s'][-1] * 1e3:.1f} ms, at once median "
                 f"{statistics.median(run['ttfts_s']) * 1e3:.1f} ms, {run['aggregate_tps']:.0f} tok/s")
    alone, at_once = statistics.median(out["alone_ttft_s"]), statistics.median(out["at_once_ttft_s"])
    out.update(alone_median_s=alone, at_once_median_s=at_once, at_once_p99_s=percentile(out["at_once_ttft_s"], 99),
               ratio=at_once / alone)
    return out


def main(args) -> None:
    shrink(args, streams=4, rounds=1, ranks=[1])
    env = bench_env(args.blas)
    if args.blas == "openblas":
        env["OPENBLAS_NUM_THREADS"] = "1"
    runner = (["--model", args.model] if args.model else []) + ["--max-batch", str(max(args.streams, 1))]
    results = {}
    for ranks in args.ranks:
        for setting in [""] + args.setting:
            name = f"P={ranks} {setting or 'off'}"
            with Server(ranks, runner + setting.split(), env, timeout=args.timeout, http=True) as server:
                results[name] = measure(server, args, name.replace(" ", "_"))
            save(out_path(args, "admission"), {"runs": results}, vars(args))
    print(f"\n{args.streams} prompts of {args.prompt_len} tokens at once against one alone ({args.rounds} rounds):")
    for name, r in results.items():
        print(f"  {name:36} alone {r['alone_median_s'] * 1e3:6.1f} ms, at once median {r['at_once_median_s'] * 1e3:6.1f}"
              f" ms (p99 {r['at_once_p99_s'] * 1e3:.0f}): {r['ratio']:.1f}x; {statistics.median(r['tps']):.0f} tok/s;"
              f" stream 0 as alone {sum(r['same_as_alone'])}/{len(r['same_as_alone'])}")
        ms = {k: statistics.median(run["ms_per_step"][k] for run in r["loop"]) for k in r["loop"][0]["ms_per_step"]}
        print("    rank 0's loop, ms a step (medians of the rounds): " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()))
    print(f"wrote {out_path(args, 'admission')}")
