"""Train the embedded default model (distributed/shard/tiny_model/): a tiny AFMoE that writes
readable English, on text that ships with Python.

    nice python scripts/train_tiny_model.py [--steps N] [--out DIR]
    nice python scripts/train_tiny_model.py --draft [--steps N]    # its draft model

--draft trains the embedded model's draft (distributed/shard/tiny_draft/, for
`--draft-model`): one dense sliding-window layer, the cheapest AFMoE that still sees
positions (a draft token costs about an eighth of the model's step), with the embedded
model's own tokenizer, trained on nothing but the embedded model's greedy continuations of
--continuations prompts cut from the training text (half of them with 15% of their tokens
replaced at random, so that it also sees the model continue text it never learned, as on
held-out prompts): each next token there is the model's argmax, what a draft must propose
to be accepted. Its log is the agreement: the share of the model's greedy tokens on
held-out prompts that the draft predicts (scripts/eval_tiny_model.py does not apply).

Corpus: the prose of the standard library's `pydoc_data.topics` (the language reference
that `help()` shows), from this interpreter, each paragraph once; every tenth paragraph is
held out. Its loss is logged every --eval-every steps (scripts/eval_tiny_model.py measures
it again, in float32 and 4-bit). The corpus is small, so the model ends well past the
held-out optimum: that costs held-out perplexity, but its greedy text reads better (trained
to about the optimum, it looped on short phrases such as '"x in y" is raised.').

Model: mlx-lm's afmoe itself (what the runner loads), with Trinity's features at toy size:
sliding-window (RoPE) and full-attention (no RoPE) layers, a dense first layer, then MoE
layers (sigmoid router, 8 experts, top 2, one shared expert), muP's embedding scale. The
router's expert_bias is not trained by gradient but balanced as Trinity's is (aux-loss-free:
nudged towards equal expert load after each step). Tokenizer: byte-level BPE trained here.

On Linux the MLX CPU wheel links a reference BLAS; preloading OpenBLAS makes training
several times faster (apt-get install libopenblas0-pthread):
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 nice python ...
Training is seeded, but threads and BLAS may change the last bits: the committed weights
are the reference, and training.json records how they were made.
"""

import argparse
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import afmoe
from mlx_lm.models.switch_layers import SwitchGLU

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from distributed.shard.config import model_args  # noqa: E402
from distributed.shard.stage import Stage  # noqa: E402
from distributed.shard.tiny_checkpoint import tiny_config  # noqa: E402

OUT = ROOT / "distributed" / "shard" / "tiny_model"
DRAFT_OUT = ROOT / "distributed" / "shard" / "tiny_draft"
EOT = "<|endoftext|>"
# A completion model has no roles: the "chat" template joins the messages' text, so a
# prompt reaches the model as written (run_trinity.py applies the template by default).
# A completion model's template: the messages' text joined, as written (a completion model has no roles);
# with tools, a json_tools header first and calls as <tool_call>…</tool_call>, so that agents' requests
# (which always carry tools) are taken (mlx-lm infers the json_tools parser from it).
PLAIN_TEMPLATE = (
    "{%- if tools %}# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Call a function with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.\n\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.tool_calls %}{% if message.content %}{{ message.content }}{% endif %}"
    "{%- for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}<tool_call>\n"
    "{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "{%- elif message.role == 'tool' %}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{%- else %}{{ message['content'] }}{% endif %}"
    "{% if not loop.last %}\n\n{% endif %}{% endfor %}")


# The context the embedded model serves: an agent's first request (Codex about 15k tokens through this
# tokenizer, Claude Code about 34k) with room to reply. Trained on 2,048-token windows; its full-attention
# layers have no positional encoding and its sliding ones see 64 positions, so longer contexts run as
# they do (its text past the training length is as loose as it is within it).
CONTEXT = 65536


def model_config(vocab_size: int, eot_id: int, layers: int = 6) -> dict:
    """HF-style config.json: 6 layers (S S F S S F), window 64, 1 dense layer then MoE."""
    return tiny_config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=384, moe_intermediate_size=64,
        num_hidden_layers=layers, num_dense_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=CONTEXT, sliding_window=64, global_attn_every_n_layers=3,
        layer_types=["full_attention" if (i + 1) % 3 == 0 or i + 1 == layers else "sliding_attention"
                     for i in range(layers)],
        num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
        # mlx-lm's default theta, so plain mlx_lm.load (which ignores rope_parameters) agrees.
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=eot_id, pad_token_id=eot_id, bos_token_id=None,
    )


def draft_config(vocab_size: int, eot_id: int) -> dict:
    """The draft's config.json: one dense sliding-window layer (RoPE: a full-attention
    layer has none, and one layer without positions guesses badly)."""
    return {**model_config(vocab_size, eot_id, layers=1), "layer_types": ["sliding_attention"]}


