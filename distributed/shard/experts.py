"""An AFMoE layer's routed experts, and how a batch's tokens reach them.

mlx-lm's SwitchGLU sorts a step's (token, expert) pairs by expert and runs each projection as one
gather_qmm with one row per pair. MLX's CUDA gather_qmm does not gain from the sorting: at 64 tokens
(512 pairs over Trinity-Mini's 128 experts) it runs 512 one-row products. Packing each expert's tokens
into a block of its own, one (experts, tokens, hidden) array, turns them into one batched matrix
product per projection, every expert's weights read once. On an H100 a Trinity-Mini layer then takes
(scripts/moe_kernels.py, ms, sorted -> packed): 64 tokens 1.52 -> 1.16, 128 tokens 2.87 -> 2.00,
512 tokens 10.5 -> 6.8, 2,048 tokens 41.0 -> 25.3; but 48 tokens 1.17 -> 1.28 and fewer worse still
(docs/benchmarks.md). The block is as tall as the batch, so no count has to come back to the host: a
token picks an expert at most once. Each token's products are the same arithmetic either way (equal
outputs on CPU and GPU).

So `Experts` packs on CUDA from 64 tokens to a prefill chunk's 2,048 and keeps mlx-lm's path
everywhere else (Metal's gather_qmm has its own kernel for sorted pairs; not measured here).

Chunks of 1,024 tokens and more run mlx-lm's sorted pairs on the weights dequantized for the call
(`dense`), one bf16 gather_mm per projection: MLX's CUDA 4-bit gather_qmm reaches about 8 TFLOP/s
there, a bf16 product many times that. On an H100 at Trinity-Mini's shape a 2,048-token prompt alone
then reaches its first token in 255 ms against 790 ms, and 64 streams of 128-token prompts give
1.19-1.33x the tokens a second (docs/benchmarks.md; CUDA_DENSE_TOKENS, MOST_DEQUANTIZED_BYTES;
bench/gpu_step.sh dense measures it again).
"""

from typing import Optional

import mlx.core as mx
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, _gather_sort, _scatter_unsort

# Token counts packed per expert on a CUDA device (measured on an H100: scripts/moe_kernels.py).
CUDA_PACKED_TOKENS = range(64, 2049)  # 2,048: a prefill chunk
# Token counts run on weights dequantized for the call (a prefill chunk): measured on an H100 at Trinity-Mini's
# shape (scripts/moe_kernels.py, 2026-12-08), one MoE layer: 1,024 tokens 4.9 against 12.8 ms packed, 2,048
# tokens 5.3 against 24.9, 4,096 tokens 7.9 against 81.5; at 256 tokens the packed block dequantized 3.1 against
# 3.9 packed (sorted pairs dequantized: 4.5); at 64 tokens packed wins (1.3 against 3.1).
CUDA_DENSE_TOKENS = range(256, 1 << 31)
# Of those, the counts run as the packed block (dequantized) rather than as sorted pairs: at 256 tokens
# 3.1 against 4.5 ms, at 1,024 4.9 either way, at 2,048 7.6 against 5.3 (from 257 to 1,023 interpolated:
# bench/gpu_step.sh moe measures 384, 512 and 768).
CUDA_DENSE_BLOCK_TOKENS = range(0, 1024)
MOST_DEQUANTIZED_BYTES = 2 << 30  # one layer's three projections in bf16 at most (Trinity-Mini's: 1.5 GiB),
# held for the call beside the quantized ones: a wider model keeps the quantized path until measured
MOST_BLOCK_BYTES = 1 << 30  # the packed block's size at most (Trinity-Mini's at 2,048 tokens; the MLP's
# activations beside it take as much again), so that a wider model's chunk stays on mlx-lm's path


def on_cuda() -> bool:
    return mx.cuda.is_available() and mx.default_device() == mx.gpu


def packed_tokens() -> range:
    """The token counts this process runs packed: on a CUDA GPU, its default device."""
    return CUDA_PACKED_TOKENS if on_cuda() else range(0)


def dense_tokens(hidden: int, inner: int, experts: int, cuda: Optional[bool] = None) -> range:
    """The token counts this process (or one on a CUDA GPU: `cuda`) runs on dequantized weights:
    on a CUDA GPU, prefill chunks, where a layer's experts dequantized (bf16) take
    MOST_DEQUANTIZED_BYTES at most."""
    fits = 3 * experts * hidden * inner * 2 <= MOST_DEQUANTIZED_BYTES
    return CUDA_DENSE_TOKENS if (on_cuda() if cuda is None else cuda) and fits else range(0)


