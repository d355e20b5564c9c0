"""Byte counts: Trinity configs against figures worked out by hand, and the tiny
checkpoints against what the loader really holds."""

import json

import pytest

from distributed.shard.config import read_config
from distributed.shard.loader import INDEX_FILE, load_stage, parameter_bytes
from distributed.shard.sizes import model_sizes, quantize_config
from distributed.shard.tiny_checkpoint import make_checkpoint
from distributed.shard.checkpoint import local_tensor_sizes
from trinity_configs import MINI_BF16, MINI_Q4, NANO_BF16, hand_cache, hand_layer, mini, nano, q4, q8


@pytest.mark.parametrize("config, table", [(mini(), MINI_BF16), (nano(), NANO_BF16), (quantize_config(mini(), 4), MINI_Q4)],
                         ids=["mini-bf16", "nano-bf16", "mini-4bit"])
def test_trinity_layer_bytes_match_hand_figures(config, table):
    sizes = model_sizes(config)
    assert sizes.embed_head == table["embed_head"]
    for layer in range(config["num_hidden_layers"]):
        assert sizes.layer_weight_bytes(layer) == hand_layer(table, layer), layer
    assert sizes.breakdown(0, 3, True) == {
        "attention": 3 * table["attention"], "dense_mlp": 2 * table["dense_mlp"], "experts": table["experts"],
        "norms": 3 * table["norms"], "embed_head": table["embed_head"],
    }


def test_trinity_totals_are_the_published_sizes():
    # 26B and 6B parameters: bf16 totals of about 52 and 12 GB; Mini 4-bit about 14.7 GB.
    def total(c):
        s = model_sizes(c)
        return s.weight_bytes(0, s.num_layers, True)

    assert total(mini()) == 2 * hand_layer(MINI_BF16, 0) + 30 * hand_layer(MINI_BF16, 2) + MINI_BF16["embed_head"]
    assert 52.0e9 < total(mini()) < 52.5e9
    assert 12.0e9 < total(nano()) < 12.5e9
    assert 14.5e9 < total(quantize_config(mini(), 4)) < 14.9e9


@pytest.mark.parametrize("context", [1, 2048, 2049, 32768, 131072])
def test_cache_bytes_sliding_bounded_full_grows(context):
    for kind, config in (("mini", mini()), ("nano", nano())):
        sizes = model_sizes(config)
        n = config["num_hidden_layers"]
        assert sizes.cache_bytes(0, n, context) == hand_cache(kind, 0, n, context)
    # Mini at 32768 tokens: 8 full layers * 32768 * 2 KiB + 24 sliding * 2048 * 2 KiB.
    if context == 32768:
        assert model_sizes(mini()).cache_bytes(0, 32, context) == 8 * 64 * 2**20 + 24 * 4 * 2**20


def test_quantization_overrides_per_tensor():
    config = quantize_config(mini(), 4)
    config["quantization"]["model.layers.5.mlp.experts.down_proj"] = {"bits": 8, "group_size": 64}
    config["quantization"]["model.layers.6.self_attn.q_proj"] = False  # left unquantized
    sizes = model_sizes(config)
    assert sizes.layers[5]["experts"] == MINI_Q4["experts"] - 128 * q4(2048, 1024) + 128 * q8(2048, 1024)
    assert sizes.layers[6]["attention"] == MINI_Q4["attention"] - q4(4096, 2048) + 4096 * 2048 * 2


@pytest.mark.parametrize("layout", ["hf", "mlx"])
def test_tiny_checkpoint_bytes_equal_the_loaded_stage(layout, hf_checkpoint, mlx_checkpoint):
    path = hf_checkpoint if layout == "hf" else mlx_checkpoint
    config = read_config(path)
    from_config = model_sizes(config)
    from_headers = model_sizes(config, local_tensor_sizes(path))
    assert from_headers.source == "tensors"
    for start, end in [(0, 8), (0, 3), (3, 8), (1, 2), (4, 8)]:
        first = start == 0
        loaded = parameter_bytes(load_stage(path, start, end, first, config))
        assert from_config.weight_bytes(start, end, first) == loaded, (start, end)
        assert from_headers.weight_bytes(start, end, first) == loaded, (start, end)
    index = json.loads((path / INDEX_FILE).read_text())  # the checkpoint's own total: a cross-check
    assert index["metadata"]["total_size"] == from_config.weight_bytes(0, 8, True)


def test_tied_embeddings_count_once(tmp_path):
    path = make_checkpoint(tmp_path, layout="hf", num_hidden_layers=4, tie_word_embeddings=True)
    config = read_config(path)
    loaded = parameter_bytes(load_stage(path, 0, 2, True, config))
    assert model_sizes(config).weight_bytes(0, 2, True) == loaded
    assert model_sizes(config, local_tensor_sizes(path)).weight_bytes(0, 2, True) == loaded
