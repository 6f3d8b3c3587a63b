#!/usr/bin/env bash
# All-reduce SUM of f32 buffers between RANKS processes on this machine, size after size: moonrl's
# mrl_dist_allreduce, plain MPI_Allreduce and MPI_Iallreduce (bench/dist/allreduce.c, under mpirun, over Open MPI's
# shared memory `--mca btl vader,self` and over TCP `--mca btl tcp,self` on loopback) against
# torch.distributed.all_reduce with gloo (bench/dist/allreduce_gloo.py, TCP on 127.0.0.1), one thread a
# rank everywhere. The three jobs alternate for ROUNDS rounds; each (implementation, transport,
# size) keeps its best median. Prints one table: median time, algorithm and bus bandwidth, and
# speed ratios (gloo time / moonrl time: > 1 means moonrl is faster).
#
#   bench/dist/allreduce.sh [BUILD_DIR]          (default build; needs BUILD_DIR/bench/bench_allreduce)
#   env: RANKS=2 MIN_MIB=1 MAX_MIB=256 FACTOR=2 ROUNDS=2 ITERS=0 (0: 10-100 by size) WARMUP=3
#        PYTHON=/usr/bin/python3 MPIRUN_ARGS (added to every mpirun)
#        IMPL=all (bench_allreduce's --impl: moonrl, MPI_Allreduce and MPI_Iallreduce taking turns
#        call by call in one job; "moonrl" alone where the bench was built without MPI)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
RANKS=${RANKS:-2} MIN_MIB=${MIN_MIB:-1} MAX_MIB=${MAX_MIB:-256} FACTOR=${FACTOR:-2} ROUNDS=${ROUNDS:-2}
ITERS=${ITERS:-0} WARMUP=${WARMUP:-3} PYTHON=${PYTHON:-/usr/bin/python3} IMPL=${IMPL:-all}
exe=$BUILD/bench/bench_allreduce
[ -x "$exe" ] || { echo "no $exe: build first (ninja -C $BUILD)" >&2; exit 2; }
[ -e "$BUILD/libmoonrl_mpi.so" ] || { echo "moonrl built without MPI (no $BUILD/libmoonrl_mpi.so)" >&2; exit 2; }
args=(--min-mib "$MIN_MIB" --max-mib "$MAX_MIB" --factor "$FACTOR" --iters "$ITERS" --warmup "$WARMUP")
export OMP_NUM_THREADS=1 MOONRL_THREADS=1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mpi() { # transport (vader|tcp), then the output file
  local btl=$1 out=$2 extra=()
  [ "$btl" = tcp ] && extra=(--mca btl_tcp_if_include lo)
  # shellcheck disable=SC2086
  mpirun -n "$RANKS" --oversubscribe --bind-to none --allow-run-as-root --mca btl "$btl,self" "${extra[@]}" \
    ${MPIRUN_ARGS:-} "$exe" --impl "$IMPL" "${args[@]}" | sed "s/^{/{\"btl\": \"$btl\", /" > "$out"
}
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(getconf _NPROCESSORS_ONLN) cores; $(mpirun --version | head -1); torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
echo "vader single-copy mechanism: $(ompi_info --param btl vader --level 9 2>/dev/null | sed -n 's/.*single_copy_mechanism" (current value: "\([a-z]*\)".*/\1/p' | head -1)"
for r in $(seq "$ROUNDS"); do
  mpi vader "$dir/vader.$r"
  mpi tcp "$dir/tcp.$r"
  "$PYTHON" bench/dist/allreduce_gloo.py --ranks "$RANKS" --threads 1 --port $((29500 + RANDOM % 400)) "${args[@]}" \
    | sed 's/^{/{"btl": "gloo", /' > "$dir/gloo.$r"
  echo "round $r done"
done
cat "$dir"/*.* > "$dir/all.jsonl"
"$PYTHON" - "$dir/all.jsonl" <<'PY'
import json, sys
best = {}
for line in open(sys.argv[1]):
    x = json.loads(line)
    k = (x["impl"], x["btl"], int(x["bytes"]))
    if k not in best or x["median_s"] < best[k]["median_s"]:
        best[k] = x
sizes = sorted({k[2] for k in best})
names = {"moonrl": "moonrl", "mpi": "MPI_Allreduce", "mpi_nb": "MPI_Iallreduce", "gloo": "gloo"}
cols = [c for c in [("moonrl", "vader"), ("mpi", "vader"), ("mpi_nb", "vader"), ("moonrl", "tcp"), ("mpi", "tcp"),
                    ("mpi_nb", "tcp"), ("gloo", "gloo")] if any((c[0], c[1], b) in best for b in sizes)]
def t(i, w, b):
    return best[(i, w, b)]["median_s"] if (i, w, b) in best else float("nan")
ratios = [("gloo/moonrl vader", ("gloo", "gloo"), ("moonrl", "vader")), ("gloo/moonrl tcp", ("gloo", "gloo"), ("moonrl", "tcp")),
          ("MPI_Allreduce/moonrl vader", ("mpi", "vader"), ("moonrl", "vader")),
          ("MPI_Allreduce/moonrl tcp", ("mpi", "tcp"), ("moonrl", "tcp"))]
print("median time, bus bandwidth in GB/s (2(n-1)/n x bytes / time: the algorithm bandwidth at 2 ranks); ratios are "
      "time / moonrl's time (> 1: moonrl is faster)")
print("| size | " + " | ".join(f"{names[i]} {'TCP' if w == 'gloo' else w}" for i, w in cols) + " | " +
      " | ".join(r[0] for r in ratios) + " |")
print("|---" * (1 + len(cols) + len(ratios)) + "|")
for b in sizes:
    cells = [f"{t(i, w, b) * 1e3:.3f} ms, {best[(i, w, b)]['busbw_GBps']:.2f}" if (i, w, b) in best else "-" for i, w in cols]
    rs = [f"{t(*x, b) / t(*y, b):.2f}x" for _, x, y in ratios]
    print(f"| {b / 2**20:g} MiB | " + " | ".join(cells) + " | " + " | ".join(rs) + " |")
PY
