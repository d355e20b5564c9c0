"""Decode speed with the KV cache quantized (--kv-bits) against whole, at long contexts: the
embedded model's stage (P=1, every layer), its caches filled with random keys and values at a
context of N tokens (a decode step's cost does not depend on their values, and prefilling 32k
tokens on a 2-core CPU takes minutes), then greedy steps timed, per CPU second of this process
(wall time swings with whatever else the machine runs) and per wall second.

    python scripts/kv_bits_decode.py [--contexts 8192,32768] [--steps 128] [--reps 3]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository

from distributed.shard.config import read_config
from distributed.shard.loader import load_stage
from distributed.shard.sizes import with_kv_quantization
from distributed.shard.tiny_checkpoint import default_checkpoint

BITS = (None, 8, 4)


def filled(stage, n: int) -> list:
    """The stage's caches at n tokens of random keys and values (a sliding one: its window)."""
    a = stage.args
    caches = stage.make_cache()
    for c in caches:
        held = min(n, a.sliding_window) if isinstance(c, RotatingKVCache) else n
        k, v = (mx.random.normal((1, a.num_key_value_heads, held, a.head_dim)) for _ in range(2))
        if isinstance(c, RotatingKVCache):
            c._idx = held
        elif not isinstance(c, KVCache):  # quantized
            k, v = (mx.quantize(x, group_size=c.group_size, bits=c.bits) for x in (k, v))
        c.keys, c.values, c.offset = k, v, n
    mx.eval([c.state for c in caches])
    return caches


def decode(stage, n: int, steps: int):
    """(tokens per CPU second, tokens per wall second) of `steps` greedy steps after n tokens."""
    caches, token = filled(stage, n), mx.array([[1]])
    for i in range(steps + 8):  # 8 warm-up steps
        if i == 8:
            cpu, wall = time.process_time(), time.perf_counter()
        token = mx.argmax(stage.head(stage(stage.embed(token), caches))[:, -1:], axis=-1)
        mx.eval(token)
    return steps / (time.process_time() - cpu), steps / (time.perf_counter() - wall)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="8192,32768")
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    path = default_checkpoint()
    config = read_config(path)
    layers = config["num_hidden_layers"]
    stages = {b: load_stage(path, 0, layers, True, with_kv_quantization(config, b, 32)) for b in BITS}
    for n in map(int, args.contexts.split(",")):
        runs = {b: [] for b in BITS}
        for _ in range(args.reps):  # the settings interleaved, so a busy moment hits them alike
            for b in BITS:
                runs[b].append(decode(stages[b], n, args.steps))
        print(f"context {n}: " + ", ".join(
            f"{b or 'whole'}: {statistics.median(r[0] for r in runs[b]):.1f} tok/CPU-s "
            f"({statistics.median(r[1] for r in runs[b]):.1f} tok/s wall)" for b in BITS), flush=True)


if __name__ == "__main__":
    main()
