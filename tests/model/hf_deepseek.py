#!/usr/bin/env python3
"""A tiny random DeepSeek-V3 against Transformers' own implementation (DeepseekV3ForCausalLM) in
float64: moonrl's log-probs and entropies within 1e-6 of it, and every parameter's gradient of
    L = sum_t a_t logprob_t + b_t entropy_t
within 1e-5 relative (max |moonrl - transformers| / max |transformers|). The model is saved by
moonrl (mrl_model_save_dir) and loaded by from_pretrained, so the names and layouts are checked
too. Skipped (exit 77) without transformers >= 4.57 (DeepseekV3 with rope_interleave); CI's
interpreter has none, the development venv has it (docs/testing.md).

usage: hf_deepseek.py path/to/libmoonrl.so
"""
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
if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (4, 57):
    print("transformers %s has no DeepseekV3 with rope_interleave: skipped" % transformers.__version__)
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moonrl_ctypes  # noqa: E402
from moonrl_ctypes import Moonrl, check, rel  # noqa: E402

lib = moonrl_ctypes.load(sys.argv[1])
failures = []
# Transformers 5 runs experts through grouped_mm by default, which takes no float64: the per-expert loop
MOE_IMPL = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 0)


def hf_grads(hf):
    """The gradients of hf's parameters by moonrl's (the checkpoint's) names: Transformers 5 stacks a layer's
    experts (mlp.experts.gate_up_proj [E, 2 Fe, D], down_proj [E, D, Fe]); the router's choice bias is a buffer
    (no gradient: 0, as moonrl's)."""
    out = {}
    for n, p in hf.named_parameters():
        g = p.grad.numpy() if p.grad is not None else np.zeros(tuple(p.shape))
        if n.endswith("mlp.experts.gate_up_proj") or n.endswith("mlp.experts.down_proj"):
            pre, fe = n.rsplit(".", 1)[0], g.shape[1] // 2
            for e in range(g.shape[0]):
                if n.endswith("gate_up_proj"):
                    out["%s.%d.gate_proj.weight" % (pre, e)] = g[e, :fe]
                    out["%s.%d.up_proj.weight" % (pre, e)] = g[e, fe:]
                else:
                    out["%s.%d.down_proj.weight" % (pre, e)] = g[e]
        else:
            out[n] = g
    for n, b in hf.named_buffers():
        if n.endswith("e_score_correction_bias"):
            out[n] = np.zeros(tuple(b.shape))
    return out


def case(name, cfg, seed=0):
    rng = np.random.default_rng(seed)
    m = Moonrl(cfg)
    for n, off, shape, _ in m.views:
        size = int(np.prod(shape))
        m.params[off:off + size] = (1 + 0.2 * rng.standard_normal(size)) if "norm" in n else 0.08 * rng.standard_normal(size)
    seqs = [list(rng.integers(0, cfg["vocab_size"], L)) for L in (9, 17, 4, 23)]
    tokens = np.concatenate(seqs).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int32)
    targets = np.full(len(tokens), -1, np.int32)
    for i, s in enumerate(seqs):
        targets[cu[i]:cu[i + 1] - 1] = s[1:]
    T = len(tokens)
    a, b = rng.standard_normal(T).astype(np.float32), rng.standard_normal(T).astype(np.float32)
    lp, ent, _ = m.forward(tokens, targets, cu, 1.0, False)
    lib.mrl_model_zero_grad(m.h)
    m.backward(a, b, None)
    with tempfile.TemporaryDirectory() as d:
        check(lib.mrl_model_save_dir(m.h, d.encode()))
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64, attn_implementation="eager",
                                                          **({"experts_implementation": "eager"} if MOE_IMPL else {}))
    rlp, rent = [], []
    for i, s in enumerate(seqs):
        logp = torch.log_softmax(hf(torch.tensor([s])).logits[0], -1)
        tg = torch.tensor(targets[cu[i]:cu[i + 1]].astype(np.int64))
        rlp.append(torch.where(tg >= 0, logp.gather(1, tg.clamp(min=0)[:, None])[:, 0], torch.zeros(len(s))))
        rent.append(-(logp.exp() * logp).sum(-1))
    rlp, rent = torch.cat(rlp), torch.cat(rent)
    ((torch.tensor(a, dtype=torch.float64) * rlp).sum() + (torch.tensor(b, dtype=torch.float64) * rent).sum()).backward()
    theirs = hf_grads(hf)
    e_lp, e_ent = rel(lp, rlp.detach().numpy()), rel(ent, rent.detach().numpy())
    worst, worst_name, missing = 0.0, "", []
    for n, _, _, _ in m.views:
        if n not in theirs:
            missing.append(n)
            continue
        e = rel(m.tensor(m.grads, n), theirs[n])
        if e > worst:
            worst, worst_name = e, n
    ok = e_lp <= 1e-6 and e_ent <= 1e-6 and worst <= 1e-5 and not missing
    print("%-46s T=%d  logprob %.1e  entropy %.1e  grad %.1e (%s)  %s" % (name, T, e_lp, e_ent, worst, worst_name,
                                                                          "ok" if ok else "FAIL"))
    if missing:
        print("  no gradient in transformers for", missing)
    if not ok:
        failures.append(name)
    lib.mrl_model_free(m.h)


base = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=101, hidden_size=64,
            intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10, rms_norm_eps=1e-6,
            tie_word_embeddings=False, first_k_dense_replace=2, n_routed_experts=4)
case("MLA, low-rank queries, v 10 < 14", base)
case("MLA, q_proj, v 20 > 14, yarn with mscale", dict(base, q_lora_rank=None, v_head_dim=20, max_position_embeddings=64,
     rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32, beta_slow=1,
                       mscale=1.0, mscale_all_dim=1.0)), seed=1)
case("MLA, half-split RoPE, tied", dict(base, rope_interleave=False, tie_word_embeddings=True), seed=2)
# the mixture of experts: a dense first layer, then 8 experts in 4 groups (2 taken), top-3, a shared expert
moe = dict(base, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
           topk_group=2, moe_intermediate_size=16, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)
case("MoE: groups, shared expert, dense first layer", moe, seed=3)
case("MoE: 16 experts top-4, 2 shared, not renormalised, q_proj", dict(moe, n_routed_experts=16, num_experts_per_tok=4,
     n_shared_experts=2, norm_topk_prob=False, q_lora_rank=None), seed=4)
if failures:
    print("FAILED:", ", ".join(failures))
    sys.exit(1)
print("transformers %s's DeepseekV3 agrees" % transformers.__version__)
