#!/usr/bin/env python3
"""moonrl's model against a small PyTorch implementation of the same
architectures (written here; no transformers needed), float64 on the torch
side. Identical weights (random, written into moonrl's parameter buffer),
a packed batch of several sequences; compares log-probs, entropy, values
and the gradient of every parameter for the loss
    L = sum_t a_t logprob_t + b_t entropy_t + c_t value_t
with random per-token a, b, c. Relative error = max|moonrl - torch| / max|torch|.

usage: model_ref.py path/to/libmoonrl.so
"""
import os
import sys

import numpy as np
import torch

torch.set_default_dtype(torch.float64)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moonrl_ctypes  # noqa: E402
from moonrl_ctypes import Moonrl, rel  # noqa: E402

lib = moonrl_ctypes.load(sys.argv[1])


from torch_ref import reference  # noqa: E402


failures = []


# model.dtype=bf16 against the same float64 reference. bf16 keeps 8 significant bits: each
# rounded operand moves a product term by ~2^-8 relative, and through the ~8 products between the
# embedding and the log-probs (errors adding like a random walk) the log-probs move by up to ~1% of
# their size; gradients go through twice as many products, and the small ones of norm weights
# (sums over every token of bf16-rounded products) move most. Measured here: log-probs <= 2.2e-3,
# entropy <= 4.8e-4, values 6.4e-3, gradients <= 4.1e-2 (a q_norm weight); the bounds are 2.5-5x
# that. fp32's (1e-5, 1e-4) are ~1000x tighter.
BOUNDS = {"fp32": dict(logprob=1e-5, entropy=1e-5, value=1e-5, grad=1e-4),
          "bf16": dict(logprob=1e-2, entropy=1e-2, value=2e-2, grad=1e-1)}


def run_case(name, cfg, lens, temperature=1.0, value_head=False, kernels=0, recompute=False, head_chunk=0, seed=0,
             dtype="fp32"):
    rng = np.random.default_rng(seed)
    if value_head:
        cfg = dict(cfg, moonrl_value_head=True)
    m = Moonrl(cfg)
    if dtype == "bf16":
        moonrl_ctypes.check(lib.mrl_model_set_dtype(m.h, 1))
    lib.mrl_model_set_kernels(m.h, kernels)
    lib.mrl_model_set_recompute(m.h, int(recompute))
    lib.mrl_model_set_head_chunk(m.h, head_chunk)
    # random weights (norms near 1, biases nonzero) written into moonrl's buffer
    for n, off, shape, _ in m.views:
        size = int(np.prod(shape))
        if "norm" in n:
            m.params[off:off + size] = 1 + 0.2 * rng.standard_normal(size)
        else:
            m.params[off:off + size] = (0.1 if n.endswith("bias") else 0.08) * rng.standard_normal(size)
    P = {n: torch.tensor(m.tensor(m.params, n).astype(np.float64), requires_grad=True) for n, _, _, _ in m.views}
    V = cfg["vocab_size"]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    tokens = rng.integers(0, V, cu[-1]).astype(np.int32)
    targets = np.full(cu[-1], -1, np.int32)
    for s in range(len(lens)):
        targets[cu[s]:cu[s + 1] - 1] = tokens[cu[s] + 1:cu[s + 1]]
    lp, ent, val = m.forward(tokens, targets, cu, temperature, value_head)
    rlp, rent, rval = reference(cfg, P, tokens, targets, cu, temperature, value_head)
    errs = {"logprob": rel(lp, rlp.detach()), "entropy": rel(ent, rent.detach())}
    if value_head:
        errs["value"] = rel(val, rval.detach())
    T = cu[-1]
    a, b = rng.standard_normal(T).astype(np.float32), rng.standard_normal(T).astype(np.float32)
    c = rng.standard_normal(T).astype(np.float32) if value_head else None
    lib.mrl_model_zero_grad(m.h)
    m.backward(a, b, c)
    loss = (torch.tensor(a, dtype=torch.float64) * rlp).sum() + (torch.tensor(b, dtype=torch.float64) * rent).sum()
    if value_head:
        loss = loss + (torch.tensor(c, dtype=torch.float64) * rval).sum()
    loss.backward()
    worst_grad, worst_name = 0.0, ""
    for n, _, _, _ in m.views:
        e = rel(m.tensor(m.grads, n), P[n].grad.numpy())
        if e > worst_grad:
            worst_grad, worst_name = e, n
    errs["grad"] = worst_grad
    bound = BOUNDS[dtype]
    ok = all(errs.get(k, 0) <= bound[k] for k in bound)
    print("%-40s T=%3d  logprob %.1e  entropy %.1e  value %.1e  grad %.1e (%s)  %s" % (
        name, T, errs["logprob"], errs["entropy"], errs.get("value", 0), worst_grad, worst_name, "ok" if ok else "FAIL"))
    if not ok:
        failures.append(name)
    # a second backward accumulates: gradients double
    g1 = m.grads.copy()
    m.backward(a, b, c)
    if rel(m.grads, 2 * g1) > 1e-6:
        failures.append(name + " (accumulation)")
        print("  gradient accumulation wrong")
    lib.mrl_model_free(m.h)
    return lp, ent, g1


