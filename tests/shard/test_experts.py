"""Experts: a batch's tokens packed per expert, or run on weights dequantized for the call, give what
mlx-lm's SwitchGLU gives them sorted, for whole and quantized weights, and a stage whose MoE layers
take either way for every batch decodes as mlx-lm's does."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.switch_layers import SwitchGLU

from distributed.runtime.caches import SlotCaches
from distributed.shard.experts import Experts, dense_block_tokens, dense_tokens, packed_tokens
from distributed.shard.loader import load_stage

EVERY_COUNT = range(1, 1 << 20)


WAYS = {"packed": dict(packed=EVERY_COUNT), "dense": dict(dense=EVERY_COUNT),
        "dense_block": dict(dense=EVERY_COUNT, dense_block=EVERY_COUNT)}


def pair(bits, way="packed"):
    """mlx-lm's SwitchGLU with random weights, and Experts holding the same ones, taking `way` for
    every token count."""
    reference = SwitchGLU(64, 32, 8)
    experts = Experts(64, 32, 8, **WAYS[way])
    if bits:
        nn.quantize(reference, group_size=32, bits=bits)
        nn.quantize(experts, group_size=32, bits=bits)
    experts.update(reference.parameters())
    return reference, experts


@pytest.mark.parametrize("way", list(WAYS))
@pytest.mark.parametrize("bits", [0, 4])
@pytest.mark.parametrize("shape", [(1, 1), (5, 1), (17, 1), (2, 9)])  # decode batches; a prefill chunk
def test_packed_or_dense_pairs_equal_mlx_lms_sorted_ones(way, bits, shape):
    reference, experts = pair(bits, way)
    x = mx.random.normal((*shape, 64), key=mx.random.key(shape[0]))
    scores = mx.random.uniform(shape=(*shape, 8), key=mx.random.key(7))
    inds = mx.argpartition(-scores, kth=2, axis=-1)[..., :3]
    want, got = reference(x, inds), experts(x, inds)
    assert got.shape == want.shape == (*shape, 3, 64)
    assert mx.array_equal(got, want).item()  # each token's products are the same arithmetic


def test_a_token_count_outside_the_range_takes_mlx_lms_path():
    reference, experts = pair(0)
    experts.packed = range(0)
    x, inds = mx.ones((4, 1, 64)), mx.array([[[0, 1, 2]]] * 4)
    assert mx.array_equal(experts(x, inds), reference(x, inds)).item()
    assert packed_tokens() == dense_tokens(2048, 1024, 128) == dense_block_tokens() == range(0)  # this CPU: mlx-lm's


def test_dense_prefill_only_where_a_layer_dequantized_fits():
    """On CUDA, Trinity-Mini's layer (128 experts of 2,048 x 1,024: 1.5 GiB in bf16) runs its prefill
    chunks on dequantized weights; a layer four times as wide keeps the quantized path."""
    assert 2048 in dense_tokens(2048, 1024, 128, cuda=True) and 128 not in dense_tokens(2048, 1024, 128, cuda=True)
    assert dense_tokens(4096, 2048, 128, cuda=True) == range(0)
    assert dense_tokens(2048, 1024, 128, cuda=False) == range(0)


@pytest.mark.parametrize("way", list(WAYS))
def test_a_stage_taking_either_way_for_every_batch_decodes_as_it_does_sorted(hf_checkpoint, way):
    sorted_stage = load_stage(hf_checkpoint, 0, 8, first=True)
    packed_stage = load_stage(hf_checkpoint, 0, 8, first=True)
    moe = [layer.mlp.experts for layer in packed_stage.layers if hasattr(layer.mlp, "experts")]
    assert moe, "the checkpoint has MoE layers"
    for experts in moe:
        for key, counts in WAYS[way].items():
            setattr(experts, key, counts)
    prompt = mx.array([[(7 * i + r) % 250 + 1 for i in range(12)] for r in range(4)], dtype=mx.uint32)
    tokens = []
    for stage in (sorted_stage, packed_stage):
        caches = SlotCaches(stage).get(0)
        step, out = prompt, []
        for _ in range(6):
            logits = stage.head(stage(stage.embed(step), caches))[:, -1]
            step = mx.argmax(logits, axis=-1)[:, None].astype(mx.uint32)
            out.append((logits, step.flatten().tolist()))
        tokens.append(out)
    for (a, ta), (b, tb) in zip(*tokens):
        assert ta == tb
        assert mx.array_equal(a, b).item()
