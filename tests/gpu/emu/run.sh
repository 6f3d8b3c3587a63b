#!/usr/bin/env bash
# tests/gpu/test_cuda_ops on the CPU: kernels/cuda compiled as C++ against
# the stand-ins of this folder (the CUDA runtime, cuBLASLt, CUB; see
# cuda_runtime.h and emu.cpp), linked with a CUDA-enabled build's libmoonrl
# for the CPU reference table (the emulated CUDA symbols of the executable
# take precedence over the library's). For a machine without a GPU: it runs
# every kernel's indexing, barriers, shuffles and arithmetic against the
# reference, not its speed, nor the GPU math library's last bits, nor races
# the fibers' fixed order hides. Slow (fibers): ~15 minutes for every group.
#   tests/gpu/emu/run.sh BUILD_DIR [GROUP]     (ASAN=1: with AddressSanitizer)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
build=$(cd "${1:?usage: run.sh BUILD_DIR [GROUP]}" && pwd)
shift
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
flags=(-O1 -g -ffp-contract=off -fPIC)
[ "${ASAN:-0}" = 1 ] && flags+=(-fsanitize=address -fno-omit-frame-pointer)
inc=(-I"$here" -I"$root/kernels/cuda" -I"$root/kernels" -I"$root/core" -I"$root/core/include" -I"$root")
objs=()
for f in "$root"/kernels/cuda/*.cu; do
  b=$(basename "$f" .cu)
  python3 "$here/launches.py" "$f" "$work/$b.cpp"
  g++ -std=c++20 "${flags[@]}" "${inc[@]}" -c "$work/$b.cpp" -o "$work/$b.o"
  objs+=("$work/$b.o")
done
g++ -std=c++20 "${flags[@]}" -I"$here" -c "$here/emu.cpp" -o "$work/emu.o"
gcc -std=gnu11 "${flags[@]}" -I"$root/tests" "${inc[@]}" -c "$root/tests/gpu/test_cuda_ops.c" -o "$work/test.o"
g++ "${flags[@]}" -rdynamic -o "$work/test_cuda_ops_emu" "$work/test.o" "${objs[@]}" "$work/emu.o" \
  -L"$build" -Wl,-rpath,"$build" -lmoonrl -lm -lpthread
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:detect_stack_use_after_return=0} "$work/test_cuda_ops_emu" "$@"