llama = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=64,
             intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
lens = [7, 1, 12, 20]
run_case("llama GQA untied + value head", llama, lens, value_head=True)
run_case("llama tied, temperature 0.7", dict(llama, tie_word_embeddings=True, num_key_value_heads=4), lens, temperature=0.7)
run_case("llama3 rope scaling, theta 5e5", dict(llama, rope_theta=500000.0, rope_scaling=dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)),
    [30, 9], seed=3)
run_case("yarn rope scaling (Qwen's long context: factor 4 from 16)", dict(llama, max_position_embeddings=64,
         rope_theta=1000000.0, rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)),
         [30, 9], seed=4)
run_case("yarn as DeepSeek-V3 gives it (factor from the lengths, mscale / mscale_all_dim, beta 32/1)",
         dict(llama, max_position_embeddings=80, rope_scaling=dict(type="yarn", original_max_position_embeddings=20,
              beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.707)), [41, 3], seed=5)
run_case("qwen2 biases, GQA 6/2", dict(llama, model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=48,
                                      num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True), lens,
         value_head=True)
q3 = dict(llama, model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=48, head_dim=16,
          num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)
run_case("qwen3 q/k norm, head_dim 16 != 48/4", q3, lens)
run_case("qwen3 reference kernels", q3, [5, 9], kernels=1)
# DeepSeek-V3's multi-head latent attention: low-rank queries or q_proj, values narrower or wider than
# the query heads (padded), DeepSeek's interleaved RoPE pairs or the half-split ones, yarn's softmax mscale
ds = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=97, hidden_size=64,
          intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
          kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10, rms_norm_eps=1e-6,
          rope_theta=10000.0, tie_word_embeddings=False, first_k_dense_replace=2, n_routed_experts=4)
run_case("deepseek_v3 MLA, q_lora_rank 24, v 10 < 14", ds, lens, value_head=True)
run_case("deepseek_v3 MLA, q_proj, v 20 > 14, half-split RoPE", dict(ds, q_lora_rank=None, v_head_dim=20,
         rope_interleave=False, tie_word_embeddings=True), lens, seed=8)
run_case("deepseek_v3 MLA, yarn with mscale_all_dim (the softmax scale)", dict(ds, max_position_embeddings=80,
         rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=20, beta_fast=32, beta_slow=1,
                           mscale=1.0, mscale_all_dim=1.0)), [41, 3], seed=9)
run_case("deepseek_v3 MLA reference kernels", ds, [5, 9], kernels=1)
mla_a = run_case("deepseek_v3 MLA recompute=off", ds, lens, seed=10)
mla_b = run_case("deepseek_v3 MLA recompute=on", ds, lens, seed=10, recompute=True)
if not all(np.array_equal(x, y) for x, y in zip(mla_a, mla_b)):
    failures.append("deepseek_v3 recompute not bit-identical")
    print("  recompute: results differ from the plain run")
run_case("bf16: deepseek_v3 MLA", ds, lens, seed=11, dtype="bf16")
# recomputation and the thread count change nothing (bit-identical); head chunking only the order of sums
base = run_case("llama recompute=off", llama, lens, seed=5)
other = run_case("llama recompute=on", llama, lens, seed=5, recompute=True)
if not all(np.array_equal(x, y) for x, y in zip(base, other)):
    failures.append("recompute not bit-identical")
    print("  recompute: results differ from the plain run")
long_lens = [150, 90, 60]  # large enough that the matrix products are split over threads
lib.mrl_parallel_set_threads(2)
two = run_case("llama 300 tokens, 2 threads", llama, long_lens, seed=6)
lib.mrl_parallel_set_threads(1)
one = run_case("llama 300 tokens, 1 thread", llama, long_lens, seed=6)
lib.mrl_parallel_set_threads(0)
if not all(np.array_equal(x, y) for x, y in zip(two, one)):
    failures.append("thread count changes results")
    print("  one thread: results differ from the default thread count")
