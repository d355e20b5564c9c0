"""Single-stream decode with and without speculative decoding, P = 1..4.

The embedded default model (distributed/shard/tiny_model), greedy, one request per fresh
process, ranks of the ring backend started directly (as decode's "direct"). Prompts:
  held-out   the start of a paragraph of pydoc's topics that training held out (every tenth),
             continued by the model: it loops on its own phrases more than it copies
  grounded   a passage, then its first words again: the model's continuation repeats the
             passage where it copies it (this model seldom copies: lookup covers a few
             percent of its continuation)
  edit       the input-grounded case (edits, summaries, QA): the tiny editor (made here by
             scripts/make_tiny_editor.py) rewrites a held-out paragraph in the past tense, a
             copy but for " is" -> " was" and " are" -> " were" (lookup only: the bundled
             draft is the embedded model's)
For each P, prompt and mode (lookup: --prompt-lookup; draft: --draft-model with the bundled
draft, distributed/shard/tiny_draft; both): decode tok/s without and with it (median of
--reps, interleaved rounds), their ratio, and how much of the output the drafts covered (accepted
drafts / tokens generated), with the verification passes. Tokens must be the same.

--ring-ceiling: the same through real rings (P in --ranks), drafts given by
bench/replay_drafter inside rank 0: the plain run's own tokens, all right or the draft for one
position in 4 / in 8 wrong, each with drafting ahead and without (--no-draft-ahead), --speculate
always.

--ceiling: what the verification path gives where drafts are right, in one process (P=1 and
--stages 2, the scheduler's own loop): a drafter that proposes the plain run's own next tokens
(every draft accepted), and one whose draft for one position in 4 is wrong; --model
for another checkpoint (the GPU's Mini shape).
--smoke: P = 1, 2, one round of 24 tokens, the held-out prompt, lookup only.
"""

import logging
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import PY, ROOT, bench_env, flags, out_path, run_ranks, save, shrink

log = logging.getLogger("bench")

MODEL = ROOT / "distributed" / "shard" / "tiny_model"
EDITOR = Path(tempfile.gettempdir()) / f"bench-speculation-editor-{os.getpid()}"


def add_arguments(p) -> None:
    flags(p, smoke=False, out=None, model=None, ranks=[1, 2, 3, 4], reps=3, max_tokens=200, timeout=300.0,
          blas="openblas")
    p.add_argument("--k", type=int, help="--num-draft-tokens (default: the runner's)")
    p.add_argument("--modes", default="lookup,draft,both",
                   help="against plain: lookup (--prompt-lookup), draft (--draft-model, the bundled draft), both; "
                   "a mode with -one after it: the same with --no-draft-ahead (one frame in the ring at a time)")
    p.add_argument("--prompts", default="held-out,grounded,edit")
    p.add_argument("--held-out", type=int, default=1, metavar="N",
                   help="the held-out prompt: the first N held-out paragraphs in turn (tok/s over all of them)")
    p.add_argument("--always", action="store_true", help="--speculate always (every pass the drafter proposes)")
    p.add_argument("--ceiling", action="store_true", help="in one process: drafts that are right (see above)")
    p.add_argument("--ring-ceiling", action="store_true", help="through rings: drafts given inside rank 0 (see above)")
    p.add_argument("--draft", default=str(ROOT / "distributed" / "shard" / "tiny_draft"),
                   help="the draft model of the draft modes (default: the bundled draft)")


def prompts(every: bool = False, held_out_prompts: int = 1):
    """{name: prompt} as above (held_out_prompts > 1: the first that many held-out paragraphs, a list,
    run one after the other as one prompt); every: the start of every held-out paragraph instead (a list)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_tiny_editor import heldout_prompt
    from train_tiny_model import corpus  # the paragraphs training held out (every tenth)

    held_out = [p for p in corpus()[1].split("\n\n") if len(p) > 300]
    if every:
        return [p[:200] for p in held_out]
    passage = held_out[3][:600]
    first = [p[:200] for p in held_out[:held_out_prompts]] if held_out_prompts > 1 else held_out[0][:200]
    return {"held-out": first, "grounded": passage + "\n\n" + passage[:80], "edit": heldout_prompt()}


def combined(runs: list) -> dict:
    """Runs of several prompts as one: tok/s is all their tokens over all their decode time;
    the speculative counts summed."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    specs = [r["speculative"] for r in runs if r["speculative"]]
    return {"tps": sum(len(r["tokens"]) for r in runs) / sum(len(r["tokens"]) / r["tps"] for r in runs),
            "tokens": [t for r in runs for t in r["tokens"]],
            "speculative": {k: sum(s[k] for s in specs) for k in specs[0]} if specs else None}


