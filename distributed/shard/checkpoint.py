"""What the planner needs from a checkpoint without loading it: config.json and,
when cheaply available, every tensor's exact size.

Exact sizes come from the safetensors headers (a few KB at the start of each
file; the weights are not read) or, for a Hugging Face repo id, from the Hub's
header metadata. Either way nothing but headers is fetched.
"""

import json
import struct
from pathlib import Path
from typing import Dict, Optional, Tuple

from .config import read_config
from .loader import INDEX_FILE, _is_local, model_dir

SAFETENSORS_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
    "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}


def resolve(model: Optional[str]) -> Tuple[str, Path]:
    """(model as given, local folder holding its config). None is the embedded tiny model."""
    if model is None:
        from .tiny_checkpoint import default_checkpoint

        model = str(default_checkpoint())
    return model, model_dir(model)


def load_config(model: Optional[str]) -> Tuple[str, Path, dict]:
    model, path = resolve(model)
    return model, path, read_config(path)


def header_sizes(file: Path) -> Dict[str, int]:
    """Tensor name -> bytes, from one safetensors file's header only."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def local_tensor_sizes(path: Path) -> Optional[Dict[str, int]]:
    """Exact sizes when every weight file is present locally, else None."""
    index = path / INDEX_FILE
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(f.name for f in path.glob("model*.safetensors"))
    if not files or not all((path / f).exists() for f in files):
        return None
    sizes: Dict[str, int] = {}
    for f in files:
        sizes.update(header_sizes(path / f))
    return sizes


def hub_tensor_sizes(repo: str) -> Optional[Dict[str, int]]:
    """Exact sizes from the Hub's safetensors header metadata; None when unavailable."""
    try:
        from huggingface_hub import get_safetensors_metadata

        meta = get_safetensors_metadata(repo)
        return {
            name: SAFETENSORS_BYTES[info.dtype] * _numel(info.shape)
            for fmeta in meta.files_metadata.values()
            for name, info in fmeta.tensors.items()
        }
    except Exception:  # offline, gated, or not safetensors: fall back to config.json
        return None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def tensor_sizes(model: str, path: Path) -> Optional[Dict[str, int]]:
    if _is_local(model):
        return local_tensor_sizes(path)
    return local_tensor_sizes(path) or hub_tensor_sizes(model)
