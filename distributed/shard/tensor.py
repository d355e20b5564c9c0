"""Tensor parallelism (--tensor-parallel-size T): every rank holds 1/T of every layer.

The split is mlx-lm's `shard()` (deepseek_v3.py, qwen3_moe.py, llama.py) for AFMoE, which
mlx-lm's afmoe.py lacks, built from mlx.nn's distributed layers (mlx.nn.layers.distributed):

- attention by KV-head groups: q, k, v and AFMoE's attention gate (`gate_proj`, whose sigmoid
  multiplies each head's output) all-to-sharded, `o_proj` sharded-to-all (its all_sum is the
  attention's one collective). Rank r holds query heads [r n/T, (r+1) n/T) and KV heads
  [r k/T, (r+1) k/T): contiguous blocks keep each query head with its KV head (GQA).
  q_norm / k_norm act per head (weights of head_dim) and stay whole on every rank.
- dense MLP and the shared expert by columns: gate / up all-to-sharded, down sharded-to-all.
- routed experts: every rank holds every expert, 1/T of its intermediate width (shard_inplace of
  SwitchGLU's projections, as mlx-lm's deepseek / qwen3_moe shard does). Why this and not whole
  experts per rank (expert parallelism): the router is replicated, so every rank picks the same
  top-k and the work splits evenly whatever the routing (whole experts would load one rank with
  every token's hot experts, and need an all-to-all MLX has not); no token moves between ranks;
  and the routed experts, the shared expert and the dense MLP all end in one partial sum, so a
  MoE layer costs one all_sum (in ShardedMoE), like a dense one. It needs moe_intermediate_size
  divisible by T (1024 on Trinity-Mini, 256 on Nano), not num_experts.
- embedding, final norm and lm_head replicated (every rank embeds the token ids it is told;
  only rank 0 runs the head).

So a layer costs two all_sums of (tokens, hidden_size) per forward pass; KV caches hold each
rank's KV heads only (1/T of the bytes).
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx_lm.models import afmoe

from .. import TrinityError


class ShardedMoE(afmoe.AfmoeMoE):
    """AfmoeMoE whose experts and shared expert hold 1/T of their intermediate width: each
    rank's output is a partial sum (the router is replicated, so every rank weighs its slice
    of the same experts alike), summed over the group once, after the shared expert."""

    sharding_group: Optional[mx.distributed.Group] = None

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(super().__call__(x), group=self.sharding_group)


def check_tensor_size(args: afmoe.ModelArgs, size: int, quantization: Optional[dict] = None) -> None:
    """Raise TrinityError naming the numbers, unless T = `size` splits this model evenly."""
    if size < 1:
        raise TrinityError(f"--tensor-parallel-size must be at least 1, got {size}")
    if size == 1:
        return
    checks = [
        ("attention heads (num_attention_heads)", args.num_attention_heads),
        ("KV heads (num_key_value_heads)", args.num_key_value_heads),
    ]
    if args.num_dense_layers > 0:
        checks.append(("the dense MLP width (intermediate_size)", args.intermediate_size))
    if args.num_hidden_layers > args.num_dense_layers:
        checks.append(("the experts' width (moe_intermediate_size)", args.moe_intermediate_size))
    bad = [f"{name} = {n}" for name, n in checks if n % size]
    if bad:
        raise TrinityError(f"--tensor-parallel-size {size} must divide " + ", ".join(bad)
                           + f": every rank holds 1/{size} of each")
    if quantization:
        # A sharded-to-all projection splits its input width: each rank's part must be whole groups.
        group = quantization.get("group_size", 64)
        widths = [("o_proj input (heads x head_dim)", args.num_attention_heads * args.head_dim)]
        widths += [(name.split(" (")[0], n) for name, n in checks[2:]]
        bad = [f"{name} / {size} = {n // size}" for name, n in widths if (n // size) % group]
        if bad:
            raise TrinityError(f"--tensor-parallel-size {size}: a quantized checkpoint's rank must hold whole groups "
                               f"of {group}, but " + ", ".join(bad))


def shard_stage(stage: nn.Module, group: mx.distributed.Group) -> None:
    """Shard every layer of `stage` (shard/stage.py) across `group`, in place and lazily: only
    this rank's slices are evaluated (the caller evaluates layer by layer)."""
    size = group.size()
    for layer in stage.layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "gate_proj"):
            setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
        attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
        attn.n_heads //= size
        attn.n_kv_heads //= size
        mlp = layer.mlp
        if isinstance(mlp, afmoe.AfmoeMoE):
            mlp.__class__ = ShardedMoE
            mlp.sharding_group = group
            parts = [mlp.experts] + ([mlp.shared_experts] if hasattr(mlp, "shared_experts") else [])
            for part in parts:
                shard_inplace(part.gate_proj, "all-to-sharded", group=group)
                shard_inplace(part.up_proj, "all-to-sharded", group=group)
                shard_inplace(part.down_proj, "sharded-to-all", group=group)
        else:
            mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
            mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
            mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
