#!/usr/bin/env python3
"""Extra check against Hugging Face Transformers itself (skipped, exit 77,
where transformers is not importable; the core reference test is
model_ref.py). A moonrl model saved with mrl_model_save_dir must load in
Transformers and give the same log-probs (and, for a
...ForSequenceClassification model, the same value at the last token); a
directory written by Transformers' save_pretrained must load in moonrl with
the same results. With a shard limit, both ways go through sharded
safetensors: mrl_model_save_dir_sharded's model-0000K-of-0000N files and
index load in from_pretrained, save_pretrained(max_shard_size=)'s in
moonrl. Checked with transformers 4.40 (Llama, Qwen2; llama3 rope
scaling needs 4.43 and Qwen3 4.51, with a newer torch than Debian's).

usage: hf_check.py path/to/libmoonrl.so
"""
import ctypes as C
import json
import os
import sys
import tempfile

import numpy as np

try:
    import torch
    import transformers
except ImportError:
    print("transformers not installed: skipped")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moonrl_ctypes  # noqa: E402
from moonrl_ctypes import Moonrl, check, rel  # noqa: E402

lib = moonrl_ctypes.load(sys.argv[1])
failures = []


def hf_logprobs(model, seqs):
    out = []
    for s in seqs:
        with torch.no_grad():
            logits = model(torch.tensor([s])).logits[0].double()
        logp = torch.log_softmax(logits, -1)
        out.append(np.concatenate([logp[:-1].gather(1, torch.tensor(s[1:])[:, None])[:, 0].numpy(), [0.0]]))
    return np.concatenate(out)


def moonrl_logprobs(m, seqs, values=False):
    tokens = np.concatenate(seqs).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int32)
    targets = np.full(len(tokens), -1, np.int32)
    for i, s in enumerate(seqs):
        targets[cu[i]:cu[i + 1] - 1] = s[1:]
    lp, _, val = m.forward(tokens, targets, cu, 1.0, values)
    return lp, val, cu


def shard_files(d):
    """The model-0000K-of-0000N.safetensors files of d, checked to be the index's, and N."""
    names = sorted(f for f in os.listdir(d) if f.startswith("model-") and f.endswith(".safetensors"))
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        used = set(json.load(f)["weight_map"].values())
    n = len(names)
    want = ["model-%05d-of-%05d.safetensors" % (k, n) for k in range(1, n + 1)]
    if names != want or used != set(names) or os.path.exists(os.path.join(d, "model.safetensors")):
        raise RuntimeError("%s: shards %s, the index's %s" % (d, names, sorted(used)))
    return n


def case(name, cfg, cls_name=None, shard_bytes=0):
    """shard_bytes: save through shards of at most that many bytes (each way), at least 3 of them."""
    rng = np.random.default_rng(0)
    m = Moonrl(cfg)
    for n, off, shape, _ in m.views:
        size = int(np.prod(shape))
        m.params[off:off + size] = (1 + 0.2 * rng.standard_normal(size)) if "norm" in n else 0.05 * rng.standard_normal(size)
    seqs = [list(rng.integers(0, cfg["vocab_size"], L)) for L in (9, 17, 4)]
    value_head = bool(cls_name)
    lp, val, cu = moonrl_logprobs(m, seqs, value_head)
    with tempfile.TemporaryDirectory() as d:
        if shard_bytes:
            check(lib.mrl_model_save_dir_sharded(m.h, d.encode(), shard_bytes))
            if shard_files(d) < 3:
                raise RuntimeError("%s: fewer than 3 shards of %d bytes" % (d, shard_bytes))
        else:
            check(lib.mrl_model_save_dir(m.h, d.encode()))
        if value_head:
            hf = getattr(transformers, cls_name).from_pretrained(d, torch_dtype=torch.float32)
            errs = []
            for i, s in enumerate(seqs):
                with torch.no_grad():
                    v = hf(torch.tensor([s])).logits[0, 0].item()
                errs.append(abs(v - val[cu[i + 1] - 1]) / max(1e-3, abs(v)))
            e = max(errs)
        else:
            hf = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
            e = rel(lp, hf_logprobs(hf, seqs))
        # and back: a directory written by Transformers, read by moonrl
        d2 = os.path.join(d, "hf")
        if shard_bytes:
            hf.save_pretrained(d2, safe_serialization=True, max_shard_size=shard_bytes)
            shard_files(d2)
        else:
            hf.save_pretrained(d2, safe_serialization=True)
        h = C.c_void_p()
        check(lib.mrl_model_load_dir(d2.encode(), C.byref(h)))
        m2 = Moonrl.__new__(Moonrl)
        m2.h = h
        lp2, val2, _ = moonrl_logprobs(m2, seqs, value_head)
        e2 = rel(val2, val) if value_head else rel(lp2, lp)
        lib.mrl_model_free(h)
    ok = e < 1e-4 and e2 < 1e-6
    print("%-44s moonrl vs transformers %.1e; reloaded from save_pretrained %.1e  %s" % (name, e, e2, "ok" if ok else "FAIL"))
    if not ok:
        failures.append(name)
    lib.mrl_model_free(m.h)


base = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False)
case("llama GQA untied", dict(base, model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=500000.0))
if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 43):  # llama3 rope scaling came in 4.43
    case("llama3 rope scaling", dict(base, model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=500000.0,
         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8)))
    # yarn (Qwen's long-context configs; DeepSeek-V3's form: its factor from the lengths, mscale over mscale_all_dim)
    case("qwen2 yarn rope scaling", dict(base, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
         max_position_embeddings=64, rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)))
    case("llama yarn as DeepSeek-V3 gives it", dict(base, model_type="llama", architectures=["LlamaForCausalLM"],
         max_position_embeddings=64, rope_scaling=dict(type="yarn", original_max_position_embeddings=16, beta_fast=32,
                                                       beta_slow=1, mscale=1.0, mscale_all_dim=0.707)))
if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 57):  # (DeepseekV3 with rope_interleave)
    mla = dict(base, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], num_key_value_heads=4,
               q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10,
               first_k_dense_replace=2, n_routed_experts=4)
    case("deepseek_v3 MLA, low-rank queries", mla)
    case("deepseek_v3 MLA, q_proj, yarn mscale", dict(mla, q_lora_rank=None, v_head_dim=20, max_position_embeddings=64,
         rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32, beta_slow=1,
                           mscale=1.0, mscale_all_dim=1.0)))
    case("deepseek_v3 with its MTP layer (Transformers drops it)", dict(mla, num_nextn_predict_layers=1))
    case("deepseek_v3 MoE: groups, shared expert, dense first layer", dict(mla, num_hidden_layers=3,
         first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
         moe_intermediate_size=16, n_shared_experts=1, routed_scaling_factor=2.5))
case("llama, saved in shards of 40 KB", dict(base, model_type="llama", architectures=["LlamaForCausalLM"]),
     shard_bytes=40000)
case("qwen2 biases, tied", dict(base, model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True))
case("llama sequence classification (value head)", dict(base, model_type="llama",
     architectures=["LlamaForSequenceClassification"]), "LlamaForSequenceClassification")
if failures:
    print("FAILED:", ", ".join(failures))
    sys.exit(1)
print("transformers %s agrees" % transformers.__version__)