def dense_block_tokens() -> range:
    """The token counts this process runs as a packed block where it runs them dequantized."""
    return CUDA_DENSE_BLOCK_TOKENS if on_cuda() else range(0)


def dequantized(proj) -> mx.array:
    """A projection's weights as (experts, in, out) in the activations' dtype."""
    if not isinstance(proj, QuantizedSwitchLinear):
        return proj.weight.swapaxes(-1, -2)
    return mx.dequantize(proj.weight, proj.scales, proj.get("biases"), group_size=proj.group_size,
                         bits=proj.bits, mode=proj.mode).swapaxes(-1, -2)


class Experts(SwitchGLU):
    """mlx-lm's SwitchGLU (the same parameters and checkpoint names), with `packed`: the token counts
    whose pairs go to the experts packed per expert rather than sorted, `dense`: those run on
    dequantized weights (dense wins where both hold), and `dense_block`: those of `dense` run as the
    packed block rather than as sorted pairs."""

    def __init__(self, hidden: int, inner: int, num_experts: int, packed: range = range(0),
                 dense: range = range(0), dense_block: range = range(0)):
        super().__init__(hidden, inner, num_experts)
        self.packed = packed
        self.dense = dense
        self.dense_block = dense_block

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        k = indices.shape[-1]
        tokens = indices.size // k
        fits = self.up_proj.num_experts * tokens * x.shape[-1] * x.dtype.size <= MOST_BLOCK_BYTES
        dense = tokens in self.dense and not {"bias", "global_scale"} & set(self.up_proj)  # (AFMoE's have neither)
        if dense and not (tokens in self.dense_block and fits):
            return self.run_dense(x, indices)
        if not dense and (tokens not in self.packed or not fits):
            return super().__call__(x, indices)
        out = self.run_packed(x.reshape(tokens, -1), indices.reshape(tokens, k), dense)
        return out.reshape(*indices.shape, -1)

    def run_dense(self, x: mx.array, indices: mx.array) -> mx.array:
        """mlx-lm's sorted pairs, each projection one gather_mm on its weights dequantized for the call."""
        x, idx, inv_order = _gather_sort(mx.expand_dims(x, (-2, -3)), mx.stop_gradient(indices))
        up = mx.gather_mm(x, dequantized(self.up_proj), rhs_indices=idx, sorted_indices=True)
        gate = mx.gather_mm(x, dequantized(self.gate_proj), rhs_indices=idx, sorted_indices=True)
        out = mx.gather_mm(self.activation(up, gate), dequantized(self.down_proj), rhs_indices=idx,
                           sorted_indices=True)
        return _scatter_unsort(out, inv_order, indices.shape).squeeze(-2)

    def run_packed(self, x: mx.array, indices: mx.array, dense: bool = False) -> mx.array:
        """(tokens, k, hidden), each projection one batched gather_qmm over every expert's block, or
        (`dense`) one batched product on its weights dequantized for the call."""
        block, place = pack_per_expert(x, indices, self.up_proj.num_experts)
        every = mx.arange(block.shape[0])
        project = (lambda proj, h: h @ dequantized(proj)) if dense else (lambda proj, h: proj(h, every))
        h = self.activation(project(self.up_proj, block), project(self.gate_proj, block))
        return unpack(project(self.down_proj, h), place, indices.shape)


def pack_per_expert(x: mx.array, indices: mx.array, experts: int) -> tuple:
    """(tokens, hidden) and their (tokens, k) experts -> the (experts, tokens, hidden) block, and each
    pair's place in it: pair p = (token p // k, expert indices.flat[p]) sits at (expert, its rank among
    that expert's pairs)."""
    tokens, k = indices.shape
    flat = mx.stop_gradient(indices).flatten()
    order = mx.argsort(flat)
    by_expert = flat[order]
    counts = mx.zeros((experts,), mx.int32).at[flat].add(1)
    first = mx.cumsum(counts) - counts  # where each expert's pairs start in `order`
    place = by_expert * tokens + (mx.arange(tokens * k) - first[by_expert])
    block = mx.zeros((experts * tokens, x.shape[-1]), x.dtype).at[place].add(x[order // k])
    place_of_pair = mx.zeros((tokens * k,), mx.int32).at[order].add(place)
    return block.reshape(experts, tokens, -1), place_of_pair


def unpack(out: mx.array, place_of_pair: mx.array, shape: tuple) -> mx.array:
    """A block's outputs back in pair order: (*shape, hidden)."""
    return out.reshape(-1, out.shape[-1])[place_of_pair].reshape(*shape, -1)
