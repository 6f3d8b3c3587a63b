#!/usr/bin/env bash
# The moonrl command end to end: exit statuses and the messages users see.
# usage: test_cli.sh PATH/TO/moonrl
set -u
MOONRL=$1
# expect NAME WANT_STATUS WANT_TEXT -- command...: its exit status, and its stderr+stdout contain
# WANT_TEXT ($tmp, ok, bad, expect and summary: tests/lib/util.sh)
. "$(dirname "$0")/../lib/util.sh"

cat > "$tmp/recipe.lua" <<'LUA'
local moonrl = require('moonrl')
local cfg = moonrl.config { lr = 0.5, steps = moonrl.config.integer(3), model = { name = 'tiny' } }
print(string.format('lr=%g steps=%d model=%s', cfg.lr, cfg.steps, cfg.model.name))
LUA
cat > "$tmp/broken.lua" <<'LUA'
local moonrl = require('moonrl')
local cfg = moonrl.config { n = 1 }
local function helper() local x = nil; return x.field end
helper()
LUA
cat > "$tmp/syntax.lua" <<'LUA'
local x = = 1
LUA
cat > "$tmp/loop.lua" <<'LUA'
local moonrl = require('moonrl')
local cfg = moonrl.config { steps = 1000 }
for step = 1, cfg.steps do
  moonrl.sleep(0.05)
  moonrl.check_stop()
end
LUA
cat > "$tmp/noconfig.lua" <<'LUA'
print('no config here')
LUA

expect "help" 0 "moonrl run RECIPE" -- "$MOONRL" --help
expect "version" 0 "backends: cpu" -- "$MOONRL" version
expect "version names features" 0 "cpu features:" -- "$MOONRL" version
expect "version names the kernels" 0 "cpu kernels: built for avx512 avx2 sse; using" -- "$MOONRL" version
expect "version names the bf16 product path" 0 "bf16 products: " -- "$MOONRL" version
expect "version names the fp32 product library" 0 "fp32 products: " -- "$MOONRL" version
expect "MOONRL_FP32_GEMM=openblas" 0 "fp32 products: OpenBLAS" -- env MOONRL_FP32_GEMM=openblas "$MOONRL" version
if "$MOONRL" version | grep -q "bf16 products: onednn"; then # oneDNN built in and running
  expect "MOONRL_FP32_GEMM=onednn" 0 "fp32 products: oneDNN (" -- env MOONRL_FP32_GEMM=onednn "$MOONRL" version
fi
expect "MOONRL_FP32_GEMM wrong" 0 "MOONRL_FP32_GEMM must be openblas, onednn or auto (got 'fast')" -- \
  env MOONRL_FP32_GEMM=fast "$MOONRL" version
expect "recipe runs" 0 "lr=0.5 steps=3 model=tiny" -- "$MOONRL" run "$tmp/recipe.lua"
expect "overrides" 0 "lr=0.25 steps=7 model=big" -- "$MOONRL" run "$tmp/recipe.lua" lr=0.25 steps=7 model.name=big
expect "missing recipe" 2 "moonrl: error: recipe '$tmp/nope.lua' not found" -- "$MOONRL" run "$tmp/nope.lua"
expect "unknown key" 2 "moonrl: error: unknown config key 'stpes' (did you mean steps?)" -- "$MOONRL" run "$tmp/recipe.lua" stpes=3
expect "wrong type" 2 "moonrl: error: config key 'lr' expects a number, got 'high'" -- "$MOONRL" run "$tmp/recipe.lua" lr=high
expect "not an integer" 2 "expects an integer, got '2.5'" -- "$MOONRL" run "$tmp/recipe.lua" steps=2.5
expect "--restarts inf" 2 "--restarts expects a whole number >= 0, got 1e309" -- "$MOONRL" run "$tmp/recipe.lua" --restarts 1e309
expect "--backoff inf" 2 "--backoff expects a number >= 0, got 1e309" -- "$MOONRL" run "$tmp/recipe.lua" --restarts 1 --backoff 1e309
expect "launch -n inf" 2 "-n expects a whole number >= 1, got 1e309" -- "$MOONRL" launch -n 1e309 "$tmp/recipe.lua"
expect "a generate option inf" 2 "--max-tokens '1e309': expected an integer" -- "$MOONRL" generate --model "$tmp" --prompt x --max-tokens 1e309
expect "bad word" 2 "expected key=value, got 'lr'" -- "$MOONRL" run "$tmp/recipe.lua" lr
expect "lua error has file and line" 1 "broken.lua:3: attempt to index local 'x'" -- "$MOONRL" run "$tmp/broken.lua"
expect "syntax error has file and line" 2 "syntax.lua:1:" -- "$MOONRL" run "$tmp/syntax.lua"
expect "no config declared" 2 "declares no config" -- "$MOONRL" run "$tmp/noconfig.lua" a=1
expect "show config" 0 "model.name" -- "$MOONRL" run "$tmp/recipe.lua" --show-config
# model.lora: the trainable share, from the model's config.json alone (no weights needed): rank 4 on
# every projection of 2 layers of hidden 32 (q, o 4 x 64; k, v 4 x 48; gate, up, down 4 x 96) = 4096
mkdir -p "$tmp/cfgonly"
echo '{"model_type": "llama", "vocab_size": 15, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": true}' > "$tmp/cfgonly/config.json"
expect "show config: LoRA's trainable share" 0 "LoRA: rank 4, alpha 32, q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj: 4096 trainable parameters (21.48% of 19072)" \
  -- "$MOONRL" run grpo model.dir="$tmp/cfgonly" model.lora.rank=4 --show-config
