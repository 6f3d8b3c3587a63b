#!/usr/bin/env python3
"""LoRA adapters (mrl_model_set_lora) against a float64 PyTorch reference: the reference computes
each adapted projection with the merged weight W + (alpha / r) B A (PyTorch forms it; moonrl never
does), so the comparison checks the unmerged forward and backward against LoRA's definition.
Random base weights, random A and non-zero random B (so the adapters matter), a packed batch:

  - log-probs and entropy (relative < 1e-5), the gradient of every A and B (relative < 1e-4) for
    L = sum_t a_t logprob_t + b_t entropy_t, on Llama, Qwen2 (biases; q and v only), Qwen3 and
    Qwen3-MoE (the experts' adapters; the router frozen); bf16 within bf16's bounds;
  - the base is frozen: no gradient buffer (mrl_model_grads fails naming LoRA), its weights unchanged;
  - the init (B = 0) gives the base model's log-probs bit for bit; adapters off likewise;
  - recomputation bit-identical; a second backward accumulates;
  - dropout: a training forward's log-probs and every adapter gradient against a reference that
    computes each adapted product unmerged with the masks lora.c draws (its hash, replayed here);
    new masks each training forward, none outside them.

usage: ref_lora.py path/to/libmoonrl.so
"""
import ctypes as C
import os
import sys

import numpy as np
import torch

torch.set_default_dtype(torch.float64)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moonrl_ctypes  # noqa: E402
from moonrl_ctypes import Moonrl, batch, check, randomize, rel  # noqa: E402
import torch_ref  # noqa: E402
import torch_ref_moe  # noqa: E402

lib = moonrl_ctypes.load(sys.argv[1])
api = moonrl_ctypes.api
failures = []
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BOUNDS = {"fp32": dict(logprob=1e-5, entropy=1e-5, grad=1e-4), "bf16": dict(logprob=1e-2, entropy=1e-2, grad=1e-1)}


def set_lora(m, rank, alpha, targets, seed=7, dropout=0.0):
    bits = sum(1 << MODULES.index(t) for t in targets)
    cfg = api.mrl_lora_config(rank, alpha, bits, seed, dropout)
    check(lib.mrl_model_set_lora(m.h, C.byref(cfg)))
    m.lparams, m.lgrads, m.lviews = moonrl_ctypes.lora(m.h)
    m.grads = None  # (the base's gradient buffer is gone)


def run_case(name, cfg, lens, rank, alpha, targets, dtype="fp32", recompute=False, seed=0):
    rng = np.random.default_rng(seed)
    m = Moonrl(cfg)
    randomize(m, rng)
    if dtype == "bf16":
        check(lib.mrl_model_set_dtype(m.h, 1))
    lib.mrl_model_set_recompute(m.h, int(recompute))
    tokens, targets_, cu = batch(cfg, lens, rng)
    base_lp, base_ent, _ = m.forward(tokens, targets_, cu)
    set_lora(m, rank, alpha, targets)
    init_lp, init_ent, _ = m.forward(tokens, targets_, cu)
    if not (np.array_equal(init_lp, base_lp) and np.array_equal(init_ent, base_ent)):
        failures.append(name + " (init B = 0 is not the base)")
        print("  the adapters' init changes the model")
    # random A and non-zero B
    for n, off, shape, _ in m.lviews:
        size = shape[0] * shape[1]
        m.lparams[off:off + size] = (0.3 if ".lora_A." in n else 0.2) * rng.standard_normal(size)
    lib.mrl_model_lora_changed(m.h)
    before = m.params.copy()
    s = alpha / rank
    # the reference: every adapted weight merged, A and B the leaves
    P = {n: torch.tensor(m.tensor(m.params, n).astype(np.float64)) for n, _, _, _ in m.views}
    L = {}
    for n, off, shape, _ in m.lviews:
        L[n] = torch.tensor(m.lparams[off:off + shape[0] * shape[1]].reshape(shape).astype(np.float64),
                            requires_grad=True)
    for n in list(L):
        if ".lora_A." in n:
            base_name = n.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
            P[base_name] = P[base_name] + s * L[n.replace(".lora_A.", ".lora_B.")] @ L[n]
    lp, ent, _ = m.forward(tokens, targets_, cu)
    if cfg["model_type"] == "qwen3_moe":
        rlp, rent, _ = torch_ref_moe.reference(cfg, P, tokens, targets_, cu, 1.0)
    else:
        rlp, rent, _ = torch_ref.reference(cfg, P, tokens, targets_, cu, 1.0, False)
    errs = {"logprob": rel(lp, rlp.detach()), "entropy": rel(ent, rent.detach())}
    T = cu[-1]
    a, b = rng.standard_normal(T).astype(np.float32), rng.standard_normal(T).astype(np.float32)
    lib.mrl_model_zero_grad(m.h)
    m.backward(a, b, None)
    loss = (torch.tensor(a, dtype=torch.float64) * rlp).sum() + (torch.tensor(b, dtype=torch.float64) * rent).sum()
    loss.backward()
    worst, worst_name = 0.0, ""
    for n, off, shape, _ in m.lviews:
        e = rel(m.lgrads[off:off + shape[0] * shape[1]].reshape(shape), L[n].grad.numpy())
        if e > worst:
            worst, worst_name = e, n
    errs["grad"] = worst
    bound = BOUNDS[dtype]
    ok = all(errs[k] <= bound[k] for k in bound)
    print("%-44s T=%3d  %4d adapter tensors  logprob %.1e  entropy %.1e  grad %.1e (%s)  %s" % (
        name, T, len(m.lviews), errs["logprob"], errs["entropy"], worst, worst_name.replace("base_model.model.", ""),
        "ok" if ok else "FAIL"))
    if not ok:
        failures.append(name)
    g1 = m.lgrads.copy()
    m.backward(a, b, None)
    if rel(m.lgrads, 2 * g1) > 1e-6:
        failures.append(name + " (accumulation)")
        print("  gradient accumulation wrong")
    if not np.array_equal(before, m.params):
        failures.append(name + " (the base changed)")
    if lib.mrl_model_grads(m.h) or b"LoRA" not in lib.mrl_last_error():
        failures.append(name + " (the base has gradients)")
        print("  mrl_model_grads did not refuse:", lib.mrl_last_error())
    # adapters off: the base again, bit for bit
    lib.mrl_model_lora_enable(m.h, 0)
    off_lp, _, _ = m.forward(tokens, targets_, cu)
    lib.mrl_model_lora_enable(m.h, 1)
    if not np.array_equal(off_lp, base_lp):
        failures.append(name + " (adapters off is not the base)")
        print("  adapters off differ from the base")
    lib.mrl_model_free(m.h)
    return lp, g1


