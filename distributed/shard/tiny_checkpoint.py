"""Deterministic tiny AFMoE checkpoints with a tokenizer, for tests; and where the
embedded default model lies.

Two layouts, as found in the wild:
- "hf": HF transformers layout, float32, per-expert keys
  (`mlp.experts.{e}.{gate,up,down}_proj.weight`), `rope_parameters`.
- "mlx": mlx-community layout, experts stacked, 4-bit with the router at 8 bits
  recorded as a per-tensor override in config["quantization"].

Weights come from numpy's PCG64 generator, so the same seed gives the same
bytes on every machine and version (the committed HF reference fixture relies
on it). Nothing is downloaded.

The default model (no --model) is not one of these random checkpoints: it is
trained, and its files ship in `tiny_model/` beside this module.
"""

import contextlib
import hashlib
import io
import json
from pathlib import Path
from typing import Dict

import numpy as np

from .. import TrinityError

DEFAULT_MODEL = Path(__file__).resolve().parent / "tiny_model"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_config(**overrides) -> dict:
    """An HF-style AFMoE config.json: 8 layers (3 sliding then 1 full, twice), window 16."""
    num_layers = overrides.pop("num_hidden_layers", 8)
    config = {
        "architectures": ["AfmoeForCausalLM"],
        "model_type": "afmoe",
        "vocab_size": 256 + len(SPECIAL_TOKENS),
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_hidden_layers": num_layers,
        "num_dense_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        # Not mlx-lm's default theta, so a lost rope_parameters translation shows up.
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
        "tie_word_embeddings": False,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "route_scale": 2.826,
        "sliding_window": 16,
        "global_attn_every_n_layers": 4,
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(num_layers)
        ],
        "mup_enabled": True,
        "torch_dtype": "float32",
        "eos_token_id": [256 + SPECIAL_TOKENS.index("<|im_end|>"), 256],
        "pad_token_id": 256,
    }
    config.update(overrides)
    return config


