"""Our runner at P=1 with --draft-model against mlx-lm's own speculative decoding
(mlx_lm.generate.stream_generate with draft_model: speculative_generate_step), on one
device, the same target and draft, greedy.

    python bench/bench_speculative_mlx_lm.py [--reps 5] [--max-tokens 200] [--k 4] [--model PATH --draft PATH]

Default: the embedded model and its bundled draft (distributed/shard/tiny_draft) on the
start of a held-out paragraph (as bench_speculation's held-out prompt). Both in this
process, alternating, median of --reps after a warm-up round; decode tok/s as each
reports it (tokens after the first over the time since the first). Also: plain decoding
of each, and whether each one's tokens equal plain greedy decoding (mlx-lm trims its
caches with trim_prompt_cache, which does nothing to a sliding-window cache once it has
wrapped: mlx-lm issue #1914). mlx-lm runs the draft through train_tiny_model's WholeStage
(the same layers, mlx-lm's): mlx-lm's afmoe.Model cannot build one without a full-attention
layer.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from mlx_lm.generate import stream_generate  # noqa: E402
from mlx_lm.utils import load_model, load_tokenizer  # noqa: E402

from distributed.runtime.pipeline import in_process_pipeline  # noqa: E402
from distributed.runtime.request import GenerationRequest, TokenEvent  # noqa: E402
from distributed.runtime.scheduler import Scheduler  # noqa: E402
from distributed.runtime.speculation import SpeculationOptions  # noqa: E402
from distributed.shard.config import model_args, read_config  # noqa: E402
from distributed.shard.loader import load_stage  # noqa: E402
from distributed.shard.tiny_checkpoint import DEFAULT_MODEL  # noqa: E402
from train_tiny_model import WholeStage, corpus  # noqa: E402  (scripts/)


def mlx_lm_model(path: Path):
    # HF-layout configs carry rope_parameters, which mlx-lm's ModelArgs ignores.
    return load_model(path, model_config={"rope_theta": model_args(read_config(path)).rope_theta})[0]


def ours(pipeline, tokenizer, prompt, max_tokens, draft, k):
    scheduler = Scheduler(pipeline, tokenizer, speculation=SpeculationOptions(draft=draft, num_draft_tokens=k))
    handle = scheduler.submit(GenerationRequest(list(prompt), max_tokens=max_tokens))
    scheduler.run_pending()
    events = list(handle.events())
    stats = scheduler.batcher.verifier.stats.as_dict() if draft is not None else None
    return [e.token_id for e in events if isinstance(e, TokenEvent)], events[-1].generation_tokens_per_sec, stats


def theirs(model, tokenizer, prompt, max_tokens, draft, k):
    tokens, tps, accepted = [], 0.0, 0
    kwargs = dict(draft_model=draft, num_draft_tokens=k) if draft is not None else {}
    for r in stream_generate(model, tokenizer, list(prompt), max_tokens=max_tokens, **kwargs):
        if r.finish_reason == "stop":  # the EOS token is not part of the text
            break
        tokens.append(r.token)
        tps = r.generation_tps
        accepted += bool(getattr(r, "from_draft", False))
    return tokens, tps, {"accepted": accepted} if draft is not None else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--draft", type=Path, default=DEFAULT_MODEL.parent / "tiny_draft")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "speculative_mlx_lm.json"))
    args = p.parse_args()

    tokenizer = load_tokenizer(args.model)
    prompt = tokenizer.encode([t for t in corpus()[1].split("\n\n") if len(t) > 300][0][:200])
    layers = model_args(read_config(args.model)).num_hidden_layers
    pipeline = in_process_pipeline([load_stage(args.model, 0, layers, True)])
    draft_stage = load_stage(args.draft, 0, model_args(read_config(args.draft)).num_hidden_layers, True)
    model, draft_model = mlx_lm_model(args.model), WholeStage(draft_stage)
    runs = {
        "ours plain": lambda: ours(pipeline, tokenizer, prompt, args.max_tokens, None, args.k),
        "ours draft": lambda: ours(pipeline, tokenizer, prompt, args.max_tokens, draft_stage, args.k),
        "mlx-lm plain": lambda: theirs(model, tokenizer, prompt, args.max_tokens, None, args.k),
        "mlx-lm draft": lambda: theirs(model, tokenizer, prompt, args.max_tokens, draft_model, args.k),
    }
    results = {name: [] for name in runs}
    for rep in range(args.reps + 1):  # the first round warms up
        for name, fn in runs.items():
            tokens, tps, stats = fn()
            if rep:
                results[name].append(tps)
            results.setdefault(name + " tokens", tokens)
            results.setdefault(name + " stats", stats)
    reference = results["ours plain tokens"]
    rows = {name: {"tps": statistics.median(results[name]), "runs": results[name],
                   "same_as_plain_greedy": results[name + " tokens"] == reference,
                   "tokens": len(results[name + " tokens"]), "speculative": results[name + " stats"]}
            for name in runs}
    print(f"one device, greedy, {args.max_tokens} tokens, K={args.k}, median of {args.reps}")
    for name, r in rows.items():
        print(f"{name:<14}{r['tps']:>9.1f} tok/s  tokens {r['tokens']:>4}  same as plain greedy: "
              f"{'yes' if r['same_as_plain_greedy'] else 'NO'}  {r['speculative'] or ''}")
    ratio = rows["ours draft"]["tps"] / rows["mlx-lm draft"]["tps"]
    print(f"ours with the draft / mlx-lm with the draft: {ratio:.2f}x; "
          f"speculation's own gain: ours {rows['ours draft']['tps'] / rows['ours plain']['tps']:.2f}x, "
          f"mlx-lm {rows['mlx-lm draft']['tps'] / rows['mlx-lm plain']['tps']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                          "rows": rows, "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
