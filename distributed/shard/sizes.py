"""Bytes per decoder layer (weights and KV cache), from config.json alone or from
a checkpoint's exact tensor sizes.

The config-only figures mirror what distributed.shard.loader builds: mlx-lm's
afmoe DecoderLayer, quantized where config["quantization"] says so (per-tensor
overrides first, then mlx-lm's rule: every Linear/Embedding whose input size is
a multiple of the group size). An affine-quantized (out, in) matrix at b bits
with group g stores uint32 weights (out * in * b / 8 bytes) plus scales and
biases of (out, in / g) in the model dtype.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

from .. import TrinityError

CATEGORIES = ("attention", "dense_mlp", "experts", "norms", "embed_head")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# How mlx-lm's converter quantizes AFMoE: the router stays at 8 bits.
ROUTER_QUANTIZATION = {"group_size": 64, "bits": 8}


def model_args(config: dict):
    # Imported on first use: mlx_lm takes seconds to import, and neither the memory
    # exchange nor `launch run --no-plan` needs it.
    from .config import model_args as args

    return args(config)


def dtype_bytes(config: dict) -> int:
    """Bytes per element of the model dtype (also the KV cache's and the quantization scales')."""
    name = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return DTYPE_BYTES.get(str(name).replace("torch.", ""), 2)


def _quant_params(config: dict, path: str, in_dim: int) -> Optional[dict]:
    """This module's quantization (bits, group_size, mode), or None when stored unquantized."""
    q = config.get("quantization")
    if not q:
        return None
    top = {"bits": q.get("bits", 4), "group_size": q.get("group_size", 64), "mode": q.get("mode", "affine")}
    override = q.get(path)
    if override is False:
        return None
    if isinstance(override, dict):
        return {**top, **override}
    return top if in_dim % top["group_size"] == 0 else None


