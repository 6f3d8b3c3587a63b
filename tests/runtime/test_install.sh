#!/usr/bin/env bash
# `meson install` puts a moonrl that finds its Lua library under
# PREFIX/share/moonrl (not in the source tree) and runs a recipe from there.
# usage: test_install.sh BUILD_DIR
set -u
build=$1
. "$(dirname "$0")/../lib/util.sh" # $tmp, ok, bad, summary
if ! meson install -C "$build" --destdir "$tmp" --quiet >"$tmp/log" 2>&1; then
  bad "meson install" "$(cat "$tmp/log")"; summary; exit
fi
exe=$(find "$tmp" -path '*/bin/moonrl' -type f | head -1)
lib=$(dirname "$(find "$tmp" -name 'libmoonrl.so*' | head -1)")
out=$(cd / && env -u MOONRL_HOME LD_LIBRARY_PATH="$lib" "$exe" version 2>&1)
case "$out" in
  *"home: $(dirname "$exe")/../share/moonrl"*) ok "the installed moonrl uses its installed Lua library" ;;
  *) bad "installed moonrl does not use its installed Lua library:" "$out"; summary; exit ;;
esac
out=$(cd / && env -u MOONRL_HOME LD_LIBRARY_PATH="$lib" "$exe" sft.steps=20 grpo.steps=1 grpo.prompts=4 heldout=20 \
  quiet=true run.dir="$tmp/run" 2>&1)
case "$out" in
  *"held-out accuracy (greedy, 20 problems)"*) ok "the installed moonrl runs the default example" ;;
  *) bad "installed moonrl cannot run the default example:" "$out" ;;
esac
summary
