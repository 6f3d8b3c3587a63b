#!/usr/bin/env bash
# Fuzz for longer than CI does: every target (or those named) for SECONDS each, one after another.
#
#   tests/fuzz/run.sh [SECONDS] [TARGET...]      # default 300 s a target, all targets
#
# With clang it builds build-fuzz/ (libFuzzer, ASan + UBSan: coverage-guided, much faster to find
# new paths); without clang, build-sanitize/ with our own mutation driver (the CI's build). What a
# run finds is kept: new inputs under BUILD/tests/fuzz/corpus/TARGET (seeds of the next run),
# findings under BUILD/tests/fuzz/artifacts/TARGET. A finding fixed becomes a seed: copy its input
# into tests/fuzz/corpus/TARGET/ and commit it with the fix.
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-300}
[ $# -gt 0 ] && shift
c_targets=(json safetensors st_index gguf config tokenizer http lines)
lua_targets=(jinja tokenizer_config json_lua jsonl manifest checkpoint)
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("${c_targets[@]}" "${lua_targets[@]}")

if command -v clang >/dev/null; then
  build=build-fuzz
  [ -f $build/build.ninja ] || CC=clang meson setup $build -Dbuildtype=debug -Db_sanitize=address,undefined \
    -Db_lundef=false -Dcuda=disabled -Dlibfuzzer=true
else
  build=build-sanitize
  [ -f $build/build.ninja ] || meson setup $build -Dbuildtype=debug -Db_sanitize=address,undefined \
    -Db_lundef=false -Dcuda=disabled
fi
ninja -C $build
export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
failed=()
for t in "${targets[@]}"; do
  if [[ " ${lua_targets[*]} " == *" $t "* ]]; then program=$build/moonrl; else program=$build/tests/fuzz/fuzz_$t; fi
  [ -x "$program" ] || { echo "fuzz: no target '$t' (C: ${c_targets[*]}; Lua: ${lua_targets[*]})" >&2; exit 2; }
  echo "== $t: $seconds s"
  tests/fuzz/fuzz.sh "$program" "$t" "$seconds" $build/tests/fuzz || failed+=("$t")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: findings in ${failed[*]} (inputs under $build/tests/fuzz/artifacts/)"
  exit 1
fi
echo "fuzz: ${#targets[@]} targets, $seconds s each: no finding"
