#!/usr/bin/env bash
# Data parallel over ranks: the GRPO recipe (recipes/grpo.lua through bench/dist/dp_grpo.lua, which only
# registers bench/grpo/grpo_step.lua's reward) on the small model of bench/grpo/grpo_step.sh, the same global
# batch (PROMPTS prompts x SAMPLES samples, up to MAX_TOKENS new tokens, natural lengths), run as
#   moonrl 1x2    one process, run.threads=2
#   moonrl 2x1    `moonrl launch -n 2` (mpirun, shared memory: --mca btl vader,self), run.threads=1
#   moonrl 2x1 z1 the same with dist.zero=1 (ZeRO-1)
#   torch  2x1    bench/dist/dp_grpo_ddp.py: the same step in plain PyTorch, DDP over gloo, 2 processes
#                 x torch.set_num_threads(1)
#   torch  1x2    the same script, one process x 2 threads (no DDP)
# Every run takes STEPS steps; the first is not counted (moonrl: from metrics.jsonl; torch: its
# warm-up). The runs alternate for ROUNDS rounds; each keeps its best round (lowest median step).
# moonrl's runs use the same seed, so 1 and 2 ranks draw the same samples (same tokens per step).
#
#   bench/dist/dp_grpo.sh [build/moonrl]
#   env: SIZE=small|tiny PROMPTS=16 SAMPLES=8 MAX_TOKENS=64 STEPS=8 ROUNDS=3 BTL=vader
#        PYTHON=/usr/bin/python3 TORCH=1 (0: moonrl only) ZERO=1 (0: no ZeRO-1 row)
set -euo pipefail
cd "$(dirname "$0")/../.."
MOONRL=${1:-build/moonrl}
SIZE=${SIZE:-small} PROMPTS=${PROMPTS:-16} SAMPLES=${SAMPLES:-8} MAX_TOKENS=${MAX_TOKENS:-64}
STEPS=${STEPS:-8} ROUNDS=${ROUNDS:-3} BTL=${BTL:-vader} PYTHON=${PYTHON:-/usr/bin/python3}
TORCH=${TORCH:-1} ZERO=${ZERO:-1}
case "$SIZE" in
  small|tiny) ;;
  *) echo "SIZE must be small or tiny, not '$SIZE'" >&2; exit 2 ;;
esac
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# the model of bench/grpo/grpo_step.sh: bench/models.json's digits-$SIZE (a Llama, 4 heads / 2 KV
# heads) with the default example's digit tokenizer, random weights, saved by moonrl in HF format
"$MOONRL" run bench/make_model.lua preset="digits-$SIZE" out="$dir/model"
# its prompts: "11+32=", "12+34=", ... (every step takes all PROMPTS records once)
"$PYTHON" -c "
import json, sys
with open('$dir/data.jsonl', 'w') as f:
    for i in range(1, $PROMPTS + 1):
        f.write(json.dumps({'prompt': f'{10 + i}+{30 + 2 * i}=', 'answer': str(40 + 3 * i)}) + '\n')
