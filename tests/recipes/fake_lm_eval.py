"""A stand-in for lm-evaluation-harness's lm_eval (tests/recipes/test_harness.lua), with Python's
standard library: it takes lm_eval's arguments (--model local-completions --model_args
base_url=...,model=...,tokenizer=... --tasks T --output_path DIR), asks the server what
local-completions asks for a log-likelihood (echo, max_tokens 0, logprobs 1) on a few token ids,
and writes DIR/<model>/results_<time>.json as lm_eval does: {"results": {T: {"acc,none": the sum
of the echoed log-probs, "acc_stderr,none": 0.1, "prompts,none": how many were echoed}}}.
FAKE_LM_EVAL_EXIT makes it fail with that status instead."""
import argparse
import json
import os
import sys
import urllib.request

if os.environ.get("FAKE_LM_EVAL_EXIT"):
    sys.stderr.write("fake lm_eval: failing on purpose\n")
    sys.exit(int(os.environ["FAKE_LM_EVAL_EXIT"]))
ap = argparse.ArgumentParser()
for a in ("--model", "--model_args", "--tasks", "--output_path", "--include_path", "--limit"):
    ap.add_argument(a)
args = ap.parse_args()
margs = dict(kv.split("=", 1) for kv in args.model_args.split(","))
assert args.model == "local-completions" and os.path.exists(os.path.join(margs["tokenizer"], "tokenizer.json"))
body = {"model": margs["model"], "prompt": [1, 5, 6, 7, 8], "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
req = urllib.request.Request(margs["base_url"], data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
lp = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["logprobs"]["token_logprobs"]
assert lp[0] is None and len(lp) == 5
out = os.path.join(args.output_path, margs["model"])
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "results_2026-12-06T00-00-00.json"), "w") as f:
    json.dump({"results": {t: {"alias": t, "acc,none": sum(lp[1:]), "acc_stderr,none": 0.1, "prompts,none": 1}
                           for t in args.tasks.split(",")}}, f)
