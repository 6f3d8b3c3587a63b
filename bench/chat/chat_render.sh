#!/usr/bin/env bash
# Chat template rendering: moonrl.chat against Python jinja2 (compiled once,
# rendered N times, as transformers does after its template cache).
# usage: bench/chat/chat_render.sh [build/moonrl]   (from the repository root)
set -eu
MOONRL=${1:-build/moonrl}
N=${N:-2000}
for tpl in Qwen-Qwen3-0.6B meta-llama-Llama-3.1-8B-Instruct Mistral-Small-3.2-24B-Instruct-2506; do
  for case in multi_turn tools_roundtrip; do
    path=tests/chat/templates/$tpl.jinja
    py=$(/usr/bin/python3 - "$path" "$case" "$N" <<'PY'
import json, sys, time
from datetime import datetime, timezone
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
path, case, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
    x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
def raise_exception(m): raise Exception(m)
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = lambda f: datetime.fromtimestamp(1750000000, timezone.utc).strftime(f)
tpl = env.from_string(open(path).read())
vars = [c for c in json.load(open("tests/chat/cases.json")) if c["name"] == case][0]["vars"]
tpl.render(**vars)
t0 = time.perf_counter()
for _ in range(n): tpl.render(**vars)
print("%.3f" % ((time.perf_counter() - t0) / n * 1e6))
PY
)
    lua=$(TEMPLATE=$path CASE=$case N=$N "$MOONRL" run bench/chat/chat_render.lua)
    awk -v t="$tpl" -v c="$case" -v p="$py" -v l="$lua" \
      'BEGIN { printf "%-40s %-16s jinja2 %8.1f us  moonrl %8.1f us  speedup %.1fx\n", t, c, p, l, p / l }'
  done
done