def large_structure_config(**overrides) -> dict:
    """Trinity-Large's layer structure (launch/configs/presets/trinity-large.json) at toy
    width: 60 layers, the first 6 dense, 256 routed experts top-4 plus 1 shared, 6:1
    query:KV heads, every 4th layer full attention, Large's router settings. Hidden 32
    and experts 4 wide keep it about 21 MB in float32; the window of 12 wraps within a
    40-token prompt and again while decoding."""
    config = tiny_config(
        num_hidden_layers=60, num_dense_layers=6, num_experts=256, num_experts_per_tok=4, num_shared_experts=1,
        hidden_size=32, intermediate_size=64, moe_intermediate_size=4,
        num_attention_heads=6, num_key_value_heads=1, head_dim=8, sliding_window=12,
        route_scale=2.826, route_norm=True, n_group=1, topk_group=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config.update(overrides)
    return config


def _hf_weights(config: dict, seed: int) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    H, V = config["hidden_size"], config["vocab_size"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    E, M = config["num_experts"], config["moe_intermediate_size"]
    S = M * config["num_shared_experts"]

    def linear(out_dim, in_dim):
        return rng.normal(0.0, in_dim**-0.5, (out_dim, in_dim)).astype(np.float32)

    def norm(dim):
        return (1.0 + 0.1 * rng.normal(size=dim)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.normal(0.0, H**-0.5, (V, H)).astype(np.float32)}
    for l in range(config["num_hidden_layers"]):
        p = f"model.layers.{l}."
        w[p + "self_attn.q_proj.weight"] = linear(nh * hd, H)
        w[p + "self_attn.k_proj.weight"] = linear(nkv * hd, H)
        w[p + "self_attn.v_proj.weight"] = linear(nkv * hd, H)
        w[p + "self_attn.gate_proj.weight"] = linear(nh * hd, H)
        w[p + "self_attn.o_proj.weight"] = linear(H, nh * hd)
        w[p + "self_attn.q_norm.weight"] = norm(hd)
        w[p + "self_attn.k_norm.weight"] = norm(hd)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_mlp_layernorm", "post_mlp_layernorm"):
            w[p + name + ".weight"] = norm(H)
        if l < config["num_dense_layers"]:
            I = config["intermediate_size"]
            w[p + "mlp.gate_proj.weight"] = linear(I, H)
            w[p + "mlp.up_proj.weight"] = linear(I, H)
            w[p + "mlp.down_proj.weight"] = linear(H, I)
            continue
        w[p + "mlp.router.gate.weight"] = linear(E, H)
        w[p + "mlp.expert_bias"] = rng.normal(0.0, 0.05, E).astype(np.float32)
        for e in range(E):
            w[p + f"mlp.experts.{e}.gate_proj.weight"] = linear(M, H)
            w[p + f"mlp.experts.{e}.up_proj.weight"] = linear(M, H)
            w[p + f"mlp.experts.{e}.down_proj.weight"] = linear(H, M)
        w[p + "mlp.shared_experts.gate_proj.weight"] = linear(S, H)
        w[p + "mlp.shared_experts.up_proj.weight"] = linear(S, H)
        w[p + "mlp.shared_experts.down_proj.weight"] = linear(H, S)
    w["model.norm.weight"] = norm(H)
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = linear(V, H)
    return w


def weights_fingerprint(weights: Dict[str, np.ndarray]) -> str:
    """sha256 over sorted keys and raw bytes: ties a reference fixture to its weights."""
    h = hashlib.sha256()
    for key in sorted(weights):
        h.update(key.encode())
        h.update(np.ascontiguousarray(weights[key]).tobytes())
    return h.hexdigest()


def _file_of(key: str, layers_per_file: int, num_files: int) -> int:
    if key.startswith("model.layers."):
        return int(key.split(".")[2]) // layers_per_file
    return 0 if key.startswith("model.embed_tokens") else num_files - 1


def _save_sharded(path: Path, weights: dict, num_layers: int, layers_per_file: int, fmt: str):
    """Several files, grouped by layer, plus model.safetensors.index.json."""
    import mlx.core as mx

    num_files = -(-num_layers // layers_per_file)
    names = [f"model-{i + 1:05d}-of-{num_files:05d}.safetensors" for i in range(num_files)]
    shards = [{} for _ in names]
    for key, value in weights.items():
        shards[_file_of(key, layers_per_file, num_files)][key] = mx.array(value)
    weight_map = {}
    for name, shard in zip(names, shards):
        mx.save_safetensors(str(path / name), shard, metadata={"format": fmt})
        weight_map.update({k: name for k in shard})
    total = sum(int(np.prod(v.shape)) * v.itemsize for v in shards_values(shards))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def shards_values(shards):
    for shard in shards:
        yield from shard.values()


def write_tokenizer(path: Path, vocab_size: int = 256 + len(SPECIAL_TOKENS)):
    """A byte-level BPE tokenizer (no merges: one token per byte) plus ChatML specials,
    padded with placeholder tokens `<tN>` up to `vocab_size` (for full-size model shapes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_chars + SPECIAL_TOKENS)}
    vocab.update({f"<t{i}>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "chat_template": CHATML_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def _byte_of(char: str) -> int:
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+n.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    code = ord(char)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def make_checkpoint(path, layout: str = "hf", seed: int = 0, layers_per_file: int = 3, config: dict = None,
                    quantize: bool = True, **overrides) -> Path:
    """Write a tiny AFMoE checkpoint (config, weights, tokenizer) to `path`: `config` (else
    tiny_config()) with `overrides`. `quantize=False` keeps the mlx layout's stacked
    experts in float32, so it can be held to HF's outputs."""
    if layout not in ("hf", "mlx"):
        raise ValueError(f"unknown layout {layout!r} (expected 'hf' or 'mlx')")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(config, **overrides) if config is not None else tiny_config(**overrides)
    weights = _hf_weights(config, seed)
    if layout == "mlx":
        weights, config = _to_mlx_layout(weights, config, quantize)
    _save_sharded(path, weights, config["num_hidden_layers"], layers_per_file, "pt" if layout == "hf" else "mlx")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path, config["vocab_size"])
    return path


def _to_mlx_layout(weights: dict, config: dict, quantize: bool = True):
    """Stack experts and (unless told not to) quantize as mlx-lm's converter does:
    4-bit, router 8-bit."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import afmoe
    from mlx_lm.utils import quantize_model

    from .config import model_args

    mlx_config = {k: v for k, v in config.items() if k != "rope_parameters"}
    mlx_config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    model = afmoe.Model(model_args(mlx_config))
    stacked = model.sanitize({k: mx.array(v) for k, v in weights.items()})
    model.load_weights(list(stacked.items()), strict=True)
    if not quantize:
        return {k: np.array(v) for k, v in tree_flatten(model.parameters())}, mlx_config
    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints a summary
        model, mlx_config = quantize_model(model, mlx_config, group_size=64, bits=4)
    out = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    return out, mlx_config


def default_checkpoint() -> Path:
    """The embedded default model: a tiny AFMoE trained on English text that ships with
    Python (scripts/train_tiny_model.py made it), shipped as package data."""
    if not (DEFAULT_MODEL / "model.safetensors").exists():
        raise TrinityError(f"the embedded default model is missing from {DEFAULT_MODEL} "
                           "(an install without package data?): pass --model")
    return DEFAULT_MODEL