"
words=(model.dir="$dir/model" data.path="$dir/data.jsonl" data.chat=false reward=sevens grpo.prompts="$PROMPTS"
  grpo.samples="$SAMPLES" grpo.max_tokens="$MAX_TOKENS" grpo.steps="$STEPS" train.lr=1e-6
  train.micro_batch_tokens=8192 run.checkpoint_minutes=0)
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(getconf _NPROCESSORS_ONLN) cores; load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "settings: $SIZE model, $PROMPTS prompts x $SAMPLES samples, up to $MAX_TOKENS new tokens, $STEPS steps (first not counted)"
echo "moonrl 1x2:    $MOONRL run bench/dist/dp_grpo.lua ${words[*]} run.threads=2"
echo "moonrl 2x1:    $MOONRL launch -n 2 --mpirun '--mca btl $BTL,self' bench/dist/dp_grpo.lua ... run.threads=1"
moonrl_run() { # name, ranks, threads, extra words...
  local name=$1 n=$2 th=$3
  shift 3
  local rd="$dir/$name.$r"
  if [ "$n" = 1 ]; then
    "$MOONRL" run bench/dist/dp_grpo.lua "${words[@]}" run.threads="$th" run.dir="$rd" "$@" > "$rd.log" 2>&1
  else
    "$MOONRL" launch -n "$n" --mpirun "--mca btl $BTL,self" bench/dist/dp_grpo.lua "${words[@]}" run.threads="$th" \
      run.dir="$rd" "$@" > "$rd.log" 2>&1
  fi || { cat "$rd.log" >&2; exit 1; }
  echo "{\"name\": \"$name\", \"side\": \"moonrl\", \"metrics\": \"$rd/metrics.jsonl\"}" >> "$dir/runs.jsonl"
}
torch_run() { # name, ranks, threads
  local name=$1 n=$2 th=$3
  OMP_NUM_THREADS=$th "$PYTHON" bench/dist/dp_grpo_ddp.py "$dir/model" --ranks "$n" --threads "$th" --prompts "$PROMPTS" \
    --samples "$SAMPLES" --max-tokens "$MAX_TOKENS" --warmup 1 --steps $((STEPS - 1)) --port $((29600 + RANDOM % 300)) \
    | tail -1 | sed "s/^{/{\"name\": \"$name\", /" >> "$dir/runs.jsonl"
}
for r in $(seq "$ROUNDS"); do
  moonrl_run "moonrl 1x2" 1 2
  moonrl_run "moonrl 2x1" 2 1
  [ "$ZERO" = 1 ] && moonrl_run "moonrl 2x1 zero1" 2 1 dist.zero=1
  if [ "$TORCH" = 1 ]; then
    torch_run "torch 2x1 DDP" 2 1
    torch_run "torch 1x2" 1 2
  fi
  echo "round $r done (load $(cut -d' ' -f1 /proc/loadavg))"
done
"$PYTHON" - "$dir/runs.jsonl" <<'PY'
import json, sys
# per run: the median over its counted steps of the step and of its phases; tokens/s = the mean
# response tokens of a step / the median step (moonrl's runs draw the same tokens whatever the
# number of ranks, so their tokens/s ratio is their step time ratio)
def median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])
runs = {}
for line in open(sys.argv[1]):
    x = json.loads(line)
    if x["side"] == "moonrl":
        st = [json.loads(l) for l in open(x["metrics"])][1:]  # the first step is not counted
        st = [dict(total=s["time/step"], generate=s["time/generate"], train=s["time/train"], tokens=s["tokens"]) for s in st]
    else:
        st = x["steps"][1:]  # its warm-up step
    rec = {k: median([s[k] for s in st]) for k in ("total", "generate", "train")}
    rec["tokens"] = sum(s["tokens"] for s in st) / len(st)
    rec["tps"], rec["train_tps"] = rec["tokens"] / rec["total"], rec["tokens"] / rec["train"]
    runs.setdefault(x["name"], []).append(rec)
best = {k: min(v, key=lambda r: r["total"]) for k, v in runs.items()}
base = best["moonrl 1x2"]
print("| run | step (median) | generate | train | response tokens / step | tokens/s (step) | tokens/s (train) | vs moonrl 1x2 (tokens/s) | rounds (median step, s) |")
print("|---|---|---|---|---|---|---|---|---|")
for k, r in best.items():
    rounds = ", ".join(f"{x['total']:.3f}" for x in runs[k])
    print(f"| {k} | {r['total']:.3f} s | {r['generate']:.3f} s | {r['train']:.3f} s | {r['tokens']:.0f} | {r['tps']:.0f} | "
          f"{r['train_tps']:.0f} | {r['tps'] / base['tps']:.2f}x | {rounds} |")
m2 = best["moonrl 2x1"]
print(f"moonrl 2 ranks x 1 thread / 1 rank x 2 threads: {m2['tps'] / base['tps']:.2f}x tokens/s (target >= 0.9); "
      f"train phase {m2['train_tps'] / base['train_tps']:.2f}x, generate {base['generate'] / m2['generate']:.2f}x")
if "torch 2x1 DDP" in best:
    t2 = best["torch 2x1 DDP"]
    print(f"moonrl 2x1 / torch DDP 2x1: {m2['tps'] / t2['tps']:.2f}x tokens/s per step, "
          f"{m2['train_tps'] / t2['train_tps']:.2f}x tokens/s of the train phase")
PY
