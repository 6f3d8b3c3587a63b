#!/usr/bin/env bash
# `moonrl generate` end to end on a tiny random model saved in Hugging Face
# format with a tokenizer fixture: the streamed greedy text equals the
# engine's, seeds repeat, -n, --chat, --stop, usage errors (exit 2), a KV
# cache larger than the machine (exit 2); with --tp 2 (where mpirun is) the
# same greedy text and seeded samples.
# usage: test_generate_cli.sh PATH/TO/moonrl SOURCE_DIR
set -u
MOONRL=$1
SRC=$2
. "$(dirname "$0")/../lib/util.sh" # $tmp, same, summary
OUT=$tmp TOK=$SRC/tests/tok/fixtures/qwen2_split PROMPT='Hello world' "$MOONRL" run "$SRC/tests/engine/make_tiny_model.lua"
same make-model $? 0
got=$("$MOONRL" generate --model "$tmp" --prompt 'Hello world' --temperature 0 --max-tokens 20 2>/dev/null)
same greedy-exit $? 0
same greedy-text "$got" "$(cat "$tmp/expected.txt")"
a=$("$MOONRL" generate --model "$tmp" --prompt 'Hi' --seed 5 --max-tokens 12 --top-p 0.9 2>/dev/null)
b=$("$MOONRL" generate --model "$tmp" --prompt 'Hi' --seed 5 --max-tokens 12 --top-p 0.9 2>/dev/null)
same same-seed "$a" "$b"
same nonempty "$([ -n "$a" ] && echo yes)" yes
out=$("$MOONRL" generate --model "$tmp" --prompt 'Hi' -n 3 --max-tokens 8 --chat 2>&1)
same chat-n-exit $? 0
same chat-n-samples "$(echo "$out" | grep -c -- '--- sample')" 2
same chat-n-stats "$(echo "$out" | grep -c 'tokens/s')" 1
# a stop string taken from the greedy text: the output stops before it
full=$(cat "$tmp/expected.txt")
if [ ${#full} -ge 6 ]; then
  stop=${full:3:2}
  got=$("$MOONRL" generate --model "$tmp" --prompt 'Hello world' --temperature 0 --max-tokens 20 --stop "$stop" 2>/dev/null)
  want=${full%%"$stop"*}
  same stop-string "$got" "$want"
fi
"$MOONRL" generate --prompt x > /dev/null 2>&1
same missing-model $? 2
"$MOONRL" generate --model "$tmp" --prompt x --top-k -1 > /dev/null 2>&1
same bad-number $? 2
"$MOONRL" generate --model "$tmp" --prompt x --bogus > /dev/null 2>&1
same unknown-flag $? 2
out=$("$MOONRL" generate --model "$tmp/no-such" --prompt x 2>&1)
same bad-path "$? $(echo "$out" | grep -c 'no-such')" "2 1"
# a KV cache larger than the machine: refused before allocating, a usage error
out=$("$MOONRL" generate --model "$tmp" --prompt x --kv-cache-mb 1e12 2>&1)
same huge-kv-cache "$? $(echo "$out" | grep -c 'physical memory')" "2 1"
# --tp 2: the command starts itself on 2 ranks, each with its slices of every layer: the greedy
# text and seeded samples of one process; a degree the heads cannot take, a usage error naming it
if command -v mpirun > /dev/null; then
  got=$("$MOONRL" generate --tp 2 --model "$tmp" --prompt 'Hello world' --temperature 0 --max-tokens 20 2>/dev/null)
  same tp-greedy-exit $? 0
  same tp-greedy-text "$got" "$(cat "$tmp/expected.txt")"
  b=$("$MOONRL" generate --tp 2 --model "$tmp" --prompt 'Hi' --seed 5 --max-tokens 12 --top-p 0.9 2>/dev/null)
  same tp-same-seed "$b" "$a"
  out=$("$MOONRL" generate --tp 3 --model "$tmp" --prompt x 2>&1)
  same tp-bad-degree "$? $(echo "$out" | grep -c 'num_attention_heads (4) is not a multiple of 3')" "2 3"
fi
summary
