#!/usr/bin/env bash
# The CUDA backend (kernels/cuda) compiled as C++ for the CPU emulation of
# this folder (cuda_runtime.h, emu.cpp, cuBLASLt and CUB stand-ins), as one
# shared library that stands in for the GPU: LD_PRELOAD it into any program
# of a CUDA-enabled build (its symbols win over libmoonrl's CUDA objects),
# and that program sees one emulated GPU (cudaGetDeviceCount = 1), whose
# memory the host code cannot read (cuda_runtime.h). For a machine without a
# GPU: it runs every kernel's indexing, barriers, shuffles and arithmetic,
# and every host/device boundary of the code that drives them; not their
# speed, nor the GPU math library's last bits, nor races the fibers' fixed
# order hides.
#   tests/gpu/emu/build.sh OUT.so        (ASAN=1: with AddressSanitizer)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
out=${1:?usage: build.sh OUT.so}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
flags=(-O2 -g -ffp-contract=off -fPIC -U_FORTIFY_SOURCE)  # fibers longjmp between stacks (emu.cpp)
[ "${ASAN:-0}" = 1 ] && flags+=(-fsanitize=address -fno-omit-frame-pointer)
inc=(-I"$here" -I"$root/kernels/cuda" -I"$root/kernels" -I"$root/core" -I"$root/core/include" -I"$root")
objs=()
for f in "$root"/kernels/cuda/*.cu; do
  b=$(basename "$f" .cu)
  python3 "$here/launches.py" "$f" "$work/$b.cpp"
  g++ -std=c++20 "${flags[@]}" "${inc[@]}" -c "$work/$b.cpp" -o "$work/$b.o" &
  objs+=("$work/$b.o")
done
g++ -std=c++20 "${flags[@]}" -I"$here" -c "$here/emu.cpp" -o "$work/emu.o" &
g++ -std=c++20 "${flags[@]}" -c "$here/nccl.cpp" -o "$work/nccl.o" &
wait
g++ "${flags[@]}" -shared -o "$out" "${objs[@]}" "$work/emu.o" "$work/nccl.o" -lpthread
