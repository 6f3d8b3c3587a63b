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
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
t0=$(date +%s)
out=$("$1" run examples/grpo_smollm2.lua model.dir="$gguf" sft.steps=2 sft.batch=4 grpo.steps=2 grpo.prompts=2 \
  grpo.samples=4 grpo.max_tokens=24 task.heldout=8 run.progress=off save=false run.dir="$tmp/run" 2>&1)
rc=$?
t1=$(date +%s)
fail() { echo "$out" | tail -30; echo "FAIL: $1"; echo "0 passed, 1 failed"; exit 1; }
[ $rc -eq 0 ] || fail "exit status $rc"
pct='[0-9]+\.[0-9]%'
echo "$out" | grep -Eq "^precision: (bf16|fp32)" || fail "no precision line"
echo "$out" | grep -Eq "^held-out accuracy of the model as it comes \(greedy, 8 problems\): $pct$" || fail "no base accuracy"
echo "$out" | grep -Eq "^SFT warm-up: 2 steps of 4 worked answers, loss [0-9.]+ -> [0-9.]+" || fail "no SFT line"
echo "$out" | grep -Eq "^held-out accuracy after the SFT warm-up \(2 steps of 4\): $pct$" || fail "no accuracy after SFT"
echo "$out" | grep -Eq "^held-out accuracy \(greedy, 8 problems\): $pct as it comes, $pct before GRPO -> $pct after" ||
  fail "no before/after line"
[ "$(grep -c . "$tmp/run/metrics.jsonl")" -eq 2 ] || fail "metrics.jsonl should have 2 lines (GRPO steps)"
grep -q '"heldout_accuracy"' "$tmp/run/events.jsonl" || fail "no heldout_accuracy event"
echo "$out" | grep '^held-out accuracy'
echo "($((t1 - t0)) s)"
echo "1 passed, 0 failed"
