"""The KV cache kept quantized (--kv-bits): the full-attention layers' caches hold their keys and
values as mlx-lm's QuantizedKVCache does (packed integers, a scale and a bias per group of
`group_size` values of a head), and attention reads them quantized (mlx-lm's
quantized_scaled_dot_product_attention). Sliding-window caches stay whole: they hold a window
only, and mlx-lm has no quantized rotating cache.

The choice travels in the config dict (sizes.with_kv_quantization), so every consumer of the
config (the stage's caches, the sizes the planner and the memory checks count) sees the same bytes.

mlx-lm has no batch of quantized caches: BatchQuantizedKVCache is its BatchKVCache run on each of
the three arrays (packed values, scales, biases) in turn. Every one of BatchKVCache's operations
(merge, extend, filter, extract, left and right padding) moves whole positions along the token
axis, and a quantized position is one row of each of the three arrays.
"""

from typing import List

import mlx.core as mx
from mlx.utils import tree_map, tree_reduce
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import BatchKVCache, KVCache

class QuantizedKVCache(mlx_cache.QuantizedKVCache):
    """mlx-lm's QuantizedKVCache with what a batch takes of a plain cache: its size, and merge."""

    def size(self):
        return self.offset

    @classmethod
    def merge(cls, caches):
        return BatchQuantizedKVCache.merge(caches)


class BatchQuantizedKVCache(BatchKVCache):
    """mlx-lm's BatchKVCache holding (packed, scales, biases) triples as QuantizedKVCache does."""

    def __init__(self, left_padding: List[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits

    def _parts(self) -> List[BatchKVCache]:
        """A BatchKVCache per array of the triples, each with this cache's row bookkeeping."""
        parts = []
        for j in range(3):
            part = BatchKVCache.__new__(BatchKVCache)
            # Arrays of their own: BatchKVCache updates some in place (finalize's `left_padding += `).
            vars(part).update({k: mx.array(v) if isinstance(v, mx.array) else v for k, v in vars(self).items()})
            part.keys = None if self.keys is None else self.keys[j]
            part.values = None if self.values is None else self.values[j]
            parts.append(part)
        return parts

    def _gather(self, parts: List[BatchKVCache]) -> None:
        vars(self).update({k: v for k, v in vars(parts[0]).items() if k not in ("keys", "values")})
        if parts[0].keys is not None:
            self.keys = tuple(p.keys for p in parts)
            self.values = tuple(p.values for p in parts)

    def _each(self, method, *others) -> None:
        """BatchKVCache.`method` on each array, with the matching array of each of `others`."""
        parts = self._parts()
        for j, part in enumerate(parts):
            method(part, *(o[j] for o in others))
        self._gather(parts)

    def update_and_fetch(self, keys, values):
        q = [mx.quantize(x, group_size=self.group_size, bits=self.bits) for x in (keys, values)]
        self._each(BatchKVCache.update_and_fetch, *q)
        return self.keys_and_values()

    def keys_and_values(self):
        return tree_map(lambda x: x[..., : self._idx, :], (self.keys, self.values))

    def finalize(self):
        self._each(BatchKVCache.finalize)

    def filter(self, batch_indices):
        self._each(lambda part: BatchKVCache.filter(part, batch_indices))

    def extend(self, other):
        self._each(BatchKVCache.extend, other._parts())

    def extract(self, idx):
        out = QuantizedKVCache(self.group_size, self.bits)
        rows = [BatchKVCache.extract(part, idx) for part in self._parts()]
        out.keys, out.values = tuple(r.keys for r in rows), tuple(r.values for r in rows)
        out.offset = rows[0].offset
        return out

    @classmethod
    def merge(cls, caches):
        out = cls([0] * len(caches), caches[0].group_size, caches[0].bits)
        parts = [BatchKVCache.merge([plain(c, j) for c in caches]) for j in range(3)]
        out._gather(parts)
        return out

    @property
    def nbytes(self):
        return tree_reduce(lambda a, x: a + x.nbytes, (self.keys, self.values), 0)


def quantized(cache, group_size: int, bits: int):
    """A whole full-attention cache (KVCache or BatchKVCache) as a quantized one, its positions
    quantized as mlx-lm's KVCache.to_quantized does (--quantized-kv-start: once it holds enough)."""
    batch = isinstance(cache, BatchKVCache)
    out = BatchQuantizedKVCache([0], group_size, bits) if batch else QuantizedKVCache(group_size, bits)
    if batch:
        vars(out).update({k: v for k, v in vars(cache).items() if k not in ("keys", "values")})
    out.offset = cache.offset
    if cache.keys is not None:
        out.keys, out.values = (mx.quantize(x, group_size=group_size, bits=bits) for x in (cache.keys, cache.values))
    return out


def plain(cache: QuantizedKVCache, j: int) -> KVCache:
    """Array j of a quantized cache's triples as a KVCache (for BatchKVCache.merge)."""
    out = KVCache()
    if cache.keys is not None:
        out.keys, out.values = cache.keys[j], cache.values[j]
    out.offset = cache.offset
    return out

