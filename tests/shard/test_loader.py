"""Loading one rank's shard: only its tensors, both layouts, clear errors."""

import json
import shutil

import mlx.core as mx
import pytest

from distributed import TrinityError
from distributed.shard.loader import load_stage, local_files, parameter_bytes, weight_map

LAYOUTS = ["hf_checkpoint", "mlx_checkpoint"]


def checkpoint_bytes(path, start, end, first):
    """Bytes of the checkpoint tensors that belong to layers [start, end) (+ embed/norm/head)."""
    total = 0
    for fname in set(weight_map(path).values()):
        for key, value in mx.load(str(path / fname)).items():
            if key.startswith("model.layers."):
                mine = start <= int(key.split(".")[2]) < end
            else:
                mine = first
            total += value.nbytes if mine else 0
    return total


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("split", [[(0, 8)], [(0, 3), (3, 4), (4, 8)]])
def test_each_stage_holds_exactly_its_layers(request, layout, split):
    path = request.getfixturevalue(layout)
    for i, (start, end) in enumerate(split):
        stage = load_stage(path, start, end, first=i == 0)
        assert parameter_bytes(stage) == checkpoint_bytes(path, start, end, i == 0)
        assert ("embed_tokens" in stage) == ("lm_head" in stage) == (i == 0)


def test_quantized_router_keeps_its_own_bits(mlx_checkpoint):
    stage = load_stage(mlx_checkpoint, 2, 4, first=False)
    layer = stage.layers[0]
    assert layer.mlp.router.gate.bits == 8
    assert layer.mlp.experts.gate_proj.bits == 4
    assert layer.self_attn.q_proj.bits == 4


def test_a_middle_stage_needs_only_its_own_files(hf_checkpoint, tmp_path):
    needed = local_files(weight_map(hf_checkpoint), 3, 6, first=False)
    assert len(needed) < len(set(weight_map(hf_checkpoint).values()))
    for f in hf_checkpoint.iterdir():
        if f.suffix != ".safetensors" or f.name in needed:
            shutil.copy(f, tmp_path / f.name)
    stage = load_stage(tmp_path, 3, 6, first=False)
    assert [layer.layer_idx for layer in stage.layers] == [3, 4, 5]


def test_missing_weight_file_is_named(hf_checkpoint, tmp_path):
    shutil.copytree(hf_checkpoint, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model-00002-of-00003.safetensors").unlink()
    load_stage(tmp_path / "ckpt", 0, 3, first=True)  # does not need that file
    with pytest.raises(TrinityError, match="model-00002-of-00003.safetensors is missing"):
        load_stage(tmp_path / "ckpt", 3, 6, first=False)


def test_missing_tensor_is_named(hf_checkpoint, tmp_path):
    shutil.copytree(hf_checkpoint, tmp_path / "ckpt")
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"]["model.layers.4.self_attn.k_norm.weight"]
    index.write_text(json.dumps(data))
    with pytest.raises(TrinityError, match=r"missing tensor model\.layers\.4\.self_attn\.k_norm\.weight"):
        load_stage(tmp_path / "ckpt", 3, 6, first=False)


def test_unknown_model_type_is_named(hf_checkpoint, tmp_path):
    shutil.copytree(hf_checkpoint, tmp_path / "ckpt")
    config = tmp_path / "ckpt" / "config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), model_type="llama")))
    with pytest.raises(TrinityError, match="unsupported model_type 'llama'"):
        load_stage(tmp_path / "ckpt", 0, 8, first=True)
