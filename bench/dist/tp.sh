#!/usr/bin/env bash
# Tensor parallel (dist.tp) on this machine: bench/models.json's SIZE model (default 30m: a Llama
# of ~30M parameters, 8 layers, 8 heads, a tied head of 8192 rows; the digit tokenizer), run as
#   step    SFT with the same global batch: 1 process x 2 threads against dist.tp=2 on 2 ranks x 1
#           thread (shared memory), STEPS steps each (the first not counted), median time/step
#   decode  GRPO's generation (GEN_PROMPTS prompts x 4 samples of GEN_TOKENS tokens, 3 steps): the
#           engine on the whole model (1 process x 2 threads) against the engine on each rank's
#           slices (dist.tp=2, 2 ranks x 1 thread), median tokens_per_s/generate
#   memory  rank 0's training state (memory/params_mb + grads_mb + optim_mb): 1 process against
#           dist.tp=2 (only the norms stay whole on every rank), and against dist.tp=2 x
#           dist.zero=3 on 4 ranks (2 groups of 2, the slices sharded over the groups; run once)
# The runs alternate for ROUNDS rounds; each keeps its best round.
#
#   bench/dist/tp.sh [build/moonrl]
#   env: SIZE=30m STEPS=6 ROUNDS=2 BATCH=8 GEN_PROMPTS=4 GEN_TOKENS=16 BTL=vader PYTHON=/usr/bin/python3
set -euo pipefail
cd "$(dirname "$0")/../.."
MOONRL=${1:-build/moonrl}
SIZE=${SIZE:-30m} STEPS=${STEPS:-6} ROUNDS=${ROUNDS:-2} BATCH=${BATCH:-8} BTL=${BTL:-vader}
GEN_PROMPTS=${GEN_PROMPTS:-4} GEN_TOKENS=${GEN_TOKENS:-16}
PYTHON=${PYTHON:-/usr/bin/python3}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
. bench/dist/inputs.sh
bench_inputs "$MOONRL" "$SIZE" "$dir" "$PYTHON"
sft=(recipes/sft.lua model.dir="$dir/model" data.path="$dir/data.jsonl" data.chat=false data.eval_fraction=0
  train.steps="$STEPS" train.batch="$BATCH" train.lr=1e-5 train.micro_batch_tokens=8192 run.checkpoint_minutes=0
  quiet=true)
grpo=(recipes/grpo.lua model.dir="$dir/model" data.path="$dir/rl.jsonl" data.prompt=question data.chat=false
  reward=exact grpo.prompts="$GEN_PROMPTS" grpo.samples=4 grpo.max_tokens="$GEN_TOKENS"
  grpo.steps=3 engine.kv_cache_mb=64 run.checkpoint_minutes=0)
bench_machine
echo "settings: $SIZE model; SFT $BATCH examples a step, $STEPS steps; GRPO $GEN_PROMPTS x 4 samples of $GEN_TOKENS tokens"
run() { # name, ranks, recipe words...: one process x 2 threads, or dist.tp over the ranks
  local name=$1 n=$2
  shift 2
  if [ "$n" = 1 ]; then bench_run "$name" 1 2 "$@"; else bench_run "$name" "$n" 1 "$@" dist.tp="$n"; fi
}
for r in $(seq "$ROUNDS"); do
  run "sft 1 process" 1 "${sft[@]}"
  run "sft tp=2" 2 "${sft[@]}"
  run "grpo 1 process" 1 "${grpo[@]}"
  run "grpo tp=2" 2 "${grpo[@]}"
  echo "round $r done (load $(cut -d' ' -f1 /proc/loadavg))"
done
r=1 bench_run "sft tp=2 zero=3" 4 1 "${sft[@]}" dist.tp=2 dist.zero=3
"$PYTHON" - "$dir" <<'PY'
import sys
sys.path.insert(0, "bench/dist")
from runs import metrics_by_name, best as best_of
runs = metrics_by_name(sys.argv[1])
def best(name, key, low):
    return best_of(runs, name, key, low)
s1, r1 = best("sft 1 process", "time/step", True)
s2, r2 = best("sft tp=2", "time/step", True)
g1, q1 = best("grpo 1 process", "tokens_per_s/generate", False)
g2, q2 = best("grpo tp=2", "tokens_per_s/generate", False)
def state(s):
    return s["memory/params_mb"] + s["memory/grads_mb"] + s["memory/optim_mb"]
m1, m2 = state(runs["sft 1 process"][0][-1]), state(runs["sft tp=2"][0][-1])
p1, p2 = runs["sft 1 process"][0][-1]["memory/params_mb"], runs["sft tp=2"][0][-1]["memory/params_mb"]
print("| run | 1 process x 2 threads | dist.tp=2, 2 ranks x 1 thread | tp=2 against 1 process | rounds |")
print("|---|---|---|---|---|")
print(f"| SFT step (median) | {s1:.3f} s | {s2:.3f} s | {s1 / s2:.2f}x | {', '.join(f'{v:.3f}' for v in r1)} / {', '.join(f'{v:.3f}' for v in r2)} |")
print(f"| GRPO decode (median tokens/s) | {g1:.0f} | {g2:.0f} | {g2 / g1:.2f}x | {', '.join(f'{v:.0f}' for v in q1)} / {', '.join(f'{v:.0f}' for v in q2)} |")
print(f"| rank 0's parameters | {p1:.1f} MiB | {p2:.1f} MiB | {p2 / p1:.2f}x | |")
print(f"| rank 0's training state | {m1:.1f} MiB | {m2:.1f} MiB | {m2 / m1:.2f}x | |")
m3 = state(runs["sft tp=2 zero=3"][0][-1])
print(f"| rank 0's training state, dist.tp=2 x dist.zero=3 on 4 ranks | {m1:.1f} MiB | {m3:.1f} MiB | {m3 / m1:.2f}x | |")
PY
