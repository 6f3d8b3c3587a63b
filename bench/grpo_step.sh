#!/usr/bin/env bash
# One GRPO step — generate PROMPTS x SAMPLES completions of MAX_TOKENS tokens, score them, group
# advantages, log-probs and one AdamW update — with moonrl (bench/grpo_step.lua) and with TRL's
# GRPOTrainer (bench/grpo_step_trl.py) on the same tiny Llama in Hugging Face format, the same
# settings and the same number of threads; each side timed on its second step. Prints the ratio.
#
#   bench/grpo_step.sh [build/moonrl]          env: PROMPTS=16 SAMPLES=8 MAX_TOKENS=64 THREADS=2
#
# TRL needs a newer torch than Debian's 1.13: the script installs torch (CPU), transformers and trl
# with pip into a virtualenv of its own (TRL_VENV, default ~/.cache/moonrl-bench-trl), for this
# benchmark only.
set -euo pipefail
cd "$(dirname "$0")/.."
MOONRL=${1:-build/moonrl}
export PROMPTS=${PROMPTS:-16} SAMPLES=${SAMPLES:-8} MAX_TOKENS=${MAX_TOKENS:-64} THREADS=${THREADS:-2}
VENV=${TRL_VENV:-$HOME/.cache/moonrl-bench-trl}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import trl, torch" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch trl transformers datasets accelerate
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# the model: a Llama (hidden 256, 4 layers, 4 heads / 2 KV heads, SwiGLU 768) with the default
# example's digit tokenizer, random weights, saved by moonrl in Hugging Face format
cat > "$dir/make.lua" <<LUA
local moonrl = require('moonrl')
local m = moonrl.model.new({ model_type = 'llama', vocab_size = 15, hidden_size = 256, intermediate_size = 768,
  num_hidden_layers = 4, num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 256,
  bos_token_id = 1, eos_token_id = 2 }, { seed = 1 })
require('moonrl.recipe').save({ dir = '$dir' }, m, moonrl.home .. '/examples/default', '$dir/model')
LUA
"$MOONRL" run "$dir/make.lua"
echo "settings: $PROMPTS prompts x $SAMPLES samples, $MAX_TOKENS new tokens, $THREADS threads, fp32"
mo=$(MODEL="$dir/model" "$MOONRL" run bench/grpo_step.lua | tail -1)
echo "moonrl: $mo"
trl=$(OMP_NUM_THREADS=$THREADS "$VENV/bin/python" bench/grpo_step_trl.py "$dir/model" --prompts "$PROMPTS" \
  --samples "$SAMPLES" --max-tokens "$MAX_TOKENS" --threads "$THREADS" 2>/dev/null | tail -1)
echo "trl:    $trl"
python3 - "$mo" "$trl" <<'PY'
import json, sys
m, t = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"one GRPO step: moonrl {m['total']:.3f} s (generate {m['generate']:.3f}, train {m['train']:.3f}), "
      f"TRL {t['total']:.3f} s: moonrl is {t['total'] / m['total']:.1f}x faster")
PY
