#!/usr/bin/env bash
# Pipeline parallel (dist.pp) on this machine: bench/models.json's SIZE model (default 30m: a Llama
# of ~30M parameters, 8 layers; the digit tokenizer), SFT with the same global batch, run as
#   step    1 process x 2 threads against dist.pp=2 on 2 ranks x 1 thread (shared memory), the
#           batch in one micro-batch and in M micro-batches (train.micro_batch_tokens), STEPS steps
#           each (the first not counted), median time/step
#   bubble  pipeline/bubble of the dist.pp=2 runs (the stages' mean share of the pipeline's span
#           not computing) against 1F1B's ideal (p - 1) / (m + p - 1), which holds for stages of
#           even cost: the SIZE model's head (8192 rows) makes its best split 5 + 3 layers, uneven;
#           the same model with a vocabulary of 512 splits 4 + 4 (the 'even stages' run)
#   memory  rank 0's parameters and training state (memory/params_mb + grads_mb + optim_mb)
# The runs alternate for ROUNDS rounds; each keeps its best round.
#
#   bench/dist/pp.sh [build/moonrl]
#   env: SIZE=30m STEPS=6 ROUNDS=2 BATCH=64 M=8 BTL=vader PYTHON=/usr/bin/python3
set -euo pipefail
cd "$(dirname "$0")/../.."
MOONRL=${1:-build/moonrl}
SIZE=${SIZE:-30m} STEPS=${STEPS:-6} ROUNDS=${ROUNDS:-2} BATCH=${BATCH:-64} M=${M:-8} BTL=${BTL:-vader}
PYTHON=${PYTHON:-/usr/bin/python3}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
. bench/dist/inputs.sh
bench_inputs "$MOONRL" "$SIZE" "$dir" "$PYTHON"
"$MOONRL" run bench/make_model.lua preset="$SIZE" out="$dir/even" vocab=512
# the examples' tokens (data.jsonl: the same length each), a micro-batch of BATCH / M of them
per=$("$PYTHON" -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])][0]; print(len(r['prompt']) + len(r['response']) + 2)" "$dir/data.jsonl")
mb=$(( per * BATCH / M ))
sft=(recipes/sft.lua model.dir="$dir/model" data.path="$dir/data.jsonl" data.chat=false data.eval_fraction=0
  train.steps="$STEPS" train.batch="$BATCH" train.lr=1e-5 run.checkpoint_minutes=0 quiet=true)
bench_machine
echo "settings: $SIZE model; SFT $BATCH examples a step, $STEPS steps; micro-batches of 8192 and $mb tokens"
for r in $(seq "$ROUNDS"); do
  bench_run "sft 1 process" 1 2 "${sft[@]}" train.micro_batch_tokens=8192
  bench_run "sft pp=2 m=1" 2 1 "${sft[@]}" train.micro_batch_tokens=8192 dist.pp=2
  bench_run "sft 1 process m" 1 2 "${sft[@]}" train.micro_batch_tokens="$mb"
  bench_run "sft pp=2 m" 2 1 "${sft[@]}" train.micro_batch_tokens="$mb" dist.pp=2
  bench_run "even 1 process m" 1 2 "${sft[@]}" train.micro_batch_tokens="$mb" model.dir="$dir/even"
  bench_run "even pp=2 m" 2 1 "${sft[@]}" train.micro_batch_tokens="$mb" dist.pp=2 model.dir="$dir/even"
  echo "round $r done (load $(cut -d' ' -f1 /proc/loadavg))"
done
"$PYTHON" - "$dir" <<'PY'
import sys
sys.path.insert(0, "bench/dist")
from runs import metrics_by_name, best as best_of
runs = metrics_by_name(sys.argv[1])
def best(name, key, low):
    return best_of(runs, name, key, low)
print("| run | 1 process x 2 threads | dist.pp=2, 2 ranks x 1 thread | pp=2 against 1 process | bubble (ideal) |")
print("|---|---|---|---|---|")
for tag, one, pp in (("one micro-batch", "sft 1 process", "sft pp=2 m=1"), ("micro-batches", "sft 1 process m", "sft pp=2 m"),
                     ("micro-batches, even stages", "even 1 process m", "even pp=2 m")):
    s1, _ = best(one, "time/step", True)
    s2, _ = best(pp, "time/step", True)
    last = runs[pp][0][-1]
    m = last["pipeline/micro_batches"]
    b, _ = best(pp, "pipeline/bubble", True)
    print(f"| SFT step, {tag} (m = {m:.0f}) | {s1:.3f} s | {s2:.3f} s | {s1 / s2:.2f}x | {b:.3f} ({1 / (m + 1):.3f}) |")
def state(s):
    return s["memory/params_mb"] + s["memory/grads_mb"] + s["memory/optim_mb"]
a, b = runs["sft 1 process"][0][-1], runs["sft pp=2 m=1"][0][-1]
print(f"| rank 0's parameters | {a['memory/params_mb']:.1f} MiB | {b['memory/params_mb']:.1f} MiB | {b['memory/params_mb'] / a['memory/params_mb']:.2f}x | |")
print(f"| rank 0's training state | {state(a):.1f} MiB | {state(b):.1f} MiB | {state(b) / state(a):.2f}x | |")
PY
