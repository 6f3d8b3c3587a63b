#!/usr/bin/env bash
# `meson install` puts a moonrl that finds its Lua library under
# PREFIX/share/moonrl (not in the source tree) and runs a recipe from there.
# usage: test_install.sh BUILD_DIR
set -u
build=$1
dest=$(mktemp -d)
trap 'rm -rf "$dest"' EXIT
if ! meson install -C "$build" --destdir "$dest" --quiet >"$dest/log" 2>&1; then
  cat "$dest/log"; echo "0 passed, 1 failed"; exit 1
fi
exe=$(find "$dest" -path '*/bin/moonrl' -type f | head -1)
lib=$(dirname "$(find "$dest" -name 'libmoonrl.so*' | head -1)")
out=$(cd / && env -u MOONRL_HOME LD_LIBRARY_PATH="$lib" "$exe" version 2>&1)
case "$out" in
  *"home: $(dirname "$exe")/../share/moonrl"*) ;;
  *) echo "installed moonrl does not use its installed Lua library:"; echo "$out"; echo "0 passed, 1 failed"; exit 1 ;;
esac
out=$(cd / && env -u MOONRL_HOME LD_LIBRARY_PATH="$lib" "$exe" sft.steps=20 grpo.steps=1 grpo.prompts=4 heldout=20 \
  quiet=true run.dir="$dest/run" 2>&1)
case "$out" in
  *"held-out accuracy (greedy, 20 problems)"*) echo "1 passed, 0 failed" ;;
  *) echo "installed moonrl cannot run the default example:"; echo "$out"; echo "0 passed, 1 failed"; exit 1 ;;
esac
