#!/usr/bin/env bash
# The default example's GRPO phase trained whole and as LoRA adapters of rank 1, 8 and 32 (the SFT
# warm-up whole in every run), 3 seeds each, held-out accuracy every 5 steps: the mean over the
# seeds at each evaluation, one row a rank (bench/RESULTS.md, "LoRA").
#   bench/lora/ranks.sh [path/to/moonrl]      (about 15 s a run on 2 cores: 3 minutes)
set -euo pipefail
exe=${1:-build/moonrl}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for seed in 1 2 3; do
  for r in 0 1 8 32; do
    "$exe" run examples/default.lua model.lora.rank=$r run.seed=$seed eval.every=5 quiet=true \
      run.dir="$out/r$r-s$seed" > "$out/r$r-s$seed.log" 2>&1
  done
done
/usr/bin/python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
print("rank   " + " ".join("step %-4s" % s for s in (5, 10, 15, 20, 25, 30)))
for r in (0, 1, 8, 32):
    acc = {}
    for s in (1, 2, 3):
        first = None
        for line in open("%s/r%d-s%d/metrics.jsonl" % (out, r, s)):
            x = json.loads(line)
            if "eval/accuracy" in x:
                acc.setdefault(x["step"], []).append(x["eval/accuracy"])
    row = ["%5.1f%%   " % (100 * sum(v) / len(v)) for _, v in sorted(acc.items())]
    print("%-6s " % ("whole" if r == 0 else r) + " ".join(row))
PY
