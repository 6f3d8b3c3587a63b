#!/usr/bin/env bash
# Sharded training state (dist.zero, dist.shard_group): the SFT recipe on bench/models.json's SIZE
# model (default 100m: a Llama of ~100M parameters, the digit tokenizer) with the same global
# batch, run as
#   step    2 ranks x 1 thread (shared memory): dist.zero=0, 1, 2 and 3, STEPS steps each (the first
#           not counted), median time/step; each ZeRO-2/3 step's bytes this rank moved
#           (dist/reduce_scatter_mb, dist/gather_mb) against the theory: (N-1)/N of the parameters'
#           bytes for the gradients, twice that for ZeRO-3's gathers (forward and backward)
#   memory  1 process against RANKS ranks with dist.zero=3: rank 0's training state (parameters,
#           gradients and optimizer state: memory/params_mb + grads_mb + optim_mb) and the largest
#           rank's resident peak (memory/max_rank_peak_mb)
#   engine  GRPO in bf16 on 2 ranks with dist.zero=3 (tests/recipes/grpo_sevens.lua, 2 steps), sync
#           (the engine reads its bf16 compute copy: memory/engine_copy_mb) against one_step_off
#           (a whole fp32 copy, which the in-process weight store publishes, and the engine's bf16
#           copies of it): the parameters' memory (memory/params_mb) and the largest rank's peak
#   load    bench/dist/zero_load.lua: the model's shards read by 1 and by LOAD_RANKS ranks at once
#           (model.load_shard; LOAD_RANKS = the cores, so that the ranks do not share one), the
#           best of 3 reads each, against one process reading it whole
# The step runs alternate for ROUNDS rounds; each keeps its best round (lowest median step).
#
#   bench/dist/zero.sh [build/moonrl]
#   env: SIZE=100m STEPS=6 ROUNDS=2 RANKS=4 LOAD_RANKS=(cores) BATCH=8 BTL=vader PYTHON=/usr/bin/python3
set -euo pipefail
cd "$(dirname "$0")/../.."
MOONRL=${1:-build/moonrl}
SIZE=${SIZE:-100m} STEPS=${STEPS:-6} ROUNDS=${ROUNDS:-2} RANKS=${RANKS:-4} BATCH=${BATCH:-8} BTL=${BTL:-vader}
LOAD_RANKS=${LOAD_RANKS:-$(getconf _NPROCESSORS_ONLN)}
PYTHON=${PYTHON:-/usr/bin/python3}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
. bench/dist/inputs.sh
bench_inputs "$MOONRL" "$SIZE" "$dir" "$PYTHON"
words=(model.dir="$dir/model" data.path="$dir/data.jsonl" data.chat=false data.eval_fraction=0 train.steps="$STEPS"
  train.batch="$BATCH" train.lr=1e-5 train.micro_batch_tokens=8192 run.checkpoint_minutes=0 quiet=true)
bench_machine
echo "settings: $SIZE model, SFT, $BATCH examples a step, $STEPS steps (first not counted), 2 ranks x 1 thread for the steps"
run() { # name, ranks, extra words...
  local name=$1 n=$2
  shift 2
  bench_run "$name" "$n" 1 recipes/sft.lua "${words[@]}" "$@"
}
for r in $(seq "$ROUNDS"); do
  for z in 0 1 2 3; do run "zero=$z" 2 dist.zero=$z; done
  echo "round $r done (load $(cut -d' ' -f1 /proc/loadavg))"
done
r=mem
run "memory 1 process" 1 train.steps=2
run "memory $RANKS ranks zero=3" "$RANKS" dist.zero=3 train.steps=2
for mode in sync one_step_off; do
  "$MOONRL" launch -n 2 --mpirun "--mca btl $BTL,self" tests/recipes/grpo_sevens.lua model.dir="$dir/model" \
    data.path="$dir/rl.jsonl" data.prompt=question data.chat=false reward=sevens grpo.prompts=2 grpo.samples=2 \
    grpo.max_tokens=4 grpo.steps=2 engine.kv_cache_mb=64 run.threads=1 run.checkpoint_minutes=0 dist.zero=3 \
    model.dtype=bf16 async.mode=$mode run.dir="$dir/engine_$mode" > "$dir/engine.log" 2>&1 ||
    { cat "$dir/engine.log" >&2; exit 1; }
