#!/usr/bin/env bash
# moonrl report end to end: the page of a real run (a plot per numeric metric, the phases, the
# events, the config), the edge cases of a synthetic run, a run with no metrics, a comparison of
# two runs, and the one-line errors (exit 2) on bad input.
# usage: test_report.sh PATH/TO/moonrl
set -u
MOONRL=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
. "$(dirname "$0")/../lib/util.sh" # $tmp, ok, bad, check NAME COMMAND..., expect, summary
EXPECT_ONE_LINE=1 # expect: the output is one line, without a traceback
has() { grep -qF -- "$2" "$1"; }
count() { grep -oF -- "$2" "$1" | wc -l; }

. "$(dirname "$0")/make_runs.sh"
make_runs "$tmp"

# ---- one real run
expect "report of a run" 0 "report: $tmp/a/report.html (1 run, 4 steps," -- "$MOONRL" report "$tmp/a"
page=$tmp/a/report.html
# the numeric keys of metrics.jsonl (nested objects flattened with '/'), each of which needs a plot
/usr/bin/python3 - "$tmp/a/metrics.jsonl" > "$tmp/a.keys" <<'PY'
import json, sys
keys = set()
def walk(o, p):
    for k, v in o.items():
        key = p + '/' + k if p else k
        if isinstance(v, dict): walk(v, key)
        elif isinstance(v, (int, float)) and key != 'step': keys.add(key)
for line in open(sys.argv[1]):
    if line.strip(): walk(json.loads(line), '')
print('\n'.join(sorted(keys)))
PY
nkeys=$(wc -l < "$tmp/a.keys")
check "the run has its usual metrics (got $nkeys keys)" [ "$nkeys" -ge 25 ]
missing=""
while read -r k; do grep -qE "<svg [^>]*class=\"plot\" [^>]*aria-label=\"$k\">" "$page" || missing="$missing $k"; done < "$tmp/a.keys"
check "a plot per numeric metric${missing:+ (missing:$missing)}" [ -z "$missing" ]
check "as many line plots as metrics" [ "$(count "$page" 'class="plot" viewBox')" -eq "$nkeys" ]
check "one stacked bar chart of the phases" [ "$(count "$page" 'class="plot bars"')" -eq 1 ]
for k in reward/mean accuracy approx_kl entropy clip_frac grad_norm lr response_length/mean tokens_per_s/generate \
         mismatch/mean_abs time/step; do
  grep -q "aria-label=\"$k\"" "$page" || missing="$missing $k"
done
check "the headline metrics are plotted${missing:+ (missing:$missing)}" [ -z "$missing" ]
# important groups first: reward, then the training keys, ..., async last of the known ones
check "reward plots come before the async ones" [ "$(grep -n 'aria-label="reward/mean"' "$page" | cut -d: -f1)" -lt \
  "$(grep -n 'aria-label="async/queue_depth"' "$page" | cut -d: -f1)" ]
check "the phases are named" has "$page" '<title>step 1: generate '
check "the skip event is listed" has "$page" '<td><b>skip</b></td>'
check "the skip is marked on the plots" has "$page" 'a: skip at step 3'
check "the config is shown" has "$page" '<td class="mono">grpo.steps</td><td class="mono">4</td>'
check "the run's own manifest is shown" has "$page" 'manifest.json</summary>'
# memory at the top: the header line and the section come before the summary and the plots
check "the header says the peak resident memory" bash -c "grep -q '<div class=\"memhead\">memory: peak resident <b>[0-9.]* MiB</b> (step [0-9]*); held parameters <b>' '$page'"
check "the memory section, before the summary" [ "$(grep -n 'id="memory"' "$page" | cut -d: -f1)" -lt \
  "$(grep -n 'id="summary"' "$page" | cut -d: -f1)" ]
for k in parameters gradients 'optimizer state' activations 'KV cache'; do
  grep -q "></i> $k</td><td class=\"num\">" "$page" || missing="$missing '$k'"
done
check "a row per kind of buffer${missing:+ (missing:$missing)}" [ -z "$missing" ]
check "the peak of each phase" has "$page" 'phase <span class="mono">generate</span>: peak resident / allocated'
check "the split drawn as a bar" has "$page" '<div class="membar"><i style="width:'
check "with the machine it ran on" has "$page" '&quot;cpu_features&quot;'
check "self-contained (no external resources)" bash -c "! grep -qiE '<link|src=|@import|url\\(|https?://[^\"]*\"[^>]*>' '$page' || \
  ! grep -oiE '(src|href)=\"https?:' '$page' | grep -q ."
check "nothing fetched from the network" bash -c "! grep -oiE '(src|href)=\"(https?:)?//' '$page' | grep -q ."