def run_once(ranks: int, prompt: str, max_tokens: int, extra: list, timeout: float, model: Path = MODEL,
             env: dict = None, blas: str = "openblas") -> dict:
    env = dict(env or bench_env(blas))
    # Each rank its share of the cores, as each Mac of a real ring has its own: OpenBLAS's own
    # threads, one per core in every rank by default, spin beside the other ranks (P = 2 with
    # the bundled draft: 15% slower).
    env.setdefault("OPENBLAS_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    cmd = [PY, str(ROOT / "run_trinity.py"), "--model", str(model), "--prompt", prompt, "--no-chat-template",
           "--max-tokens", str(max_tokens), "--json", *extra]
    r = run_ranks(cmd, ranks, env, timeout)
    if "error" in r:
        return {"error": r["error"][-300:]}
    return {"tps": r["generation_tokens_per_sec"], "tokens": r["token_ids"], "speculative": r.get("speculative")}


class Replay:
    """Drafts the plain run's continuation; with `miss`, the draft for every `miss`-th
    position of the output wrong (by position, so the same drafts are wrong however the
    proposals group them: one frame at a time or several ahead)."""

    def __init__(self, tokens, miss=0):
        self.tokens, self.miss = tokens, miss

    def propose(self, seq, k, after=()):
        at = len(seq.generated) + len(after)
        drafts = list(self.tokens[at:at + k])
        for j in range(len(drafts)):
            if self.miss and (at + j) % self.miss == self.miss - 1:
                drafts[j] = (drafts[j] + 1) % 256
        return drafts


def ceiling(prompt: str, max_tokens: int, k: int, reps: int, model: str = None) -> list:
    from mlx_lm.utils import load_tokenizer

    from distributed.runtime.pipeline import in_process_pipeline
    from distributed.runtime.request import GenerationRequest, TokenEvent
    from distributed.runtime.scheduler import Scheduler
    from distributed.runtime.speculation import SpeculationOptions
    from distributed.shard.loader import load_stage

    path = Path(model) if model else ROOT / "distributed" / "shard" / "tiny_model"
    tokenizer = load_tokenizer(path)
    # A random-weight checkpoint's text means nothing: byte ids then, as bench_decode's.
    ids = tokenizer.encode(prompt) if not model else [(i * 37 + 11) % 251 for i in range(128)]
    rows = []
    for stages in (1, 2):
        layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
        cuts = [0, layers // 2, layers][:: 2 if stages == 1 else 1]
        pipeline = in_process_pipeline([load_stage(path, a, b, i == 0) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))])

        def timed(drafter):
            scheduler = Scheduler(pipeline, tokenizer, speculation=SpeculationOptions(prompt_lookup=True, num_draft_tokens=k))
            scheduler.batcher.verifier.drafter = drafter
            handle = scheduler.submit(GenerationRequest(list(ids), max_tokens=max_tokens, speculative=drafter is not None))
            scheduler.run_pending()
            events = list(handle.events())
            return ([e.token_id for e in events if isinstance(e, TokenEvent)], events[-1].generation_tokens_per_sec,
                    scheduler.batcher.verifier.stats.as_dict())

        tokens = timed(None)[0]
        results = {name: [] for name in ("plain", "all accepted", "1 draft in 4 wrong")}
        for _ in range(reps + 1):  # the first round warms up
            for name, drafter in (("plain", None), ("all accepted", Replay(tokens)),
                                  ("1 draft in 4 wrong", Replay(tokens, miss=4))):
                out, tps, stats = timed(drafter)
                # float32 on a CPU: the same tokens; a GPU's bf16 / 4-bit greedy run may differ
                # between repeats at near-ties (then the replayed drafts just miss there).
                assert out == tokens or model, name
                results[name].append((tps, stats))
        base = statistics.median(t for t, _ in results["plain"][1:])
        for name, rs in results.items():
            tps = statistics.median(t for t, _ in rs[1:])
            rows.append({"stages": stages, "drafter": name, "tps": tps, "ratio": tps / base, "speculative": rs[-1][1]})
    return rows