def prose(text: str) -> list:
    """A pydoc topic's prose paragraphs, each on one line: grammar rules, code examples,
    signatures and headings are left out (a model this small learns English better
    without them)."""
    keep = []
    for paragraph in re.split(r"\n\s*\n", text):
        line = " ".join(paragraph.split())
        letters = sum(c.isalpha() or c == " " for c in line)
        if (len(line.split()) >= 8 and line[-1] in ".:" and letters >= 0.85 * len(line)
                and "::=" not in line and ">>>" not in line):
            keep.append(line)
    return keep


def corpus():
    """(training documents, held-out text): the pydoc topics' prose, each paragraph once
    (topics repeat each other's sections, e.g. "specialnames" holds "attribute-access"),
    in sorted topic order; every tenth distinct paragraph is held out."""
    from pydoc_data.topics import topics

    seen, train, held = set(), [], []
    for name in sorted(topics):
        kept = []
        for paragraph in prose(topics[name]):
            if paragraph not in seen:
                seen.add(paragraph)
                (held if len(seen) % 10 == 5 else kept).append(paragraph)
        if kept:
            train.append("\n\n".join(kept))
    return train, "\n\n".join(held)


def windows(ids: list, context: int) -> list:
    """Non-overlapping windows of `context` tokens (the last may be shorter), each scored
    from scratch: every token after a window's first."""
    return [ids[i:i + context] for i in range(0, len(ids) - 1, context) if len(ids[i:i + context]) > 1]


def nll(model, chunks, make_cache=None) -> float:
    """Total negative log-likelihood (nats) of the windows' scored tokens (`make_cache()`: each
    window's fresh caches, e.g. quantized ones; default none)."""
    total = 0.0
    for w in chunks:
        x = mx.array(w)[None]
        logits = model(x[:, :-1], cache=make_cache() if make_cache else None)
        total += nn.losses.cross_entropy(logits, x[:, 1:], reduction="sum").item()
    return total


def train_tokenizer(docs, vocab_size: int, out: Path):
    """Byte-level BPE (GPT-2's pre-tokenizer) with one special token, saved as HF expects."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": EOT,
        "pad_token": EOT, "unk_token": None, "model_max_length": CONTEXT, "chat_template": PLAIN_TEMPLATE,
    }, indent=2))
    return tok


class CountingSwitchGLU(SwitchGLU):
    """mlx-lm's SwitchGLU that also records how many tokens each expert got, in call order
    (kept outside the module, where it would become a parameter)."""

    loads: list = []

    def __call__(self, x, indices):
        experts = self.gate_proj.weight.shape[0]
        self.loads.append(mx.stop_gradient((indices[..., None] == mx.arange(experts)).sum(axis=(0, 1, 2))))
        return super().__call__(x, indices)


class WholeStage(nn.Module):
    """A stage of every layer (shard/stage.py), embedding and head included, in the shape of
    an mlx-lm model (called with tokens and caches; its layers; its caches): the draft's
    config has no full-attention layer, which mlx-lm's afmoe.Model requires. Its weights
    keep mlx-lm's names ("model." before the stage's)."""

    def __init__(self, stage: Stage):
        super().__init__()
        self.model = stage

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self):
        return self.model.make_cache()

    def __call__(self, tokens, cache=None, **_):
        return self.model.head(self.model(self.model.embed(tokens), cache))


def build_model(config: dict):
    mx.random.seed(0)
    args = model_args(config)
    model = afmoe.Model(args) if "full_attention" in config["layer_types"] else WholeStage(
        Stage(args, 0, args.num_hidden_layers, True))
    moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, afmoe.AfmoeMoE)]
    for mlp in moe:
        mlp.experts.__class__ = CountingSwitchGLU
    model.freeze(keys=["expert_bias"])  # balanced, not trained
    return model, moe


def token_stream(tok, docs: list) -> np.ndarray:
    """The documents' tokens end to end, each followed by the end of text."""
    eot = tok.token_to_id(EOT)
    return np.fromiter((t for e in tok.encode_batch(docs) for t in (*e.ids, eot)), dtype=np.int32)


def batches(stream: np.ndarray, batch: int, context: int, seed: int):
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(stream) - context - 1, batch)
        yield mx.array(np.stack([stream[s:s + context + 1] for s in starts]))


def load_teacher(path: Path):
    """The embedded model as trained (mlx-lm's afmoe), to distil a draft from."""
    config = json.loads((path / "config.json").read_text())
    model = afmoe.Model(model_args(config))
    weights = model.sanitize(dict(mx.load(str(path / "model.safetensors"))))
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    return model


