"""Serving under load: mlx-lm batch_generate against this runner over gRPC, every configuration one
after another on the same weights, greedy.

  mlx-lm        a child process: batch_generate's BatchGenerator with every stream batched at once,
                timed per step; generate_step for prompts alone and the long prompts
  runner P=k    run_trinity.py --serve on k ranks (--backend: ring, started here; launch; nccl or
                mlx-launch-ring through mlx.launch), --max-batch the largest stream count, then every
                --runner-arg (later flags win)
  baseline P=k  with --baseline DIR: DIR/run_trinity.py (another checkout) right after runner P=k;
                or with --against "ARGS": this runner again with ARGS added (a flag on against off,
                e.g. --against "--prefix-cache-bytes 0" or "--memory-limit 512M"); runner rows get "x base".
                --against again: more configurations, "baseline2 P=k" and on (x base stays the first's)

For each prompt length and stream count: that many distinct byte-token prompts sent at once (after an
untimed warm-up batch of the same shape: MLX on CUDA compiles kernels per shape), --max-tokens each.
tok/s = generated tokens / (last stream's end - first request sent); TTFT p50 / p99 at the client;
ITL = gaps between a stream's tokens. Exactness: the first --check streams of each run again alone,
tokens compared (counted, never failed on: bf16 near-ties on a GPU may differ). --mixed: max_tokens
spread over [max/2, 3 max/2]; --arrival-gap S: stream i sent S x i s after the first (runners only);
--long: each long prompt's TTFT alone, median of --reps. --make-mini PATH builds Trinity-Mini's shape
with random 4-bit weights there (a GPU's model). --smoke: the small checkpoint, 1 and 4 streams of
8-token prompts, 16 tokens, P = 1, 2, a 64-token long prompt.
"""

import logging
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from distributed.runtime.loop_clock import per_step

from bench.harness import (FULL, PY, ROOT, SMALL, Server, bench_env, checkpoint, concurrent_streams, flags,
                           grpc_generate, int_list, load_mlx_lm, make_mini, out_path, percentile, run_ranks, save,
                           stream_prompts)

log = logging.getLogger("bench")

BASELINE = "mlx-lm"
WARMUP_TOKENS = 4
DEFAULTS = dict(streams=[1, 8, 32, 64, 128], prompt_lens=[8, 128], max_tokens=128, ranks=[1, 2], long=[], reps=3,
                check=4)
SMOKE = dict(streams=[1, 4], prompt_lens=[8], max_tokens=16, ranks=[1, 2], long=[64], reps=1, check=None)


def add_arguments(p) -> None:
    flags(p, smoke=False, model=None, out=None, streams=None, max_tokens=None, ranks=None, reps=None,
          blas="reference", timeout=1800.0)
    p.add_argument("--make-mini", metavar="PATH", help="Trinity-Mini's shape, random 4-bit weights, made at PATH")
    p.add_argument("--prompt-lens", type=int_list, help="prompt lengths of the streams (default 8,128)")
    p.add_argument("--mixed", action="store_true", help="max_tokens spread over [max/2, 3 max/2] across the streams")
    p.add_argument("--arrival-gap", type=float, default=0.0, metavar="S", help="stream i arrives S x i s after the "
                   "first (needs --no-mlx-lm)")
    p.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx-lm baseline")
    p.add_argument("--backend", choices=Server.BACKENDS, default="ring", help="how P > 1 ranks start")
    p.add_argument("--gpu-per-rank", action="store_true", help="ring: rank r gets CUDA_VISIBLE_DEVICES=r")
    p.add_argument("--check", type=lambda s: None if s == "all" else int(s), help="streams re-run alone (default 4)")
    p.add_argument("--long", type=int_list, help="long prompt lengths: TTFT alone")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt chunk, mlx-lm and runner")
    p.add_argument("--max-batch", type=int, help="run_trinity.py --max-batch (default: the largest stream count)")
    p.add_argument("--runner-arg", action="append", default=[], metavar="ARG", help="more run_trinity.py arguments, "
                   "e.g. --runner-arg=--prefix-cache-bytes=0 (repeatable)")
    p.add_argument("--baseline", type=Path, metavar="DIR", help="another checkout, measured after each P")
    p.add_argument("--against", metavar="ARGS", action="append", default=[], help="the runner again with these "
                   "arguments added, after each P (one flag alone: --against=--prompt-lookup); repeatable")
    p.add_argument("--mlx-lm-child", metavar="SPEC", help="(the mlx-lm measurement)")


