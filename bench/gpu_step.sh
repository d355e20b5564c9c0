#!/usr/bin/env bash
# One GPU (an H100 of the device machine): issue 57's measures in one call, on Trinity-Mini's shape
# (random weights, 4-bit as mlx-community quantizes it: bench/harness.py make_mini), one rank.
#
#   bash bench/gpu_step.sh [moe|anatomy|load|all|budget|repeat]    # from the checkout's root, MLX (CUDA) importable
#
# moe:      scripts/moe_kernels.py: one MoE layer for 8-2,048 tokens, mlx-lm's sorted pairs against
#           the runner's packed ones, and both on dequantized weights (distributed/shard/experts.py)
# anatomy:  scripts/step_anatomy.py: a decode step of mlx-lm's model at 1 / 8 / 64 rows, split into
#           build (Python), launch (mx.async_eval) and wait, as mlx-lm runs it, with its elementwise
#           tails compiled (fused), its MoE block compiled whole at decode shapes (block), with
#           projections of one input joined (proj) and with packed
#           experts; three rounds, interleaved (steps vary more between processes than within one)
# load:     python -m bench load at 1 / 8 / 64 streams, mlx-lm against the runner, then the runner
#           with --itl-target-ms 150 (rank 0's loop per step is printed for each)
# dense:    the routed experts on weights dequantized per call (Experts.run_dense, on from 1,024 tokens):
#           one MoE layer for 64-4,096 tokens, then, from the fewest tokens where it wins at every larger
#           count, the runner with it from there (a copy of the checkout in /tmp/dense) against mlx-lm and
#           against this checkout as the baseline, 1 / 8 / 64 streams and a 2,048-token prompt alone
# budget:   python -m bench load at 8 / 64 streams and a 2,048-token prompt alone: mlx-lm, the
#           runner, and the runner with --max-step-tokens 1024 and with --itl-target-ms 200
# repeat:   mlx-lm against the runner at 1 and 8 streams, three invocations (their figures swing)
# fused:    the runner against a copy of it whose layers keep mlx-lm's uncompiled tails (shard/fused.py
#           off), and mlx-lm, at 1 / 8 / 64 streams in one invocation
#
# Everything writes under $OUT (or /tmp/out). Time on a fresh machine: the checkpoint about 50 s, the
# first model run compiles kernels for 100-200 s, `load` about 360 s; `all` does not fit one 10-minute
# call on a fresh machine: run `moe anatomy` in one call and `load` in the next, `dense` in its own
# (the machine must stay warm: /tmp/mini and the kernel cache live in /tmp).
#
# Python packages: the device's python3 lacks MLX (CUDA), mlx-lm, pydantic and others; install the
# wheels under /tmp/site first and export PYTHONPATH and LD_LIBRARY_PATH as the device notes say
# (one call carries 64 MiB with the tree: the 90 MB mlx-cuda-13 wheel travels in three parts).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${*:-all}
python3 -c "from pathlib import Path; from bench.harness import make_mini; make_mini(Path('/tmp/mini'))"
for part in $what; do
    case $part in
        moe|all)
            timeout 200 python3 scripts/moe_kernels.py --rows 8,64,128,192,256,384,512,768,1024,2048 --reps 10 \
                --variants sorted,packed,dense_packed,dense_sorted --json "$OUT/moe_kernels.json" ;;&
        anatomy|all)
            timeout 400 python3 scripts/step_anatomy.py --model /tmp/mini --rows 1,8,64 --steps 24 --rounds 3 \
                --variants mlx-lm,fused,block,proj,packed --json "$OUT/step_anatomy.json" 2>&1 | grep -v INFO ;;&
        load|all)
            pgrep -af run_trinity || true  # a ring left by an earlier call holds memory and ports
            timeout -s INT 540 python3 -m bench load --make-mini /tmp/mini --streams 1,8,64 --prompt-lens 128 \
                --max-tokens 128 --ranks 1 --check 1 --against "--itl-target-ms 150" --blas reference \
                --out "$OUT/load.json" 2>&1 | tail -30 ;;&
        budget)
            pgrep -af run_trinity || true
            timeout -s INT 560 python3 -m bench load --make-mini /tmp/mini --streams 8,64 --prompt-lens 128 \
                --max-tokens 128 --ranks 1 --check 1 --long 2048 --reps 2 --against "--max-step-tokens 1024" \
                --against "--itl-target-ms 200" --blas reference --out "$OUT/load_budget.json" 2>&1 | tail -36 ;;
        repeat)
            for i in 1 2 3; do
                timeout -s INT 180 python3 -m bench load --make-mini /tmp/mini --streams 1,8 --prompt-lens 128 \
                    --max-tokens 128 --ranks 1 --check 1 --blas reference --out "$OUT/load_repeat$i.json" 2>&1 | tail -8
            done ;;
        fused)
            rm -rf /tmp/nofuse && mkdir -p /tmp/nofuse && cp -r distributed launch bench scripts run_trinity.py /tmp/nofuse/
            sed -i 's/^            fused.fuse(layer)$/            pass  # fused off/' /tmp/nofuse/distributed/shard/stage.py
            grep -c "fused off" /tmp/nofuse/distributed/shard/stage.py
            pgrep -af run_trinity || true
            timeout -s INT 560 python3 -m bench load --make-mini /tmp/mini --streams 1,8,64 --prompt-lens 128 \
                --max-tokens 128 --ranks 1 --check 1 --baseline /tmp/nofuse --blas reference \
                --out "$OUT/load_fused.json" 2>&1 | tail -30 ;;
        dense)
            timeout 150 python3 scripts/moe_kernels.py --rows 64,128,256,512,1024,2048,4096 --reps 10 \
                --variants sorted,packed,dense_sorted,dense_packed,dequantize --json "$OUT/moe_dense.json"
            from=$(python3 scripts/moe_kernels.py --dense-from "$OUT/moe_dense.json")
            echo "dense_sorted wins from $from tokens (0: nowhere)"
            [ "$from" -gt 0 ] || continue
            rm -rf /tmp/dense && mkdir -p /tmp/dense && cp -r distributed launch bench scripts run_trinity.py /tmp/dense/
            sed -i "s/^CUDA_DENSE_TOKENS = range(.*)$/CUDA_DENSE_TOKENS = range($from, 1 << 31)/" \
                /tmp/dense/distributed/shard/experts.py
            grep -n "^CUDA_DENSE_TOKENS" /tmp/dense/distributed/shard/experts.py
            here=$PWD
            (cd /tmp/dense && PYTHONPATH="/tmp/site:/tmp/dense" timeout -s INT 420 python3 -m bench load \
                --make-mini /tmp/mini --streams 1,8,64 --prompt-lens 128 --max-tokens 128 --ranks 1 --check 1 \
                --long 2048 --baseline "$here" --blas reference --out "$OUT/load_dense.json" 2>&1 | tail -30) ;;
    esac
done
