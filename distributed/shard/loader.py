"""Loading one rank's slice of a checkpoint, and nothing else.

Both layouts load: HF (per-expert keys, fp32/bf16) and mlx-community (experts
pre-stacked, quantized, with per-tensor overrides in config["quantization"]).
Tensors are loaded lazily and only this rank's are evaluated; with a Hugging
Face repo id only the files that hold this rank's tensors are downloaded.
"""

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Set

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import afmoe

from .. import TrinityError
from .config import model_args, read_config
from .hub import snapshot, where
from .sizes import kv_quantization
from .stage import Stage

INDEX_FILE = "model.safetensors.index.json"
# Everything but the weights: config, tokenizer, chat template.
METADATA_PATTERNS = [
    "*.json",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
]
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def weight_map(model_path: Path) -> Dict[str, str]:
    """Checkpoint key -> file name, from the index or the single weight file."""
    index = model_path / INDEX_FILE
    if index.exists():
        with open(index) as f:
            return json.load(f)["weight_map"]
    files = sorted(model_path.glob("model*.safetensors"))
    if not files:
        raise TrinityError(f"no model*.safetensors and no {INDEX_FILE} in {model_path}")
    return {key: f.name for f in files for key in mx.load(str(f))}


def to_stage_key(key: str, start: int, end: int, first: bool) -> Optional[str]:
    """Map a checkpoint key to this stage's parameter name, or None if not ours."""
    m = _LAYER_KEY.match(key)
    if m:
        layer = int(m.group(1))
        return f"layers.{layer - start}.{m.group(2)}" if start <= layer < end else None
    if not first:
        return None
    for prefix, local in (("model.embed_tokens.", "embed_tokens."), ("model.norm.", "norm."), ("lm_head.", "lm_head.")):
        if key.startswith(prefix):
            return local + key[len(prefix):]
    return None


def to_checkpoint_key(stage_key: str, start: int) -> str:
    """The inverse of to_stage_key, for per-tensor quantization overrides."""
    if stage_key.startswith("layers."):
        _, idx, rest = stage_key.split(".", 2)
        return f"model.layers.{int(idx) + start}.{rest}"
    if stage_key.startswith("lm_head"):
        return stage_key
    return "model." + stage_key


def local_files(wmap: Dict[str, str], start: int, end: int, first: bool) -> Set[str]:
    return {f for k, f in wmap.items() if to_stage_key(k, start, end, first) is not None}


def _is_local(model: str) -> bool:
    return Path(model).exists() or model.startswith((".", "/", "~")) or model.count("/") != 1


def model_dir(model: str, flag: str = "--model") -> Path:
    """A local directory as is; for a Hugging Face repo id, a snapshot of its
    config and tokenizer files only (weights come with fetch_stage_files)."""
    if _is_local(model):
        path = Path(model).expanduser()
        if path.exists() and not path.is_dir():
            raise TrinityError(f"{flag} {model} is a file: give the checkpoint's folder (the one with config.json)")
        if not path.is_dir():
            raise TrinityError(f"{flag} {model}: no such folder (nor a Hugging Face repo id, which reads owner/name)")
        return path
    path = snapshot(model, METADATA_PATTERNS)
    if not (path / "config.json").exists():
        raise TrinityError(f"{flag} {model}: the repo on {where()} has no config.json")
    return path


def fetch_stage_files(model: str, start: int, end: int, first: bool, path: Optional[Path] = None) -> Path:
    """Download only the weight files holding this stage's tensors (progress bars on).
    `path`: model_dir(model), when the caller has it already."""
    path = path or model_dir(model)
    if _is_local(model):
        return path
    if not (path / INDEX_FILE).exists():
        return snapshot(model, METADATA_PATTERNS + ["model*.safetensors"], revision=path.name)
    files = sorted(local_files(weight_map(path), start, end, first))
    # A hub snapshot's folder is named after its commit: the weights come from
    # the commit that config.json and the index came from, even if the repo moved on.
    fetched = snapshot(model, METADATA_PATTERNS + files, revision=path.name)
    missing = [f for f in files if not (fetched / f).exists()]
    if missing:
        raise TrinityError(f"--model {model}: its {INDEX_FILE} names {missing[0]}, which layers [{start}, {end}) "
                           f"need, but the repo on {where()} has no such file")
    return fetched


def _load_tensors(model_path: Path, wmap: Dict[str, str], start: int, end: int, first: bool):
    """Lazily load this stage's tensors, keyed by checkpoint name."""
    wanted: Dict[str, List[str]] = {}
    for key, fname in wmap.items():
        if to_stage_key(key, start, end, first) is not None:
            wanted.setdefault(fname, []).append(key)
    tensors = {}
    for fname, keys in sorted(wanted.items()):
        fpath = model_path / fname
        if not fpath.exists():
            raise TrinityError(
                f"weight file {fname} is missing from {model_path} "
                f"(it holds {keys[0]} and {len(keys) - 1} more tensors for layers [{start}, {end}))"
            )
        loaded = mx.load(str(fpath))  # lazy: nothing is read until evaluated
        for key in keys:
            if key not in loaded:
                raise TrinityError(f"tensor {key} is listed in {INDEX_FILE} but missing from {fname}")
            tensors[key] = loaded[key]
    return tensors


def _quantize(stage: Stage, quantization: dict, weights: Dict[str, mx.array]):
    """Quantize the modules that the checkpoint stores quantized, each at its own bits."""

    def predicate(path: str, module: nn.Module):
        override = quantization.get(to_checkpoint_key(path, stage.start))
        if override is not None:
            return override
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        from mlx_lm.utils import infer_quant_config  # its module imports transformers: only when quantizing

        return infer_quant_config(path, module, weights)

    nn.quantize(
        stage,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


def load_stage(model_path: Path, start: int, end: int, first: bool, config: Optional[dict] = None,
               group=None) -> Stage:
    """Build the stage for layers [start, end) and load its weights (evaluated). `group`: a
    tensor-parallel group (tensor.py) of more than one rank; this rank keeps its slice of each
    layer, evaluated layer by layer (a layer's whole tensors are read, their slices kept)."""
    model_path = Path(model_path)
    config = config or read_config(model_path)
    args = model_args(config)
    tensors = _load_tensors(model_path, weight_map(model_path), start, end, first)
    # mlx-lm's afmoe sanitize stacks HF per-expert keys and drops rotary
    # buffers; it only needs `args`, and it skips layers we did not load.
    tensors = afmoe.Model.sanitize(SimpleNamespace(args=args), tensors)
    weights = {to_stage_key(k, start, end, first): v for k, v in tensors.items()}

    stage = Stage(args, start, end, first, kv_quantization(config))
    if config.get("quantization"):
        _quantize(stage, config["quantization"], weights)
    expected = {k for k, _ in tree_flatten(stage.parameters())}
    missing = sorted(expected - weights.keys())
    if missing:
        names = [to_checkpoint_key(k, start) for k in missing]
        raise TrinityError(
            f"checkpoint {model_path} is missing tensor {names[0]}"
            + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")
        )
    unexpected = sorted(weights.keys() - expected)
    if unexpected:
        raise TrinityError(
            f"checkpoint {model_path} has unexpected tensor {to_checkpoint_key(unexpected[0], start)}"
            " for this model config"
        )
    stage.load_weights(list(weights.items()), strict=True)
    stage.eval()
    if group is not None and group.size() > 1:
        from .tensor import shard_stage

        shard_stage(stage, group)
        for layer in stage.layers:
            mx.eval(layer.parameters())
    mx.eval(stage.parameters())
    return stage


def parameter_bytes(module: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))
