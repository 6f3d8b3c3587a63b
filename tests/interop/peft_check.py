#!/usr/bin/env python3
"""moonrl's LoRA against the peft package over Transformers (the interop virtualenv; skipped, exit
77, where peft does not import). On tiny random Llama, Qwen2 (biases) and Qwen3 (q/k norms)
models saved by Transformers:

  1. forward and gradients: a PEFT LoRA with random A and B (init_lora_weights=False) on the
     Transformers model in float64; the same base (read from its save_pretrained directory) and
     the same adapter values, by PEFT's tensor names, in moonrl (mrl_model_set_lora): log-probs
     within 1e-5 (relative), every A and B gradient within 1e-4, for L = sum_t a_t logprob_t;
  2. PEFT's files in moonrl: the adapter PEFT saved (save_pretrained) read by Model:load_lora
     (tests/interop/lora_io.lua) gives PEFT's log-probs;
  3. moonrl's files in PEFT: adapters moonrl saved (Model:save_lora) load with
     PeftModel.from_pretrained over the base and give moonrl's log-probs.

usage: peft_check.py path/to/libmoonrl.so path/to/moonrl
"""
import ctypes as C
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

try:
    import peft
    import torch
    import transformers
except ImportError:
    print("peft not installed: skipped")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "model"))
import moonrl_ctypes  # noqa: E402
from moonrl_ctypes import check, ptr, rel  # noqa: E402

lib = moonrl_ctypes.load(sys.argv[1])
api = moonrl_ctypes.api
EXE = os.path.abspath(sys.argv[2])
ROOT = os.path.join(HERE, "..", "..")
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
failures = []


def peft_logprobs(model, seqs, grad=False):
    out = []
    for s in seqs:
        logits = model(torch.tensor([s])).logits[0].double()
        logp = torch.log_softmax(logits, -1)
        out.append(torch.cat([logp[:-1].gather(1, torch.tensor(s[1:])[:, None])[:, 0], torch.zeros(1)]))
    lp = torch.cat(out)
    return lp if grad else lp.detach().numpy()


def moonrl_run(mode, base, adapter, seqs, out, extra=None):
    env = dict(os.environ, LORA_MODE=mode, LORA_BASE=base, LORA_DIR=adapter, LORA_SEQS=json.dumps(seqs), LORA_OUT=out)
    env.update(extra or {})
    r = subprocess.run([EXE, "run", os.path.join(HERE, "lora_io.lua")], env=env, cwd=ROOT, capture_output=True,
                       text=True)
    if r.returncode != 0:
        raise RuntimeError("moonrl %s: %s%s" % (mode, r.stdout, r.stderr))
    return np.concatenate([np.array(x) for x in json.load(open(out))])


def run_case(name, cfg_cls, cfg, rank, alpha, targets, seed):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    tmp = tempfile.mkdtemp(prefix="peft-")
    base_dir, peft_dir, ours_dir = tmp + "/base", tmp + "/peft", tmp + "/ours"
    model = transformers.AutoModelForCausalLM.from_config(cfg_cls(**cfg)).double()
    with torch.no_grad():  # norms away from 1, biases non-zero
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.float().save_pretrained(base_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                                                     init_lora_weights=False))
    with torch.no_grad():  # fp32-representable values: both sides start from the same numbers
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(p.float().double())
    seqs = [rng.integers(0, cfg["vocab_size"], L).tolist() for L in (9, 1, 14, 6)]
    # 1. forward and gradients
    lp = peft_logprobs(pm, seqs, grad=True)
    a = rng.standard_normal(len(lp)).astype(np.float32)
    (torch.tensor(a, dtype=torch.float64) * lp).sum().backward()
    h = C.c_void_p()
    check(lib.mrl_model_load_dir(base_dir.encode(), C.byref(h)))
    bits = sum(1 << MODULES.index(t) for t in targets)
    check(lib.mrl_model_set_lora(h, C.byref(api.mrl_lora_config(rank, alpha, bits, 0))))
    lp_params, lp_grads, ours = moonrl_ctypes.lora(h)
    theirs = {k.replace(".default", ""): v for k, v in pm.named_parameters() if "lora_" in k}
    views = []
    for nm, off, shape, _ in ours:
        if nm not in theirs:
            failures.append("%s: PEFT has no %s" % (name, nm))
            continue
        lp_params[off:off + shape[0] * shape[1]] = theirs[nm].detach().numpy().reshape(-1)
        views.append((nm, off, shape))
    if len(views) != len(theirs):
        failures.append("%s: %d adapter tensors in moonrl, %d in PEFT" % (name, len(views), len(theirs)))
    tokens = np.concatenate(seqs).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int32)
    targets_ = np.full(len(tokens), -1, np.int32)
    for i, s in enumerate(seqs):
        targets_[cu[i]:cu[i + 1] - 1] = s[1:]
    b = api.mrl_batch(tokens.ctypes.data_as(C.POINTER(C.c_int32)), targets_.ctypes.data_as(C.POINTER(C.c_int32)),
                      cu.ctypes.data_as(C.POINTER(C.c_int32)), len(tokens), len(seqs), None, None)
    ours = np.zeros(len(tokens), np.float32)
    check(lib.mrl_model_forward(h, C.byref(b), C.c_float(1.0), ptr(ours), None, None))
    check(lib.mrl_model_backward(h, ptr(a), None, None))
    e_lp = rel(ours, lp.detach().numpy())
    e_g, worst = 0.0, ""
    for nm, off, shape in views:
        e = rel(lp_grads[off:off + shape[0] * shape[1]].reshape(shape), theirs[nm].grad.numpy())
        if e > e_g:
            e_g, worst = e, nm
    lib.mrl_model_free(h)
    ok1 = e_lp <= 1e-5 and e_g <= 1e-4
    # 2. PEFT's files read by moonrl
    pm.float().save_pretrained(peft_dir)  # (F32, as PEFT saves a float32 model's)
    want = peft_logprobs(pm.double(), seqs)
    got = moonrl_run("read", base_dir, peft_dir, seqs, tmp + "/read.json")
    e_read = rel(got, want)
    # 3. moonrl's files read by PEFT
    got = moonrl_run("write", base_dir, ours_dir, seqs, tmp + "/write.json",
                     {"LORA_RANK": str(rank), "LORA_ALPHA": str(alpha), "LORA_TARGETS": ",".join(targets)})
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    back = peft.PeftModel.from_pretrained(base, ours_dir)
    e_write = rel(got, peft_logprobs(back, seqs))
    ok = ok1 and e_read <= 1e-5 and e_write <= 1e-5
    print("%-36s r=%d  %3d adapter tensors  log-probs %.1e  grads %.1e (%s)  PEFT file->moonrl %.1e  "
          "moonrl file->PEFT %.1e  %s" % (name, rank, len(views), e_lp, e_g, worst.replace("base_model.model.", ""),
                                          e_read, e_write, "ok" if ok else "FAIL"))
    if not ok:
        failures.append(name)


small = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
run_case("llama, all-linear", transformers.LlamaConfig, small, 4, 8, MODULES, 1)
run_case("qwen2 biases tied, q and v", transformers.Qwen2Config, dict(small, tie_word_embeddings=True), 1, 32,
         ["q_proj", "v_proj"], 2)
run_case("qwen3 q/k norms, the MLP", transformers.Qwen3Config, dict(small, head_dim=32), 8, 16,
         ["gate_proj", "up_proj", "down_proj"], 3)
if failures:
    print("FAILED:", ", ".join(failures))
    sys.exit(1)
print("peft %s, transformers %s: moonrl's LoRA agrees" % (peft.__version__, transformers.__version__))
