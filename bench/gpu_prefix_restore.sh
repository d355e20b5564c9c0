#!/usr/bin/env bash
# One GPU (an H100 of the device machine): a 32,768-token prompt's prefill against the same prompt
# restored from the prefix cache's disk tier after a restart, and the disk tier's bytes per token,
# on Trinity-Mini's shape (random weights, 4-bit as mlx-community quantizes it: bench/harness.py
# make_mini), one rank. Issue 56's target: the restore within 0.05 of the prefill.
#
#   bash bench/gpu_prefix_restore.sh            # from the checkout's root; writes under $OUT
#
# What it runs (bench/prefix_cache.py):
#   python3 -m bench prefix-cache --make-mini /tmp/mini --prompt-lens 32768 --steps cold,ram,disk \
#       --blas reference --warmup-len 4096 --out $OUT/prefix_cache_gpu.json
# (a) cold: the prompt's TTFT (max_tokens 1); (b) the same again from RAM; then the server is
# stopped, the entry's files dropped from the page cache (posix_fadvise; gVisor may ignore it: the
# JSON says page_cache_dropped) and the server started again on the same folder; (d) the prompt
# restored from disk. Each server first prefills a distinct 4,096-token prompt (MLX compiles its
# CUDA kernels per shape; it shares no block with the measured one). Figures: TTFT, cached tokens
# (cached_disk from the access log), restore / prefill, RAM bytes of the entry, disk bytes per token.
#
# Time: building the checkpoint (about 14 GiB on disk; skipped where /tmp/mini exists), two server
# starts, a 32k prefill (about 21 s on an H100), the entry's write (about 2 GiB) and read. The whole
# run is held under 530 s (timeout sends SIGINT, so the bench ends its servers) and the JSON is
# written after each step, so a run cut short keeps what it measured.
#
# Python packages: the device's python3 lacks MLX (CUDA), mlx-lm and some of this package's
# dependencies. Carry them as wheels in .whl (docs: the device README, "a Python package missing
# there"; e.g. mlx[cuda13]==0.32.4 with mlx-cuda-13 and mlx-metal-free deps, mlx-lm, grpcio-health-
# checking, grpcio-reflection, protobuf>=7.36, llguidance, uvicorn, httptools, starlette) and name
# .whl in the run's carry: this script installs them into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/prefix_cache_gpu.log"
export PYTHONUNBUFFERED=1
{
  date -u +"start %FT%TZ"
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader || true
  df -h /tmp | tail -1
  python3 - <<'EOF' || { echo "preflight failed: see above (carry the wheels in .whl)"; exit 1; }
import importlib
for name in ("mlx.core", "mlx_lm", "grpc", "grpc_health.v1", "google.protobuf", "prometheus_client", "llguidance",
             "uvicorn", "starlette", "numpy"):
    importlib.import_module(name)
import mlx.core as mx
print("mlx", mx.__version__, mx.default_device())
assert mx.default_device() == mx.gpu, "MLX sees no GPU"
EOF
  tic=$SECONDS
  timeout -s INT -k 20 530 python3 -m bench prefix-cache --make-mini /tmp/mini --prompt-lens 32768 \
    --steps cold,ram,disk --blas reference --warmup-len 4096 --timeout 300 --out "$OUT/prefix_cache_gpu.json"
  rc=$?
  echo "bench exit $rc after $((SECONDS - tic)) s"
  du -sh /tmp/mini 2>/dev/null || true
  date -u +"end %FT%TZ"
  exit $rc
} 2>&1 | tee "$LOG"
