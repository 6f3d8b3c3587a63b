#!/usr/bin/env bash
# Suite 'ref': chat templates rendered by moonrl against Python jinja2.
# usage: run_ref.sh PATH/TO/moonrl   (run from the repository root)
set -eu
MOONRL=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
/usr/bin/python3 tests/chat/ref_chat.py tests/chat/templates:tests/chat/synthetic tests/chat/cases.json "$tmp/ref.json"
MOONRL_CHAT_REF="$tmp/ref.json" "$MOONRL" run tests/chat/test_ref.lua
