#!/usr/bin/env bash
# Run one fuzz target for a while: the meson tests of suite `fuzz` and tests/fuzz/run.sh both
# come through here, so a target runs the same way in CI and on a developer's machine.
#
#   tests/fuzz/fuzz.sh PROGRAM TARGET SECONDS OUT_DIR
#
# PROGRAM: the target's executable (build*/tests/fuzz/fuzz_TARGET, libFuzzer's or our driver's), or
# the moonrl executable for the targets in Lua (tests/fuzz/fuzz.lua). Seeds: tests/fuzz/corpus/TARGET
# and what earlier runs kept in OUT_DIR/corpus/TARGET (libFuzzer adds the inputs that reach new code
# there). A finding's input goes to OUT_DIR/artifacts/TARGET/ (crash-*, leak-*, timeout-*, oom-*),
# named on the last lines of the output; the run then fails.
set -euo pipefail
[ $# -eq 4 ] || { echo "usage: $0 PROGRAM TARGET SECONDS OUT_DIR" >&2; exit 2; }
program=$(realpath "$1") target=$2 seconds=$3 out=$(realpath -m "$4") # absolute: the Lua targets run from the source root
here=$(cd "$(dirname "$0")" && pwd)
seeds=$here/corpus/$target
[ -d "$seeds" ] || seeds=$here/corpus/${target%_lua} # json_lua: the seeds of json
# The random seed: FUZZ_SEED, else one from the source's git commit (CI fuzzes the same inputs for
# a commit, so a rerun gives the same answer, and other inputs for the next commit), else the clock.
seed=${FUZZ_SEED:-}
if [ -z "$seed" ] && rev=$(git -C "$here" rev-parse --short=12 HEAD 2>/dev/null); then seed=$((16#$rev % 1000000007 + 1)); fi
found=$out/corpus/$target
artifacts=$out/artifacts/$target
mkdir -p "$found" "$artifacts"

if [ "$(basename "$program")" = moonrl ]; then
  # the Lua targets run from the source root, where `moonrl run` finds tests/fuzz/fuzz.lua; the
  # driver keeps the input it runs in $artifacts/current, which is the finding if the process dies
  cd "$here/../.."
  rm -f "$artifacts/current"
  # no LeakSanitizer: it cannot see into LuaJIT's heap, so every C object a Lua value still holds
  # at exit would look leaked (the C targets look for leaks, input by input)
  export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
  status=0
  "$program" run tests/fuzz/fuzz.lua "target=$target" "seconds=$seconds" "seeds=$seeds" "artifacts=$artifacts/" \
    ${seed:+"seed=$seed"} ||
    status=$?
  if [ -f "$artifacts/current" ]; then
    kept=$artifacts/crash-$(cksum <"$artifacts/current" | cut -d' ' -f1)
    mv "$artifacts/current" "$kept"
    echo "fuzz: the process died (status $status) in the input now in $kept" >&2
  fi
  exit $status
fi
case $target in # the dictionary of the input's language
  json|config|st_index|tokenizer) dict=json ;;
  *) dict=$target ;;
esac
dicts=()
[ -f "$here/dict/$dict.dict" ] && dicts=("-dict=$here/dict/$dict.dict")
# -timeout: one input; -rss_limit_mb: the whole process (libFuzzer also fails one allocation over it)
exec "$program" "-max_total_time=$seconds" -timeout=20 -rss_limit_mb=2048 "-artifact_prefix=$artifacts/" \
  -print_final_stats=1 ${seed:+"-seed=$seed"} "${dicts[@]}" "$found" "$seeds"