llama = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=64,
             intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
lens = [7, 1, 12, 20]
base = run_case("llama GQA, rank 4 alpha 8, all-linear", llama, lens, 4, 8.0, MODULES, seed=1)
other = run_case("llama recompute=on", llama, lens, 4, 8.0, MODULES, seed=1, recompute=True)
if not all(np.array_equal(x, y) for x, y in zip(base, other)):
    failures.append("recompute not bit-identical")
    print("  recompute: results differ from the plain run")
run_case("qwen2 biases tied, rank 1 alpha 32, q and v", dict(
    llama, model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=48, num_attention_heads=6,
    num_key_value_heads=2, tie_word_embeddings=True), lens, 1, 32.0, ["q_proj", "v_proj"], seed=2)
q3 = dict(llama, model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=48, head_dim=16,
          num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)
run_case("qwen3 q/k norm, rank 8 alpha 16, all-linear", q3, lens, 8, 16.0, MODULES, seed=3)
run_case("qwen3 rank 2, the MLP only", q3, lens, 2, 4.0, ["gate_proj", "up_proj", "down_proj"], seed=4)
moe = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=97, hidden_size=48,
           intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
           router_aux_loss_coef=0.01, output_router_logits=False)
run_case("qwen3_moe experts + a dense layer, rank 4", moe, lens, 4, 8.0, MODULES, seed=5)
run_case("bf16: llama rank 8, all-linear", llama, lens, 8, 16.0, MODULES, dtype="bf16", seed=6)

# ---- dropout: the masks as lora.c draws them (splitmix64's finaliser), the reference computing each
# adapted product unmerged with the same masks
M64 = (1 << 64) - 1


def mix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def drop_mask(forward_key, a_offset, T, K, p):
    key = mix64(forward_key ^ a_offset)
    cut = int(p * 9007199254740992.0)
    keep = [(mix64(key ^ i) >> 11) >= cut for i in range(T * K)]
    return torch.tensor(keep, dtype=torch.float64).reshape(T, K) / (1 - p)


