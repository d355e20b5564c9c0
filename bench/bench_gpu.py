"""GPU benchmark at Trinity-Mini shape: one-process mlx-lm vs this runner on 1 and 2 GPUs.

Run on the lent GPU machine (see ../shared/DEVICE-MLX-CUDA.md for installing MLX there):

    python bench/bench_gpu.py --phases make,baseline,oneshot --out results.json
    python bench/bench_gpu.py --phases grpc --out results_grpc.json

- make: random weights in bf16 with mlx-lm's afmoe at Trinity-Mini shape, quantized as
  mlx-community does (4-bit, group 64, router 8-bit), saved with a padded tiny tokenizer.
- baseline: mlx-lm `generate_step` in this process: prefill tok/s (512, 2048 tokens) and
  decode tok/s (128 greedy tokens), median of --runs after a warm-up.
- oneshot: `run_trinity.py --json` on 1 GPU and on 2 GPUs (`mlx.launch --backend nccl`).
- grpc: `run_trinity.py --serve` on 1 and 2 GPUs; the same requests through gRPC, median of
  --runs after a warm-up; peak memory per GPU from GetModelInfo.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from common import MLX_LAUNCH as LAUNCH  # noqa: E402

MINI = dict(
    model_type="afmoe", vocab_size=200192, hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=1024, num_hidden_layers=32, num_dense_layers=2, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
    num_shared_experts=1, route_norm=True, route_scale=2.826, score_func="sigmoid", n_group=1,
    topk_group=1, sliding_window=2048, mup_enabled=True,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(32)],
    eos_token_id=[258], torch_dtype="bfloat16",
)
# --smoke: the same pipeline at a size a CPU runs in seconds (checks the script, not speed).
SMOKE = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
             num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, sliding_window=256,
             layer_types=["sliding_attention"] * 3 + ["full_attention"])

LAUNCH_BACKEND = ["nccl"]


def prompt(n):
    return [(37 * i + 11) % (MINI["vocab_size"] - 300) + 300 for i in range(n)]


def make(path: Path):
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.models import afmoe
    from mlx_lm.utils import quantize_model, save_config, save_model

    from distributed.shard.tiny_checkpoint import write_tokenizer

    if (path / "config.json").exists():
        return
    tic = time.perf_counter()
    model = afmoe.Model(afmoe.ModelArgs.from_dict(MINI))
    keep_fp32 = model.cast_predicate  # expert_bias stays float32, as in mlx-lm's converter
    model.update(tree_map_with_path(lambda k, x: x.astype(mx.bfloat16) if keep_fp32(k) else x, model.parameters()))
    model, config = quantize_model(model, dict(MINI), group_size=64, bits=4, quant_predicate=model.quant_predicate)
    for layer in [model.model.embed_tokens, model.model.norm, model.lm_head, *model.layers]:
        mx.eval(layer.parameters())  # layer by layer: never all the bf16 weights at once
    save_model(path, model)
    save_config(config, path / "config.json")
    write_tokenizer(path, MINI["vocab_size"])
    print(f"made {path} in {time.perf_counter() - tic:.0f} s", flush=True)


def baseline(path: Path, runs: int, max_tokens: int):
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    model, _ = load(str(path))
    out = {}
    for n in (512, 2048):
        prefill, decode = [], []
        for i in range(runs + 1):
            tic = time.perf_counter()
            for k, (tok, _) in enumerate(generate_step(mx.array(prompt(n)), model, max_tokens=max_tokens)):
                if k == 0:
                    first = time.perf_counter()
            done = time.perf_counter()
            if i:  # the first run is the warm-up
                prefill.append(n / (first - tic))
                decode.append((max_tokens - 1) / (done - first))
        out[n] = {"prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode),
                  "decode_runs": decode}
        print(f"mlx-lm {n}: {out[n]['prefill_tok_s']:.0f} prefill tok/s, {out[n]['decode_tok_s']:.1f} decode tok/s", flush=True)
    out["peak_memory_bytes"] = mx.get_peak_memory()
    return out


def runner_cmd(gpus: int, *args):
    run = [sys.executable, str(ROOT / "run_trinity.py"), *args]
    return run if gpus == 1 else [*LAUNCH, "--backend", LAUNCH_BACKEND[0], "-n", str(gpus), *run]


def oneshot(path: Path, gpus: int, max_tokens: int):
    out = {}
    for n in (512, 2048):
        ids = ",".join(map(str, prompt(n)))
        cmd = runner_cmd(gpus, "--model", str(path), "--prompt-ids", ids, "--max-tokens", str(max_tokens), "--json")
        proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
        if proc.returncode or not proc.stdout.strip():
            print(proc.stderr[-3000:], flush=True)
            raise SystemExit(f"runner failed on {gpus} GPU(s)")
        r = json.loads(proc.stdout)
        out[n] = {"prefill_tok_s": r["prefill_tokens_per_sec"], "decode_tok_s": r["generation_tokens_per_sec"],
                  "tokens": len(r["token_ids"]), "peak_memory_bytes": [x["peak_memory_bytes"] for x in r["ranks"]]}
        print(f"runner {gpus} GPU one-shot {n}: {out[n]}", flush=True)
    return out


def grpc_runs(path: Path, gpus: int, runs: int, max_tokens: int, port: int):
    import grpc

    from distributed.serving.proto import generation_pb2 as pb
    from distributed.serving.proto import generation_pb2_grpc as pb_grpc

    cmd = runner_cmd(gpus, "--model", str(path), "--serve", f"127.0.0.1:{port}")
    server = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        deadline = time.time() + 300
        while True:
            try:
                info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
                if info.ranks:
                    break
            except grpc.RpcError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise SystemExit("server did not come up")
            time.sleep(2)
        out = {}
        for n in (512, 2048):
            ttft, decode = [], []
            for i in range(runs + 1):
                req = pb.GenerateRequest(token_ids=prompt(n), max_tokens=max_tokens, temperature=0.0)
                tic = time.perf_counter()
                first, count = None, 0
                for resp in stub.Generate(req, timeout=300):
                    count += len(resp.token_ids)
                    if first is None and resp.token_ids:
                        first = time.perf_counter()
                done = time.perf_counter()
                if i:
                    ttft.append(first - tic)
                    decode.append((count - 1) / (done - first))
            out[n] = {"ttft_s": statistics.median(ttft), "prefill_tok_s": n / statistics.median(ttft),
                      "decode_tok_s": statistics.median(decode), "decode_runs": decode}
            print(f"runner {gpus} GPU gRPC {n}: {out[n]}", flush=True)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        out["peak_memory_bytes"] = [r.peak_memory_bytes for r in info.ranks]
        return out
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="/tmp/trinity-mini-shape-4bit")
    p.add_argument("--phases", default="make,baseline,oneshot,grpc")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--gpus", default="1,2")
    p.add_argument("--out", default="bench/results/gpu.json")
    p.add_argument("--smoke", action="store_true", help="tiny shape, to check the script on a CPU")
    p.add_argument("--backend", default="nccl", help="mlx.launch backend for several GPUs (ring on a CPU)")
    args = p.parse_args()
    if args.smoke:
        MINI.update(SMOKE)
    LAUNCH_BACKEND[0] = args.backend
    path, phases = Path(args.model), args.phases.split(",")
    gpus = [int(g) for g in args.gpus.split(",")]
    results = {"phases": phases}
    if "make" in phases:
        make(path)
    if "baseline" in phases:
        results["mlx_lm"] = baseline(path, args.runs, args.max_tokens)
    if "oneshot" in phases:
        results["oneshot"] = {g: oneshot(path, g, args.max_tokens) for g in gpus}
    if "grpc" in phases:
        results["grpc"] = {g: grpc_runs(path, g, args.runs, args.max_tokens, 50551 + g) for g in gpus}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
