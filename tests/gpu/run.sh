#!/usr/bin/env bash
# The GPU check, in one go on a machine with an NVIDIA GPU: build with CUDA,
# then `meson test --suite gpu`: every CUDA op and the NCCL communicator
# against the CPU reference (the op test's cuda row, test_nccl), the model's training
# step on the GPU against the CPU from the same weights (test_cuda_model),
# the engine (test_cuda_engine) and GRPO / PPO / SFT / DPO runs with
# model.device=cuda against the same runs on the CPU (test_cuda_recipes);
# then the benchmarks: the CUDA table's products and attention
# (bench_cuda_ops), NCCL all-reduce bandwidth (test_nccl --bench),
# training MFU of a Qwen2.5-0.5B-shaped model in bf16 (bench/gpu/gpu_train.lua)
# and decode tokens/s at batch 1/16/64 against PyTorch eager on the same GPU
# (bench/gpu/gpu_decode.py). Writes logs to $OUT (or ./gpu-out) when set.
#
# The machine may lack LuaJIT, libuv and OpenBLAS development packages: if a
# folder .debs/ holds their .deb files (tests/gpu/fetch_debs.sh downloads
# them), they are unpacked into a private root (never into /) and used from
# there through pkg-config's sysroot.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-out}
mkdir -p "$out"
exec > >(tee "$out/gpu_run.log") 2>&1

[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true

if [ -d .debs ] && ls .debs/*.deb >/dev/null 2>&1; then
  root=/tmp/moonrl-debroot
  mkdir -p "$root"
  for f in .debs/*.deb; do dpkg -x "$f" "$root"; done
  export PKG_CONFIG_SYSROOT_DIR="$root"
  export PKG_CONFIG_PATH="$root/usr/lib/x86_64-linux-gnu/pkgconfig:$root/usr/share/pkgconfig"
  export LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu:$root/usr/lib/x86_64-linux-gnu/openblas-pthread:${LD_LIBRARY_PATH:-}"
  export LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu:$root/usr/lib/x86_64-linux-gnu/openblas-pthread:${LIBRARY_PATH:-}"
fi

rm -rf build-gpu
meson setup build-gpu -Dcuda=enabled -Dbuildtype=release >"$out/setup.log" 2>&1 || { tail -40 "$out/setup.log"; exit 1; }
ninja -C build-gpu > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
meson test -C build-gpu --suite gpu --print-errorlogs -v
status=$?
cp build-gpu/meson-logs/testlog.txt "$out/gpu_testlog.txt" 2>/dev/null || true
if [ -x build-gpu/bench/bench_cuda_ops ]; then
  # the products' and attention's TFLOP/s (meson ran the checks: the op test's cuda row)
  timeout 300 build-gpu/bench/bench_cuda_ops | tee "$out/bench_cuda_ops.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ -x build-gpu/tests/gpu/test_nccl ]; then
  timeout 300 build-gpu/tests/gpu/test_nccl --bench | tee "$out/bench_nccl.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
# training MFU (bf16, 16 x 1024 tokens a step), with and without recomputation
for rc in false true; do
  timeout 300 build-gpu/moonrl run bench/gpu/gpu_train.lua recompute=$rc | tee -a "$out/bench_train.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
# decode against PyTorch eager (the machine's Python with torch and transformers)
py=$(command -v python3 || command -v python)
timeout 400 "$py" bench/gpu/gpu_decode.py --moonrl build-gpu/moonrl | tee "$out/bench_decode.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
