#!/usr/bin/env bash
# Progress on the terminal (moonrl.io.progress) and `moonrl status RUN_DIR`, end to end: plain
# periodic lines when stderr is not a terminal, a live \r line when it is (under script(1)),
# switched off by run.progress=off and MOONRL_PROGRESS=off; `moonrl generate -n` counts its
# samples; status on a finished run, a running one, a stopped one, a killed one, and its errors.
# usage: test_progress_status.sh PATH/TO/moonrl SOURCE_DIR
set -u
MOONRL=$1
SRC=$2
. "$(dirname "$0")/../lib/util.sh" # $tmp, ok, bad, has_text, lacks_text, status_is, summary
bg=
trap '[ -n "$bg" ] && kill -9 $bg 2>/dev/null; rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1
unset MOONRL_PROGRESS MOONRL_PROGRESS_SECONDS

SHORT=(sft.steps=20 grpo.steps=2 grpo.prompts=2 heldout=10 quiet=true)

# ---- progress, stderr not a terminal: plain lines (every update with progress_seconds=0)
"$MOONRL" "${SHORT[@]}" run.dir="$tmp/plain" run.progress_seconds=0 > "$tmp/plain.out" 2> "$tmp/plain.err"
status_is "plain: the run ends well" $? 0
err=$(cat "$tmp/plain.err")
has_text "plain: warm-up lines" "$err" "sft 10/20 (50%) | "
has_text "plain: rate and ETA" "$err" " step/s | elapsed 0:0"
has_text "plain: the warm-up's last line" "$err" "sft 20/20 (100%)"
has_text "plain: training lines" "$err" "grpo 2/2 (100%)"
lacks_text "plain: no \\r in a log" "$err" $'\r'
lacks_text "plain: stdout keeps only the results" "$(cat "$tmp/plain.out")" "sft 10/20"
# the default interval (10 s) prints nothing for a run this short
"$MOONRL" "${SHORT[@]}" run.dir="$tmp/quietdefault" > /dev/null 2> "$tmp/qd.err"
lacks_text "plain: nothing before the interval" "$(cat "$tmp/qd.err")" "sft "
# switched off
"$MOONRL" "${SHORT[@]}" run.dir="$tmp/off" run.progress=off run.progress_seconds=0 > /dev/null 2> "$tmp/off.err"
lacks_text "run.progress=off" "$(cat "$tmp/off.err")" "sft "
MOONRL_PROGRESS=off MOONRL_PROGRESS_SECONDS=0 "$MOONRL" "${SHORT[@]}" run.dir="$tmp/envoff" > /dev/null 2> "$tmp/envoff.err"
lacks_text "MOONRL_PROGRESS=off" "$(cat "$tmp/envoff.err")" "sft "
out=$("$MOONRL" "${SHORT[@]}" run.dir="$tmp/bad" run.progress=fancy 2>&1)
status_is "a bad run.progress: usage error" $? 2
has_text "a bad run.progress: the message" "$out" "config key 'run.progress' must be one of auto, live, plain, off; got 'fancy'"

# ---- a terminal: the live line, rewritten with \r
if command -v script > /dev/null && script -qec true /dev/null > /dev/null 2>&1; then
  live=$(TERM=xterm script -qec "'$MOONRL' ${SHORT[*]} quiet=false run.dir='$tmp/live'" /dev/null 2>&1)
  has_text "live: the bar" "$live" "sft ["
  has_text "live: rewritten in place" "$live" $'\r\e[Ksft ['
  has_text "live: the per-step lines stay" "$live" "step 2/2 | loss"
  live=$(TERM=xterm script -qec "'$MOONRL' ${SHORT[*]} run.progress=off run.dir='$tmp/liveoff'" /dev/null 2>&1)
  lacks_text "live: off" "$live" "sft ["
else
  echo "skip live: no script(1) that runs here"
fi

# ---- moonrl generate -n N, its output to a file: the samples done
OUT="$tmp/model" TOK="$SRC/tests/tok/fixtures/qwen2_split" PROMPT='Hello world' "$MOONRL" run "$SRC/tests/engine/make_tiny_model.lua" > /dev/null
MOONRL_PROGRESS_SECONDS=0 "$MOONRL" generate --model "$tmp/model" --prompt Hi -n 12 --max-tokens 8 > "$tmp/gen.out" 2> "$tmp/gen.err"
status_is "generate -n: ends well" $? 0
has_text "generate -n: samples counted" "$(cat "$tmp/gen.err")" "generate 12/12 (100%)"
[ "$(grep -c -- '--- sample' "$tmp/gen.out")" -eq 11 ] && ok "generate -n: the samples on stdout" || bad "generate -n: samples" "$(cat "$tmp/gen.out")"

# ---- moonrl status on a finished run
out=$("$MOONRL" status "$tmp/plain")
status_is "status: finished run" $? 0
has_text "status: finished" "$out" "recipe default, finished"
has_text "status: the loop" "$out" "grpo: step 2/2 (100%)"
has_text "status: the last metrics" "$out" "last metrics (step 2, written"
has_text "status: the checkpoint" "$out" "checkpoint: step-000022"
has_text "status: the events" "$out" "finish 1"
[[ "$out" =~ memory\ \(resident,\ per\ rank\):\ 0:\ [0-9]+\ MB\ \(peak\ [0-9]+\ MB\) ]] && ok "status: the rank's memory" ||
  bad "status: the rank's memory" "$out"
