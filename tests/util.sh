# Helpers of the shell tests, sourced after a test has read its arguments:
#   $tmp                  a fresh directory, removed at exit
#   ok NAME, bad NAME     a check that passed / failed: counted in $passed / $failed, one line printed
#   check NAME COMMAND... ok when the command succeeds, else bad
#   expect NAME WANT_STATUS WANT_TEXT -- COMMAND...
#                         runs the command: ok when it exits with WANT_STATUS and its stdout+stderr
#                         hold WANT_TEXT (with EXPECT_ONE_LINE=1 set, also one line of output and no
#                         traceback), else bad and the output's first 20 lines
#   summary               the counts; its status, the test's last command, fails when a check did
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0
failed=0
ok() { passed=$((passed + 1)); echo "ok   $1"; }
bad() { failed=$((failed + 1)); echo "FAIL $1"; }
check() { local name=$1; shift; if "$@"; then ok "$name"; else bad "$name"; fi; }

expect() {
  local name=$1 want_status=$2 want_text=$3
  shift 4
  local out status one_line=1
  out=$("$@" 2>&1)
  status=$?
  if [ -n "${EXPECT_ONE_LINE:-}" ]; then
    [[ "$out" != *traceback* ]] && [ "$(printf '%s\n' "$out" | wc -l)" -eq 1 ] || one_line=
  fi
  if [ "$status" -eq "$want_status" ] && [[ "$out" == *"$want_text"* ]] && [ -n "$one_line" ]; then
    ok "$name"
  else
    bad "$name: status $status (want $want_status), output:"; echo "$out" | head -20
  fi
}

summary() {
  echo "$passed passed, $failed failed"
  [ "$failed" -eq 0 ]
}
