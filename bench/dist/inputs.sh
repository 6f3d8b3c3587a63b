# Sourced by bench/dist/zero.sh, tp.sh, cp.sh and pp.sh: the inputs of their runs, the machine line, a run.
#   bench_inputs MOONRL SIZE DIR PYTHON   bench/models.json's SIZE model (random weights, the digit
#                                         tokenizer) in DIR/model; 200 additions as SFT examples in
#                                         DIR/data.jsonl and 100 as RL questions (with answers) in
#                                         DIR/rl.jsonl
#   bench_machine                         the CPU, cores, load and Open MPI's version
bench_inputs() {
  local moonrl=$1 size=$2 d=$3 python=$4
  "$moonrl" run bench/make_model.lua preset="$size" out="$d/model"
  "$python" -c "
import json
with open('$d/data.jsonl', 'w') as f:
    for i in range(1, 201):
        f.write(json.dumps({'prompt': f'{10 + i}+{30 + 2 * i}=', 'response': str(40 + 3 * i)}) + '\n')
with open('$d/rl.jsonl', 'w') as f:
    for i in range(1, 101):
        f.write(json.dumps({'question': f'{10 + i}+{30 + 2 * i}=', 'answer': str(40 + 3 * i)}) + '\n')
"
}
bench_machine() {
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(getconf _NPROCESSORS_ONLN) cores; load $(cut -d' ' -f1-3 /proc/loadavg); $(mpirun --version | head -1)"
}
# bench_run NAME N THREADS WORDS...: a recipe (WORDS: its path and words) on N ranks x 1 thread
# (moonrl launch, Open MPI's $BTL) or, N = 1, one process of THREADS threads, into $dir/NAME.$r
# (its log beside); a line naming it and its metrics in $dir/runs.jsonl. Uses $MOONRL, $BTL,
# $dir and the round $r.
bench_run() {
  local name=$1 n=$2 threads=$3
  shift 3
  local rd="$dir/$name.$r"
  if [ "$n" = 1 ]; then
    MOONRL_THREADS=$threads "$MOONRL" run "$@" run.threads="$threads" run.dir="$rd" > "$rd.log" 2>&1
  else
    "$MOONRL" launch -n "$n" --mpirun "--mca btl $BTL,self" "$@" run.threads=1 run.dir="$rd" > "$rd.log" 2>&1
  fi || { cat "$rd.log" >&2; exit 1; }
  echo "{\"name\": \"$name\", \"ranks\": $n, \"metrics\": \"$rd/metrics.jsonl\"}" >> "$dir/runs.jsonl"
}
