#!/usr/bin/env bash
# A FIFO (or another file that is not regular) where moonrl reads a file: `moonrl generate`,
# `moonrl report` and `moonrl status` fail at once with one line naming the file (exit status 2),
# where the open of a FIFO with no writer used to wait for ever. Each command runs under a
# timeout: a wait is a failed check (status 137), never a hung test.
# usage: test_fifo.sh PATH/TO/moonrl SOURCE_DIR
set -u
MOONRL=$1
SRC=$2
. "$(dirname "$0")/../lib/util.sh" # $tmp, ok, bad, expect, summary
cd "$SRC" || exit 1
bounded() { timeout -s KILL 30 "$@"; }

# a tiny model in Hugging Face format (tests/lib/models.lua) and a run directory written by hand
echo "dofile('tests/lib/models.lua').save(os.getenv('OUT'), 'digits')" > "$tmp/save.lua"
OUT=$tmp/model "$MOONRL" run "$tmp/save.lua" > /dev/null
status_is "the model is saved" $? 0
run=$tmp/run
mkdir -p "$run/status"
echo '{"recipe": "grpo", "config": {}}' > "$run/config.json"
echo '{"step": 1, "loss": 0.5}' > "$run/metrics.jsonl"
echo '{"event": "finish", "step": 1, "time": 0}' > "$run/events.jsonl"
echo '{"rank": 0, "state": "finished", "step": 1}' > "$run/status/rank-0.json"
EXPECT_ONE_LINE=1 expect "status on the plain run" 0 "finished" -- bounded "$MOONRL" status "$run" --json

# a copy of dir ($1) with file $2 replaced by a FIFO; prints the copy's path
with_fifo() {
  local copy=$tmp/fifo-$(echo "$2" | tr '/.' '__')
  rm -rf "$copy"
  cp -r "$1" "$copy"
  rm "$copy/$2"
  mkfifo "$copy/$2"
  echo "$copy"
}

for f in config.json model.safetensors tokenizer.json tokenizer_config.json; do
  d=$(with_fifo "$tmp/model" $f)
  EXPECT_ONE_LINE=1 expect "generate: a FIFO as $f" 2 "$d/$f: not a regular file (a FIFO)" -- \
    bounded "$MOONRL" generate --model "$d" --prompt 1+2= --max-tokens 2
done

for f in config.json metrics.jsonl events.jsonl; do
  d=$(with_fifo "$run" $f)
  EXPECT_ONE_LINE=1 expect "report: a FIFO as $f" 2 "$d/$f: not a regular file (a FIFO)" -- \
    bounded "$MOONRL" report "$d" -o "$tmp/r.html"
done
for f in config.json metrics.jsonl events.jsonl status/rank-0.json; do
  d=$(with_fifo "$run" $f)
  EXPECT_ONE_LINE=1 expect "status: a FIFO as $f" 2 "$d/$f: not a regular file (a FIFO)" -- \
    bounded "$MOONRL" status "$d"
done

# the data, a recipe, a --require file
mkfifo "$tmp/data.jsonl" "$tmp/recipe.lua"
EXPECT_ONE_LINE=1 expect "run: a FIFO as data.path" 2 "$tmp/data.jsonl: not a regular file (a FIFO)" -- \
  bounded "$MOONRL" run sft model.dir="$tmp/model" data.path="$tmp/data.jsonl" run.dir="$tmp/sft"
EXPECT_ONE_LINE=1 expect "run: a FIFO as the recipe" 2 "not found" -- bounded "$MOONRL" run "$tmp/recipe.lua"
EXPECT_ONE_LINE=1 expect "run: a FIFO as --require" 2 "$tmp/recipe.lua: not a regular file (a FIFO)" -- \
  bounded "$MOONRL" run "$tmp/save.lua" --require "$tmp/recipe.lua"
# a run directory whose metrics.jsonl is a FIFO: its open for appending would wait for a reader
printf '{"prompt": "1+2=", "response": "3"}\n{"prompt": "2+2=", "response": "4"}\n' > "$tmp/sft.jsonl"
mkdir -p "$tmp/sftrun"
mkfifo "$tmp/sftrun/metrics.jsonl"
EXPECT_ONE_LINE=1 expect "run: a FIFO as the run's metrics.jsonl" 2 "$tmp/sftrun/metrics.jsonl: not a regular file (a FIFO)" -- \
  bounded "$MOONRL" run sft model.dir="$tmp/model" data.path="$tmp/sft.jsonl" run.dir="$tmp/sftrun" train.steps=1
summary
