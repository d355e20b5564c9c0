"""Make the tiny editor: a tiny AFMoE checkpoint, its weights written by hand, that rewrites the
passage in its prompt: the input-grounded case of speculative decoding (code edits, document
QA, summaries), where most of the output is a copy of the input.

    python scripts/make_tiny_editor.py --out DIR

It takes a second, so tests and `python -m bench speculation` make it where they need it (40 MB
of mostly zeros in float32: not package data). Its task: "In the present tense:" and a
passage on a line, then "In the past tense:", and it writes the passage
again with every " is" made " was" and every " are" made " were", then an end of text. Prompt
lookup (`--prompt-lookup`) drafts the copied runs; the edits are where its drafts fail.
`python -m bench speculation --prompts edit` measures that on held-out text.

Training a model this small to copy took thousands of CPU steps without getting there (the
induction head a copy needs did not form), so the circuit is written directly, in mlx-lm's
afmoe itself, with the embedded model's tokenizer. The residual stream holds, per position:
  A         a 64-dimension code of the token (" was" shares the code of " is", " were" of " are")
  B1 .. B4  the codes of the 4 tokens before it
  D         the code of the token to write next
  and one constant dimension.
Layer 0 (sliding window, RoPE): 4 previous-token heads. Their queries and keys are constant
(read from the constant dimension) and phased so that RoPE peaks at a distance of d (head
d - 1); their values are A, written to B_d.
Layer 2 (full attention, no RoPE): an induction head. Its query is the last 4 tokens here
(A, B1, B2, B3), its key the 4 before a position (B1 .. B4), the nearer ones weighing more,
so it attends to where the last tokens occurred before, longest match first; its value (that
position's A) goes to D: the token that followed them. The prompt's prefix ends as its
instruction does (" tense", ":", "\n"), so the instruction's end finds the passage's start.
The head reads D: every token's code, but " is" and " are" write nothing (" was" and " were"
carry their codes) and a line break writes the end of text (passages are one line).
Layers 1 and 3 and every MLP and expert are zero: they cost what a layer costs, so that P = 4
holds a layer per rank. On the first 40 held-out paragraphs of 20 to 200 tokens, 32 rewrites
are exact; the rest go astray where a run of 4 tokens occurs twice.
"""

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny_model import EOT, OUT as MODEL, corpus, model_config  # noqa: E402

PREFIX = "In the present tense:\n"
INSTRUCTION = "\n\nIn the past tense:\n"
EDITS = {" is": " was", " are": " were"}

CODE = 64  # dimensions of a token's code
PREV = 4  # previous tokens each position holds: the induction head matches the last PREV
A, D, ONE = 0, (PREV + 1) * CODE, (PREV + 2) * CODE  # where each part of the stream starts (B_d at d * CODE)
HIDDEN, HEAD_DIM, HEADS = (PREV + 2) * CODE + 16, PREV * CODE, PREV
MATCH = [0.7 ** d for d in range(PREV)]  # the current token's match counts most, then the one before, ...
SHARP = 3.0  # q_norm and k_norm weights: how sharply the heads attend


def token_codes(vocab: int, same: dict, seed: int = 0) -> np.ndarray:
    """A random unit code per token (same[b] = a: b takes a's code)."""
    codes = np.random.default_rng(seed).standard_normal((vocab, CODE))
    codes /= np.linalg.norm(codes, axis=1, keepdims=True)
    for b, a in same.items():
        codes[b] = codes[a]
    return codes


