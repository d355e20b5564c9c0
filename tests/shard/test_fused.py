"""The layers' compiled tails (shard/fused.py) give mlx-lm's afmoe results bit for bit: the MoE and the
attention of the tiny checkpoint, for decode batches and a prefill chunk, with and without caches."""

import mlx.core as mx
import pytest
from mlx_lm.models import afmoe
from mlx_lm.models.cache import KVCache, RotatingKVCache

from distributed.shard import fused
from distributed.shard.loader import load_stage


def layers_of(hf_checkpoint, compiled: bool):
    stage = load_stage(hf_checkpoint, 0, 8, first=True)
    if not compiled:  # mlx-lm's own classes back
        for layer in stage.layers:
            layer.self_attn.__class__ = afmoe.Attention
            if isinstance(layer.mlp, afmoe.AfmoeMoE):
                layer.mlp.__class__ = afmoe.AfmoeMoE
    return stage


def test_every_layer_of_a_stage_is_fused(hf_checkpoint):
    stage = load_stage(hf_checkpoint, 0, 8, first=True)
    assert all(type(layer.self_attn) is fused.Attention for layer in stage.layers)
    moe = [layer.mlp for layer in stage.layers if isinstance(layer.mlp, afmoe.AfmoeMoE)]
    assert moe and all(type(m) is fused.MoE for m in moe)


@pytest.mark.parametrize("shape", [(1, 1), (6, 1), (2, 13)])
def test_fused_layers_equal_mlx_lms(hf_checkpoint, shape):
    ours, theirs = layers_of(hf_checkpoint, True), layers_of(hf_checkpoint, False)
    x = mx.random.normal((*shape, ours.args.hidden_size), key=mx.random.key(shape[0]))
    for a, b in zip(ours.layers, theirs.layers):
        assert mx.array_equal(a.mlp(x), b.mlp(x)).item()
        caches = [RotatingKVCache(max_size=ours.args.sliding_window) if a.use_sliding else KVCache() for _ in range(2)]
        prompt = mx.random.normal((shape[0], 5, ours.args.hidden_size), key=mx.random.key(9))
        for layer, cache in zip((a, b), caches):
            layer.self_attn(prompt, "causal", cache)  # a history first: offsets and rope
        assert mx.array_equal(a.self_attn(x, None if shape[1] == 1 else "causal", caches[0]),
                              b.self_attn(x, None if shape[1] == 1 else "causal", caches[1])).item()
        assert mx.array_equal(a.self_attn(x, "causal" if shape[1] > 1 else None),
                              b.self_attn(x, "causal" if shape[1] > 1 else None)).item()


def test_the_router_matches_mlx_lms_choice_and_weights():
    k, scale = 4, 2.5
    gates = mx.random.normal((9, 1, 32), key=mx.random.key(1)).astype(mx.bfloat16) * 3
    bias = mx.random.normal((32,), key=mx.random.key(2)) * 0.05
    inds, weights = fused.router(k, scale, True)(gates, bias)
    scores = mx.sigmoid(gates.astype(mx.float32))
    want = mx.argpartition(-(scores + bias), kth=k - 1, axis=-1)[..., :k]
    chosen = mx.take_along_axis(scores, want, axis=-1)
    assert mx.array_equal(inds, want).item()
    assert mx.array_equal(weights, chosen / chosen.sum(axis=-1, keepdims=True) * scale).item()
