#!/usr/bin/env bash
# examples/train_text.lua trains on a text file and the cross-entropy falls by a clear margin.
# usage: test_train_text.sh PATH/TO/moonrl
set -u
. "$(dirname "$0")/../lib/util.sh" # $tmp, ok, bad, summary
out=$("$1" run examples/train_text.lua steps=60 save=false log_every=1000 run.dir="$tmp/run" 2>&1)
line=$(echo "$out" | grep '^loss: ')
first=$(echo "$line" | sed -E 's/^loss: ([0-9.]+) at step 1 -> ([0-9.]+) at step 60$/\1/')
last=$(echo "$line" | sed -E 's/^loss: ([0-9.]+) at step 1 -> ([0-9.]+) at step 60$/\2/')
if [ -n "$line" ] && awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < 0.7 * a) }'; then
  ok "$line"
else
  bad "the loss falls below 0.7 of the first step's in 60 steps" "$(echo "$out" | tail -20)"
fi
summary
