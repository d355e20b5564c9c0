"""Batched prefill and decode in one process, no front end: mlx-lm's BatchGenerator vs the
runner's Scheduler on one device (P=1), which is what bench_load.py measures less the gRPC layer.

    python bench/bench_steps.py --model PATH [--streams 8,32,64] [--prompt-len 128] [--max-tokens 64]
                                [--prefill-step-sizes 512,2048] [--stagger S] [--prefill-batch-tokens N]
                                [--consumers threads,inline] [--profile] [--timeline] [--out PATH]

For each stream count B: B distinct prompts submitted at once, greedy, --max-tokens each; the
runner admits them as one batch (unless --prefill-batch-tokens is given), once per
--prefill-step-sizes value (prompt tokens per prefill frame). --stagger S submits the first prompt
alone and the rest S seconds later, as a burst arrives over gRPC (the first is admitted by itself),
so that a gRPC run (bench_load.py) can be compared with the same arrivals in-process.
  prefill_s   submission to the last stream's first token
  decode_tps  steady-state tokens/s while all B streams decode: tokens generated between the
              moment every stream has its first token and the moment the first one finishes,
              over that time
  wall_tps    all generated tokens / wall time
mlx-lm is timed the same way from its BatchGenerator's responses (completion and prefill batch
size = B). One JSON object per row is printed and saved to --out.
"""

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

from common import load_mlx_lm, stream_prompts  # noqa: E402
from step_profile import StepProfile  # noqa: E402


def summarize(first: list, done: list, stamps: list, start: float) -> dict:
    """first/done: per stream, time of its first token / its end; stamps: every token's time."""
    first = [f for f in first if f is not None]  # a stream may end at once (EOS first)
    t1, t2 = max(first), min(done)
    steady = sum(1 for t in stamps if t1 < t <= t2)
    wall = max(done) - start
    return {"prefill_s": t1 - start, "decode_tps": steady / (t2 - t1) if t2 > t1 else None,
            "wall_tps": len(stamps) / wall, "ttft_p50_s": statistics.median(f - start for f in first)}


def mlx_lm_row(model, eos, prompts, max_tokens):
    from mlx_lm.generate import BatchGenerator

    n = len(prompts)
    gen = BatchGenerator(model, stop_tokens=[[t] for t in eos], completion_batch_size=n, prefill_batch_size=n,
                         prefill_step_size=2048)
    start = time.perf_counter()
    uids = gen.insert(prompts, [max_tokens] * n)
    first, done, stamps = {}, {}, []
    while responses := gen.next_generated():
        now = time.perf_counter()
        for r in responses:
            first.setdefault(r.uid, now)
            stamps.append(now)
            if r.finish_reason is not None:
                done[r.uid] = now
    gen.close()
    return summarize([first[u] for u in uids], [done[u] for u in uids], stamps, start)


def runner_row(pipeline, tokenizer, prompts, max_tokens, prefill_step_size, profile=False, consumers="threads",
               stagger=0.0, batch_tokens=None, timeline=False):
    """consumers: "threads", a thread per stream reading its events, as the gRPC and HTTP
    servers have; "inline", events recorded as they are emitted, on the scheduler's thread
    (what the runner costs without front-end threads contending for the GIL). stagger: the
    first prompt alone, the others that many seconds later (as a burst over gRPC arrives: the
    first is admitted by itself). batch_tokens: --prefill-batch-tokens (default: all in one batch)."""
    from distributed.runtime.request import GenerationRequest, TokenEvent
    from distributed.runtime.scheduler import Scheduler

    n = len(prompts)
    sched = Scheduler(pipeline, tokenizer, max_batch=n, max_queue=n, prefill_step_size=prefill_step_size,
                      prefill_batch_tokens=batch_tokens or n * (len(prompts[0]) + 1))
    profiler = StepProfile() if profile or timeline else None
    if profiler:
        profiler.__enter__()
    handles, threads = [None] * n, []
    first, done, stamps = [None] * n, [None] * n, [[] for _ in range(n)]

    def consume(i):
        for e in handles[i].events():
            now = time.perf_counter()
            if getattr(e, "error", None):
                raise RuntimeError(e.error)
            if isinstance(e, TokenEvent):
                first[i] = first[i] or now
                stamps[i].append(now)
        done[i] = time.perf_counter()

    left = [n]

    def record(i, e):
        now = time.perf_counter()
        if isinstance(e, TokenEvent):
            first[i] = first[i] or now
            stamps[i].append(now)
        elif hasattr(e, "finish_reason"):
            done[i] = now
            left[0] -= 1
            if not left[0]:
                sched.stop()

    def submit(indices):
        for i in indices:
            handles[i] = sched.submit(GenerationRequest(list(prompts[i]), max_tokens=max_tokens))
            if consumers == "inline":
                handles[i].emit = lambda e, i=i: record(i, e)  # its first event comes after a prefill
            else:
                threads.append(threading.Thread(target=consume, args=(i,)))
                threads[-1].start()

    def later():
        if stagger:
            time.sleep(stagger)
            submit(range(1, n))
        for t in list(threads):
            t.join()
        if threads:
            sched.stop()

    start = time.perf_counter()
    submit(range(1) if stagger else range(n))
    if stagger or threads:
        threading.Thread(target=later).start()
    # The scheduler on this thread (a thread that used MLX must not end before the process).
    sched.serve_forever()
    row = summarize(first, done, [t for s in stamps for t in s], start)
    if profiler:
        profiler.__exit__(None, None, None)
        row["per_frame_ms"] = profiler.per_frame_ms()
        if timeline:
            row["timeline"] = profiler.timeline()
    return row


