#!/usr/bin/env python3
"""A DeepSeek-V3 directory moonrl saves, run by vLLM (the CPU build of the interop virtualenv;
skipped, exit 77, where vllm does not import). Tiny random models in shapes vLLM's CPU MLA
attention takes (a latent of 512, heads of 128 + 64), saved by moonrl (tests/interop/deepseek_io.lua):

  1. low-rank queries, a dense first layer, grouped sigmoid experts with a shared one, and an MTP
     layer (num_nextn_predict_layers = 1, which vLLM's main model leaves aside);
  2. full-rank queries (q_lora_rank null), dense layers only.

For each: vLLM's prompt log-probs of a sequence equal moonrl's trainer's (within 1e-4) and its
greedy tokens after a prompt equal moonrl's engine's.

vLLM's CPU rotary-embedding op rotates the strided rope slice of DeepSeek's queries wrongly (log-
probs off by up to 0.2 on transformers' own checkpoints as on moonrl's); the check runs vLLM with
that op off (compilation_config custom_ops "-rotary_embedding": its PyTorch form).

usage: vllm_deepseek.py path/to/moonrl
"""
import json
import os
import subprocess
import sys
import tempfile

try:
    from vllm import LLM, SamplingParams
except ImportError:
    print("vllm not installed: skipped")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
EXE = os.path.abspath(sys.argv[1])
SEQ = [1, 5, 9, 3, 7, 4, 8, 6, 3, 2, 9, 5]
PROMPT = [1, 5, 9, 3, 7]
SHAPE = {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 512,
         "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 128,
         "moe_intermediate_size": 64, "initializer_range": 0.05, "tie_word_embeddings": False}
CASES = [
    ("low-rank queries, experts, MTP layer", dict(SHAPE, q_lora_rank=64, num_nextn_predict_layers=1)),
    ("full-rank queries, dense", dict(SHAPE, q_lora_rank=0, num_hidden_layers=2, first_k_dense_replace=2)),
]
passed = failed = 0


def check(ok, what):
    global passed, failed
    print(("ok     " if ok else "FAILED ") + what, flush=True)
    passed, failed = passed + ok, failed + (not ok)


def moonrl_side(tmp, over):
    d, out = os.path.join(tmp, "model"), os.path.join(tmp, "moonrl.json")
    env = dict(os.environ, DS_DIR=d, DS_OUT=out, DS_OVER=json.dumps(over), DS_SEQ=json.dumps(SEQ),
               DS_PROMPT=json.dumps(PROMPT))
    r = subprocess.run([EXE, "run", os.path.join(HERE, "deepseek_io.lua")], env=env, cwd=ROOT,
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit("deepseek_io.lua failed:\n" + r.stdout + r.stderr)
    with open(out) as f:
        return d, json.load(f)


def vllm_side(d):
    llm = LLM(model=d, dtype="float32", max_model_len=64, enforce_eager=True, gpu_memory_utilization=0.15,
              compilation_config={"custom_ops": ["-rotary_embedding"]})
    o = llm.generate([{"prompt_token_ids": SEQ}], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    lps = [p[SEQ[i]].logprob for i, p in enumerate(o[0].prompt_logprobs) if p is not None]
    g = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=8))
    del llm
    return lps, list(g[0].outputs[0].token_ids)


def main():
    for name, over in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            d, mine = moonrl_side(tmp, over)
            lps, greedy = vllm_side(d)
            gap = max(abs(a - b) for a, b in zip(lps, mine["logprobs"])) if len(lps) == len(mine["logprobs"]) else 1e9
            check(gap <= 1e-4, "%s: vLLM's prompt log-probs against moonrl's trainer's, %.2g" % (name, gap))
            check(greedy == mine["greedy"], "%s: vLLM's greedy tokens %s, moonrl's engine's %s" % (name, greedy, mine["greedy"]))
    print("%d passed, %d failed" % (passed, failed))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