def settle(args) -> None:
    for key, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.check = max(args.streams or [0]) if args.check is None else args.check
    if not args.streams and not args.long:
        sys.exit("nothing to measure: --streams none and no --long")
    if args.arrival_gap and not args.no_mlx_lm:
        sys.exit("--arrival-gap needs --no-mlx-lm: mlx-lm's batch_generate takes every prompt at once")
    if args.baseline and args.against:
        sys.exit("--baseline and --against: give one")
    if args.baseline and not (args.baseline / "run_trinity.py").exists():
        sys.exit(f"--baseline {args.baseline}: no run_trinity.py there")


def budgets(streams: int, max_tokens: int, mixed: bool):
    """max_tokens of each stream: all alike, or (mixed) spread evenly over [max/2, 3 max/2] in a fixed
    shuffled order, so rows finish at different steps, as in real traffic."""
    if not mixed or streams == 1:
        return max_tokens
    spread = [max(1, round(max_tokens * (0.5 + i / (streams - 1)))) for i in range(streams)]
    return [spread[(i * 7919) % streams] if math.gcd(7919, streams) == 1 else spread[i] for i in range(streams)]


def measure(spec: dict, client, name: str) -> dict:
    """Per prompt length and stream count a warm-up batch of the same shape, one batch and its first
    spec["check"] prompts alone; then each long prompt's TTFT spec["reps"] times. A client call that
    fails raises RuntimeError: what was measured is kept, with the error."""
    out = {"streams": {}, "long": {}}
    say = lambda text: log.info(f"  {name}: {text}")  # noqa: E731
    try:
        warm = stream_prompts(min(8, max(spec["streams"] or [1])), 16, tag="warmup")
        client.alone(warm[0], WARMUP_TOKENS)
        client.batch(warm, WARMUP_TOKENS)
        for length in spec["prompt_lens"] if spec["streams"] else []:
            runs = out["streams"][str(length)] = {}
            for n in spec["streams"]:
                client.batch(stream_prompts(n, length, tag=f"warmup-{length}-{n}"), WARMUP_TOKENS)
                prompts = stream_prompts(n, length, tag=f"load-{length}-{n}")
                limits = budgets(n, spec["max_tokens"], spec["mixed"])
                before = client.loop()
                run = client.batch(prompts, limits, spec["arrival_gap"]) if spec["arrival_gap"] else client.batch(prompts, limits)
                if before is not None:
                    run["loop"] = per_step(before, client.loop())
                each = limits if isinstance(limits, list) else [limits] * n
                run["alone"] = [client.alone(p, m) for p, m in zip(prompts[:spec["check"]], each)]
                runs[str(n)] = run
                say(f"{length}-token prompts, {n} streams: {run['aggregate_tps']:.1f} tok/s, TTFT p50 "
                    f"{percentile(run['ttfts_s'], 50) * 1e3:.0f} ms")
        long = lambda n: stream_prompts(1, n, tag=f"long-{n}")[0]  # noqa: E731
        if spec["long"]:
            client.first_token(long(min(spec["long"])))  # warm-up: kernels for long sequences
        for length in spec["long"]:
            ttfts = [client.first_token(long(length)) for _ in range(spec["reps"])]
            out["long"][str(length)] = {"ttft_s": ttfts, "median_ttft_s": statistics.median(ttfts)}
            say(f"{length}-token prompt alone: TTFT {statistics.median(ttfts) * 1e3:.0f} ms")
    except RuntimeError as e:
        out["error"] = str(e)
        say(f"FAILED: {e}")
    return out