# ---- a synthetic run: nested objects, NaN, inf, missing values, a single step, a manifest
expect "report of a synthetic run, -o" 0 "report: $tmp/syn.html (1 run, 4 steps," -- "$MOONRL" report "$tmp/syn/" -o "$tmp/syn.html"
page=$tmp/syn.html
check "nested objects are flattened" has "$page" 'aria-label="nested/a/b"'
check "a nested guard counter is summed" has "$page" 'updates skipped by the guards: 1 (in 1 steps)'
check "stale samples dropped are summed" has "$page" 'stale samples dropped: 5 (in 1 steps)'
check "NaN is counted as non-finite" has "$page" '<b>1 non-finite</b>'
check "NaN is marked" has "$page" 'step 2: NaN</title>'
check "+inf is marked" has "$page" 'step 3: inf</title>'
check "a metric of only -inf says so" has "$page" 'no finite values'
check "a metric logged once" has "$page" 'one step: last 7'
check "booleans are plotted, strings are not" bash -c "grep -q 'aria-label=\"flag\"' '$page' && ! grep -q 'aria-label=\"note\"' '$page'"
check "the events of every kind" bash -c "for k in skip rollback restart resume; do grep -q \"<td><b>\$k</b></td>\" '$page' || exit 1; done"
check "event fields are escaped" has "$page" 'ckpt/&lt;step-2&gt;'
check "the manifest is shown" has "$page" 'synthetic-cpu-xyz'
check "the config's nested keys" has "$page" '<td class="mono">grpo.reward</td><td class="mono">exact</td>'
# the memory peaks: the largest over the steps, with the step of the resident peak
check "memory headline: the resident peak and its step" has "$page" \
  'memory: peak resident <b>1.50 GiB</b> (step 3); held parameters <b>120 MiB</b>, gradients <b>120 MiB</b>, optimizer state <b>240 MiB</b>, activations <b>512 KiB</b>, KV cache <b>300 MiB</b></div>'
check "peak allocated" has "$page" '<td>peak allocated by moonrl</td><td class="num">700 MiB</td>'
check "the largest rank's peak" has "$page" 'peak resident, the largest rank <span class="mono">(memory/max_rank_peak_mb)</span></td><td class="num">1.56 GiB</td>'
check "a sharded model's parts" bash -c "grep -q 'the shard of a rank <span class=\"mono\">(memory/params_shard_mb)</span></td><td class=\"num\">60.0 MiB</td>' '$page' && grep -q 'gathered at once, at most <span class=\"mono\">(memory/params_gathered_peak_mb)</span></td><td class=\"num\">12.5 MiB</td>' '$page' && grep -q '(memory/engine_copy_mb)</span></td><td class=\"num\">240 MiB</td>' '$page'"
check "no row for what no run logged" bash -c "! grep -q 'grads_windows_peak_mb' '$page'"
check "a phase's peaks" has "$page" 'phase <span class="mono">generate</span>: peak resident / allocated</td><td class="num">1.46 GiB / 320 MiB</td>'
check "the bar: each kind's share of the total held (300 of 783.5 MiB)" has "$page" '<i style="width:38.29%;background:#b07aa1" title="KV cache 300 MiB"></i>'

# ---- a run that has logged nothing
expect "report of a run with no metrics" 0 "(1 run, 0 steps, 0 plots)" -- "$MOONRL" report "$tmp/empty"
check "the page says there are no metrics" has "$tmp/empty/report.html" 'empty has no metrics: metrics.jsonl holds no record'
check "and has no memory section" bash -c "! grep -q 'id=\"memory\"' '$tmp/empty/report.html'"

# ---- a comparison of two runs on the same axes
expect "comparison of two runs" 0 "report: $tmp/cmp.html (2 runs, 8 steps," -- "$MOONRL" report "$tmp/a" "$tmp/b" -o "$tmp/cmp.html"
check "what each run trained: the whole model, LoRA adapters and their share" \
  bash -c "grep -qF '<td>the whole model</td>' '$tmp/cmp.html' && grep -qE '<td>LoRA rank 4: [0-9]+ parameters \([0-9.]+%\)</td>' '$tmp/cmp.html'"
page=$tmp/cmp.html
check "both runs in the legend" bash -c "grep -q 'data-run=\"run-1\"' '$page' && grep -q 'data-run=\"run-2\"' '$page'"
check "both runs on one plot" bash -c "awk '/aria-label=\"reward\\/mean\"/,/<\\/svg>/' '$page' | grep -q 'class=\"series run-1\"' && \
  awk '/aria-label=\"reward\\/mean\"/,/<\\/svg>/' '$page' | grep -q 'class=\"series run-2\"'"
