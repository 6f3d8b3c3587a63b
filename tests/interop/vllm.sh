#!/usr/bin/env bash
# vLLM (the CPU build in .venv-interop/, ./dev.sh vllm) as moonrl's rollout engine, the long way:
#   1. tests/interop/vllm_check.lua on a tiny model (what the interop suite runs): greedy tokens
#      equal moonrl's engine's at each weight version, log-probs the trainer's, GRPO through it;
#   2. the same greedy and log-prob checks on the real SmolLM2-135M-Instruct (fp32);
#   3. tests/interop/smollm2_grpo.lua: GRPO on SmolLM2 (examples/grpo_smollm2.lua) through vLLM
#      and on moonrl's engine: the held-out accuracy rises on both; the step times.
# Usage: tests/interop/vllm.sh [path/to/moonrl]   (STEPS=N: GRPO steps of 3, default 20)
# Its last line is "N passed, N failed".
set -uo pipefail
cd "$(dirname "$0")/../.."
exe=${1:-build/moonrl}
gguf=${MODEL:-${MOONRL_CACHE:-$HOME/.cache/moonrl}/models/SmolLM2-135M-Instruct.Q4_1.gguf}
passed=0 failed=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT
part() { # a Lua test file: its own "N passed, N failed" added to the totals
  local out
  "$@" 2>&1 | tee "$log"
  out=$(tail -1 "$log")
  if [[ $out =~ ^([0-9]+)\ passed,\ ([0-9]+)\ failed ]]; then
    passed=$((passed + BASH_REMATCH[1])); failed=$((failed + BASH_REMATCH[2]))
  elif [[ $out == skipped* ]]; then
    echo "vllm.sh: $out" >&2
  else
    failed=$((failed + 1))
  fi
}
if [ ! -x .venv-interop/bin/vllm ]; then echo "vllm.sh: no .venv-interop/bin/vllm (./dev.sh vllm)"; echo "0 passed, 1 failed"; exit 1; fi
if [ ! -f "$gguf" ]; then echo "vllm.sh: no $gguf (./dev.sh fetch-model)"; echo "0 passed, 1 failed"; exit 1; fi
part "$exe" run tests/interop/vllm_check.lua
MODEL=$gguf part "$exe" run tests/interop/vllm_check.lua
MODEL=$gguf part "$exe" run tests/interop/smollm2_grpo.lua
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
