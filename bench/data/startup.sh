#!/usr/bin/env bash
# Data start-up: seconds and peak memory an SFT and a GRPO run spend on their
# data before the first step, on a JSONL file of LINES lines: a one-step run
# on that file less the same run on its first 100 lines (the baseline, in
# the same script: model load, engine, the step). Tiny model (tests/lib);
# the median of REPEAT (3) runs of each.
# usage: bench/data/startup.sh [build/moonrl]   (from the repository root; LINES=..., REPEAT=...)
set -eu
MOONRL=${1:-build/moonrl}
LINES=${LINES:-10000000}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
/usr/bin/python3 - "$tmp/d.jsonl" "$LINES" <<'PY'
import sys
with open(sys.argv[1], "w") as f:
    n, chunk = int(sys.argv[2]), []
    for i in range(n):
        a, b = i % 97, i % 89
        chunk.append('{"prompt": "%d+%d=", "response": "%d", "question": "%d+%d=", "answer": "%d"}\n' % (a, b, a + b, a, b, a + b))
        if len(chunk) == 100000 or i == n - 1:
            f.write("".join(chunk))
            chunk = []
PY
head -100 "$tmp/d.jsonl" > "$tmp/small.jsonl"
echo "local U = dofile('tests/recipes/util.lua'); U.tiny_model('$tmp/model')" > "$tmp/model.lua"
"$MOONRL" run "$tmp/model.lua"
run() { # recipe file -> "seconds peak_kB", the median of REPEAT runs
  local args
  if [ "$1" = sft ]; then args="train.steps=1 train.batch=2"
  else args="grpo.steps=1 grpo.prompts=2 grpo.samples=2 grpo.max_tokens=4 reward=exact data.prompt=question data.chat=false"; fi
  local n=${REPEAT:-3}
  for _ in $(seq "$n"); do
    rm -rf "$tmp/run"
    /usr/bin/time -f "%e %M" -o "$tmp/time" "$MOONRL" run "recipes/$1.lua" "model.dir=$tmp/model" "data.path=$2" \
      "run.dir=$tmp/run" run.progress=off $args > /dev/null 2>&1
    cat "$tmp/time"
  done > "$tmp/runs"
  local k=$(( (n + 1) / 2 ))
  echo "$(cut -d' ' -f1 "$tmp/runs" | sort -n | sed -n "${k}p") $(cut -d' ' -f2 "$tmp/runs" | sort -n | sed -n "${k}p")"
}
size=$(stat -c %s "$tmp/d.jsonl")
for recipe in sft grpo; do
  echo "$recipe $(run $recipe "$tmp/small.jsonl") $(run $recipe "$tmp/d.jsonl")"
done | awk -v l="$LINES" -v s="$size" '{
  printf "%s start-up on %d lines (%.0f MB): %.2f s, %.0f MB (the run %.2f s, %.0f MB; on 100 lines %.2f s, %.0f MB)\n",
    $1, l, s / 1e6, $4 - $2, ($5 - $3) / 1024, $4, $5 / 1024, $2, $3 / 1024 }'
