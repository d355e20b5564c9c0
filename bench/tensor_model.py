"""The speed model on paper behind docs/tensor-parallel.md: one stream's decode tok/s for
Trinity-Mini and Trinity-Large (4-bit, as mlx-lm converts them) on 1, 2 and 4 Macs, tensor
parallel against the pipeline, over RDMA (JACCL) and over TCP.

The model is launch/tensor_plan.py's, the one `trinity-launch plan` advises with: a token reads
every active weight once; the pipeline reads them one Mac at a time plus a hop per Mac; a tensor
group of T Macs reads 1/T of each layer on each Mac, plus 2 all-reduces per layer (see its
docstring for the formula and the assumed link latencies, efficiency and per-layer cost).
"""

import json

from bench.harness import RESULTS, flags, save

MACS = {  # the preset, the Mac, its memory bandwidth in GB/s (Apple's figures)
    "Trinity-Mini": ("trinity-mini", "Mac mini M4 Pro", 273),
    "Trinity-Large": ("trinity-large", "Mac Studio M3 Ultra", 819),
}
LINKS = {"JACCL (RDMA over Thunderbolt 5)": "jaccl", "TCP (ring backend)": "ring"}


def macs(n: int, backend: str, bandwidth: float):
    """A hostfile of n Macs joined as `backend` says (RDMA both ways for jaccl)."""
    from launch import hostfile

    hosts = [{"ssh": f"mac{i}", "ips": [f"10.0.0.{i + 1}"], "bandwidth_gb_s": bandwidth} for i in range(n)]
    if backend == "jaccl":
        for i, h in enumerate(hosts):
            h["rdma"] = [None if j == i else f"rdma_en{j}" for j in range(n)]
    return hostfile.parse({"backend": backend, "hosts": hosts})


def model() -> dict:
    from distributed.shard.sizes import quantize_config
    from launch import bundled
    from launch.tensor_plan import EFFICIENCY, LINKS as LINK_TIMES, PER_LAYER_S, active_bytes, options, seconds_per_token

    out = {"assumptions": {"efficiency": EFFICIENCY, "per_layer_fixed_ms": PER_LAYER_S * 1e3,
                           "links_ms": {k: {"allreduce_step": v.step_s * 1e3, "hop": v.hop_s * 1e3}
                                        for k, v in LINK_TIMES.items()}},
           "models": {}}
    for name, (preset, mac, bandwidth) in MACS.items():
        config = quantize_config(json.loads(bundled.resolve("preset", preset).read_text())["config"], 4)
        b = active_bytes(config)
        rows = {"1 Mac": 1 / seconds_per_token(config, macs(1, "ring", bandwidth), [[0]])}
        for link, backend in LINKS.items():
            for n in (2, 4):
                for o in options(config, macs(n, backend, bandwidth)):
                    if o.tensor in (1, n):  # the pipeline and tensor over every Mac (T < N needs MPI)
                        rows[f"{'pipeline' if o.tensor == 1 else 'tensor'} {n}, {link}"] = o.tok_s
        out["models"][name] = {"mac": mac, "bandwidth_gb_s": bandwidth, "active_gb": (b["layers"] + b["head"]) / 1e9,
                               "head_gb": b["head"] / 1e9, "tok_s": rows}
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