def tight(model, stage, prompts, steps=32) -> dict:
    """Greedy decode steps in a bare loop, ms per step: mlx-lm's model vs the runner's stage
    (embedding, layers, head) on plain caches, each synchronous and pipelined (the next step
    built before the last is read, as mlx-lm's generate does)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from distributed.runtime.caches import SlotCaches

    x = mx.array(prompts, dtype=mx.uint32)
    forward = {"mlx-lm": (lambda t, c: model(t, cache=c), lambda: make_prompt_cache(model)),
               "stage": (lambda t, c: stage.head(stage(stage.embed(t), c)), lambda: SlotCaches(stage).get(0))}
    out = {}
    for name, (fn, caches) in forward.items():
        for mode in ("sync", "pipelined"):
            cache = caches()
            y = mx.argmax(fn(x, cache)[:, -1, :], axis=-1)
            mx.eval(y)
            tic = time.perf_counter()
            for _ in range(steps):
                nxt = mx.argmax(fn(y[:, None], cache)[:, -1, :], axis=-1)
                if mode == "pipelined":
                    mx.async_eval(nxt)
                    y.tolist()
                else:
                    mx.eval(nxt)
                    nxt.tolist()
                y = nxt
            out[f"{name} {mode}"] = round(1000 * (time.perf_counter() - tic) / steps, 2)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--streams", default="8,32,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prefill-step-sizes", default="512,2048")
    p.add_argument("--consumers", default="threads", help="threads and/or inline (see runner_row)")
    p.add_argument("--stagger", type=float, default=0.0,
                   help="runner: the first prompt alone, the rest this many seconds later (e.g. 0.03)")
    p.add_argument("--prefill-batch-tokens", type=int, default=None,
                   help="runner: --prefill-batch-tokens (default: every prompt in one prefill batch)")
    p.add_argument("--skip-mlx-lm", action="store_true")
    p.add_argument("--profile", action="store_true", help="time the runner's parts per frame (step_profile.py)")
    p.add_argument("--timeline", action="store_true",
                   help="runner: every frame sent (step_profile.py timeline()) in the row's JSON")
    p.add_argument("--tight", action="store_true", help="also: decode steps in a bare loop, model vs stages")
    p.add_argument("--out", type=Path, default=BENCH / "results" / "steps.json")
    args = p.parse_args()

    from mlx_lm.utils import load_tokenizer

    from distributed.runtime.pipeline import Pipeline
    from distributed.shard.loader import load_stage

    model, tok = load_mlx_lm(args.model)
    config = json.loads((Path(args.model) / "config.json").read_text())
    stage = load_stage(Path(args.model), 0, config["num_hidden_layers"], True)
    pipeline, tokenizer = Pipeline(stage), load_tokenizer(Path(args.model))
    eos = set(tok.eos_token_ids)
    rows = []
    warm = stream_prompts(4, args.prompt_len, "warm")
    mlx_lm_row(model, eos, warm, 4)
    steps = [int(x) for x in args.prefill_step_sizes.split(",")]
    runner_row(pipeline, tokenizer, warm, 4, steps[0])
    for n in [int(x) for x in args.streams.split(",")]:
        prompts = stream_prompts(n, args.prompt_len, "steps")
        # Each batch shape once untimed (the first call of a shape compiles kernels on GPU), the
        # runner's with the same arrivals and batch budget (a staggered burst makes other shapes).
        mlx_lm_row(model, eos, prompts, 8)
        if args.tight:
            tight(model, stage, prompts)
            print(json.dumps({"streams": n, "tight_ms_per_step": tight(model, stage, prompts)}), flush=True)
        for step in steps:
            runner_row(pipeline, tokenizer, prompts, 8, step, stagger=args.stagger, batch_tokens=args.prefill_batch_tokens)
        runs = [] if args.skip_mlx_lm else [("mlx-lm", lambda: mlx_lm_row(model, eos, prompts, args.max_tokens))]
        runs += [(f"runner prefill step {k} {c}",
                  lambda k=k, c=c: runner_row(pipeline, tokenizer, prompts, args.max_tokens, k, args.profile, c,
                                             args.stagger, args.prefill_batch_tokens, args.timeline))
                 for k in steps for c in args.consumers.split(",")]
        for name, fn in runs:
            row = dict(streams=n, what=name, **fn())
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