def continuations(teacher, stream: np.ndarray, count: int, length: int, seed: int = 1, batch: int = 256,
                  noise: float = 0.15) -> np.ndarray:
    """The teacher's greedy continuations (`length` tokens) of `count` prompts of 8 to 64
    tokens cut from the training stream, each after its prompt and before an end of text:
    what a draft is asked to predict when the model continues a prompt. Every other batch
    of prompts has `noise` of its tokens replaced at random: the model continues text it
    never learned, as it does after a held-out prompt."""
    rng, out = np.random.default_rng(seed), []
    eot = int(stream[-1])
    for i, first in enumerate(range(0, count, batch)):
        n, size = min(batch, count - first), int(rng.integers(8, 65))
        starts = rng.integers(0, len(stream) - size, n)
        prompts = np.stack([stream[s:s + size] for s in starts])
        if i % 2:
            prompts = np.where(rng.random(prompts.shape) < noise, rng.integers(0, teacher.args.vocab_size, prompts.shape), prompts)
        out.append(np.concatenate([prompts, greedy(teacher, prompts, length), np.full((n, 1), eot)], axis=1).reshape(-1))
    return np.concatenate(out).astype(np.int32)


def greedy(model, prompts: np.ndarray, length: int) -> np.ndarray:
    """(rows, length): the model's greedy continuations of equally long prompts."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.array(prompts), cache=cache)[:, -1], axis=-1)
    drawn = [y]
    for _ in range(length - 1):
        mx.async_eval(y)  # as it goes (as mlx-lm's generate_step), not one graph of every step at the end
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        drawn.append(y)
    return np.array(mx.stack(drawn, axis=1))


def agreement_set(teacher, held_text: str, tok, count: int = 20, length: int = 200) -> list:
    """(prompt, the teacher's greedy continuation) for the start (200 characters) of each of
    the first `count` held-out paragraphs longer than 300 (`python -m bench speculation`'s held-out
    prompt is the first); a continuation ends at its end of text."""
    eot, pairs = tok.token_to_id(EOT), []
    for paragraph in [p for p in held_text.split("\n\n") if len(p) > 300][:count]:
        ids = tok.encode(paragraph[:200]).ids
        drawn = greedy(teacher, np.array([ids]), length)[0].tolist()
        pairs.append((ids, drawn[:drawn.index(eot) + 1] if eot in drawn else drawn))
    return pairs


def agreement(model, pairs: list) -> float:
    """The share of the teacher's greedy tokens that the model predicts after the same
    history (a draft's acceptance rate for its first guess)."""
    hits = total = 0
    for prompt, drawn in pairs:
        history = prompt + drawn
        guesses = np.array(mx.argmax(model(mx.array([history[:-1]]))[0, len(prompt) - 1:], axis=-1))
        hits, total = hits + int((guesses == np.array(drawn)).sum()), total + len(drawn)
    return hits / total


def train(model, moe, stream, evaluate, args):
    """AdamW with warm-up and cosine decay, next-token cross-entropy; returns a record of the
    run (losses, time). evaluate: (name, function of the model), logged every --eval-every steps."""
    name, figure_of = evaluate
    def loss_fn(model, x):
        CountingSwitchGLU.loads.clear()
        loss = nn.losses.cross_entropy(model(x[:, :-1]), x[:, 1:]).mean()
        return loss, mx.stack(CountingSwitchGLU.loads) if moe else mx.zeros((0,))

    schedule = optim.join_schedules(
        [optim.linear_schedule(1e-4, args.lr, args.warmup),
         optim.cosine_decay(args.lr, args.steps - args.warmup, args.lr / 10)], [args.warmup])
    opt = optim.AdamW(schedule, weight_decay=0.1)
    grad_fn = nn.value_and_grad(model, loss_fn)
    started, cpu, losses, curve = time.monotonic(), time.process_time(), [], []
    for step, x in zip(range(1, args.steps + 1), batches(stream, args.batch, args.context, seed=0)):
        (loss, load), grads = grad_fn(model, x)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        # Aux-loss-free balancing (as Trinity's router): raise under-used experts' bias.
        for mlp, counts in zip(moe, load):
            mlp.expert_bias = mlp.expert_bias + args.bias_rate * mx.sign(counts.mean() - counts)
        mx.eval(model.parameters(), opt.state, loss)
        losses.append(loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            train_loss, figure = float(np.mean(losses[-args.eval_every:])), figure_of(model)
            curve.append([step, round(train_loss, 4), round(figure, 4)])
            rate = step * args.batch * args.context / (time.monotonic() - started)
            print(f"step {step}/{args.steps}  train loss {train_loss:.3f}  {name} {figure:.4f}  "
                  f"{rate:.0f} tokens/s", flush=True)
    return {"training_seconds": round(time.monotonic() - started),
            "training_cpu_seconds": round(time.process_time() - cpu),
            "loss_curve": {"columns": ["step", "train_loss", name], "rows": curve}}


def hf_weights(model, config: dict) -> dict:
    """The HF layout (per-expert keys), float32, as tiny_checkpoint's random checkpoints."""
    out = {}
    for key, value in tree_flatten(model.parameters()):
        if ".mlp.experts." in key:  # stacked (experts, out, in) -> one tensor per expert
            prefix, proj = key.rsplit(".mlp.experts.", 1)
            for e in range(config["num_experts"]):
                out[f"{prefix}.mlp.experts.{e}.{proj}"] = value[e]
        else:  # a WholeStage keeps lm_head in its stage
            out[key.replace("model.lm_head.", "lm_head.")] = value
    return {k: v.astype(mx.float32) for k, v in sorted(out.items())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=None, help="default 300 (3000 with --draft)")
    p.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary, the end-of-text token included")
    p.add_argument("--batch", type=int, default=None, help="default 8 (16 with --draft)")
    p.add_argument("--context", type=int, default=256, help="tokens per training sequence")
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--bias-rate", type=float, default=1e-3, help="expert_bias step per training step")
    p.add_argument("--eval-every", type=int, default=None, help="steps between evaluations (default 50; 500 with --draft)")
    p.add_argument("--out", type=Path, default=None, help=f"default: {OUT.relative_to(ROOT)} ({DRAFT_OUT.relative_to(ROOT)} with --draft)")
    p.add_argument("--draft", action="store_true", help="train the embedded model's draft (one layer, on its greedy text)")
    p.add_argument("--continuations", type=int, default=3072,
                   help="with --draft: how many of the model's greedy continuations (256 tokens) it learns from")
    args = p.parse_args(argv)
    args.steps = args.steps or (3000 if args.draft else 300)
    args.batch = args.batch or (16 if args.draft else 8)
    args.eval_every = args.eval_every or (500 if args.draft else 50)
    args.out = args.out or (DRAFT_OUT if args.draft else OUT)
    args.out.mkdir(parents=True, exist_ok=True)

    train_docs, held_text = corpus()
    if args.draft:  # the target's own tokenizer: a draft must share it
        from tokenizers import Tokenizer

        for name in ("tokenizer.json", "tokenizer_config.json"):
            (args.out / name).write_bytes((OUT / name).read_bytes())
        tok = Tokenizer.from_file(str(OUT / "tokenizer.json"))
    else:
        tok = train_tokenizer(train_docs, args.vocab, args.out)
    eot = tok.token_to_id(EOT)
    stream = token_stream(tok, train_docs)
    print(f"corpus: {len(train_docs)} documents, {sum(map(len, train_docs))} characters, {len(stream)} tokens; "
          f"held out: {len(held_text)} characters", flush=True)
    if args.draft:  # the model's own greedy text, and its greedy text after held-out prompts to score
        teacher = load_teacher(OUT)
        stream = continuations(teacher, stream, args.continuations, 256)
        pairs = agreement_set(teacher, held_text, tok)
        config, evaluate = draft_config(tok.get_vocab_size(), eot), ("agreement", lambda m: agreement(m, pairs))
        print(f"the model's continuations: {len(stream)} tokens", flush=True)
    else:
        held_chunks = windows(tok.encode(held_text).ids, args.context)
        scored = sum(len(w) - 1 for w in held_chunks)
        config, evaluate = model_config(tok.get_vocab_size(), eot), ("heldout_loss", lambda m: nll(m, held_chunks) / scored)
    model, moe = build_model(config)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"model: {n_params} parameters", flush=True)
    record = train(model, moe, stream, evaluate, args)

    mx.save_safetensors(str(args.out / "model.safetensors"), hf_weights(model, config), metadata={"format": "pt"})
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    (args.out / "training.json").write_text(json.dumps({
        "made_by": "scripts/train_tiny_model.py" + (" --draft" if args.draft else ""),
        "distilled_from": "tiny_model" if args.draft else None, "python": sys.version.split()[0], "mlx": mx.__version__,
        "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("out", "draft") and (args.draft or k != "continuations")},
        "parameters": n_params, "corpus_documents": len(train_docs),
        "corpus_characters": sum(map(len, train_docs)), "training_tokens": int(len(stream)),
        "heldout_characters": len(held_text), "heldout_sha256": hashlib.sha256(held_text.encode()).hexdigest(),
        "tokens_per_step": args.batch * args.context, **record,
        "environment": {k: os.environ.get(k) for k in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS")},
    }, indent=2) + "\n")
    print(f"wrote {args.out} ({record['training_seconds']} s, {record['training_cpu_seconds']} CPU seconds)")


if __name__ == "__main__":
    main()
