"""The speed model on paper behind docs/tensor-parallel.md: one stream's decode tok/s for
Trinity-Mini and Trinity-Large (4-bit) on 1, 2 and 4 Macs, tensor parallel against the pipeline.

A token reads every active weight once (decode is memory-bound on Apple silicon):
  one Mac       t1 = (layer_bytes + head_bytes) / (eff * BW) + L * d
  pipeline P    t1 + P * hop                 (the same bytes, one Mac at a time, plus P hops)
  tensor T      (layer_bytes / T + head_bytes) / (eff * BW) + L * d + (2 L + 1) * a_T
with layer_bytes the active bytes of the decoder layers (attention, dense MLPs, the router, the
top-k and shared experts), head_bytes the lm_head's (rank 0 alone runs it), d a fixed cost per
layer that no split shrinks (kernel launches and host dispatch), a_T one all-reduce of a hidden
vector among T Macs (2 per layer, + 1 broadcast of the token ids), hop one hidden-state hop.
"""

from bench.harness import RESULTS, flags, save

Q4 = 0.5 + 4 / 64  # bytes per weight: 4-bit + a bf16 scale and bias per group of 64
Q8 = 1 + 4 / 64


def active_bytes(layers, dense, hidden, heads, kv_heads, head_dim, inter, moe_inter, experts, top_k, shared, vocab):
    attn = (3 * heads * head_dim * hidden + 2 * kv_heads * head_dim * hidden) * Q4  # q, gate, o; k, v
    dense_mlp = 3 * inter * hidden * Q4
    moe = (top_k + shared) * 3 * moe_inter * hidden * Q4 + experts * hidden * Q8  # + the 8-bit router
    layer_bytes = layers * attn + dense * dense_mlp + (layers - dense) * moe
    return layer_bytes, vocab * hidden * Q4


MODELS = {
    # trinity_configs.py / launch/configs/presets: 32 layers (2 dense), hidden 2048, 32/4 heads, 128 experts top-8
    "Trinity-Mini": dict(layers=32, dense=2, hidden=2048, heads=32, kv_heads=4, head_dim=128, inter=6144,
                         moe_inter=1024, experts=128, top_k=8, shared=1, vocab=200192),
    # 60 layers (6 dense), hidden 3072, 48/8 heads, 256 experts top-4 (presets/trinity-large.json)
    "Trinity-Large": dict(layers=60, dense=6, hidden=3072, heads=48, kv_heads=8, head_dim=128, inter=12288,
                          moe_inter=3072, experts=256, top_k=4, shared=1, vocab=200192),
}
MACS = {  # memory bandwidth, GB/s (Apple's figures)
    "Trinity-Mini": ("Mac mini M4 Pro 64 GB", 273),
    "Trinity-Large": ("Mac Studio M3 Ultra 256 GB", 819),
}
EFF = 0.7  # fraction of the bandwidth a decode step reaches (assumed)
D = 0.05e-3  # fixed cost per layer per token, s (assumed: Metal launches of a MoE layer)
LINKS = {
    # all-reduce of one hidden vector among 2 / 4 Macs, and one pipeline hop, seconds
    "JACCL (RDMA over Thunderbolt 5)": {"a": {2: 10e-6, 4: 25e-6}, "hop": 10e-6},
    "TCP over Thunderbolt (ring backend)": {"a": {2: 300e-6, 4: 900e-6}, "hop": 300e-6},
}


def model() -> dict:
    out = {"assumptions": {"efficiency": EFF, "per_layer_fixed_ms": D * 1e3,
                           "links": {k: {"allreduce_ms": {t: v * 1e3 for t, v in l["a"].items()},
                                         "hop_ms": l["hop"] * 1e3} for k, l in LINKS.items()}},
           "models": {}}
    for name, cfg in MODELS.items():
        layer_bytes, head_bytes = active_bytes(**cfg)
        mac, bw = MACS[name]
        L = cfg["layers"]
        t1 = (layer_bytes + head_bytes) / (EFF * bw * 1e9) + L * D
        rows = {"1 Mac": 1 / t1}
        for link, l in LINKS.items():
            for n in (2, 4):
                tp = (layer_bytes / n + head_bytes) / (EFF * bw * 1e9) + L * D + (2 * L + 1) * l["a"][n]
                rows[f"pipeline {n}, {link}"] = 1 / (t1 + n * l["hop"])
                rows[f"tensor {n}, {link}"] = 1 / tp
        out["models"][name] = {"mac": mac, "bandwidth_gb_s": bw, "active_gb": (layer_bytes + head_bytes) / 1e9,
                               "head_gb": head_bytes / 1e9, "tok_s": rows}
    return out


def add_arguments(p) -> None:
    flags(p, out=str(RESULTS / "tensor_speed_model.json"))


def main(args) -> None:
    out = model()
    for name, m in out["models"].items():
        print(f"{name} 4-bit on {m['mac']} ({m['bandwidth_gb_s']} GB/s): {m['active_gb']:.2f} GB read per token "
              f"({m['head_gb']:.2f} of it the lm_head)")
        for row, v in m["tok_s"].items():
            print(f"  {row:50} {v:6.1f} tok/s  x{v / m['tok_s']['1 Mac']:.2f}")
    print(f"wrote {save(args.out, out)}")
