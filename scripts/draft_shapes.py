"""Which draft shape predicts the embedded model best when trained long: each shape is
trained as `train_tiny_model.py --draft` trains the bundled draft (the model's greedy
continuations, next-token cross-entropy), for its own number of steps, and scored by its
held-out agreement (the share of the model's greedy tokens it predicts, the model's own
history given). Meant for a GPU: on a 2-core CPU one shape takes hours.

    python scripts/draft_shapes.py [--shapes 1L,2L] [--steps 16000,12000] [--continuations 16384]
                                   [--batch 64] [--out DIR]

Shapes: 1L (the bundled draft's: one dense sliding-window layer, hidden 128), 1L-i1536 (its
MLP 4x wider), 1L-h256 (hidden 256), 2L (two dense sliding-window layers). Writes each
draft (config, weights, tokenizer: usable as --draft-model) and results.json to --out.
Seen on one H100 (16,384 continuations, batch 64): 1L 0.643 after 16,000 steps (the bundled
draft: 0.603 after 3,000 steps of 16 on this CPU), 2L 0.715 after 12,000, still rising.
"""

import argparse
import json
import sys
import types
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_tiny_model as T  # noqa: E402


def shape(name: str, base: dict) -> dict:
    shapes = {
        "1L": {},
        "1L-i1536": {"intermediate_size": 1536},
        "1L-h256": {"hidden_size": 256, "intermediate_size": 768, "head_dim": 64},
        "2L": {"num_hidden_layers": 2, "num_dense_layers": 2, "layer_types": ["sliding_attention"] * 2},
    }
    if name not in shapes:
        sys.exit(f"--shapes: {name!r} is none of {', '.join(shapes)}")
    return {**base, **shapes[name]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="1L,2L")
    p.add_argument("--steps", default="16000,12000", help="training steps of each shape, in order")
    p.add_argument("--continuations", type=int, default=16384, help="the model's greedy continuations (256 tokens)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--out", type=Path, default=Path("draft_shapes"))
    args = p.parse_args()
    names, steps = args.shapes.split(","), [int(s) for s in args.steps.split(",")]
    if len(names) != len(steps):
        sys.exit("--steps: one number per shape")

    from tokenizers import Tokenizer

    docs, held = T.corpus()
    tok = Tokenizer.from_file(str(T.OUT / "tokenizer.json"))
    eot = tok.token_to_id(T.EOT)
    stream = T.token_stream(tok, docs)
    teacher = T.load_teacher(T.OUT)
    pairs = T.agreement_set(teacher, held, tok)
    data = T.continuations(teacher, stream, args.continuations, 256)
    print(f"the model's continuations: {len(data)} tokens", flush=True)
    results = []
    for name, n in zip(names, steps):
        config = shape(name, T.draft_config(tok.get_vocab_size(), eot))
        model, moe = T.build_model(config)
        run = types.SimpleNamespace(steps=n, batch=args.batch, context=256, lr=args.lr, warmup=min(50, n // 2),
                                    bias_rate=1e-3, eval_every=max(1, n // 4))
        record = T.train(model, moe, data, ("agreement", lambda m: T.agreement(m, pairs)), run)
        results.append({"shape": name, "steps": n, "batch": args.batch, "agreement": record["loss_curve"]["rows"][-1][2],
                        **record})
        out = args.out / name
        out.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(out / "model.safetensors"), T.hf_weights(model, config), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(config, indent=2))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (out / f).write_bytes((T.OUT / f).read_bytes())
        print(f"{name}: agreement {results[-1]['agreement']:.4f} after {n} steps", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