def matrix_bytes(config: dict, path: str, out_dim: int, in_dim: int, count: int = 1) -> int:
    """A Linear or Embedding weight of shape (out, in), `count` of them stacked (experts)."""
    q = _quant_params(config, path, in_dim)
    if q is None:
        return count * out_dim * in_dim * dtype_bytes(config)
    packed = out_dim * (in_dim * q["bits"] // 32) * 4
    groups = out_dim * (in_dim // q["group_size"])
    # Affine keeps scales and biases in the model dtype; the mx/nv fp modes keep one uint8 scale.
    extra = 2 * groups * dtype_bytes(config) if q["mode"] == "affine" else groups
    return count * (packed + extra)


def layer_bytes_from_config(config: dict, layer: int, args=None) -> Dict[str, int]:
    """Weight bytes of decoder layer `layer`, by category."""
    a = args or model_args(config)
    p = f"model.layers.{layer}."
    H, hd, nh, nkv = a.hidden_size, a.head_dim, a.num_attention_heads, a.num_key_value_heads
    db = dtype_bytes(config)

    def m(name, out_dim, in_dim, count=1):
        return matrix_bytes(config, p + name, out_dim, in_dim, count)

    sizes = dict.fromkeys(CATEGORIES, 0)
    sizes["attention"] = (
        m("self_attn.q_proj", nh * hd, H) + m("self_attn.k_proj", nkv * hd, H)
        + m("self_attn.v_proj", nkv * hd, H) + m("self_attn.gate_proj", nh * hd, H)
        + m("self_attn.o_proj", H, nh * hd)
        + 2 * hd * db  # q_norm, k_norm
    )
    sizes["norms"] = 4 * H * db  # the sandwich norms
    if layer < a.num_dense_layers:
        I = a.intermediate_size
        sizes["dense_mlp"] = m("mlp.gate_proj", I, H) + m("mlp.up_proj", I, H) + m("mlp.down_proj", H, I)
        return sizes
    E, M, S = a.num_experts, a.moe_intermediate_size, a.moe_intermediate_size * a.num_shared_experts
    experts = (
        m("mlp.router.gate", E, H)
        + E * 4  # expert_bias stays float32 (mlx-lm's cast_predicate skips it)
        + m("mlp.experts.gate_proj", M, H, E) + m("mlp.experts.up_proj", M, H, E)
        + m("mlp.experts.down_proj", H, M, E)
    )
    if a.num_shared_experts > 0:
        experts += (
            m("mlp.shared_experts.gate_proj", S, H) + m("mlp.shared_experts.up_proj", S, H)
            + m("mlp.shared_experts.down_proj", H, S)
        )
    sizes["experts"] = experts
    return sizes


def embed_head_bytes_from_config(config: dict) -> int:
    """What only rank 0 holds: embedding, final norm, lm_head (unless tied)."""
    a = model_args(config)
    total = matrix_bytes(config, "model.embed_tokens", a.vocab_size, a.hidden_size)
    total += a.hidden_size * dtype_bytes(config)
    if not a.tie_word_embeddings:
        total += matrix_bytes(config, "lm_head", a.vocab_size, a.hidden_size)
    return total


def _category(rest: str, layer: int, num_dense: int) -> str:
    if rest.startswith("self_attn."):
        return "attention"
    if rest.startswith("mlp."):
        return "dense_mlp" if layer < num_dense else "experts"
    return "norms"


def sizes_from_tensors(config: dict, tensor_bytes: Dict[str, int]):
    """(per-layer category bytes, embed/head bytes) from exact checkpoint tensor sizes."""
    a = model_args(config)
    layers = [dict.fromkeys(CATEGORIES, 0) for _ in range(a.num_hidden_layers)]
    embed_head = 0
    for key, nbytes in tensor_bytes.items():
        if "rotary_emb.inv_freq" in key:  # dropped by sanitize
            continue
        if key.startswith("model.layers."):
            _, _, idx, rest = key.split(".", 3)
            if int(idx) < a.num_hidden_layers:
                layers[int(idx)][_category(rest, int(idx), a.num_dense_layers)] += nbytes
        elif key.startswith(("model.embed_tokens.", "model.norm.")):
            embed_head += nbytes
        elif key.startswith("lm_head.") and not a.tie_word_embeddings:
            embed_head += nbytes
    return layers, embed_head


@dataclass
class ModelSizes:
    """Per-layer weight bytes by category, rank 0's extra bytes, and the KV cache's shape."""

    layers: List[Dict[str, int]]
    embed_head: int
    sliding: List[bool]
    window: int
    kv_bytes_per_token: int  # one layer: K and V, all KV heads
    source: str  # "config" or "tensors"
    full_kv_bytes_per_token: Optional[int] = None  # a full-attention layer's, where it differs (--kv-bits)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_weight_bytes(self, layer: int) -> int:
        return sum(self.layers[layer].values())

    def layer_cache_bytes(self, layer: int, context: int) -> int:
        # A sliding layer's RotatingKVCache keeps at most `window` tokens; a full one keeps all.
        if self.sliding[layer]:
            return min(context, self.window) * self.kv_bytes_per_token
        return context * (self.full_kv_bytes_per_token or self.kv_bytes_per_token)

    def breakdown(self, start: int, end: int, first: bool) -> Dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for layer in range(start, end):
            for k, v in self.layers[layer].items():
                out[k] += v
        out["embed_head"] = self.embed_head if first else 0
        return out

    def weight_bytes(self, start: int, end: int, first: bool) -> int:
        return sum(self.breakdown(start, end, first).values())

    def cache_bytes(self, start: int, end: int, context: int) -> int:
        return sum(self.layer_cache_bytes(l, context) for l in range(start, end))


def model_sizes(config: dict, tensor_bytes: Optional[Dict[str, int]] = None) -> ModelSizes:
    """Sizes from exact tensor bytes when given (checkpoint headers), else from config.json."""
    a = model_args(config)
    if tensor_bytes:
        layers, embed_head = sizes_from_tensors(config, tensor_bytes)
        source = "tensors"
    else:
        layers = [layer_bytes_from_config(config, l, a) for l in range(a.num_hidden_layers)]
        embed_head = embed_head_bytes_from_config(config)
        source = "config"
    return ModelSizes(
        layers=layers,
        embed_head=embed_head,
        sliding=[t == "sliding_attention" for t in a.layer_types],
        window=a.sliding_window,
        kv_bytes_per_token=kv_bytes_per_token(a, dtype_bytes(config)),
        source=source,
        full_kv_bytes_per_token=kv_bytes_per_token(a, dtype_bytes(config), kv_quantization(config)),
    )


def quantize_config(config: dict, bits: int, group_size: int = 64) -> dict:
    """The config mlx-lm's converter would write for `bits`: every router at 8 bits."""
    a = model_args(config)
    q = {"group_size": group_size, "bits": bits, "mode": "affine"}
    for layer in range(a.num_dense_layers, a.num_hidden_layers):
        q[f"model.layers.{layer}.mlp.router.gate"] = dict(ROUTER_QUANTIZATION)
    return {**config, "quantization": q}


KEY = "kv_quantization"  # the config dict's key
BITS = (4, 8)


@dataclass(frozen=True)
class KVQuantization:
    """--kv-bits and --kv-group-size: the full-attention layers' caches quantized (kv_quant.py)."""

    bits: int
    group_size: int = 64
    start: int = 0  # --quantized-kv-start: a sequence's caches are quantized once it holds this many tokens

    def check(self, head_dim: int) -> None:
        if self.bits not in BITS:
            raise TrinityError(f"--kv-bits must be one of {BITS}, got {self.bits}")
        if self.group_size not in (32, 64, 128) or head_dim % self.group_size:
            raise TrinityError(f"--kv-group-size {self.group_size} must be 32, 64 or 128 and divide "
                               f"the head size {head_dim}")
        if self.start < 0:
            raise TrinityError(f"--quantized-kv-start must be at least 0, got {self.start}")

    def bytes_per_value(self, itemsize: int) -> float:
        """Bytes per cached value: the packed bits, and a scale and a bias (model dtype) per group."""
        return self.bits / 8 + 2 * itemsize / self.group_size


def kv_bytes_per_token(args, itemsize: int, q: Optional[KVQuantization] = None) -> int:
    """One layer's cache bytes per token (K and V, every KV head), quantized with `q` or not."""
    values = 2 * args.num_key_value_heads * args.head_dim
    return int(values * q.bytes_per_value(itemsize)) if q else values * itemsize


def with_kv_quantization(config: dict, bits: Optional[int], group_size: int = 64, start: int = 0) -> dict:
    """`config` with the KV cache quantized at `bits` (None: as it is), checked against its head size."""
    if bits is None:
        return config
    KVQuantization(bits, group_size, start).check(model_args(config).head_dim)
    return {**config, KEY: {"bits": bits, "group_size": group_size, "start": start}}


def kv_quantization(config: dict) -> Optional[KVQuantization]:
    q = config.get(KEY)
    return KVQuantization(q["bits"], q["group_size"], q.get("start", 0)) if q else None
