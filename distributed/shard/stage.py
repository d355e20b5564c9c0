"""One pipeline stage: decoder layers [start, end) of an AFMoE model.

The layer math is mlx-lm's (`mlx_lm.models.afmoe.DecoderLayer`); this module
only slices the model, compiles its layers' elementwise tails (fused.py), and gives
its MoE layers experts that pack a batch's tokens per expert where the device gains
from it (experts.py). The first stage (rank 0)
also holds the embedding and the tail (final norm, lm_head or the tied embedding);
the others hold neither.
"""

import math
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import afmoe
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from . import fused
from .experts import Experts, dense_block_tokens, dense_tokens, packed_tokens
from .kv_quant import QuantizedKVCache
from .sizes import KVQuantization


class Stage(nn.Module):
    def __init__(self, args: afmoe.ModelArgs, start: int, end: int, first: bool,
                 kv_quantization: Optional[KVQuantization] = None):
        super().__init__()
        self.args = args
        self.kv_quantization = kv_quantization  # --kv-bits: the full-attention caches' (kv_quant.py)
        self.start, self.end, self.first = start, end, first
        if first:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
            self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
            if not args.tie_word_embeddings:
                self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.layers = [
            afmoe.DecoderLayer(
                args, layer_idx=i, use_sliding=args.layer_types[i] == "sliding_attention"
            )
            for i in range(start, end)
        ]
        for layer in self.layers:
            fused.fuse(layer)
            if isinstance(layer.mlp, afmoe.AfmoeMoE):
                shape = (args.hidden_size, args.moe_intermediate_size, args.num_experts)
                layer.mlp.experts = Experts(*shape, packed_tokens(), dense_tokens(*shape), dense_block_tokens())

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.embed_tokens(tokens)
        if self.args.mup_enabled:
            h = h * math.sqrt(self.args.hidden_size)
        return h

    def head(self, h: mx.array) -> mx.array:
        h = self.norm(h)
        if self.args.tie_word_embeddings:
            return self.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def make_cache(self) -> list:
        q = self.kv_quantization  # with a start, SlotCaches quantizes them later
        return [
            RotatingKVCache(max_size=self.args.sliding_window)
            if layer.use_sliding
            else QuantizedKVCache(q.group_size, q.bits) if q and not q.start
            else KVCache()
            for layer in self.layers
        ]

    def __call__(self, h: mx.array, cache: Optional[List] = None) -> mx.array:
        if cache is None:
            cache = [None] * len(self.layers)
        full_mask, sliding_mask = self._masks(h, cache)
        for layer, c in zip(self.layers, cache):
            h = layer(h, sliding_mask if layer.use_sliding else full_mask, cache=c)
        return h

    def mixed(self, parts: List[Tuple[mx.array, List]]) -> List[mx.array]:
        """Several batches, each (hidden states, its caches), through the layers in one
        pass: attention per batch, with its own caches and masks, and the MLP or MoE
        over all their tokens together, so the expert weights are read once for all
        (a decode step and a prefill chunk in one frame). Each layer is mlx-lm's
        DecoderLayer.__call__ with the attention half taken per batch."""
        masks = [self._masks(h, cache) for h, cache in parts]
        hs = [h for h, _ in parts]
        for i, layer in enumerate(self.layers):
            hs = [
                h + layer.post_attention_layernorm(
                    layer.self_attn(layer.input_layernorm(h), m[1] if layer.use_sliding else m[0], cache[i]))
                for h, m, (_, cache) in zip(hs, masks, parts)
            ]
            flat = flatten(hs)
            flat = flat + layer.post_mlp_layernorm(layer.mlp(layer.pre_mlp_layernorm(flat)))
            hs = unflatten(flat, [h.shape for h in hs])
        return hs

    def _masks(self, h: mx.array, cache: List) -> Tuple:
        """(full-attention mask, sliding-window mask) for `h` after `cache`. They come
        from this stage's own caches: a stage may hold no full-attention layer, or no
        sliding one."""
        full_cache = next((c for l, c in zip(self.layers, cache) if not l.use_sliding), None)
        sliding_cache = next((c for l, c in zip(self.layers, cache) if l.use_sliding), None)
        return (create_attention_mask(h, full_cache),
                create_attention_mask(h, sliding_cache, window_size=self.args.sliding_window))


def flatten(hs: List[mx.array]) -> mx.array:
    """Arrays (rows, length, hidden) as one (1, tokens, hidden), their tokens in order."""
    return mx.concatenate([h.reshape(1, -1, h.shape[-1]) for h in hs], axis=1)


def unflatten(flat: mx.array, shapes: List[Tuple[int, ...]]) -> List[mx.array]:
    """Split (1, tokens, hidden) back into arrays of `shapes` (their tokens in order)."""
    out, start = [], 0
    for shape in shapes:
        n = shape[0] * shape[1]
        out.append(flat[:, start:start + n].reshape(shape))
        start += n
    return out