other = run_case("llama head chunk 5 tokens", llama, lens, seed=5, head_chunk=5)
if max(rel(x, y) for x, y in zip(base, other)) > 1e-6:
    failures.append("head chunking changes results")
# bf16 (fp32 master weights, bf16 products with fp32 sums) against the same float64 reference
run_case("bf16: llama GQA untied + value head", llama, lens, value_head=True, dtype="bf16")
run_case("bf16: llama 300 tokens, head chunk 64", llama, long_lens, seed=6, head_chunk=64, dtype="bf16")
run_case("bf16: qwen2 biases, tied", dict(llama, model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=48,
                                        num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True), lens,
         dtype="bf16")
run_case("bf16: qwen3 q/k norm", q3, lens, seed=2, dtype="bf16")



def run_shared_case(name, cfg, seed=7):
    """Shared prompts (mrl_batch.prefix): moonrl on the shared layout against the float64
    reference on every sequence packed whole (its prefix's tokens, then its own)."""
    rng = np.random.default_rng(seed)
    m = Moonrl(cfg)
    for n, off, shape, _ in m.views:
        size = int(np.prod(shape))
        m.params[off:off + size] = (1 + 0.2 * rng.standard_normal(size)) if "norm" in n else 0.08 * rng.standard_normal(size)
    P = {n: torch.tensor(m.tensor(m.params, n).astype(np.float64), requires_grad=True) for n, _, _, _ in m.views}
    # prefix A (6 rows) with children of 3, 1 and 9 rows; a lone sequence of 5; prefix B (4) with a child of 2
    lens, prefix = [6, 3, 1, 9, 5, 4, 2], np.array([-1, 0, 0, 0, -1, -1, 5], np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    tokens = rng.integers(0, cfg["vocab_size"], cu[-1]).astype(np.int32)
    targets = np.full(cu[-1], -1, np.int32)
    for s in range(len(lens)):
        targets[cu[s]:cu[s + 1] - 1] = tokens[cu[s] + 1:cu[s + 1]]
    T = cu[-1]
    a, b = rng.standard_normal(T).astype(np.float32), rng.standard_normal(T).astype(np.float32)
    lp, ent, _ = m.forward(tokens, targets, cu, 1.0, False, prefix)
    lib.mrl_model_zero_grad(m.h)
    m.backward(a, b, None)
    # whole: each child carries a copy of its prefix's rows (no target, weight 0)
    rows, copy = [], []
    for s in range(len(lens)):
        if prefix[s] >= 0:
            rows += range(cu[prefix[s]], cu[prefix[s] + 1])
            copy += [True] * lens[prefix[s]]
        rows += range(cu[s], cu[s + 1])
        copy += [False] * lens[s]
    wlens = [lens[s] + (lens[prefix[s]] if prefix[s] >= 0 else 0) for s in range(len(lens))]
    wcu = np.concatenate([[0], np.cumsum(wlens)]).astype(np.int32)
    rows, copy = np.array(rows), np.array(copy)
    wtargets = np.where(copy, -1, targets[rows]).astype(np.int32)
    rlp, rent, _ = reference(cfg, P, tokens[rows], wtargets, wcu, 1.0, False)
    own = ~copy
    wa, wb = np.where(copy, 0, a[rows]), np.where(copy, 0, b[rows])
    loss = (torch.tensor(wa) * rlp).sum() + (torch.tensor(wb) * rent).sum()
    loss.backward()
    errs = {"logprob": rel(lp[rows[own]], rlp.detach().numpy()[own]), "entropy": rel(ent[rows[own]], rent.detach().numpy()[own])}
    worst_grad = max(rel(m.tensor(m.grads, n), P[n].grad.numpy()) for n, _, _, _ in m.views)
    ok = errs["logprob"] < 1e-5 and errs["entropy"] < 1e-5 and worst_grad <= 1e-4
    print("%-40s T=%3d (whole %3d)  logprob %.1e  entropy %.1e  grad %.1e  %s" % (
        name, T, wcu[-1], errs["logprob"], errs["entropy"], worst_grad, "ok" if ok else "FAIL"))
    if not ok:
        failures.append(name)
    lib.mrl_model_free(m.h)


run_shared_case("llama shared prompts (prefix)", llama)
run_shared_case("qwen2 shared prompts, GQA 6/2", dict(llama, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                                                     hidden_size=48, num_attention_heads=6, num_key_value_heads=2), seed=8)
run_shared_case("deepseek_v3 MLA shared prompts", ds, seed=9)

if failures:
    print("FAILED:", ", ".join(failures))
    sys.exit(1)
print("all model reference checks passed")
