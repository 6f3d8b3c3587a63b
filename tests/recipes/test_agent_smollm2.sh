#!/usr/bin/env bash
# examples/agent_smollm2_python.lua on the real SmolLM2-135M-Instruct GGUF for a few steps (the SFT
# warm-up on transcripts, GRPO on episodes with the sandboxed python tool, the held-out episodes
# before and after), in the suite 'long' (about two minutes on 2 cores). Skipped (exit 77) where the
# file is absent or the sandbox cannot run (no user namespaces).
# usage: test_agent_smollm2.sh PATH/TO/moonrl
set -u
cache=${MOONRL_CACHE:-${HOME:-/tmp}/.cache/moonrl}
gguf=${MOONRL_SMOLLM2_GGUF:-$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ ! -f "$gguf" ]; then echo "skipped: no $gguf (./dev.sh fetch-model fetches it)"; exit 77; fi
if ! "$1" sandbox -- /bin/true > /dev/null 2>&1; then echo "skipped: the sandbox cannot run here"; exit 77; fi
. "$(dirname "$0")/../lib/util.sh" # $tmp, ok, bad, check, summary
out=$("$1" run examples/agent_smollm2_python.lua model.dir="$gguf" sft.steps=4 sft.tool=0.5 grpo.steps=2 grpo.prompts=2 \
  grpo.samples=4 task.heldout=4 eval.every=0 run.progress=off save=false run.dir="$tmp/run" 2>&1)
rc=$?
if [ $rc -ne 0 ]; then bad "exit status $rc" "$(echo "$out" | tail -30)"; summary; exit; fi
pct='[0-9]+\.[0-9]%'
shows() { echo "$out" | grep -Eq "$1"; }
check "the before/after line" shows "^held-out accuracy \(greedy, 4 problems\): $pct as it comes, $pct before GRPO -> $pct after"
check "metrics.jsonl has 2 lines (GRPO steps)" [ "$(grep -c . "$tmp/run/metrics.jsonl")" -eq 2 ]
check "8 episodes a step" grep -q '"env/episodes": 8' "$tmp/run/metrics.jsonl"
check "no episode failed" [ "$(grep -c '"env/ended/env_error": 0' "$tmp/run/metrics.jsonl")" -eq 2 ]
[ "$failed" -eq 0 ] || echo "$out" | tail -30
echo "$out" | grep '^held-out accuracy'
summary