expect "unknown command" 2 "unknown command 'frobnicate'" -- "$MOONRL" frobnicate
expect "deadline stops cleanly" 124 "stopped (deadline of 0.3 s passed) at a safe point" -- "$MOONRL" run "$tmp/loop.lua" run.max_seconds=0.3
expect "default example (shortened)" 0 "held-out accuracy (greedy, 20 problems)" -- "$MOONRL" sft.steps=20 grpo.steps=1 grpo.prompts=4 heldout=20 quiet=true run.dir="$tmp/default_run"
expect "default example: bad override" 2 "unknown config key 'grpo.stepz'" -- "$MOONRL" grpo.stepz=1
expect "doctor: the kernels chosen" 0 "kernels: " -- "$MOONRL" doctor --dir "$tmp"
expect "doctor: BLAS and memory" 0 "available of" -- "$MOONRL" doctor --dir "$tmp"
if "$MOONRL" version | grep -q "amx_bf16"; then # a CPU with AMX: MOONRL_AMX=0 turns our tiles off, else in use
  expect "doctor: MOONRL_AMX=0" 0 "our AMX tiles off: MOONRL_AMX=0" -- env MOONRL_AMX=0 "$MOONRL" doctor --dir "$tmp"
  if ! "$MOONRL" doctor --dir "$tmp" | grep -q "did not grant"; then # (a Linux older than 5.16 does not)
    expect "version: AMX tiles in use" 0 "+ amx (weight panels" -- "$MOONRL" version
  fi
fi
expect "doctor: a missing run directory fails" 1 "FAIL  disk" -- "$MOONRL" doctor --dir "$tmp/nonexistent"
expect "doctor: bad argument" 2 "unknown argument --bogus" -- "$MOONRL" doctor --bogus
expect "doctor: the sandbox" 0 "sandbox    namespaces" -- "$MOONRL" doctor --dir "$tmp"
# moonrl sandbox: stdin in, stdout out, the program's exit status, a limit said, the JSON record
expect "sandbox: stdin, stdout, exit status" 3 "HELLO" -- sh -c "echo hello | '$MOONRL' sandbox -- sh -c 'tr a-z A-Z; exit 3'"
expect "sandbox: a limit hit" 137 "limit hit: wall" -- "$MOONRL" sandbox --time 0.3 -- sleep 5
expect "sandbox: its own /tmp, a file put there" 0 "model = { name = 'tiny' }" -- "$MOONRL" sandbox --put "$tmp/recipe.lua" -- cat /tmp/recipe.lua
expect "sandbox: --json" 0 "" -- "$MOONRL" sandbox --json "$tmp/sb.json" --memory 64 -- true
if grep -q '"limit": "none"' "$tmp/sb.json" && grep -q '"ok": true' "$tmp/sb.json"; then ok "sandbox: the JSON record"
else bad "sandbox: the JSON record: $(cat "$tmp/sb.json")"; fi
expect "sandbox: a bad option" 2 "unknown option '--bogus'" -- "$MOONRL" sandbox --bogus -- true
expect "sandbox: a bad limit" 2 "--memory 'lots' is not a number" -- "$MOONRL" sandbox --memory lots -- true
expect "sandbox: no program" 2 "no program (after --)" -- "$MOONRL" sandbox --time 1
expect "convert: usage" 2 "usage: moonrl convert FILE.gguf DIR" -- "$MOONRL" convert
expect "a missing model directory is a usage error" 2 "model.dir: $tmp/nomodel/config.json: cannot open" -- "$MOONRL" run grpo model.dir="$tmp/nomodel" data.path=x
expect "a missing .gguf model is a usage error" 2 "model.dir: $tmp/nomodel.gguf: no such file" -- "$MOONRL" run grpo model.dir="$tmp/nomodel.gguf" data.path=x
mkdir -p "$tmp/arun/model" && echo '{}' > "$tmp/arun/model/config.json" && : > "$tmp/arun/metrics.jsonl"
expect "a run directory as model.dir: the hint names its model/" 2 "its model is model.dir=$tmp/arun/model" -- "$MOONRL" run grpo model.dir="$tmp/arun" data.path=x

# exactly one line of error output for usage errors
lines=$("$MOONRL" run "$tmp/recipe.lua" stpes=3 2>&1 | wc -l)
if [ "$lines" -eq 1 ]; then ok "one error line"; else bad "one error line: $lines lines"; fi

# SIGTERM and SIGINT: stop at the next safe point, message, non-zero status
for sig in TERM INT; do
  "$MOONRL" run "$tmp/loop.lua" > "$tmp/out_$sig" 2>&1 &
  pid=$!
  sleep 1
  kill -$sig $pid
  wait $pid
  status=$?
  want=$([ $sig = TERM ] && echo 143 || echo 130)
  if [ $status -eq $want ] && grep -q "received SIG$sig, stopping at the next safe point" "$tmp/out_$sig" \
     && grep -q "stopped (SIG$sig) at a safe point" "$tmp/out_$sig"; then
    ok "SIG$sig stops cleanly"
  else
    bad "SIG$sig: status $status (want $want)"; cat "$tmp/out_$sig"
  fi
done

summary
