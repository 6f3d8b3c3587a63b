#!/usr/bin/env bash
# The fp32 product library (kernels/cpu/blas.h) where OpenBLAS does not know the CPU: the products
# of one linear layer's training step (bench_gemm_shapes: forward, input and weight gradients),
# with OpenBLAS's kernels as it picks them here, with its generic SSE3 "Prescott" kernels (what
# Debian's OpenBLAS 0.3.21 silently takes on an Intel Xeon family 6 model 207), and with those
# kernels reported but the products on oneDNN (what `auto` does then). The three settings take
# turns for ROUNDS rounds; each prints GFLOP/s.
#   bench/gemm/fp32_path.sh [build] ; env: T=2048 IN=768 OUT=2048 REPS=10 ROUNDS=3 MOONRL_THREADS
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${1:-build}/bench/bench_gemm_shapes
T=${T:-2048} IN=${IN:-768} OUT=${OUT:-2048} REPS=${REPS:-10} ROUNDS=${ROUNDS:-3}
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), load average $(cut -d' ' -f1 /proc/loadavg)"
run() { # label, env...
  local label=$1; shift
  printf '%-46s' "$label"
  env "$@" "$B" "$T" "$IN" "$OUT" "$REPS" | head -3 | sed 's/.*: .* ms, \([0-9.]*\) GFLOP\/s/\1/' | paste -sd' ' |
    awk '{printf "fwd %6.1f  dx %6.1f  dW %6.1f GFLOP/s\n", $1, $2, $3}'
}
for r in $(seq "$ROUNDS"); do
  echo "round $r"
  run "OpenBLAS, its own kernel choice" MOONRL_FP32_GEMM=openblas
  run "OpenBLAS, Prescott kernels" OPENBLAS_CORETYPE=Prescott MOONRL_FP32_GEMM=openblas
  run "Prescott reported, auto (oneDNN)" OPENBLAS_CORETYPE=Prescott MOONRL_FP32_GEMM=auto
done
echo "auto picks: $(OPENBLAS_CORETYPE=Prescott ${1:-build}/moonrl version | grep 'fp32 products')"