class MlxLm:
    """measure()'s client on mlx-lm in this process (the child)."""

    def __init__(self, model_path: str, prefill_step_size: int):
        self.model, tokenizer = load_mlx_lm(model_path)
        self.eos, self.pss = set(tokenizer.eos_token_ids), prefill_step_size

    def batch(self, prompts: list, max_tokens) -> dict:
        from mlx_lm.generate import BatchGenerator

        n = len(prompts)
        gen = BatchGenerator(self.model, stop_tokens=[[t] for t in self.eos], completion_batch_size=n,
                             prefill_batch_size=n, prefill_step_size=self.pss)
        start = time.perf_counter()
        uids = gen.insert(prompts, max_tokens if isinstance(max_tokens, list) else [max_tokens] * n)
        tokens, first = {u: [] for u in uids}, {}
        steps = 0
        while responses := gen.next_generated():
            steps += 1
            now = time.perf_counter()
            for r in responses:
                first.setdefault(r.uid, now)
                if r.finish_reason != "stop":
                    tokens[r.uid].append(r.token)
        wall = time.perf_counter() - start
        gen.close()
        count = sum(len(t) for t in tokens.values())
        return {"streams": n, "wall_s": wall, "tokens": count, "aggregate_tps": count / wall, "steps": steps,
                "ttfts_s": [first[u] - start if u in first else None for u in uids],
                "token_ids": [tokens[u] for u in uids]}

    def loop(self):
        return None  # (no scheduler loop to read)

    def _generate(self, prompt: list, max_tokens: int):
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        return generate_step(mx.array(prompt, dtype=mx.uint32), self.model, max_tokens=max_tokens,
                             prefill_step_size=self.pss)

    def alone(self, prompt: list, max_tokens: int) -> list:
        out = []
        for token, _ in self._generate(prompt, max_tokens):
            if int(token) in self.eos:
                break
            out.append(int(token))
        return out

    def first_token(self, prompt: list) -> float:
        tic = time.perf_counter()
        for _ in self._generate(prompt, 1):
            return time.perf_counter() - tic
        raise RuntimeError("generate_step yielded no token")


def mlx_lm_child(spec_path: str) -> None:
    import mlx.core as mx

    spec = json.loads(Path(spec_path).read_text())
    tic = time.perf_counter()
    client = MlxLm(spec["model"], spec["prefill_step_size"])
    out = dict(load_s=time.perf_counter() - tic, **measure(spec, client, BASELINE))
    print(json.dumps(dict(out, peak_memory_bytes=[mx.get_peak_memory()])))


class GrpcClient:
    """measure()'s client on a Server; a failure names the server and its log tail."""

    def __init__(self, server: Server, timeout: float):
        self.server, self.timeout, self.stub = server, timeout, server.stub()

    def _call(self, fn, *args):
        try:
            out = fn(*args)
        except Exception as e:
            raise RuntimeError(self.server.why(f"{type(e).__name__}: {e.details() if hasattr(e, 'details') else e}"))
        if isinstance(out, dict) and "error" in out:
            raise RuntimeError(self.server.why(out["error"]))
        if self.server.dead():
            raise RuntimeError(self.server.why("a server process exited"))
        return out

    def loop(self) -> dict:
        """Rank 0's scheduler loop clock (/v1/status)."""
        return self._call(self.server.status)["loop"]

    def batch(self, prompts: list, max_tokens, gap: float = 0.0) -> dict:
        return self._call(concurrent_streams, self.stub, prompts, max_tokens, self.timeout, gap)

    def alone(self, prompt: list, max_tokens: int) -> list:
        return self._call(grpc_generate, self.stub, prompt, max_tokens, self.timeout)["token_ids"]

    def first_token(self, prompt: list) -> float:
        r = self._call(grpc_generate, self.stub, prompt, 1, self.timeout)
        if r["first"] is None:
            raise RuntimeError(self.server.why(f"no token for a {len(prompt)}-token prompt ({r['finish_reason']})"))
        return r["first"] - r["sent"]


