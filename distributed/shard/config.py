"""Reading config.json into mlx-lm's AFMoE ModelArgs."""

import json
from pathlib import Path

from mlx_lm.models import afmoe

from .. import TrinityError

SUPPORTED_MODEL_TYPES = ("afmoe",)
# mlx-lm's ModelArgs defaults every size to Trinity-Mini's: a config without these
# would load as the wrong shape, or fail with a KeyError.
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
# What mlx_lm.models.rope_utils.initialize_rope builds (it raises on any other, mid-load).
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "deepseek_yarn", "telechat3-yarn", "longrope",
              "proportional", "mrope")


def read_config(model_path: Path) -> dict:
    path = Path(model_path) / "config.json"
    if not path.exists():
        raise TrinityError(f"config.json not found in {model_path}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise TrinityError(f"{path} is not valid JSON: {e}") from e


def model_args(config: dict) -> afmoe.ModelArgs:
    """ModelArgs from either checkpoint layout's config.

    HF transformers >= 5 writes RoPE settings as `rope_parameters`; mlx-lm's
    ModelArgs only knows `rope_theta` / `rope_scaling`, and would silently fall
    back to its default theta, so translate here.
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise TrinityError(
            f"unsupported model_type {model_type!r} in config.json "
            f"(this runner supports {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    missing = [k for k in REQUIRED_KEYS if k not in config]
    if missing:
        raise TrinityError(f"config.json lacks {', '.join(missing)} (every {model_type} config.json has them)")
    config = dict(config)
    rope = config.get("rope_parameters")
    if rope:
        config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            config.setdefault("rope_scaling", rope)
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("type") or scaling.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise TrinityError(f"config.json's RoPE type {kind!r} is not one mlx-lm implements ({', '.join(ROPE_TYPES)})")
    if "layer_types" not in config:
        every = config.get("global_attn_every_n_layers", 4)
        config["layer_types"] = [
            "sliding_attention" if (i + 1) % every else "full_attention"
            for i in range(config["num_hidden_layers"])
        ]
    args = afmoe.ModelArgs.from_dict(config)
    if len(args.layer_types) != args.num_hidden_layers:
        raise TrinityError(
            f"config.json has {len(args.layer_types)} layer_types for "
            f"{args.num_hidden_layers} layers"
        )
    return args
