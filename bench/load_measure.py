"""What bench_load.py measures on every configuration (mlx-lm in its child process, or a runner
served over gRPC), in one order, through a client with three calls:

    batch(prompts, max_tokens[, gap])
                                all prompts at once (max_tokens: one for all, or one per prompt;
                                a runner also takes `gap`: prompt i arrives gap * i s after the first):
                                {"aggregate_tps", "wall_s", "tokens",
                                "ttfts_s" (one per prompt, request -> first token), "token_ids",
                                a runner's "itl_s" (inter-token latency p50 / p99 / max)}
    alone(prompt, max_tokens)   the prompt by itself: its greedy token ids
    first_token(prompt)         seconds from the request to the first token (max_tokens 1)

A call that fails raises RuntimeError naming the cause; measure() keeps what it has and records
the error. The prompts are made here from the spec alone, so every configuration (and the
mlx-lm child) gets the same ones.
"""

import math
import statistics
import sys

from common import percentile, stream_prompts

WARMUP_TOKENS = 4


def prompts_for(length: int, streams: int) -> list:
    """The prompts of one run: distinct per stream and per run (a prefix cache finds nothing
    from an earlier run, as mlx-lm's batch_generate, which keeps none, would not)."""
    return stream_prompts(streams, length, tag=f"load-{length}-{streams}")


def budgets(streams: int, max_tokens: int, mixed: bool):
    """max_tokens of each stream: all the same, or (mixed) spread evenly over [max_tokens / 2,
    3 max_tokens / 2] in a fixed shuffled order, about the same total, so rows finish at different
    steps, as in real traffic (each finish changes a batch: mlx-lm's and the runner's filters)."""
    if not mixed or streams == 1:
        return max_tokens
    spread = [max(1, round(max_tokens * (0.5 + i / (streams - 1)))) for i in range(streams)]
    return [spread[(i * 7919) % streams] if math.gcd(7919, streams) == 1 else spread[i] for i in range(streams)]


def long_prompt(length: int) -> list:
    return stream_prompts(1, length, tag=f"long-{length}")[0]


def describe(run: dict) -> str:
    ttfts, itl = run["ttfts_s"], run.get("itl_s") or {}
    gaps = f", ITL p50 {itl['p50'] * 1e3:.0f} ms p99 {itl['p99'] * 1e3:.0f} ms" if itl.get("p99") is not None else ""
    return (f"{run['aggregate_tps']:.1f} tok/s, TTFT p50 {percentile(ttfts, 50) * 1e3:.0f} ms "
            f"p99 {percentile(ttfts, 99) * 1e3:.0f} ms{gaps} ({run['tokens']} tokens in {run['wall_s']:.2f} s)")


def measure(spec: dict, client, name: str) -> dict:
    """Per prompt length and stream count, a warm-up batch of the same shape (other prompts,
    WARMUP_TOKENS each), one batch run and its first spec["check"] prompts alone; then each
    long prompt's TTFT spec["reps"] times. Progress goes to stderr.

    MLX on CUDA compiles its kernels per shape on first use, and the runner's staggered
    admission makes more shapes than one batched call (a lone first prompt, batches of several
    sizes, growing decode groups): without a warm-up of the same shape the measured run times
    compilation (on a fresh H200 machine the first 64 x 128-token run spent 63 s on its first
    one-row chunk)."""
    out = {"streams": {}, "long": {}}

    def say(text):
        print(f"  {name}: {text}", file=sys.stderr, flush=True)

    try:
        warm = stream_prompts(min(8, max(spec["streams"] or [1])), 16, tag="warmup")
        client.alone(warm[0], WARMUP_TOKENS)
        client.batch(warm, WARMUP_TOKENS)
        for length in spec["prompt_lens"]:
            runs = out["streams"][str(length)] = {}
            for n in spec["streams"]:
                client.batch(stream_prompts(n, length, tag=f"warmup-{length}-{n}"), WARMUP_TOKENS)
                prompts = prompts_for(length, n)
                limits = budgets(n, spec["max_tokens"], spec.get("mixed", False))
                gap = spec.get("arrival_gap", 0.0)
                run = client.batch(prompts, limits, gap) if gap else client.batch(prompts, limits)
                each = limits if isinstance(limits, list) else [limits] * n
                run["alone"] = [client.alone(p, m) for p, m in zip(prompts[: spec["check"]], each)]
                runs[str(n)] = run
                say(f"{length}-token prompts, {n} streams: {describe(run)}")
        if spec["long"]:
            client.first_token(long_prompt(min(spec["long"])))  # warm-up: kernels for long sequences
        for length in spec["long"]:
            ttfts = [client.first_token(long_prompt(length)) for _ in range(spec["reps"])]
            out["long"][str(length)] = {"ttft_s": ttfts, "median_ttft_s": statistics.median(ttfts)}
            say(f"{length}-token prompt alone: TTFT {statistics.median(ttfts) * 1e3:.0f} ms (median of {len(ttfts)})")
    except RuntimeError as e:
        out["error"] = str(e)
        say(f"FAILED: {e}")
    return out
