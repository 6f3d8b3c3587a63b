#!/usr/bin/env bash
# Weight sync to rollout ranks (async.weights_delta): GRPO in bf16 on bench/models.json's SIZE model
# (default 30m; the digit tokenizer; bench/dist/spread_reward.lua, so that every step updates), one trainer and one rollout rank over shared memory (MPI),
# async.mode=one_step_off, STEPS steps at learning rate LR (real updates: Adam moves each weight by
# about LR), each version sent
#   whole   as fp32 by MPI (async.weights=mpi: trainer rank 0's broadcast)
#   delta   the elements whose bf16 value changed (async.weights_delta=true), a whole bf16 version
#           every FULL versions
# Per version: bytes and seconds (async/publish/bytes, async/publish/seconds; the median over the
# versions after the first), and the share of elements whose bf16 value changed. The runs
# alternate for ROUNDS rounds; each keeps its best round.
#
#   bench/dist/delta.sh [build/moonrl]
#   env: SIZE=30m STEPS=8 ROUNDS=2 LR=1e-6 FULL=10 BTL=vader PYTHON=/usr/bin/python3
set -euo pipefail
cd "$(dirname "$0")/../.."
MOONRL=${1:-build/moonrl}
SIZE=${SIZE:-30m} STEPS=${STEPS:-8} ROUNDS=${ROUNDS:-2} LR=${LR:-1e-6} FULL=${FULL:-10} BTL=${BTL:-vader}
PYTHON=${PYTHON:-/usr/bin/python3}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
. bench/dist/inputs.sh
bench_inputs "$MOONRL" "$SIZE" "$dir" "$PYTHON"
grpo=(recipes/grpo.lua model.dir="$dir/model" data.path="$dir/rl.jsonl" data.prompt=question data.chat=false
  reward=bench/dist/spread_reward.lua:spread grpo.prompts=4 grpo.samples=4 grpo.max_tokens=16 grpo.steps="$STEPS" train.lr="$LR"
  model.dtype=bf16 async.mode=one_step_off dist.rollout_ranks=1 engine.kv_cache_mb=64 run.checkpoint_minutes=0)
bench_machine
echo "settings: $SIZE model in bf16; GRPO, 4 x 4 samples of 16 tokens, $STEPS steps at lr $LR; a whole version every $FULL"
for r in $(seq "$ROUNDS"); do
  bench_run "whole" 2 1 "${grpo[@]}" async.weights=mpi
  bench_run "delta" 2 1 "${grpo[@]}" async.weights_delta=true async.full_sync_every="$FULL"
  echo "round $r done (load $(cut -d' ' -f1 /proc/loadavg))"
done
"$PYTHON" - "$dir" <<'PY'
import sys
sys.path.insert(0, "bench/dist")
from runs import metrics_by_name, median
runs = metrics_by_name(sys.argv[1])
def per_version(name, key, want=lambda s: True):
    best = None
    for st in runs[name]:
        vals = [s[key] for s in st[2:] if key in s and want(s)]
        m = median(vals) if vals else float("nan")
        best = m if best is None or m < best else best
    return best
def is_delta(s):
    return s.get("async/publish/full", 1) == 0
wb, ws = per_version("whole", "async/publish/bytes"), per_version("whole", "async/publish/seconds")
db, ds = per_version("delta", "async/publish/bytes", is_delta), per_version("delta", "async/publish/seconds", is_delta)
ch = per_version("delta", "async/publish/changed", is_delta)
print("| a version | whole (fp32, MPI) | delta (bf16 changes) | delta against whole |")
print("|---|---|---|---|")
print(f"| bytes (median) | {wb:.0f} | {db:.0f} | {db / wb:.3f}x |")
print(f"| seconds (median) | {ws * 1e3:.2f} ms | {ds * 1e3:.2f} ms | {ds / ws:.2f}x |")
print(f"| elements whose bf16 value changed | | {100 * ch:.2f}% | |")
PY