def dropout_case(name, cfg, lens, rank, alpha, p, seed=8):
    rng = np.random.default_rng(seed)
    m = Moonrl(cfg)
    randomize(m, rng)
    tokens, targets_, cu = batch(cfg, lens, rng)
    set_lora(m, rank, alpha, MODULES, seed=11, dropout=p)
    for n, off, shape, _ in m.lviews:
        m.lparams[off:off + shape[0] * shape[1]] = 0.3 * rng.standard_normal(shape[0] * shape[1])
    eval_lp, _, _ = m.forward(tokens, targets_, cu)
    lib.mrl_model_set_training(m.h, 1, 5)
    lp, ent, _ = m.forward(tokens, targets_, cu)  # the first training forward since key 5
    fkey = mix64(11 ^ mix64(5 + 1))
    s = alpha / rank
    P = {n: torch.tensor(m.tensor(m.params, n).astype(np.float64)) for n, _, _, _ in m.views}
    L = {n: torch.tensor(m.lparams[off:off + sh[0] * sh[1]].reshape(sh).astype(np.float64), requires_grad=True)
         for n, off, sh, _ in m.lviews}
    offsets = {n: off for n, off, _, _ in m.lviews}
    T = int(cu[-1])
    masks, row0 = {}, [0]

    def lin(l, mod, x):
        a = "base_model.model.model.layers.%d.%s.lora_A.weight" % (l, mod)
        y = x @ P["model.layers.%d.%s.weight" % (l, mod)].T
        if a not in masks:  # [T, K] over the whole packed batch, as moonrl draws it
            masks[a] = drop_mask(fkey, offsets[a], T, x.shape[1], p)
        xd = x * masks[a][row0[0]:row0[0] + x.shape[0]]
        return y + s * (xd @ L[a].T) @ L[a.replace("lora_A", "lora_B")].T
    P["__linear__"] = lin
    lm = torch_ref.head_weight(cfg, P)
    rlps, rents = [], []
    for q in range(len(cu) - 1):
        row0[0] = int(cu[q])
        tok = torch.tensor(tokens[cu[q]:cu[q + 1]].astype(np.int64))
        h = torch_ref.final_hidden(cfg, P, tok)
        logp = torch.log_softmax(h @ lm.T, -1)
        tg = torch.tensor(targets_[cu[q]:cu[q + 1]].astype(np.int64))
        rlps.append(torch.where(tg >= 0, logp.gather(1, tg.clamp(min=0)[:, None])[:, 0], torch.zeros(len(tok))))
        rents.append(-(logp.exp() * logp).sum(-1))
    rlp, rent = torch.cat(rlps), torch.cat(rents)
    a_, b_ = rng.standard_normal(T).astype(np.float32), rng.standard_normal(T).astype(np.float32)
    lib.mrl_model_zero_grad(m.h)
    m.backward(a_, b_, None)
    ((torch.tensor(a_, dtype=torch.float64) * rlp).sum() + (torch.tensor(b_, dtype=torch.float64) * rent).sum()).backward()
    worst = max(rel(m.lgrads[off:off + sh[0] * sh[1]].reshape(sh), L[n].grad.numpy()) for n, off, sh, _ in m.lviews)
    errs = (rel(lp, rlp.detach()), rel(ent, rent.detach()), worst)
    differ = not np.array_equal(lp, eval_lp)
    lp2, _, _ = m.forward(tokens, targets_, cu)  # a second training forward: new masks
    lib.mrl_model_set_training(m.h, 0, 0)
    lp3, _, _ = m.forward(tokens, targets_, cu)
    ok = errs[0] <= 1e-5 and errs[1] <= 1e-5 and errs[2] <= 1e-4 and differ and not np.array_equal(lp2, lp) and \
        np.array_equal(lp3, eval_lp)
    print("%-44s T=%3d  dropout %.1f  logprob %.1e  entropy %.1e  grad %.1e  masks new each training forward, "
          "none outside them  %s" % (name, T, p, errs[0], errs[1], errs[2], "ok" if ok else "FAIL"))
    if not ok:
        failures.append(name)
    lib.mrl_model_free(m.h)


dropout_case("llama rank 4, dropout 0.3 (training forwards)", llama, [7, 1, 12, 20], 4, 8.0, 0.3)

# bad configs are errors naming what is wrong
m = Moonrl(llama)
for cfg, want in [((0, 8.0, 127, 0.0), b"rank"), ((4, 0.0, 127, 0.0), b"alpha"), ((4, 8.0, 0, 0.0), b"targets"),
                  ((4, 8.0, 1 << 9, 0.0), b"targets"), ((4, 8.0, 127, 1.0), b"dropout")]:
    st = lib.mrl_model_set_lora(m.h, C.byref(api.mrl_lora_config(cfg[0], cfg[1], cfg[2], 0, cfg[3])))
    if st == 0 or want not in lib.mrl_last_error():
        failures.append("bad config %r" % (cfg,))
        print("  bad config %r: %s" % (cfg, lib.mrl_last_error()))
lib.mrl_model_free(m.h)

if failures:
    print("FAILED:", ", ".join(failures))
    sys.exit(1)
print("all LoRA reference checks passed")
