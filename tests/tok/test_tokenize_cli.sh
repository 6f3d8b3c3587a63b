#!/usr/bin/env bash
# `moonrl tokenize` end to end: ids, --tokens, --decode, usage errors.
# usage: test_tokenize_cli.sh PATH/TO/moonrl FIXTURE_DIR
set -u
MOONRL=$1
FIX=$2
. "$(dirname "$0")/../lib/util.sh" # $tmp, same, summary
ids=$(printf 'Hello <|eot_id|> world' | "$MOONRL" tokenize --tokenizer "$FIX/llama3_split")
same ids "$(echo "$ids" | wc -w)" "$(printf 'Hello <|eot_id|> world' | "$MOONRL" tokenize --tokenizer "$FIX/llama3_split" --tokens | wc -l)"
same decode "$(echo "$ids" | "$MOONRL" tokenize --tokenizer "$FIX/llama3_split" --decode)" 'Hello <|eot_id|> world'
same add-special "$(printf 'x' | "$MOONRL" tokenize --tokenizer "$FIX/llama3_split" --add-special --tokens | head -1)" $'0\t<|begin_of_text|>'
same lines "$(printf 'a b\nc\n' | "$MOONRL" tokenize --tokenizer "$FIX/gpt2_bytelevel" --lines | wc -l)" 2
"$MOONRL" tokenize > /dev/null 2>&1
same missing-option $? 2
out=$("$MOONRL" tokenize --tokenizer "$FIX/no-such" 2>&1 < /dev/null)
same bad-path "$? $(echo "$out" | grep -c 'no-such')" "2 1"
summary