check "one phase chart per run" [ "$(count "$page" 'class="plot bars"')" -eq 2 ]
check "the memory of each run in the header" bash -c "grep -q 'class=\"memhead\"><span style=\"color:#1f77b4\">a</span> memory: peak resident' '$page' && \
  grep -q 'class=\"memhead\"><span style=\"color:#d62728\">b</span> memory: peak resident' '$page'"
check "a memory column per run" bash -c "sed -n '/id=\"memory\"/,/<\/table>/p' '$page' | grep -q '<tr><td><b>peak resident</b></td><td class=\"num\"><b>[0-9.]* MiB</b> (step [0-9]*)</td><td class=\"num\"><b>[0-9.]* MiB</b> (step [0-9]*)</td></tr>'"
check "and a bar per run" [ "$(count "$page" 'class="membar"')" -eq 2 ]
check "the config keys that differ" has "$page" '<tr><td class="mono">run.seed</td><td class="mono">1</td><td class="mono">2</td></tr>'
expect "the same run twice gets two names" 0 "(2 runs," -- "$MOONRL" report "$tmp/a" "$tmp/a" -o "$tmp/twice.html"
check "... a (2)" has "$tmp/twice.html" '>a (2)</span>'
(cd "$tmp" && "$MOONRL" report a syn > /dev/null 2>&1)
check "a comparison is written to ./report.html by default" [ -s "$tmp/report.html" ]

# ---- bad input: one line naming the file (and line), exit 2
expect "no run directory" 2 "report: no run directory given" -- "$MOONRL" report
expect "unknown option" 2 "report: unknown option --bogus" -- "$MOONRL" report --bogus "$tmp/a"
expect "-o without a file" 2 "report: -o needs a file name" -- "$MOONRL" report "$tmp/a" -o
expect "a missing directory" 2 "report: $tmp/nope: no such directory" -- "$MOONRL" report "$tmp/nope"
expect "a file, not a directory" 2 "report: $tmp/a.log is not a directory" -- "$MOONRL" report "$tmp/a.log"
mkdir -p "$tmp/other"; echo hi > "$tmp/other/notes.txt"
expect "not a run directory" 2 "report: $tmp/other is not a moonrl run directory" -- "$MOONRL" report "$tmp/other"
mkdir -p "$tmp/c1"; printf '{"step": 1, "loss": 1}\n{"step": 2, "loss": }\n{"step": 3}\n' > "$tmp/c1/metrics.jsonl"
expect "a corrupt line names file and line" 2 "report: $tmp/c1/metrics.jsonl:2: not valid JSON: unexpected character '}' (column 21)" -- "$MOONRL" report "$tmp/c1"
mkdir -p "$tmp/c2"; printf '{"step": 1}\n[1, 2]\n' > "$tmp/c2/metrics.jsonl"
expect "a line that is not an object" 2 "$tmp/c2/metrics.jsonl:2: expected a JSON object, got an array" -- "$MOONRL" report "$tmp/c2"
mkdir -p "$tmp/c3"; printf '{"step": 1}\n\n{"loss": 2}\n' > "$tmp/c3/metrics.jsonl"
expect "a record without a step" 2 "$tmp/c3/metrics.jsonl:3: the record has no numeric \"step\"" -- "$MOONRL" report "$tmp/c3"
mkdir -p "$tmp/c4"; printf '{"step": 1}\n' > "$tmp/c4/metrics.jsonl"; printf '{"recipe":\n' > "$tmp/c4/config.json"
expect "a corrupt config.json" 2 "$tmp/c4/config.json:2: not valid JSON" -- "$MOONRL" report "$tmp/c4"
mkdir -p "$tmp/c5"; printf '{"event": "skip"}\n\xff\xfe\n' > "$tmp/c5/events.jsonl"
expect "binary garbage in events.jsonl" 2 "$tmp/c5/events.jsonl:2: not valid JSON: unexpected character '\\xff'" -- "$MOONRL" report "$tmp/c5"
expect "the second of two runs is bad" 2 "$tmp/c1/metrics.jsonl:2:" -- "$MOONRL" report "$tmp/a" "$tmp/c1" -o "$tmp/x.html"
expect "an output that cannot be written" 2 "report: $tmp/nodir/x.html: cannot create" -- "$MOONRL" report "$tmp/a" -o "$tmp/nodir/x.html"
# a last line cut short (a run still writing it) is left out, with a note in the page
mkdir -p "$tmp/live"; printf '{"step": 1, "loss": 1}\n{"step": 2, "lo' > "$tmp/live/metrics.jsonl"
expect "a run still writing its last line" 0 "(1 run, 1 step, 1 plot)" -- "$MOONRL" report "$tmp/live"
check "... the page says the last line was left out" has "$tmp/live/report.html" 'metrics.jsonl:2: the last line is incomplete'

summary