def ring_ceiling(prompt: str, args) -> list:
    """Rows as in main's table, for drafts given by bench/replay_drafter (see above)."""
    plain_args = ["--num-draft-tokens", str(args.k)]
    drafters = {"all right": 0, "1 in 4 wrong": 4, "1 in 8 wrong": 8}
    runs, tokens = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for ranks in args.ranks:
                r = run_once(ranks, prompt, args.max_tokens, [], args.timeout, blas=args.blas)
                runs.setdefault((ranks, "plain"), []).append(r)
                tokens = tokens or r.get("tokens")
                for name, miss in drafters.items():
                    replay = Path(tmp) / f"{miss}.json"
                    replay.write_text(json.dumps({"tokens": tokens, "miss": miss}))
                    env = bench_env(args.blas)
                    env.update(TRINITY_REPLAY=str(replay),
                               PYTHONPATH=os.pathsep.join([str(ROOT / "bench" / "replay_drafter"), env["PYTHONPATH"]]))
                    for ahead in (True, False):
                        extra = ["--prompt-lookup", "--speculate", "always", *plain_args] + ([] if ahead else ["--no-draft-ahead"])
                        mode = name + ("" if ahead else " -one")
                        r = run_once(ranks, prompt, args.max_tokens, extra, args.timeout, env=env)
                        runs.setdefault((ranks, mode), []).append(r)
                        log.info(f"[{rep + 1}/{args.reps}] P={ranks} {mode}: {r.get('error') or '%.1f tok/s' % r['tps']}")
    rows = []
    for (ranks, mode), rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        plain = [r["tps"] for r in runs[(ranks, "plain")] if "error" not in r]
        if mode == "plain" or not ok or not plain:
            continue
        s = ok[0]["speculative"]
        rows.append({"prompt": "ring ceiling", "ranks": ranks, "mode": mode, "plain_tps": statistics.median(plain),
                     "spec_tps": statistics.median(r["tps"] for r in ok), "tokens": len(ok[0]["tokens"]),
                     "same_tokens": all(r["tokens"] == tokens for r in ok), "drafted": s["drafted"],
                     "accepted": s["accepted"], "passes": s["passes"], "cancelled": s["cancelled"],
                     "covered": s["accepted"] / max(1, len(ok[0]["tokens"])),
                     "plain_runs": plain, "spec_runs": [r["tps"] for r in ok]})
        rows[-1]["ratio"] = rows[-1]["spec_tps"] / rows[-1]["plain_tps"]
    return rows


def main(args) -> None:
    from distributed.runtime.frames import DEFAULT_DRAFT_TOKENS

    args.k = args.k or DEFAULT_DRAFT_TOKENS
    shrink(args, ranks=[1, 2], reps=1, max_tokens=24, prompts="held-out", modes="lookup")
    texts = prompts(held_out_prompts=1 if args.ceiling or args.ring_ceiling else args.held_out)
    if args.ceiling:
        rows = ceiling(texts["held-out"], args.max_tokens, args.k, args.reps, args.model)
        print(f"{args.model or 'embedded model'} in one process, {'128 byte ids' if args.model else 'held-out text'}, "
              f"{args.max_tokens} tokens, K={args.k}, "
              f"median of {args.reps}")
        print(f"{'stages':>6}  {'drafter':<24}{'tok/s':>8}{'ratio':>7}  speculative")
        for r in rows:
            print(f"{r['stages']:>6}  {r['drafter']:<24}{r['tps']:>8.1f}{r['ratio']:>7.2f}  {r['speculative']}")
        print(f"wrote {save(out_path(args, 'speculation'), {'ceiling': rows}, vars(args))}")
        return
    start = time.perf_counter()
    if args.ring_ceiling:
        rows = ring_ceiling(texts["held-out"], args)
        return report(rows, args, texts, start)
    mode_flags = {"plain": [], "lookup": ["--prompt-lookup"], "draft": ["--draft-model", args.draft],
             "both": ["--prompt-lookup", "--draft-model", args.draft]}
    for mode in list(mode_flags)[1:]:
        mode_flags[mode + "-one"] = mode_flags[mode] + ["--no-draft-ahead"]
    modes = ["plain"] + [m for m in args.modes.split(",") if m != "plain"]
    texts = {name: texts[name] for name in args.prompts.split(",")}
    if "edit" in texts:
        from make_tiny_editor import main as make_editor

        make_editor(["--out", str(EDITOR)])
    try:
        rows = compare(texts, modes, mode_flags, args)
    finally:
        shutil.rmtree(EDITOR, ignore_errors=True)
    report(rows, args, texts, start)


