#!/usr/bin/env bash
# A rank that does not arrive: tests/dist/test_dist_timeout.c under mpirun.
# Passes when every rank but the sleeping one reported the timeout as it
# should ("timeout test: ok on rank R"), the stderr report is there, and the
# job ended non-zero within 30 s (no hang: the ranks that gave up exit
# without MPI_Finalize and mpirun ends the rest).
# usage: timeout.sh NP vader|tcp BUILD_DIR PROGRAM OP
set -u
np=$1 btl=$2 build=$3 prog=$4 op=$5
here=$(dirname "$0")
out=$(mktemp)
trap 'rm -f "$out"' EXIT
start=$(date +%s%N)
bash "$here/mpirun.sh" "$np" "$btl" "$build" "$prog" "$op" >"$out" 2>&1
status=$?
ms=$((($(date +%s%N) - start) / 1000000))
cat "$out"
[ "$status" -eq 77 ] && exit 77
fail() { echo "FAILED: $*"; exit 1; }
[ "$status" -ne 0 ] || fail "the job exited 0"
[ "$status" -ne 124 ] && [ "$status" -ne 137 ] || fail "the job hung (killed by timeout)"
[ "$ms" -lt 30000 ] || fail "the job took $ms ms"
for r in $(seq 0 $((np - 1))); do
  [ "$r" -eq 1 ] && continue
  grep -q "timeout test: ok on rank $r " "$out" || fail "rank $r did not report the timeout correctly"
  grep -qE "^moonrl \[rank $r/$np\] .* (timed out|abandoned)" "$out" || fail "no stderr report from rank $r"
done
echo "ok: $np ranks over $btl, $op: ended in $ms ms"
