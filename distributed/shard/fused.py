"""mlx-lm's AFMoE attention and MoE, their elementwise tails compiled.

A decode step is many small kernels: Trinity-Mini's 32 layers launch about 50 each, and on one H100 a
step of 1 to 8 rows spends most of its time inside mx.async_eval, building and launching them, with the
device seldom the one waited for (docs/benchmarks.md). The chains of elementwise operations around the
matrix products need no kernel of their own each: mx.compile fuses
the router's scores (sigmoid, expert bias, top-k, normalisation, scale: 10 operations), the experts'
weighted sum with the shared expert (4) and the attention gate (2), as mlx-lm already compiles its
SwiGLU. Each is the same arithmetic in the same order and dtypes as mlx-lm's `afmoe` (bitwise equal:
tests/shard/test_fused.py); only the grouped routing (n_group > 1) and softmax scores keep mlx-lm's
call. On a CPU a step costs the same either way (the arithmetic dominates); what it saves on a GPU is
measured by `bench/gpu_step.sh anatomy` (mlx-lm's model with these tails: the `fused` variant).
"""

import functools

import mlx.core as mx
from mlx_lm.models import afmoe


@functools.lru_cache(maxsize=None)
def router(k: int, scale: float, norm: bool):
    """The router after its gate: the top-k experts by biased sigmoid score, and their weights."""

    def route(gates: mx.array, expert_bias: mx.array):
        scores = mx.sigmoid(gates.astype(mx.float32))
        inds = mx.stop_gradient(mx.argpartition(-(scores + expert_bias), kth=k - 1, axis=-1)[..., :k])
        chosen = mx.take_along_axis(scores, inds, axis=-1)
        if norm:
            chosen = chosen / chosen.sum(axis=-1, keepdims=True)
        return inds, chosen * scale

    return mx.compile(route)


@mx.compile
def weighted(y: mx.array, weights: mx.array) -> mx.array:
    return (y * weights[..., None]).sum(axis=-2).astype(y.dtype)


@mx.compile
def weighted_plus(y: mx.array, weights: mx.array, shared: mx.array) -> mx.array:
    return (y * weights[..., None]).sum(axis=-2).astype(y.dtype) + shared


@mx.compile
def gated(out: mx.array, gate: mx.array) -> mx.array:
    return out * mx.sigmoid(gate)


class MoE(afmoe.AfmoeMoE):
    def __call__(self, x: mx.array) -> mx.array:
        if self.score_func != "sigmoid" or self.n_group > 1:
            return super().__call__(x)
        k = self.num_experts_per_tok
        inds, weights = router(k, self.route_scale, self.route_norm and k > 1)(self.router(x), self.expert_bias)
        y = self.experts(x, inds)
        if self.args.num_shared_experts > 0:
            return weighted_plus(y, weights, self.shared_experts(x))
        return weighted(y, weights)


class Attention(afmoe.Attention):
    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3))
        keys = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3))
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if self.is_local_attention and self.rope is not None:
            offset = 0 if cache is None else cache.offset
            queries, keys = self.rope(queries, offset=offset), self.rope(keys, offset=offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        out = afmoe.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(gated(out.transpose(0, 2, 1, 3).reshape(B, L, -1), self.gate_proj(x)))


def fuse(layer: afmoe.DecoderLayer) -> None:
    """`layer` (mlx-lm's) runs with its tails compiled: the same parameters, names and results."""
    layer.self_attn.__class__ = Attention
    if isinstance(layer.mlp, afmoe.AfmoeMoE):
        layer.mlp.__class__ = MoE
