"""What bench/dist/zero.sh, tp.sh, cp.sh and pp.sh read back of their runs (bench_run's $dir/runs.jsonl)."""
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


def metrics_by_name(d):
    """{name: [[its metrics.jsonl records] of each round]}."""
    return {name: [st for _, st in rs] for name, rs in load_runs(d).items()}


def best(runs, name, key, low=True):
    """The best round's median of key over each step but the first (lowest when low), and every round's."""
    vals = [median([s[key] for s in st[1:]]) for st in runs[name]]
    return (min if low else max)(vals), vals
