"""Perplexity of the embedded default model on held-out text, in float32 and 4-bit, and with its
KV caches quantized (run-trinity's --kv-bits).

    python scripts/eval_tiny_model.py [--model PATH] [--json]

The held-out text is the pydoc prose that scripts/train_tiny_model.py left out of
training (its training.json has the text's sha256, checked here). It is cut into windows
of the training context, each scored from scratch; perplexity is exp(mean negative
log-likelihood per scored token), and bits per byte divides the same total by the text's
UTF-8 bytes. The model is mlx-lm's afmoe (what the runner loads); the 4-bit copy is
mlx-lm's quantize_model at group size 64 (routers 8-bit, as mlx-lm converts AFMoE).

"kv 8-bit" and "kv 4-bit": float32 weights, the full-attention layers' caches made with
KVCache.to_quantized (group 32, the head size) from each window's first token, the sliding
ones whole, as --kv-bits keeps them; each also gives its greedy agreement with float32 caches:
the share of the first 200 generated tokens equal, position by position, over 20 held-out
prompts (the first 64 tokens of the first 20 windows), and where each first differs.
"""

import argparse
import contextlib
import hashlib
import io
import json
import math
import sys
from pathlib import Path

from train_tiny_model import corpus, nll, windows  # this folder; it puts the repository on sys.path

from distributed.shard.tiny_checkpoint import default_checkpoint


def weight_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="default: the embedded default model")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    path = args.model or default_checkpoint()
    if not (path / "training.json").exists():
        sys.exit(f"{path / 'training.json'} not found: --model must be made by scripts/train_tiny_model.py")
    info = json.loads((path / "training.json").read_text())
    _, text = corpus()
    if hashlib.sha256(text.encode()).hexdigest() != info["heldout_sha256"]:
        sys.exit(f"this Python's pydoc topics give other held-out text than {path} was trained beside")

    from mlx_lm.utils import load, quantize_model
    from transformers.utils import logging

    logging.set_verbosity_error()  # the held-out text is longer than model_max_length: windows cut it

    model, tokenizer = load(str(path))  # its rope_theta is mlx-lm's default (see model_config)
    config = json.loads((path / "config.json").read_text())
    chunks = windows(tokenizer.encode(text), info["arguments"]["context"])
    scored = sum(len(w) - 1 for w in chunks)
    results = {"model": str(path), "heldout_characters": len(text), "scored_tokens": scored}
    whole = greedy(model, chunks[:PROMPTS], None)
    for name, bits in (("kv 8-bit", 8), ("kv 4-bit", 4)):
        total = nll(model, chunks, lambda: kv_caches(model, bits))
        results[name] = {"perplexity": round(math.exp(total / scored), 3),
                         "bits_per_byte": round(total / math.log(2) / len(text.encode()), 4),
                         **agreement(whole, greedy(model, chunks[:PROMPTS], bits))}
    for name, bits in (("float32", None), ("4-bit", 4)):
        if bits:
            with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints a summary
                model, _ = quantize_model(model, config, group_size=64, bits=bits)
        total = nll(model, chunks)
        results[name] = {"perplexity": round(math.exp(total / scored), 3),
                         "bits_per_byte": round(total / math.log(2) / len(text.encode()), 4),
                         "weight_bytes": weight_bytes(model)}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{path}: {len(text)} held-out characters, {scored} scored tokens")
    for name in ("float32", "4-bit"):
        r = results[name]
        print(f"  {name:8s} perplexity {r['perplexity']:8.3f}  bits/byte {r['bits_per_byte']:.4f}  "
              f"weights {r['weight_bytes'] / 2**20:.2f} MiB")
    for name in ("kv 8-bit", "kv 4-bit"):
        r = results[name]
        print(f"  {name:8s} perplexity {r['perplexity']:8.3f}  bits/byte {r['bits_per_byte']:.4f}  greedy agreement "
              f"{r['greedy_agreement']:.3f} (first difference at {r['first_differences']})")


PROMPTS, PROMPT_TOKENS, GENERATED = 20, 64, 200


def kv_caches(model, bits):
    """The model's caches, the full-attention ones quantized (bits None: all whole)."""
    from mlx_lm.models.cache import KVCache

    return [c.to_quantized(32, bits) if bits and type(c) is KVCache else c for c in model.make_cache()]


def greedy(model, chunks, bits):
    """GENERATED greedy tokens after each window's first PROMPT_TOKENS, caches as kv_caches makes them."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    return [[t for t, _ in generate_step(mx.array(w[:PROMPT_TOKENS]), model, max_tokens=GENERATED,
                                         prompt_cache=kv_caches(model, bits))] for w in chunks]


def agreement(whole, quantized) -> dict:
    same = [sum(a == b for a, b in zip(x, y)) for x, y in zip(whole, quantized)]
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(whole, quantized)]
    return {"greedy_agreement": round(sum(same) / sum(map(len, whole)), 4), "first_differences": first}


if __name__ == "__main__":
    main()
