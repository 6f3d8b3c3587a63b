#!/usr/bin/env bash
# Every wait ends on the first SIGTERM: the event loop turns the signal into a stop request, which
# a wait that polls it sees (a subprocess's: the child is killed), and a wait that cannot poll it
# (a read of standard input) lets the signal end the process at once. Each process is bounded:
# still there 10 s after the signal is a failed check, and it is killed.
# usage: test_waits.sh PATH/TO/moonrl
set -u
MOONRL=$1
. "$(dirname "$0")/../lib/util.sh" # $tmp, ok, bad, status_is, has_text, summary
writer=
trap '[ -n "$writer" ] && kill $writer 2>/dev/null; rm -rf "$tmp"' EXIT

# term PID: SIGTERM to PID after it has waited a second; $st is its exit status, or 999 when
# it is still there 10 s later (then killed)
term() {
  sleep 1
  kill -TERM "$1"
  for _ in $(seq 100); do
    kill -0 "$1" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$1" 2>/dev/null; then
    kill -9 "$1"
    wait "$1" 2>/dev/null
    st=999
    return
  fi
  wait "$1"
  st=$?
}

# a subprocess that outlives its caller's patience (moonrl.io.proc: no timeout)
cat > "$tmp/child.lua" <<'LUA'
local r = require('moonrl.io.proc').run({ 'sleep', '71.25' }) -- (an odd length: pgrep finds it below)
print('the wait ended without the stop: ' .. tostring(r.seconds))
LUA
"$MOONRL" run "$tmp/child.lua" > "$tmp/child.out" 2>&1 &
term $!
status_is "waiting for a subprocess: SIGTERM ends it (143)" "$st" 143
has_text "waiting for a subprocess: stopped" "$(cat "$tmp/child.out")" "stopped (SIGTERM)"
sleep 0.2
check "waiting for a subprocess: the child is killed" bash -c "! pgrep -f '^sleep 71.25$' > /dev/null"

# standard input that never ends: a FIFO held open by a writer that writes nothing
mkfifo "$tmp/in"
sleep 60 > "$tmp/in" &
writer=$!
"$MOONRL" tokenize --tokenizer "$(dirname "$0")/../../examples/default" < "$tmp/in" > "$tmp/tok.out" 2>&1 &
term $!
status_is "reading standard input: SIGTERM ends it (143)" "$st" 143
has_text "reading standard input: says so" "$(cat "$tmp/tok.out")" "received SIGTERM while waiting, exiting now"
summary
