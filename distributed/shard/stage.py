"""One pipeline stage: decoder layers [start, end) of an AFMoE model.

The layer math is mlx-lm's (`mlx_lm.models.afmoe.DecoderLayer`); this module
only slices the model. The first stage (rank 0) also holds the embedding and
the tail (final norm, lm_head or the tied embedding); the others hold neither.
"""

import math
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import afmoe
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache


class Stage(nn.Module):
    def __init__(self, args: afmoe.ModelArgs, start: int, end: int, first: bool):
        super().__init__()
        self.args = args
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
        return [
            RotatingKVCache(max_size=self.args.sliding_window)
            if layer.use_sliding
            else KVCache()
            for layer in self.layers
        ]

    def __call__(self, h: mx.array, cache: Optional[List] = None) -> mx.array:
        if cache is None:
            cache = [None] * len(self.layers)
        # Masks come from this stage's own caches: a stage may hold no
        # full-attention layer, or no sliding one.
        full_cache = next((c for l, c in zip(self.layers, cache) if not l.use_sliding), None)
        sliding_cache = next((c for l, c in zip(self.layers, cache) if l.use_sliding), None)
        full_mask = create_attention_mask(h, full_cache)
        sliding_mask = create_attention_mask(
            h, sliding_cache, window_size=self.args.sliding_window
        )
        for layer, c in zip(self.layers, cache):
            h = layer(h, sliding_mask if layer.use_sliding else full_mask, cache=c)
        return h
