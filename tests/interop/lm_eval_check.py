"""lm-evaluation-harness against `moonrl serve` (its local-completions model: echo with log-probs for
log-likelihoods, greedy completions for generation) and against its own hf backend on the same
model, a tiny random Llama in Hugging Face format: a local multiple-choice task and a local
generation task give the same scores, each document the same log-likelihoods (1e-4) and the same
generated text. Run by meson with the interop virtualenv's python (./dev.sh vllm installs it);
skipped (77) without it. Ends with the "N passed, N failed" line."""
import glob
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

MOONRL, SRC = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
VENV = os.path.join(SRC, ".venv-interop")
LM_EVAL = os.path.join(VENV, "bin", "lm_eval")
if not os.path.exists(LM_EVAL):
    print("skipped: no %s (./dev.sh vllm installs it)" % LM_EVAL)
    sys.exit(77)
passed = failed = 0


def check(name, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1
        print("ok   " + name)
    else:
        failed += 1
        print("FAIL %s %s" % (name, str(detail)[:2000]))


tmp = tempfile.mkdtemp(prefix="moonrl-lm-eval-")
model = os.path.join(tmp, "tiny")
subprocess.run([MOONRL, "run", os.path.join(SRC, "tests/engine/make_tiny_model.lua")], check=True,
               env=dict(os.environ, OUT=model, TOK=os.path.join(SRC, "tests/tok/fixtures/qwen2_split"), PROMPT="Hello"))
rng = random.Random(1)
with open(os.path.join(tmp, "mc.jsonl"), "w") as f:
    for _ in range(24):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        choices = [str(a + b + d) for d in (0, 1, -10, 11)]
        rng.shuffle(choices)
        f.write(json.dumps({"question": "%d plus %d is" % (a, b), "choices": [" " + c for c in choices],
                            "answer": choices.index(str(a + b))}) + "\n")
with open(os.path.join(tmp, "gen.jsonl"), "w") as f:
    for _ in range(12):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        f.write(json.dumps({"question": "Hello %d and %d" % (a, b), "answer": str(a + b)}) + "\n")
with open(os.path.join(tmp, "mc.yaml"), "w") as f:
    f.write("task: moonrl_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: %s/mc.jsonl\n"
            "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
            "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n" % tmp)
with open(os.path.join(tmp, "gen.yaml"), "w") as f:
    f.write("task: moonrl_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: %s/gen.jsonl\n"
            "test_split: test\noutput_type: generate_until\ndoc_to_text: \"{{question}}\"\n"
            "doc_to_target: \"{{answer}}\"\ngeneration_kwargs:\n  until: [\"<|im_end|>\"]\n  max_gen_toks: 8\n"
            "  do_sample: false\nmetric_list:\n  - metric: exact_match\n" % tmp)


def lm_eval(name, model_kind, model_args):
    out = os.path.join(tmp, name)
    r = subprocess.run([LM_EVAL, "--model", model_kind, "--model_args", model_args, "--tasks", "moonrl_mc,moonrl_gen",
                        "--include_path", tmp, "--output_path", out, "--log_samples"], capture_output=True, text=True,
                       env=dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"), timeout=900)
    if r.returncode != 0:
        print(r.stdout[-3000:], r.stderr[-3000:])
        raise SystemExit("lm_eval --model %s failed (%d)" % (model_kind, r.returncode))
    res = json.load(open(glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True)[0]))["results"]
    samples = {}
    for task in ("moonrl_mc", "moonrl_gen"):
        path = glob.glob(os.path.join(out, "**", "samples_%s_*.jsonl" % task), recursive=True)[0]
        samples[task] = {s["doc_id"]: s for s in map(json.loads, open(path))}
    return res, samples


hf_res, hf_s = lm_eval("hf", "hf", "pretrained=%s,dtype=float32" % model)
log = open(os.path.join(tmp, "serve.log"), "w")
srv = subprocess.Popen([MOONRL, "serve", "--model", model, "--port", "0", "--served-model-name", "tiny"], stderr=log)
port = None
for _ in range(600):
    m = re.search(r"listening on http://[^ ]*:(\d+)", open(log.name).read())
    if m:
        port = int(m.group(1))
        break
    time.sleep(0.05)
try:
    mr_res, mr_s = lm_eval("moonrl", "local-completions",
                           "base_url=http://127.0.0.1:%d/v1/completions,model=tiny,tokenizer=%s,tokenized_requests=True,"
                           "max_length=512,num_concurrent=4" % (port, model))
finally:
    srv.terminate()
    srv.wait(30)
check("mc-acc", hf_res["moonrl_mc"]["acc,none"] == mr_res["moonrl_mc"]["acc,none"],
      (hf_res["moonrl_mc"], mr_res["moonrl_mc"]))
worst = 0.0
for doc, s in hf_s["moonrl_mc"].items():
    for a, b in zip(s["resps"], mr_s["moonrl_mc"][doc]["resps"]):
        worst = max(worst, abs(float(a[0][0]) - float(b[0][0])))
check("mc-loglikelihoods", worst < 1e-4, worst)
print("     multiple choice: acc %s (both); the largest log-likelihood difference %.2g" %
      (mr_res["moonrl_mc"]["acc,none"], worst))


def same_text(hf, mine):
    # a sample cut by max_gen_toks inside a character (or with bytes no character has): hf decodes
    # the ids whole, replacing them with U+FFFD, where moonrl serve (as vLLM) sends only the text its
    # stream decoder completed: the same ids
    return hf == mine or (hf.startswith(mine) and hf[len(mine):].startswith("\ufffd"))


same = [same_text(hf_s["moonrl_gen"][d]["resps"][0][0], mr_s["moonrl_gen"][d]["resps"][0][0]) for d in hf_s["moonrl_gen"]]
check("gen-texts", all(same), [(hf_s["moonrl_gen"][d]["resps"], mr_s["moonrl_gen"][d]["resps"]) for d in hf_s["moonrl_gen"]][:3])
check("gen-nonempty", any(hf_s["moonrl_gen"][d]["resps"][0][0] for d in hf_s["moonrl_gen"]), "every generation empty")
check("gen-exact-match", hf_res["moonrl_gen"]["exact_match,none"] == mr_res["moonrl_gen"]["exact_match,none"])
# eval.harness: the same task run by a training run against its policy at its last step, then by
# lm-eval's hf backend on the model the run saved
with open(os.path.join(tmp, "sft.jsonl"), "w") as f:
    for line in open(os.path.join(tmp, "mc.jsonl")):
        d = json.loads(line)
        f.write(json.dumps({"prompt": d["question"], "response": d["choices"][d["answer"]]}) + "\n")
run = os.path.join(tmp, "run")
r = subprocess.run([MOONRL, "run", "sft", "model.dir=" + model, "data.path=" + os.path.join(tmp, "sft.jsonl"),
                    "data.chat=false", "train.steps=4", "train.batch=4", "train.lr=1e-2", "run.threads=1",
                    "eval.harness=moonrl_mc", "eval.harness_every=4", "eval.harness_include=" + tmp,
                    "eval.harness_command=" + LM_EVAL, "run.dir=" + run], capture_output=True, text=True, timeout=900)
if r.returncode != 0:
    print(r.stdout[-2000:], r.stderr[-2000:])
last = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))][-1]
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(model, f), os.path.join(run, "model", f))
after, _ = lm_eval("hf_after", "hf", "pretrained=%s,dtype=float32" % os.path.join(run, "model"))
check("harness-in-run", last.get("eval/harness/moonrl_mc/acc") == after["moonrl_mc"]["acc,none"],
      (last.get("eval/harness/moonrl_mc/acc"), after["moonrl_mc"]))
print("     eval.harness at the run's last step: acc %s; hf on the saved model: %s" %
      (last.get("eval/harness/moonrl_mc/acc"), after["moonrl_mc"]["acc,none"]))
shutil.rmtree(tmp, ignore_errors=True)
print("%d passed, %d failed" % (passed, failed))
sys.exit(1 if failed else 0)
