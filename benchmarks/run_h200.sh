#!/bin/bash
# One GPU call that checks and times the Pallas kernels (device minutes are scarce: run this, not
# the pieces). Writes every output under $OUT (or ./gpu_run when unset) and prints the tables last.
#
#   bash benchmarks/run_h200.sh                 # check_gpu, the five bench shapes, float32 train steps
#   STEPS="check bench" bash benchmarks/run_h200.sh
#
# Wheels of the black-box comparisons (jax-linear-attention, fla-core) are installed from
# $WHEELS (default .base/wheels) when present. Each step has its own time limit so that a slow
# one cannot eat the others' (LIMIT_CHECK, LIMIT_BENCH, LIMIT_TRAIN seconds).
set -o pipefail
OUT=${OUT:-gpu_run}
mkdir -p "$OUT"
WHEELS=${WHEELS:-.base/wheels}
STEPS=${STEPS:-"check bench train"}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  pip install -q --no-deps --target /tmp/ext "$WHEELS"/*.whl 2>/dev/null && export PYTHONPATH=/tmp/ext:${PYTHONPATH}
fi
export PYTHONPATH=.:${PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/device.txt"
for s in $STEPS; do
  case $s in
    check) timeout "${LIMIT_CHECK:-150}" python benchmarks/check_gpu.py 2>&1 | grep -v -i warning | tee "$OUT/check_gpu.txt" | tail -3 ;;
    bench) timeout "${LIMIT_BENCH:-330}" python benchmarks/bench_pallas.py --reps 20 --no-fla --no-breakdown --no-chunk \
             --variants gpu_kernels=triton 2>&1 | grep -v -i warning | tee "$OUT/bench_pallas.txt" | tail -3 ;;
    train) timeout "${LIMIT_TRAIN:-120}" python benchmarks/bench_train_step.py --mixers gdn deltanet --d_models 128 256 \
             --backend auto --reps 10 2>&1 | grep -v -i warning | tee "$OUT/train_auto.txt" | tail -3 ;;
  esac
done
echo "=== tables"
for f in check_gpu bench_pallas train_auto; do
  [ -f "$OUT/$f.txt" ] && { echo "--- $f"; sed -n '/within the suite\|SUMMARY\|^mixer/,$p' "$OUT/$f.txt" | head -40; }
done
