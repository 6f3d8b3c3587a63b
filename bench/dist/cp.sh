#!/usr/bin/env bash
# Context parallel (dist.cp, Ulysses) on this machine: bench/models.json's SIZE model (default 30m:
# a Llama of ~30M parameters, 8 layers, 8 heads and 8 K/V heads; the digit tokenizer) on long
# sequences: SFT on examples of LEN response tokens, BATCH of them a step, one micro-batch a step
# (BATCH x LEN tokens), run as
#   step    1 process x 2 threads against dist.cp=2 on 2 ranks x 1 thread (shared memory), STEPS
#           steps each (the first not counted), median time/step
#   memory  rank 0's activations after a step (memory/activations_mb: the buffer of the step's
#           tokens) and its peak of moonrl's accounted memory in the step
# The runs alternate for ROUNDS rounds; each keeps its best round.
#
#   bench/dist/cp.sh [build/moonrl]
#   env: SIZE=30m LEN=1500 BATCH=2 STEPS=4 ROUNDS=2 BTL=vader PYTHON=/usr/bin/python3
set -euo pipefail
cd "$(dirname "$0")/../.."
MOONRL=${1:-build/moonrl}
SIZE=${SIZE:-30m} LEN=${LEN:-1500} BATCH=${BATCH:-2} STEPS=${STEPS:-4} ROUNDS=${ROUNDS:-2} BTL=${BTL:-vader}
PYTHON=${PYTHON:-/usr/bin/python3}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
. bench/dist/inputs.sh
"$MOONRL" run bench/make_model.lua preset="$SIZE" out="$dir/model" max_len=$((LEN + 64)) > /dev/null
"$PYTHON" -c "
import json, random
random.seed(1)
with open('$dir/long.jsonl', 'w') as f:
    for i in range(64):
        f.write(json.dumps({'prompt': f'{i}+{i}=', 'response': ''.join(random.choice('0123456789') for _ in range($LEN))}) + '\n')
"
sft=(recipes/sft.lua model.dir="$dir/model" data.path="$dir/long.jsonl" data.chat=false data.eval_fraction=0
  train.steps="$STEPS" train.batch="$BATCH" train.lr=1e-5 train.micro_batch_tokens=$((BATCH * (LEN + 32)))
  run.checkpoint_minutes=0 quiet=true)
bench_machine
echo "settings: $SIZE model; SFT $BATCH examples of $LEN response tokens a step, one micro-batch, $STEPS steps"
for r in $(seq "$ROUNDS"); do
  bench_run "1 process" 1 2 "${sft[@]}"
  bench_run "cp=2" 2 1 "${sft[@]}" dist.cp=2
  echo "round $r done (load $(cut -d' ' -f1 /proc/loadavg))"
done
"$PYTHON" - "$dir" <<'PY'
import sys
sys.path.insert(0, "bench/dist")
from runs import metrics_by_name, best as best_of
runs = metrics_by_name(sys.argv[1])
def best(name, key):
    return best_of(runs, name, key)
s1, r1 = best("1 process", "time/step")
s2, r2 = best("cp=2", "time/step")
last1, last2 = runs["1 process"][0][-1], runs["cp=2"][0][-1]
print("| run | 1 process x 2 threads | dist.cp=2, 2 ranks x 1 thread | cp=2 against 1 process | rounds |")
print("|---|---|---|---|---|")
print(f"| SFT step (median) | {s1:.3f} s | {s2:.3f} s | {s1 / s2:.2f}x | {', '.join(f'{v:.3f}' for v in r1)} / {', '.join(f'{v:.3f}' for v in r2)} |")
for key, what in (("memory/activations_mb", "rank 0's activations"), ("memory/peak_mb", "rank 0's peak (accounted)")):
    print(f"| {what} | {last1[key]:.1f} MiB | {last2[key]:.1f} MiB | {last2[key] / last1[key]:.2f}x | |")
PY
