"""Draft checkpoints for a test checkpoint: the same tokenizer, fewer layers."""

import json
import shutil
from pathlib import Path

import mlx.core as mx


def truncated_draft(source: Path, out: Path, layers: int) -> Path:
    """The checkpoint's first `layers` layers with its embedding and head (as LayerSkip's
    self-drafting uses a model's early layers): a draft right often, not always."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config.update(num_hidden_layers=layers, layer_types=config["layer_types"][:layers])
    weights = {}
    for f in sorted(source.glob("model*.safetensors")):
        for key, value in mx.load(str(f)).items():
            if not key.startswith("model.layers.") or int(key.split(".")[2]) < layers:
                weights[key] = value
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in source.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out
