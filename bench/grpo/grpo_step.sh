#!/usr/bin/env bash
# One GRPO step — generate PROMPTS x SAMPLES completions of up to MAX_TOKENS tokens, score them,
# group advantages, log-probs and one AdamW update — with moonrl (bench/grpo/grpo_step.lua) and with
# TRL's GRPOTrainer (bench/grpo/grpo_step_trl.py) on the same tiny Llama in Hugging Face format, the
# same settings and the same number of threads. Each side: WARMUP warm-up steps, then STEPS timed
# steps; the two sides alternate for ROUNDS rounds and each keeps its best mean. Prints the ratio.
#
#   bench/grpo/grpo_step.sh [build/moonrl]
#   env: SIZE=small (hidden 256, 4 layers, ~3.2M parameters) or tiny (the default example's
#        model: hidden 128, 2 layers, ~0.4M); PROMPTS=16 SAMPLES=8 MAX_TOKENS=64 THREADS=2
#        STEPS=3 WARMUP=2 ROUNDS=2; LENGTHS=natural (a completion ends at EOS or MAX_TOKENS, as in real
#        RL) or fixed (no EOS: every completion runs to MAX_TOKENS, so both sides do the same
#        arithmetic and the ratio is that of the kernels alone)
#
# TRL needs a newer torch than Debian's 1.13: the script installs torch, transformers and trl
# with pip into a virtualenv of its own (TRL_VENV, default ~/.cache/moonrl-bench-trl), for this
# benchmark only.
set -euo pipefail
cd "$(dirname "$0")/../.."
MOONRL=${1:-build/moonrl}
export PROMPTS=${PROMPTS:-16} SAMPLES=${SAMPLES:-8} MAX_TOKENS=${MAX_TOKENS:-64} THREADS=${THREADS:-2}
export STEPS=${STEPS:-3} WARMUP=${WARMUP:-2} LENGTHS=${LENGTHS:-natural} DTYPE=${DTYPE:-fp32}
SIZE=${SIZE:-small} ROUNDS=${ROUNDS:-2}
case "$SIZE" in
  small|tiny|medium) ;;
  *) echo "SIZE must be small, tiny or medium, not '$SIZE'" >&2; exit 2 ;;
esac
case "$DTYPE" in
  fp32|bf16) ;;
  *) echo "DTYPE must be fp32 or bf16, not '$DTYPE'" >&2; exit 2 ;;
esac
VENV=${TRL_VENV:-$HOME/.cache/moonrl-bench-trl}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import trl, torch" 2>/dev/null; then
  python3 -m venv "$VENV"
  # the CPU-only torch wheel where its index is reachable (~200 MB), else PyPI's (with CUDA, ~6 GB)
  "$VENV/bin/pip" install -q --index-url https://download.pytorch.org/whl/cpu torch 2>/dev/null ||
    "$VENV/bin/pip" install -q torch
  "$VENV/bin/pip" install -q trl transformers datasets accelerate
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# the model: bench/models.json's digits-$SIZE (a Llama, 4 heads / 2 KV heads) with the default
# example's digit tokenizer (15 ids, EOS among them), random weights, saved by moonrl in
# Hugging Face format (bench/make_model.lua)
"$MOONRL" run bench/make_model.lua preset="digits-$SIZE" out="$dir/model"
echo "settings: $SIZE model, $PROMPTS prompts x $SAMPLES samples, up to $MAX_TOKENS new tokens ($LENGTHS lengths), $THREADS threads, $DTYPE, load average $(cut -d' ' -f1 /proc/loadavg)"
for r in $(seq "$ROUNDS"); do
  MODEL="$dir/model" "$MOONRL" run bench/grpo/grpo_step.lua | tail -1 > "$dir/moonrl.$r"
  OMP_NUM_THREADS=$THREADS "$VENV/bin/python" bench/grpo/grpo_step_trl.py "$dir/model" --prompts "$PROMPTS" \
    --samples "$SAMPLES" --max-tokens "$MAX_TOKENS" --threads "$THREADS" --steps "$STEPS" --warmup "$WARMUP" --lengths "$LENGTHS" \
    --dtype "$DTYPE" 2>/dev/null | tail -1 > "$dir/trl.$r"
  echo "round $r: moonrl $(cat "$dir/moonrl.$r")"
  echo "round $r: trl    $(cat "$dir/trl.$r")"
done
python3 - "$dir" "$ROUNDS" <<'PY'
import json, sys
d, rounds = sys.argv[1], int(sys.argv[2])
load = lambda side: [json.load(open(f"{d}/{side}.{r}")) for r in range(1, rounds + 1)]
m = min(load("moonrl"), key=lambda x: x["total"])
t = min(load("trl"), key=lambda x: x["total"])
print(f"one GRPO step: moonrl {m['total']:.3f} s (generate {m['generate']:.3f}, train {m['train']:.3f}; "
      f"mean length {m['mean_length']:.1f}), TRL {t['total']:.3f} s (mean length {t['mean_length']:.1f}): "
      f"moonrl is {t['total'] / m['total']:.1f}x faster")
PY
