"""Where one batched decode step's time goes on this device (issue 57, item 2): mlx-lm's AFMoE
with random 4-bit weights in Trinity-Mini's shape (or --layers fewer), B rows of mlx-lm's batch
caches after a --context-token prompt, decoded greedily with mlx-lm's pipelining (the next step's
graph is built and launched before the current token is read). Per step: host ms building the
graph, ms inside mx.async_eval (launching its kernels), ms waiting for the token, and the wall.

Variants: `mlx-lm` as it is; `fused`: the layer's elementwise tails (router scores, residual adds,
the attention gate) compiled with mx.compile; `packed`: the routed experts as the runner runs them
(distributed/shard/experts.py: a batch's tokens packed per expert where the device gains from it);
`shared-only`: the routed experts left out (what the gather_qmm kernels cost).

MLX's CUDA backend launches a step's kernels as CUDA graphs of at most MLX_MAX_OPS_PER_BUFFER
operations each (30 on an H100); run the script under other values to see what launching costs.

    PYTHONPATH=. python scripts/step_anatomy.py --rows 1,8,64 --steps 32 [--layers 32 | --model DIR] [--json out.json]
"""

import argparse
import functools
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.models import afmoe
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

from bench.harness import MINI, MINI_SMOKE, random_model
from distributed.shard.experts import Experts, packed_tokens

def build(layers: int, tiny: bool):
    shape = MINI_SMOKE if tiny else MINI
    types = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)]
    model, _ = random_model(dict(shape, num_hidden_layers=layers, layer_types=types),
                            dtype="float32" if tiny else "bfloat16")
    return model


def load(path: str):
    from mlx_lm import load as mlx_lm_load

    return mlx_lm_load(path)[0]


def packed_experts(model) -> None:
    """Each MoE layer's SwitchGLU as the runner's Experts (the same weights)."""
    for layer in model.model.layers:
        if isinstance(layer.mlp, afmoe.AfmoeMoE):
            old = layer.mlp.experts
            new = Experts(1, 1, 1, packed_tokens())
            new.gate_proj, new.up_proj, new.down_proj = old.gate_proj, old.up_proj, old.down_proj
            layer.mlp.experts = new


def caches(model, rows: int) -> list:
    return [BatchRotatingKVCache(model.args.sliding_window, [0] * rows) if layer.use_sliding
            else BatchKVCache([0] * rows) for layer in model.model.layers]


@functools.lru_cache(maxsize=None)
def router_tail(k: int, scale: float):
    """The router after its gate, compiled: sigmoid scores, top-k by biased score, normalised weights."""

    def route(gates, expert_bias):
        scores = mx.sigmoid(gates.astype(mx.float32))
        inds = mx.stop_gradient(mx.argpartition(-(scores + expert_bias), kth=k - 1, axis=-1)[..., :k])
        chosen = mx.take_along_axis(scores, inds, axis=-1)
        return inds, chosen / chosen.sum(axis=-1, keepdims=True) * scale

    return mx.compile(route)


@mx.compile
def _combine(y, weights, shared):
    return (y * weights[..., None]).sum(axis=-2).astype(y.dtype) + shared


@mx.compile
def _gated(out, gate):
    return out * mx.sigmoid(gate)


def fused_moe(self, x):
    inds, weights = router_tail(self.num_experts_per_tok, self.route_scale)(self.router(x), self.expert_bias)
    return _combine(self.experts(x, inds), weights, self.shared_experts(x))


def shared_only_moe(self, x):
    return self.shared_experts(x)


def fused_attention(self, x, mask=None, cache=None):
    B, L, _ = x.shape
    q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3))
    k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3))
    v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if self.rope is not None:
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
    k, v = cache.update_and_fetch(k, v)
    out = afmoe.scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
    return self.o_proj(_gated(out.transpose(0, 2, 1, 3).reshape(B, L, -1), self.gate_proj(x)))


ORIGINAL = (afmoe.AfmoeMoE.__call__, afmoe.Attention.__call__)
VARIANTS = {"mlx-lm": ORIGINAL, "fused": (fused_moe, fused_attention), "packed": ORIGINAL,
            "shared-only": (shared_only_moe, ORIGINAL[1])}


def run(model, rows: int, context: int, steps: int) -> dict:
    cache = caches(model, rows)
    prompt = mx.random.randint(0, 1000, (rows, context), key=mx.random.key(rows))
    y = mx.argmax(model(prompt, cache)[:, -1], axis=-1)
    mx.eval(y)
    build, launch, wait, walls, tokens = [], [], [], [], []
    for i in range(steps + 4):
        t0 = time.perf_counter()
        nxt = mx.argmax(model(y[:, None], cache)[:, -1], axis=-1)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        tokens.append(y.tolist())
        t3 = time.perf_counter()
        y = nxt
        if i >= 4:
            build.append(t1 - t0), launch.append(t2 - t1), wait.append(t3 - t2), walls.append(t3 - t0)
    ms = lambda xs: round(statistics.median(xs) * 1e3, 2)
    return {"rows": rows, "build_ms": ms(build), "launch_ms": ms(launch), "wait_ms": ms(wait), "step_ms": ms(walls),
            "tok_s": round(rows / statistics.median(walls), 1), "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,8,64")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--model", help="a checkpoint folder (bench load --make-mini) instead of random weights")
    p.add_argument("--context", type=int, default=64, help="prompt tokens per row (64 rows x 128 overflows a CUDA grid)")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--tiny", action="store_true", help="a small shape, to try the script on a CPU")
    p.add_argument("--json")
    args = p.parse_args()
    model = load(args.model) if args.model else build(args.layers, args.tiny)
    out, reference = [], {}
    originals = [layer.mlp.experts for layer in model.model.layers if isinstance(layer.mlp, afmoe.AfmoeMoE)]
    for name in args.variants.split(","):
        afmoe.AfmoeMoE.__call__, afmoe.Attention.__call__ = VARIANTS[name]
        moe = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, afmoe.AfmoeMoE)]
        for mlp, experts in zip(moe, originals):
            mlp.experts = experts
        if name == "packed":
            packed_experts(model)
        for rows in map(int, args.rows.split(",")):
            run(model, rows, args.context, 4)  # kernels compiled for this shape
            r = dict(run(model, rows, args.context, args.steps), variant=name, device=str(mx.default_device()))
            tokens = r.pop("tokens")
            reference.setdefault(rows, tokens)
            r["same_tokens_as_mlx_lm"] = tokens == reference[rows]  # bf16 may differ at near-ties
            print(json.dumps(r), flush=True)
            out.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