out=$("$MOONRL" status "$tmp/plain" --json)
has_text "status --json" "$out" '"state": "finished"'

# ---- on a running run: poll until it shows a step; then stop it (SIGTERM) and kill another
wait_step() { # DIR -> the status text once it shows a running step past the first (at most ~30 s):
  # at the first step no step has ended yet, so there is no rate to show
  local i out
  for i in $(seq 1 150); do
    out=$("$MOONRL" status "$1" 2>&1)
    if [[ "$out" == *"running (pid"* && "$out" =~ sft:\ step\ ([2-9]|[1-9][0-9]) ]]; then echo "$out"; return 0; fi
    sleep 0.2
  done
  echo "$out"
  return 1
}
"$MOONRL" sft.steps=100000 heldout=10 quiet=true run.dir="$tmp/live1" run.progress=off > /dev/null 2>&1 &
bg=$!
out=$(wait_step "$tmp/live1")
status_is "status: a running run shows a step" $? 0
has_text "status: running: rate and ETA" "$out" "step/s, ETA "
has_text "status: running: the phase and for how long" "$out" "phase: sft for 0:0"
has_text "status: running: the heartbeat" "$out" "heartbeat "
kill -TERM $bg
wait $bg
status_is "status: the run stopped on SIGTERM" $? 143
bg=
out=$("$MOONRL" status "$tmp/live1")
has_text "status: stopped" "$out" "recipe default, stopped"
"$MOONRL" sft.steps=100000 heldout=10 quiet=true run.dir="$tmp/live2" run.progress=off > /dev/null 2>&1 &
bg=$!
wait_step "$tmp/live2" > /dev/null
kill -9 $bg
wait $bg 2> /dev/null
bg=
out=$("$MOONRL" status "$tmp/live2")
has_text "status: a killed run is not running" "$out" "NOT RUNNING: process"

# ---- errors: one line, exit 2
out=$("$MOONRL" status "$tmp/nope" 2>&1)
status_is "status: a missing directory" $? 2
has_text "status: a missing directory: the message" "$out" "moonrl: error: status: no such run directory: $tmp/nope"
[ "$(echo "$out" | wc -l)" -eq 1 ] && ok "status: one line" || bad "status: one line" "$out"
mkdir -p "$tmp/other" && echo x > "$tmp/other/file"
out=$("$MOONRL" status "$tmp/other" 2>&1)
status_is "status: not a run directory" $? 2
has_text "status: not a run directory: the message" "$out" "is not a moonrl run directory"
out=$("$MOONRL" status "$tmp/other/file" 2>&1)
status_is "status: a file" $? 2
out=$("$MOONRL" status 2>&1)
status_is "status: no argument" $? 2
has_text "status: usage" "$out" "usage: moonrl status RUN_DIR"
out=$("$MOONRL" status "$tmp/plain" --bogus 2>&1)
status_is "status: an unknown option" $? 2
out=$("$MOONRL" status "$tmp/plain" --watch 1e309 2>&1)
status_is "status: --watch inf" $? 2

# ---- a garbage heartbeat file: one line naming the file and the field, exit 2 (once an internal
# error in the rendering); a metrics or events line of the wrong types is shown without a crash
garbage() { # NAME TEXT WANT: status on a copy of the finished run whose rank-0 heartbeat holds TEXT
  rm -rf "$tmp/garbage" && cp -r "$tmp/plain" "$tmp/garbage" && printf '%s\n' "$2" > "$tmp/garbage/status/rank-0.json"
  out=$("$MOONRL" status "$tmp/garbage" 2>&1)
  status_is "status, garbage heartbeat: $1" $? 2
  has_text "status, garbage heartbeat: $1: the message" "$out" "$3"
  [ "$(echo "$out" | wc -l)" -eq 1 ] && ok "status, garbage heartbeat: $1: one line" || bad "$1: one line" "$out"
}
garbage "a step of text" '{"state": "running", "step": "x"}' "status/rank-0.json: field 'step' must be an integer >= 0, got \"x\""
garbage "a state of a number" '{"state": 5}' "field 'state' must be a string, got 5"
garbage "a pid of an object" '{"state": "running", "pid": {}}' "field 'pid' must be an integer >= 0, got a table"
garbage "an eta past the doubles" '{"state": "running", "eta": 1e999}' "field 'eta' must be a finite number, got inf"
garbage "a resident set of text" '{"state": "running", "rss_mb": "x"}' "field 'rss_mb' must be a finite number, got \"x\""
garbage "a list" '[1, 2]' "status/rank-0.json: not a JSON object"
garbage "cut JSON" '{"state": ' "status/rank-0.json:2:1: unexpected end of input"
rm -rf "$tmp/garbage" && cp -r "$tmp/plain" "$tmp/garbage" && rm -r "$tmp/garbage/status"
printf '%s\n' '{"step": 1, "time": "x"}' '{"step": "2", "time": {}}' >> "$tmp/garbage/metrics.jsonl"
printf '%s\n' '{"event": "skip", "step": {}}' >> "$tmp/garbage/events.jsonl"
out=$("$MOONRL" status "$tmp/garbage" 2>&1)
status_is "status: metrics and events lines of the wrong types" $? 0
has_text "status: the last event shown" "$out" "last: skip ("

summary
