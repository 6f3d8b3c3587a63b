# Helpers of the shell tests, sourced after a test has read its arguments:
#   . "$(dirname "$0")/../lib/util.sh"
#   $tmp                  a fresh directory, removed at exit
#   ok NAME               a check that passed: counted in $passed, one line printed
#   bad NAME [DETAIL...]  a check that failed: counted in $failed, one line printed, then the
#                         first 30 lines of each DETAIL
#   check NAME COMMAND... ok when the command succeeds, else bad
#   same NAME GOT WANT    ok when GOT is WANT, else bad naming both
#   status_is NAME GOT WANT
#                         ok when the exit status GOT is WANT, else bad naming both
#   has_text NAME TEXT WANT, lacks_text NAME TEXT UNWANTED
#                         ok when TEXT holds WANT (holds no UNWANTED), else bad and TEXT
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
bad() {
  failed=$((failed + 1)); echo "FAIL $1"; shift
  local x; for x in "$@"; do echo "$x" | head -30; done
}
check() { local name=$1; shift; if "$@"; then ok "$name"; else bad "$name"; fi; }
same() { if [ "$2" == "$3" ]; then ok "$1"; else bad "$1: got [$2] want [$3]"; fi; }
status_is() { if [ "$2" -eq "$3" ]; then ok "$1"; else bad "$1: exit status $2, want $3"; fi; }
has_text() { if [[ "$2" == *"$3"* ]]; then ok "$1"; else bad "$1: no [$3] in:" "$2"; fi; }
lacks_text() { if [[ "$2" != *"$3"* ]]; then ok "$1"; else bad "$1: unexpected [$3] in:" "$2"; fi; }

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
