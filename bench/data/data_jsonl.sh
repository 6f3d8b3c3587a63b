#!/usr/bin/env bash
# JSONL datasets: moonrl.data (C line index, Lua JSON decoder) against
# Python (offsets from iterating the file in binary mode, json.loads).
# usage: bench/data/data_jsonl.sh [build/moonrl]   (from the repository root; LINES=... to resize)
set -eu
MOONRL=${1:-build/moonrl}
LINES=${LINES:-200000}
N=20000
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
/usr/bin/python3 - "$tmp/d.jsonl" "$LINES" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(int(sys.argv[2])):
        f.write(json.dumps({"id": i, "q": "What is %d + %d? " % (i, i + 1) + "x" * 150, "a": str(2 * i + 1),
                            "meta": {"source": "synthetic", "level": i % 5}}) + "\n")
PY
py=$(/usr/bin/python3 - "$tmp/d.jsonl" "$N" <<'PY'
import json, random, sys, time
path, n = sys.argv[1], int(sys.argv[2])
t0 = time.perf_counter()
offsets = []
with open(path, "rb") as f:
    pos = 0
    for line in f:
        if line.strip():
            offsets.append(pos)
        pos += len(line)
t1 = time.perf_counter()
order = list(range(len(offsets)))
random.Random(1).shuffle(order)
with open(path, "rb") as f:
    for i in order[:n]:
        f.seek(offsets[i])
        assert json.loads(f.readline())["q"]
print("%.4f %.3f" % (t1 - t0, (time.perf_counter() - t1) / n * 1e6))
PY
)
lua=$(FILE=$tmp/d.jsonl N=$N "$MOONRL" run bench/data/data_jsonl.lua)
size=$(stat -c %s "$tmp/d.jsonl")
echo "$py $lua" | awk -v l="$LINES" -v s="$size" '{
  printf "index %d lines (%.0f MB): python %.3f s  moonrl %.3f s  speedup %.1fx\n", l, s / 1e6, $1, $3, $1 / $3
  printf "random record read+decode:     python %.1f us  moonrl %.1f us  speedup %.1fx\n", $2, $4, $2 / $4 }'
