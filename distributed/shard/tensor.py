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
from .fused import MoE


class ShardedMoE(MoE):
    """AfmoeMoE (its tails compiled: fused.py) whose experts and shared expert hold 1/T of their intermediate width: each
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


class _NoGradients:
    """Inference only. An all-to-sharded layer uses its group for nothing but sum_gradients (a
    vjp that all_sums gradients), and MLX's custom_function keeps a reference to the group for
    every call made: the group never dies, and MLX's MPI backend, which finalizes when it
    does, never finalizes (mpirun then calls every rank's exit improper). A group of one has
    no gradients to sum."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _all_to_sharded(linear: nn.Module, group) -> nn.Module:
    sharded = shard_linear(linear, "all-to-sharded", group=group)
    sharded.group = _NoGradients()
    return sharded


def shard_stage(stage: nn.Module, group: mx.distributed.Group) -> None:
    """Shard every layer of `stage` (shard/stage.py) across `group`, in place and lazily: only
    this rank's slices are evaluated (the caller evaluates layer by layer)."""
    size = group.size()
    for layer in stage.layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "gate_proj"):
            setattr(attn, name, _all_to_sharded(getattr(attn, name), group))
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
            mlp.gate_proj = _all_to_sharded(mlp.gate_proj, group)
            mlp.up_proj = _all_to_sharded(mlp.up_proj, group)
            mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)



def release_group(stage: nn.Module) -> None:
    """Once the ranks have stopped: drop the sharded layers' references to their group, which
    the stage (held by the scheduler's cycles) would keep past the interpreter's teardown, so
    MLX's MPI backend finalizes (when the group's last reference goes) before the exit."""
    for _, module in stage.named_modules():
        for name in ("group", "sharding_group"):
            if getattr(module, name, None) is not None:
                setattr(module, name, None)