def compare(texts: dict, modes: list, flags: dict, args) -> list:
    """Every prompt, P and mode against plain, in interleaved rounds: the rows of the table."""
    ranks_range = args.ranks
    cases = [(name, ranks, mode) for name in texts for ranks in ranks_range for mode in modes_for(name, modes)]
    runs = {case: [] for case in cases}
    for rep in range(args.reps):
        for name in texts:
            # Several prompts (--held-out N): each one's cases back to back, so that a slow spell
            # of the machine (its speed swings by 2x over minutes here) falls on all of them alike.
            parts = texts[name] if isinstance(texts[name], list) else [texts[name]]
            mine = [case for case in cases if case[0] == name]
            results = {case: [] for case in mine}
            for part in parts:
                for case in mine:
                    _, ranks, mode = case
                    extra = flags[mode] + (["--num-draft-tokens", str(args.k)] if flags[mode] else [])
                    extra += ["--speculate", "always"] if args.always and flags[mode] else []
                    results[case].append(run_once(ranks, part, args.max_tokens, extra, args.timeout,
                                                  EDITOR if name == "edit" else MODEL, blas=args.blas))
            for case in mine:
                r = combined(results[case])
                runs[case].append(r)
                log.info(f"[{rep + 1}/{args.reps}] {name} P={case[1]} {case[2]}: "
                      f"{r.get('error') or '%.1f tok/s' % r['tps']}")
    rows = []
    for name in texts:
        for ranks in ranks_range:
            plain = [r for r in runs[(name, ranks, "plain")] if "error" not in r]
            for mode in modes_for(name, modes)[1:]:
                spec_runs = [r for r in runs[(name, ranks, mode)] if "error" not in r]
                if not plain or not spec_runs:
                    rows.append({"prompt": name, "ranks": ranks, "mode": mode, "error": True})
                    continue
                s = spec_runs[0]["speculative"]
                tps = [statistics.median(r["tps"] for r in rs) for rs in (plain, spec_runs)]
                rows.append({"prompt": name, "ranks": ranks, "mode": mode, "plain_tps": tps[0], "spec_tps": tps[1],
                             "ratio": tps[1] / tps[0], "tokens": len(plain[0]["tokens"]),
                             "same_tokens": all(r["tokens"] == plain[0]["tokens"] for r in plain + spec_runs),
                             "drafted": s["drafted"], "accepted": s["accepted"], "passes": s["passes"],
                             "cancelled": s.get("cancelled", 0), "covered": s["accepted"] / max(1, len(plain[0]["tokens"])),
                             "plain_runs": [r["tps"] for r in plain], "spec_runs": [r["tps"] for r in spec_runs]})
    return rows


def modes_for(prompt: str, modes: list) -> list:
    """The editor has no draft model: its prompt runs plain and the lookup modes only."""
    return [m for m in modes if prompt != "edit" or m in ("plain", "lookup", "lookup-one")]


def report(rows: list, args, texts: dict, start: float) -> None:
    print(f"\nembedded model (edit: the editor), greedy, {args.max_tokens} tokens max, K={args.k}, median of {args.reps}")
    print(f"{'prompt':<13}{'P':>3}  {'mode':<22}{'plain tok/s':>12}{'spec tok/s':>12}{'ratio':>7}{'tokens':>8}"
          f"{'covered':>9}{'accepted/drafted':>18}{'passes':>8}{'cancelled':>10}  same")
    for r in rows:
        if r.get("error"):
            print(f"{r['prompt']:<13}{r['ranks']:>3}  {r['mode']:<22}  failed")
            continue
        print(f"{r['prompt']:<13}{r['ranks']:>3}  {r['mode']:<22}{r['plain_tps']:>12.1f}{r['spec_tps']:>12.1f}"
              f"{r['ratio']:>7.2f}{r['tokens']:>8}{r['covered']:>9.2f}{'%d/%d' % (r['accepted'], r['drafted']):>18}"
              f"{r['passes']:>8}{r['cancelled']:>10}  {'yes' if r['same_tokens'] else 'NO'}")
    print(f"wall time {time.perf_counter() - start:.0f} s")
    print(f"wrote {save(out_path(args, 'speculation'), {'prompts': texts, 'rows': rows}, vars(args))}")

