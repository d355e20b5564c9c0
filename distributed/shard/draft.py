"""The draft model for speculative decoding (--draft-model), which rank 0 holds beside
its stage: a small AFMoE checkpoint that shares the target's tokenizer, loaded whole
(every layer, its embedding and head), and the memory it takes."""

from pathlib import Path
from typing import Union

from .. import TrinityError
from .config import model_args, read_config
from .loader import fetch_stage_files, load_stage, model_dir
from .sizes import model_sizes
from .stage import Stage

# Positions a proposal may take back at once (runtime/draft_model.py): a sliding layer's
# buffer holds its window and this many more.
ROLLBACK = 64


def draft_config(model: str) -> tuple:
    """(its folder, its config.json) for --draft-model (a folder, or a repo id: config only)."""
    path = model_dir(model, flag="--draft-model")
    return path, read_config(path)


def draft_bytes(config: dict, context: int, sequences: int) -> int:
    """The draft's weights and `sequences` sequences' caches of `context` tokens, at most
    (runtime/draft_model.py: a sliding layer keeps its window and ROLLBACK positions more, a
    full-attention layer every position in a buffer grown by doubling, up to twice as many)."""
    sizes = model_sizes(config)
    window = model_args(config).sliding_window
    slots = sum(min(context, window + ROLLBACK) if kind == "sliding_attention" else 2 * context
                for kind in model_args(config).layer_types)
    return sizes.weight_bytes(0, sizes.num_layers, True) + sequences * slots * sizes.kv_bytes_per_token


def draft_reserve(model: Union[str, dict, None], context: int, sequences: int) -> int:
    """draft_bytes for --draft-model `model` (a folder or repo id, or its config; 0 without
    one): what rank 0 is planned to hold beside its layers, `sequences` being the ranks (one
    speculating sequence each at most)."""
    if not model:
        return 0
    return draft_bytes(model if isinstance(model, dict) else draft_config(model)[1], context, sequences)


def load_draft(model: str, target_tokenizer) -> Stage:
    """The draft, evaluated; refused unless its tokenizer's vocabulary is the target's."""
    from mlx_lm.utils import load_tokenizer

    path, config = draft_config(model)
    if load_tokenizer(Path(path)).get_vocab() != target_tokenizer.get_vocab():
        raise TrinityError(f"--draft-model {model}: its tokenizer is not the model's (a draft must share it: "
                           "its tokens are the model's tokens)")
    layers = model_args(config).num_hidden_layers
    return load_stage(fetch_stage_files(model, 0, layers, True, path), 0, layers, True, config)
