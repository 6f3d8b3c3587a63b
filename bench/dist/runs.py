"""What bench/dist/zero.sh and tp.sh read back of their runs (bench_run's $dir/runs.jsonl)."""
import json


def median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def load_runs(d):
    """{name: [(the runs.jsonl line, [its metrics.jsonl records]), ...]} in the order run."""
    runs = {}
    for line in open(d + "/runs.jsonl"):
        x = json.loads(line)
        runs.setdefault(x["name"], []).append((x, [json.loads(l) for l in open(x["metrics"])]))
    return runs
