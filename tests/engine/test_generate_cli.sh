#!/usr/bin/env bash
# `moonrl generate` end to end on a tiny random model saved in Hugging Face
# format with a tokenizer fixture: the streamed greedy text equals the
# engine's, seeds repeat, -n, --chat, --stop, usage errors (exit 2), a KV
# cache larger than the machine (exit 2).
# usage: test_generate_cli.sh PATH/TO/moonrl SOURCE_DIR
set -u
MOONRL=$1
SRC=$2
failed=0
check() { # NAME GOT WANT
  if [ "$2" == "$3" ]; then echo "ok   $1"; else echo "FAIL $1: got [$2] want [$3]"; failed=$((failed + 1)); fi
}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
OUT=$dir TOK=$SRC/tests/tok/fixtures/qwen2_split PROMPT='Hello world' "$MOONRL" run "$SRC/tests/engine/make_tiny_model.lua"
check make-model $? 0
got=$("$MOONRL" generate --model "$dir" --prompt 'Hello world' --temperature 0 --max-tokens 20 2>/dev/null)
check greedy-exit $? 0
check greedy-text "$got" "$(cat "$dir/expected.txt")"
a=$("$MOONRL" generate --model "$dir" --prompt 'Hi' --seed 5 --max-tokens 12 --top-p 0.9 2>/dev/null)
b=$("$MOONRL" generate --model "$dir" --prompt 'Hi' --seed 5 --max-tokens 12 --top-p 0.9 2>/dev/null)
check same-seed "$a" "$b"
check nonempty "$([ -n "$a" ] && echo yes)" yes
out=$("$MOONRL" generate --model "$dir" --prompt 'Hi' -n 3 --max-tokens 8 --chat 2>&1)
check chat-n-exit $? 0
check chat-n-samples "$(echo "$out" | grep -c -- '--- sample')" 2
check chat-n-stats "$(echo "$out" | grep -c 'tokens/s')" 1
# a stop string taken from the greedy text: the output stops before it
full=$(cat "$dir/expected.txt")
if [ ${#full} -ge 6 ]; then
  stop=${full:3:2}
  got=$("$MOONRL" generate --model "$dir" --prompt 'Hello world' --temperature 0 --max-tokens 20 --stop "$stop" 2>/dev/null)
  want=${full%%"$stop"*}
  check stop-string "$got" "$want"
fi
"$MOONRL" generate --prompt x > /dev/null 2>&1
check missing-model $? 2
"$MOONRL" generate --model "$dir" --prompt x --top-k -1 > /dev/null 2>&1
check bad-number $? 2
"$MOONRL" generate --model "$dir" --prompt x --bogus > /dev/null 2>&1
check unknown-flag $? 2
out=$("$MOONRL" generate --model "$dir/no-such" --prompt x 2>&1)
check bad-path "$? $(echo "$out" | grep -c 'no-such')" "2 1"
# a KV cache larger than the machine: refused before allocating, a usage error
out=$("$MOONRL" generate --model "$dir" --prompt x --kv-cache-mb 1e12 2>&1)
check huge-kv-cache "$? $(echo "$out" | grep -c 'physical memory')" "2 1"
[ "$failed" -eq 0 ]