def rope_phases(distance: int, window: int) -> np.ndarray:
    """Weights w (summing to 1) over RoPE's frequencies that make sum_i w_i cos((d - distance)
    theta_i) peak at d = distance with the widest margin over every other d in the window:
    the softmin of the margins, maximised by exponentiated gradient."""
    theta = 10000.0 ** (-np.arange(HEAD_DIM // 2) * 2 / HEAD_DIM)
    others = np.array([d - distance for d in range(window) if d != distance])
    gap = 1 - np.cos(np.outer(others, theta))  # (others, frequencies): margin per unit weight
    w = np.full(len(theta), 1 / len(theta))
    for _ in range(3000):
        margins = gap @ w
        soft = np.exp(-(margins - margins.min()) * 50)
        w *= np.exp(0.5 * (soft / soft.sum()) @ gap)
        w /= w.sum()
    return w, theta


def build(tok, config: dict) -> dict:
    vocab, eot = tok.get_vocab_size(), tok.token_to_id(EOT)
    edits = {tok.encode(new).ids[0]: tok.encode(old).ids[0] for old, new in EDITS.items()}
    newline = tok.encode("\n").ids[0]
    codes = token_codes(vocab, edits)
    w = {}

    def zeros(*shape):
        return np.zeros(shape, dtype=np.float32)

    embed = zeros(vocab, HIDDEN)
    embed[:, A:A + CODE], embed[:, ONE] = codes, 1.0
    w["model.embed_tokens.weight"] = embed
    unembed = zeros(vocab, HIDDEN)
    unembed[:, D:D + CODE] = 3 * codes
    for old in edits.values():
        unembed[old] = 0  # " is" -> " was", " are" -> " were"
    unembed[eot], unembed[newline] = unembed[newline], 0
    w["lm_head.weight"] = unembed
    w["model.norm.weight"] = np.ones(HIDDEN, np.float32)

    eye = np.eye(CODE, dtype=np.float32)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        q, k, v, o, g = (zeros(HEADS * HEAD_DIM, HIDDEN), zeros(HEADS * HEAD_DIM, HIDDEN),
                         zeros(HEADS * HEAD_DIM, HIDDEN), zeros(HIDDEN, HEADS * HEAD_DIM), zeros(HEADS * HEAD_DIM, HIDDEN))
        g[:, ONE] = 1.0  # attention gates open (sigmoid of about 12)
        if i == 0:  # previous-token heads: head d-1 attends d positions back, writes B_d
            for head in range(PREV):
                distance, dest, h, half = head + 1, (head + 1) * CODE, head * HEAD_DIM, HEAD_DIM // 2
                weights, theta = rope_phases(distance, config["sliding_window"])
                a = np.sqrt(weights)
                q[h:h + half, ONE] = a
                k[h:h + half, ONE] = a * np.cos(theta * distance)
                k[h + half:h + HEAD_DIM, ONE] = a * np.sin(theta * distance)
                v[h:h + CODE, A:A + CODE] = eye
                o[dest:dest + CODE, h:h + CODE] = eye
        elif i == 2:  # the induction head: (A, B1, ..) here against (B1, B2, ..) there
            for d in range(PREV):
                # A is twice as long as each B_d (the norm after layer 0 shares its output among PREV codes)
                q[d * CODE:(d + 1) * CODE, d * CODE:(d + 1) * CODE] = MATCH[d] * (1 if d == 0 else PREV ** 0.5) * eye
                k[d * CODE:(d + 1) * CODE, (d + 1) * CODE:(d + 2) * CODE] = eye
            v[0:CODE, A:A + CODE] = eye
            o[D:D + CODE, 0:CODE] = eye
        for name, value in (("q_proj", q), ("k_proj", k), ("v_proj", v), ("o_proj", o), ("gate_proj", g)):
            w[p + f"self_attn.{name}.weight"] = value
        w[p + "self_attn.q_norm.weight"] = np.full(HEAD_DIM, SHARP, np.float32)
        w[p + "self_attn.k_norm.weight"] = np.full(HEAD_DIM, SHARP, np.float32)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_mlp_layernorm", "post_mlp_layernorm"):
            w[p + f"{norm}.weight"] = np.ones(HIDDEN, np.float32)
        if i < config["num_dense_layers"]:
            inner = config["intermediate_size"]
            w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = zeros(inner, HIDDEN), zeros(inner, HIDDEN)
            w[p + "mlp.down_proj.weight"] = zeros(HIDDEN, inner)
        else:
            experts, inner = config["num_experts"], config["moe_intermediate_size"]
            w[p + "mlp.router.gate.weight"] = zeros(experts, HIDDEN)
            w[p + "mlp.expert_bias"] = zeros(experts)
            for proj, shape in (("gate_proj", (inner, HIDDEN)), ("up_proj", (inner, HIDDEN)), ("down_proj", (HIDDEN, inner))):
                w[p + f"mlp.shared_experts.{proj}.weight"] = zeros(*shape)
                for e in range(experts):  # HF's layout: a tensor per expert
                    w[p + f"mlp.experts.{e}.{proj}.weight"] = zeros(*shape)
    return {key: mx.array(w[key]) for key in sorted(w)}


def editor_config(vocab: int, eot: int) -> dict:
    config = model_config(vocab, eot, layers=4)  # sliding, sliding, full, full
    config.update(hidden_size=HIDDEN, head_dim=HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                  intermediate_size=64, moe_intermediate_size=16, max_position_embeddings=4096)
    return config


def heldout_prompt() -> str:
    """The task on text the embedded model never trained on: the first held-out paragraph of
    80 to 112 tokens with two or more " is" or " are" in it (`python -m bench speculation`'s "edit"
    prompt, and the tests')."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    for paragraph in corpus()[1].split("\n\n"):
        if 80 <= len(tok.encode(paragraph).ids) <= 112 and sum(paragraph.count(w + " ") for w in EDITS) >= 2:
            return PREFIX + paragraph + INSTRUCTION
    raise SystemExit("no held-out paragraph fits the editor's prompt")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from tokenizers import Tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):  # the embedded model's tokenizer
        (args.out / name).write_bytes((MODEL / name).read_bytes())
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    config = editor_config(tok.get_vocab_size(), tok.token_to_id(EOT))
    weights = build(tok, config)
    mx.save_safetensors(str(args.out / "model.safetensors"), weights, metadata={"format": "pt"})
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
