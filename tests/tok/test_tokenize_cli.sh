#!/usr/bin/env bash
# `moonrl tokenize` end to end: ids, --tokens, --decode, usage errors.
# usage: test_tokenize_cli.sh PATH/TO/moonrl FIXTURE_DIR
set -u
MOONRL=$1
FIX=$2
failed=0
check() { # NAME GOT WANT
  if [ "$2" == "$3" ]; then echo "ok   $1"; else echo "FAIL $1: got [$2] want [$3]"; failed=$((failed + 1)); fi
}
ids=$(printf 'Hello <|eot_id|> world' | "$MOONRL" tokenize --tokenizer "$FIX/llama3_split")
check ids "$(echo "$ids" | wc -w)" "$(printf 'Hello <|eot_id|> world' | "$MOONRL" tokenize --tokenizer "$FIX/llama3_split" --tokens | wc -l)"
check decode "$(echo "$ids" | "$MOONRL" tokenize --tokenizer "$FIX/llama3_split" --decode)" 'Hello <|eot_id|> world'
check add-special "$(printf 'x' | "$MOONRL" tokenize --tokenizer "$FIX/llama3_split" --add-special --tokens | head -1)" $'0\t<|begin_of_text|>'
check lines "$(printf 'a b\nc\n' | "$MOONRL" tokenize --tokenizer "$FIX/gpt2_bytelevel" --lines | wc -l)" 2
"$MOONRL" tokenize > /dev/null 2>&1
check missing-option $? 2
out=$("$MOONRL" tokenize --tokenizer "$FIX/no-such" 2>&1 < /dev/null)
check bad-path "$? $(echo "$out" | grep -c 'no-such')" "2 1"
[ "$failed" -eq 0 ]