def run_mlx_lm(spec: dict, env: dict, timeout: float) -> dict:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.write(fd, json.dumps(spec).encode())
    os.close(fd)
    try:
        return run_ranks([PY, "-m", "bench", "load", "--mlx-lm-child", path], 1, env, timeout, relay=True)
    finally:
        os.unlink(path)


def run_runner(ranks: int, args, runner_args: list, env: dict, spec: dict, base: int = 0) -> tuple:
    """runner P=ranks, or (base 1, 2, ...) a baseline: --baseline's checkout, or this one with the base-th
    --against's arguments."""
    checkout = args.baseline.resolve() if base and args.baseline else ROOT
    extra = args.against[base - 1].split() if base and args.against else []
    name = "runner" if not base else "baseline" if base == 1 else f"baseline{base}"
    server = Server(ranks, runner_args + extra, env, args.backend, args.timeout, args.gpu_per_rank,
                    run=str(checkout / "run_trinity.py"), name=name, http=True)
    try:
        with server:
            out = measure(spec, GrpcClient(server, args.timeout), server.label)
            out["startup_s"] = server.startup_s
            if not server.dead():
                out.update(server.model_info())
    except RuntimeError as e:  # did not start: already named, with its log tail
        out = {"error": str(e)}
    return server.label, out


def stream_rows(results: dict, spec: dict) -> list:
    """One row per configuration, prompt length and stream count, with its ratios."""
    def row_of(name, length, n):
        run = results.get(name, {}).get("streams", {}).get(str(length), {}).get(str(n))
        if run is None:
            return None
        same = sum(run["token_ids"][k] == tokens for k, tokens in enumerate(run.get("alone", [])))
        itl = run.get("itl_s") or {}
        ms = lambda s: None if s is None else s * 1e3  # noqa: E731
        return {"config": name, "prompt_len": length, "streams": n, "tok_s": run["aggregate_tps"],
                "p50_ms": ms(percentile(run["ttfts_s"], 50)), "p99_ms": ms(percentile(run["ttfts_s"], 99)),
                "itl_p50_ms": ms(itl.get("p50")), "itl_p99_ms": ms(itl.get("p99")), "exact": [same, len(run.get("alone", []))]}

    ratio = lambda a, b: a["tok_s"] / b["tok_s"] if a and b else None  # noqa: E731
    rows = []
    for name in results:
        p1 = next((n for n in results if n.startswith(name.split(" P=")[0] + " P=1")), None)
        for length in spec["prompt_lens"]:
            for n in spec["streams"]:
                row = row_of(name, length, n)
                if row:
                    row.update(vs_mlx_lm=ratio(row, row_of(BASELINE, length, n)) if name != BASELINE else None,
                               vs_p1=ratio(row, row_of(p1, length, n)) if name not in (BASELINE, p1) else None,
                               vs_base=ratio(row, row_of(name.replace("runner", "baseline", 1), length, n))
                               if name.startswith("runner") else None)
                    rows.append(row)
    return rows


def print_report(rows: list, results: dict, spec: dict) -> None:
    num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    head = ["config", "prompt", "streams", "tok/s", "TTFT p50 ms", "p99 ms", "ITL p50 ms", "p99 ms", "exact",
            "x mlx-lm", "x P=1", "x base"]
    cells = [head] + [[r["config"], str(r["prompt_len"]), str(r["streams"]), num(r["tok_s"], ".1f"),
                       num(r["p50_ms"], ".0f"), num(r["p99_ms"], ".0f"), num(r["itl_p50_ms"], ".0f"),
                       num(r["itl_p99_ms"], ".0f"), "%d/%d" % tuple(r["exact"]), num(r["vs_mlx_lm"], ".2f"),
                       num(r["vs_p1"], ".2f"), num(r["vs_base"], ".2f")] for r in rows]
    for length in spec["long"]:
        cells.append([f"long {length} alone: TTFT ms"] + [""] * (len(head) - 1))
        cells += [[f"  {name}", str(length), "1", "", num(1e3 * res["long"][str(length)]["median_ttft_s"], ".0f")]
                  + [""] * (len(head) - 5) for name, res in results.items() if str(length) in res.get("long", {})]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    for r in cells:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print("tok/s = generated tokens / (last stream's end - first request); TTFT: request sent -> first token; ITL: "
          f"gaps between a stream's tokens; exact: streams equal to their prompt alone (the first {spec['check']})")
    print_loop(results, spec)
    for name, res in results.items():
        if res.get("error"):
            print(f"\n{name} FAILED: {res['error']}")


