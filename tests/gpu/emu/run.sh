#!/usr/bin/env bash
# The op test's CUDA row on the CPU: the emulated GPU (build.sh) preloaded
# into a CUDA-enabled build's tests/kernels/test_ops, run on its cuda table
# alone (the cuda_ops_emu test of tests/gpu/meson.build runs the same).
#   tests/gpu/emu/run.sh BUILD_DIR [OP]     (ASAN=1: with AddressSanitizer)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "${1:?usage: run.sh BUILD_DIR [OP]}" && pwd)
op=${2:-all}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$here/build.sh" "$work/libmoonrl_cuda_emu.so"
pre="$work/libmoonrl_cuda_emu.so"
[ "${ASAN:-0}" = 1 ] && pre="$(gcc -print-file-name=libasan.so):$pre"
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:detect_stack_use_after_return=0} LD_PRELOAD="$pre" \
  "$build/tests/kernels/test_ops" "$op" cuda
