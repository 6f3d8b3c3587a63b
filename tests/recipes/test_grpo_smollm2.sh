#!/usr/bin/env bash
# examples/grpo_smollm2.lua on the real SmolLM2-135M-Instruct GGUF for a few steps (SFT warm-up,
# GRPO, the held-out accuracy before and after), well under a minute on 2 cores. Skipped (exit 77)
# where the file is absent: ./dev.sh fetch-model (or ./dev.sh test) fetches it; MOONRL_SMOLLM2_GGUF
# names another copy.
# usage: test_grpo_smollm2.sh PATH/TO/moonrl
set -u
cache=${MOONRL_CACHE:-${HOME:-/tmp}/.cache/moonrl}
gguf=${MOONRL_SMOLLM2_GGUF:-$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ ! -f "$gguf" ]; then echo "skipped: no $gguf (./dev.sh fetch-model fetches it)"; exit 77; fi
. "$(dirname "$0")/../lib/util.sh" # $tmp, ok, bad, check, summary
t0=$(date +%s)
out=$("$1" run examples/grpo_smollm2.lua model.dir="$gguf" sft.steps=2 sft.batch=4 grpo.steps=2 grpo.prompts=2 \
  grpo.samples=4 grpo.max_tokens=16 task.heldout=4 run.progress=off save=false run.dir="$tmp/run" 2>&1)
rc=$?
t1=$(date +%s)
if [ $rc -ne 0 ]; then bad "exit status $rc" "$(echo "$out" | tail -30)"; summary; exit; fi
pct='[0-9]+\.[0-9]%'
shows() { echo "$out" | grep -Eq "$1"; }
check "a precision line" shows "^precision: (bf16|fp32)"
check "the base accuracy" shows "^held-out accuracy of the model as it comes \(greedy, 4 problems\): $pct$"
check "the SFT line" shows "^SFT warm-up: 2 steps of 4 worked answers, loss [0-9.]+ -> [0-9.]+"
check "the accuracy after SFT" shows "^held-out accuracy after the SFT warm-up \(2 steps of 4\): $pct$"
check "the before/after line" shows "^held-out accuracy \(greedy, 4 problems\): $pct as it comes, $pct before GRPO -> $pct after"
check "metrics.jsonl has 2 lines (GRPO steps)" [ "$(grep -c . "$tmp/run/metrics.jsonl")" -eq 2 ]
check "a heldout_accuracy event" grep -q '"heldout_accuracy"' "$tmp/run/events.jsonl"
[ "$failed" -eq 0 ] || echo "$out" | tail -30
echo "$out" | grep '^held-out accuracy'
echo "($((t1 - t0)) s)"
summary