done
"$MOONRL" run bench/dist/zero_load.lua dir="$dir/model" > "$dir/load1.jsonl"
"$MOONRL" launch -n "$LOAD_RANKS" --mpirun "--mca btl $BTL,self" bench/dist/zero_load.lua dir="$dir/model" > "$dir/loadN.jsonl"
"$PYTHON" - "$dir" "$RANKS" "$LOAD_RANKS" <<'PY'
import json, sys
sys.path.insert(0, "bench/dist")
from runs import median, load_runs
d, ranks, load_ranks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
runs = load_runs(d)
steps = {}
for name, rs in runs.items():
    if name.startswith("memory"):
        continue
    best = min(rs, key=lambda r: median([s["time/step"] for s in r[1][1:]]))
    steps[name] = best
base = median([s["time/step"] for s in steps["zero=0"][1][1:]])
print("| run (2 ranks x 1 thread) | step (median) | vs zero=0 | this rank's bytes a step: reduce-scatter, gather | rounds (median step, s) |")
print("|---|---|---|---|---|")
for name in ("zero=0", "zero=1", "zero=2", "zero=3"):
    x, st = steps[name]
    t = median([s["time/step"] for s in st[1:]])
    rs = median([s.get("dist/reduce_scatter_mb", 0) for s in st[1:]])
    ga = median([s.get("dist/gather_mb", 0) for s in st[1:]])
    rounds = ", ".join(f"{median([s['time/step'] for s in r[1][1:]]):.3f}" for r in runs[name])
    moved = f"{rs:.1f} MB, {ga:.1f} MB" if rs or ga else "-"
    print(f"| {name} | {t:.3f} s | {base / t:.2f}x | {moved} | {rounds} |")
ev = None
for line in open(runs["zero=3"][0][0]["metrics"].rsplit("/", 1)[0] + "/events.jsonl"):
    e = json.loads(line)
    if e.get("event") == "data_parallel":
        ev = e
n = ev["state_bytes"] / 8
x, st = steps["zero=3"]
rs, ga = median([s["dist/reduce_scatter_mb"] for s in st[1:]]), median([s["dist/gather_mb"] for s in st[1:]])
theory = 4 * n / 2 / 1e6  # (N-1)/N of the parameters' bytes, N = 2
print(f"zero=3: {n / 1e6:.1f}M parameters; bytes a rank moved a step {rs + ga:.1f} MB against the theoretical "
      f"3 x (N-1)/N x {4 * n / 1e6:.1f} MB = {3 * theory:.1f} MB ({(rs + ga) / (3 * theory):.2f}x)")
def state(s):
    return s["memory/params_mb"] + s["memory/grads_mb"] + s["memory/optim_mb"]
one = runs["memory 1 process"][0][1][-1]
many = runs[f"memory {ranks} ranks zero=3"][0][1][-1]
print(f"training state a rank: 1 process {state(one):.1f} MiB, {ranks} ranks with zero=3 {state(many):.1f} MiB "
      f"({state(many) / state(one):.2f}x); peak resident: 1 process {one['memory/rss_peak_mb']:.1f} MiB, the largest "
      f"of {ranks} ranks {many['memory/max_rank_peak_mb']:.1f} MiB")
cc = [json.loads(l) for l in open(d + "/engine_sync/metrics.jsonl")][-1]
wc = [json.loads(l) for l in open(d + "/engine_one_step_off/metrics.jsonl")][-1]
print(f"engine (bf16 GRPO, 2 ranks, zero=3): the compute copy {cc['memory/engine_copy_mb']:.1f} MiB "
      f"({cc['memory/engine_copy_mb'] * 2**20 / n:.2f} bytes a parameter), parameters {cc['memory/params_mb']:.1f} MiB, "
      f"largest peak {cc['memory/max_rank_peak_mb']:.1f} MiB; with a whole fp32 copy ({wc['memory/engine_copy_mb']:.1f} MiB) "
      f"and the engine's bf16 copies of it: parameters {wc['memory/params_mb']:.1f} MiB "
      f"({cc['memory/params_mb'] / wc['memory/params_mb']:.2f}x), largest peak {wc['memory/max_rank_peak_mb']:.1f} MiB")
l1 = [json.loads(l) for l in open(d + "/load1.jsonl")]
ln = [json.loads(l) for l in open(d + "/loadN.jsonl")]
whole = l1[0]["whole_bytes"] / l1[0]["whole_s"]
shard1 = l1[0]["shard_bytes"] / l1[0]["shard_s"]
agg = sum(x["shard_bytes"] for x in ln) / max(x["shard_s"] for x in ln)
print(f"loading: one process reads the whole model at {whole / 1e9:.2f} GB/s (as its one shard: {shard1 / 1e9:.2f} GB/s); "
      f"{load_ranks} ranks read their shards at once at {agg / 1e9:.2f} GB/s together, {agg / (load_ranks * shard1):.2f}x of "
      f"{load_ranks} x one rank's rate")
PY