def print_loop(results: dict, spec: dict) -> None:
    """Where each run's steps went: rank 0's loop by part (ms a step, runtime/loop_clock.py); mlx-lm's
    BatchGenerator, ms a step (its whole next_generated call)."""
    parts = ("admit", "build", "launch", "sample", "wait", "accept", "prefix", "other")
    print("\nms a step: rank 0's loop by part (host = all but wait); mlx-lm: wall / steps")
    for name, res in results.items():
        for length, runs in res.get("streams", {}).items():
            for n, run in runs.items():
                if "loop" in run:
                    ms = run["loop"]["ms_per_step"]
                    print(f"  {name} {length}x{n}: {run['loop']['steps']} steps, busy {ms['busy']:.2f} = host "
                          f"{ms['host']:.2f} + wait {ms['wait']:.2f}; " + ", ".join(f"{p} {ms[p]:.2f}" for p in parts))
                elif run.get("steps"):
                    print(f"  {name} {length}x{n}: {run['steps']} steps, {1e3 * run['wall_s'] / run['steps']:.2f} a step")


def main(args) -> None:
    if args.mlx_lm_child:
        return mlx_lm_child(args.mlx_lm_child)
    settle(args)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # through the finally blocks that stop the servers
        signal.signal(sig, lambda n, _: sys.exit(128 + n))
    env = bench_env(args.blas)
    model = make_mini(Path(args.make_mini)) if args.make_mini else Path(args.model) if args.model else \
        checkpoint(SMALL if args.smoke else FULL)
    max_batch = args.max_batch or max(args.streams or [1])
    runner_args = ["--model", str(model), "--max-tokens-cap", str(max(4096, 2 * args.max_tokens)),
                   "--max-queue", str(max(64, *args.streams or [1])), "--max-batch", str(max_batch),
                   "--prefill-step-size", str(args.prefill_step_size), *args.runner_arg]
    spec = {k: getattr(args, k) for k in ("streams", "prompt_lens", "max_tokens", "mixed", "arrival_gap", "check",
                                          "long", "reps", "prefill_step_size")}
    spec["model"] = str(model)
    results, out = {}, out_path(args, "load")
    settings = dict(vars(args), model=str(model), runner_args=runner_args)

    def keep():  # after every configuration: a run stopped at a time limit keeps what it measured
        save(out, {"rows": stream_rows(results, spec), "results": results}, settings)

    if not args.no_mlx_lm:
        mlx_env = dict(env, CUDA_VISIBLE_DEVICES="0") if args.gpu_per_rank else env
        results[BASELINE] = run_mlx_lm(spec, mlx_env, args.timeout * 4)
        keep()
    for ranks in args.ranks:
        for base in range(1 + (1 if args.baseline else len(args.against))):
            name, results[name] = run_runner(ranks, args, runner_args, env, spec, base)
            keep()
            log.info(f"{name}: {results[name].get('error', 'done').splitlines()[0]}")
    print(f"\n{model}: {args.max_tokens} tokens a stream; runner --max-batch {max_batch}, P > 1 via {args.backend}")
    for i, extra in enumerate(args.against):
        print(f"{'baseline' if i == 0 else f'baseline{i + 1}'}: the runner with {extra}")
    print_report(stream_rows(results, spec), results, spec)
    keep()
    print(f"wrote {out}")
