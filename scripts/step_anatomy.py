"""Where one batched decode step's time goes on this device (issue 57, item 2): mlx-lm's AFMoE
with random 4-bit weights in Trinity-Mini's shape (or --layers fewer), B rows of mlx-lm's batch
caches after a --context-token prompt, decoded greedily with mlx-lm's pipelining (the next step's
graph is built and launched before the current token is read). Per step: host ms building the
graph, ms inside mx.async_eval (launching its kernels), ms waiting for the token, and the wall.

Variants: `mlx-lm` as it is; `fused`: the layer's elementwise tails (router scores, the experts' weighted
sum, the attention gate) compiled with mx.compile, as distributed/shard/fused.py runs them; `block`:
`fused` with the whole MoE block compiled at decode shapes (Python builds none of its operations);
`proj`: `fused` with the projections that read the same input joined into one (attention's q, k, v
and gate; the experts' and the shared expert's gate and up), so a step launches fewer matrix kernels;
`packed`: the routed experts as the runner runs them (distributed/shard/experts.py: a batch's tokens
packed per expert where the device gains from it); `shared-only`: the routed experts left out (what
the gather_qmm kernels cost).

MLX's CUDA backend launches a step's kernels as CUDA graphs of at most MLX_MAX_OPS_PER_BUFFER
operations each (30 on an H100); run the script under other values to see what launching costs.

    PYTHONPATH=. python scripts/step_anatomy.py --rows 1,8,64 --steps 32 [--layers 32 | --model DIR] [--json out.json]
"""

import argparse
import copy
import functools
import itertools
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.models import afmoe
from mlx_lm.models.activations import swiglu
from mlx_lm.models.switch_layers import _gather_sort, _scatter_unsort
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


_WHOLE: dict = {}


def whole_moe(self, x):
    """`fused`, and at a decode step's shape (one position a row) the whole MoE block compiled: its graph
    traced once per row count and replayed, so Python builds none of its operations."""
    if x.shape[1] != 1:
        return fused_moe(self, x)
    if id(self) not in _WHOLE:
        _WHOLE[id(self)] = mx.compile(lambda h: fused_moe(self, h))
    return _WHOLE[id(self)](x)


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


def joined(parts: list, axis: int):
    """One linear (or switch linear) computing the parts' outputs side by side, on the same weights."""
    out = copy.copy(parts[0])
    for key in ("weight", "scales", "biases"):
        if key in parts[0]:
            out[key] = mx.concatenate([p[key] for p in parts], axis=axis)
    return out


def join_projections(model) -> None:
    for layer in model.model.layers:
        a = layer.self_attn
        a.qkvg = joined([a.q_proj, a.k_proj, a.v_proj, a.gate_proj], 0)
        a.splits = list(itertools.accumulate([a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim,
                                              a.n_kv_heads * a.head_dim]))
        mlps = [layer.mlp] if isinstance(layer.mlp, afmoe.MLP) else [layer.mlp.shared_experts]
        for mlp in mlps:
            mlp.gate_up = joined([mlp.gate_proj, mlp.up_proj], 0)
        if isinstance(layer.mlp, afmoe.AfmoeMoE):
            e = layer.mlp.experts
            e.gate_up = joined([e.gate_proj, e.up_proj], 1)
    mx.eval(model.parameters())


def joined_mlp(self, x):
    gate, up = mx.split(self.gate_up(x), 2, axis=-1)
    return self.down_proj(swiglu(gate, up))


def joined_experts(self, x, indices):
    x = mx.expand_dims(x, (-2, -3))
    do_sort = indices.size >= 64
    idx, inv_order = indices, None
    if do_sort:
        x, idx, inv_order = _gather_sort(x, indices)
    gate, up = mx.split(self.gate_up(x, idx, sorted_indices=do_sort), 2, axis=-1)
    x = self.down_proj(swiglu(gate, up), idx, sorted_indices=do_sort)
    return (_scatter_unsort(x, inv_order, indices.shape) if do_sort else x).squeeze(-2)


def joined_moe(self, x):
    inds, weights = router_tail(self.num_experts_per_tok, self.route_scale)(self.router(x), self.expert_bias)
    return _combine(joined_experts(self.experts, x, inds), weights, self.shared_experts(x))


def joined_attention(self, x, mask=None, cache=None):
    B, L, _ = x.shape
    q, k, v, gate = mx.split(self.qkvg(x), self.splits, axis=-1)
    q = self.q_norm(q.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3))
    k = self.k_norm(k.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3))
    v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if self.rope is not None:
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
    k, v = cache.update_and_fetch(k, v)
    out = afmoe.scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
    return self.o_proj(_gated(out.transpose(0, 2, 1, 3).reshape(B, L, -1), gate))


ORIGINAL = (afmoe.AfmoeMoE.__call__, afmoe.Attention.__call__, afmoe.MLP.__call__)
VARIANTS = {"mlx-lm": ORIGINAL, "fused": (fused_moe, fused_attention, ORIGINAL[2]),
            "proj": (joined_moe, joined_attention, joined_mlp), "block": (whole_moe, fused_attention, ORIGINAL[2]),
            "packed": ORIGINAL,
            "shared-only": (shared_only_moe, *ORIGINAL[1:])}


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
    p.add_argument("--rounds", type=int, default=1, help="every variant this many times, interleaved (one process "
                   "varies less than two)")
    p.add_argument("--json")
    args = p.parse_args()
    model = load(args.model) if args.model else build(args.layers, args.tiny)
    names = args.variants.split(",")
    if "proj" in names:
        join_projections(model)
    out, reference = [], {}
    originals = [layer.mlp.experts for layer in model.model.layers if isinstance(layer.mlp, afmoe.AfmoeMoE)]
    for round_ in range(args.rounds):
        for name in names:
            afmoe.AfmoeMoE.__call__, afmoe.Attention.__call__, afmoe.MLP.__call__ = VARIANTS[name]
            moe = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, afmoe.AfmoeMoE)]
            for mlp, experts in zip(moe, originals):
                mlp.experts = experts
            if name == "packed":
                packed_experts(model)
            for rows in map(int, args.rows.split(",")):
                if round_ == 0:
                    run(model, rows, args.context, 4)  # kernels compiled for this shape
                r = dict(run(model, rows, args.context, args.steps), variant=name, round=round_,
                         device=str(mx.default_device()))
                tokens = r.pop("tokens")
                reference.setdefault(rows, tokens)
                r["same_tokens_as_mlx_lm"] = tokens == reference[rows]  # bf16 may differ at near-ties
                print(json.dumps(r), flush=True)
                out.append(r)
    if args.rounds > 1:
        for name in names:
            for rows in map(int, args.rows.split(",")):
                steps = [r["step_ms"] for r in out if r["variant"] == name and r["rows"] == rows]
                print(f"{name} {rows} rows: step ms median {statistics.median(steps):.2f} of {steps}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
