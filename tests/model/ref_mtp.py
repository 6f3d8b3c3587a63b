#!/usr/bin/env python3
"""Training DeepSeek-V3's multi-token prediction layer (mrl_model_set_mtp_loss) against a float64
PyTorch reference written here: the main model (torch_ref.py, torch_ref_moe.py), then for each
token t of a sequence the MTP layer on [enorm(embed_mtp[token t+1]), hnorm(final normed hidden
of t)] (no embedding at position 0 or past the end), its own decoder layer, shared_head's norm
and head, and its log-prob of token t+2. For the loss
    L = sum_t a_t logprob_t + b_t entropy_t + w sum_t a_{t+1} mtp_logprob_t
(a_{t+1}: the main loss's weight of the next position) every parameter's gradient, the MTP
layer's included, within 1e-4 relative, and the MTP loss (mean -mtp_logprob) within 1e-5; a
dense and a mixture-of-experts model, fp32; bf16 within bf16's error of fp32. The gradients
with weight 0 are the plain model's, bit for bit, and its MTP weights' are 0.

usage: ref_mtp.py path/to/libmoonrl.so"""
import os
import sys

import numpy as np
import torch

torch.set_default_dtype(torch.float64)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moonrl_ctypes  # noqa: E402
from moonrl_ctypes import Moonrl, batch, randomize, rel  # noqa: E402
from torch_ref import dense_mlp, mla_attention, rmsnorm  # noqa: E402
from torch_ref_moe import deepseek_block, forward_seq, is_sparse  # noqa: E402

lib = moonrl_ctypes.load(sys.argv[1])
failures = []


def mtp_logprobs(cfg, P, tok, h):
    """The MTP layer's log-probs of token t+2 for each t of one sequence (0 where there is none)."""
    L, D, l = len(tok), cfg["hidden_size"], cfg["num_hidden_layers"]
    eps = cfg.get("rms_norm_eps", 1e-6)
    p = lambda n: P["model.layers.%d.%s" % (l, n)]
    nxt = torch.cat([tok[1:], torch.zeros(1, dtype=torch.int64)])
    keep = torch.tensor([0.0 if t == 0 or t + 2 >= L else 1.0 for t in range(L)])[:, None]
    e = p("embed_tokens.weight")[nxt] * keep
    x = torch.cat([rmsnorm(e, p("enorm.weight"), eps), rmsnorm(h, p("hnorm.weight"), eps)], -1) @ p("eh_proj.weight").T
    x = x + mla_attention(cfg, P, l, rmsnorm(x, p("input_layernorm.weight"), eps), L)
    hh = rmsnorm(x, p("post_attention_layernorm.weight"), eps)
    x = x + (deepseek_block(cfg, p, hh)[0] if is_sparse(cfg, l) else dense_mlp(l, p, hh))
    logp = torch.log_softmax(rmsnorm(x, p("shared_head.norm.weight"), eps) @ p("shared_head.head.weight").T, -1)
    tgt = torch.cat([tok[2:], torch.zeros(2, dtype=torch.int64)])[:L]
    has = torch.arange(L) + 2 < L  # (position 0 too: its input embedding is masked, its target is not)
    return torch.where(has, logp.gather(1, tgt[:, None])[:, 0], torch.zeros(L))


def reference(cfg, P, tokens, targets, cu):
    lm = P["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else P["lm_head.weight"]
    lps, ents, mlps = [], [], []
    for s in range(len(cu) - 1):
        tok = torch.tensor(tokens[cu[s]:cu[s + 1]].astype(np.int64))
        h = forward_seq(cfg, P, tok, [])
        logp = torch.log_softmax(h @ lm.T, -1)
        tg = torch.tensor(targets[cu[s]:cu[s + 1]].astype(np.int64))
        lps.append(torch.where(tg >= 0, logp.gather(1, tg.clamp(min=0)[:, None])[:, 0], torch.zeros(len(tok))))
        ents.append(-(logp.exp() * logp).sum(-1))
        mlps.append(mtp_logprobs(cfg, P, tok, h))
    return torch.cat(lps), torch.cat(ents), torch.cat(mlps)


def case(name, cfg, lens, weight=0.3, seed=0, dtype="fp32"):
    rng = np.random.default_rng(seed)
    m = Moonrl(cfg)
    if dtype == "bf16":
        moonrl_ctypes.check(lib.mrl_model_set_dtype(m.h, 1))
    randomize(m, rng)
    moonrl_ctypes.check(lib.mrl_model_set_mtp_loss(m.h, moonrl_ctypes.C.c_double(weight)))
    P = {n: torch.tensor(m.tensor(m.params, n).astype(np.float64), requires_grad=True) for n, _, _, _ in m.views}
    tokens, targets, cu = batch(cfg, lens, rng)
    T = cu[-1]
    a, b = rng.standard_normal(T).astype(np.float32), rng.standard_normal(T).astype(np.float32)
    lp, ent, _ = m.forward(tokens, targets, cu)
    got_loss = lib.mrl_model_mtp_loss(m.h)  # (the forward's: every next-but-one token)
    lib.mrl_model_zero_grad(m.h)
    m.backward(a, b, None)
    rlp, rent, rmlp = reference(cfg, P, tokens, targets, cu)
    a_next = torch.tensor(np.concatenate([a[1:], [0]]).astype(np.float64))
    loss = (torch.tensor(a, dtype=torch.float64) * rlp).sum() + (torch.tensor(b, dtype=torch.float64) * rent).sum() + \
        weight * (a_next * rmlp).sum()
    loss.backward()
    has = np.concatenate([np.arange(cu[s + 1] - cu[s]) + 2 < cu[s + 1] - cu[s] for s in range(len(cu) - 1)])
    want_loss = -rmlp.detach().numpy()[has].mean()
    e_loss = abs(got_loss - want_loss) / abs(want_loss)
    worst, worst_name = 0.0, ""
    for n, _, _, _ in m.views:
        want = P[n].grad.numpy() if P[n].grad is not None else np.zeros(P[n].shape)
        e = rel(m.tensor(m.grads, n), want)
        if e > worst:
            worst, worst_name = e, n
    bound = dict(fp32=(1e-5, 1e-4), bf16=(2e-2, 1e-1))[dtype]
    ok = rel(lp, rlp.detach().numpy()) < bound[0] and e_loss < bound[0] and worst <= bound[1]
    print("%-48s T=%d  logprob %.1e  mtp loss %.4f (%.1e)  grad %.1e (%s)  %s" % (
        name, T, rel(lp, rlp.detach().numpy()), got_loss, e_loss, worst, worst_name, "ok" if ok else "FAIL"))
    if not ok:
        failures.append(name)
    g = m.grads.copy()
    lib.mrl_model_free(m.h)
    return g


ds = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=61, hidden_size=48,
          intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
          kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=8, rms_norm_eps=1e-6,
          tie_word_embeddings=False, first_k_dense_replace=3, n_routed_experts=4, num_nextn_predict_layers=1)
lens = [7, 1, 12, 20]
case("MTP layer, dense", ds, lens)
moe = dict(ds, first_k_dense_replace=1, n_routed_experts=8, num_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
           moe_intermediate_size=16, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)
case("MTP layer, mixture of experts (its layer sparse)", moe, lens, seed=1)
case("bf16: MTP layer, dense", ds, lens, seed=2, dtype="bf16")
# weight 0: the plain model's gradients bit for bit, none on the MTP weights
n_failed = len(failures)
m = Moonrl(ds)
randomize(m, np.random.default_rng(3))
tokens, targets, cu = batch(ds, lens, np.random.default_rng(4))
a = np.random.default_rng(5).standard_normal(cu[-1]).astype(np.float32)
m.forward(tokens, targets, cu)
lib.mrl_model_zero_grad(m.h)
m.backward(a, None, None)
g0 = m.grads.copy()
mtp_views = [(n, off, int(np.prod(s))) for n, off, s, _ in m.views if n.startswith("model.layers.2.")]
if any(np.any(g0[off:off + sz] != 0) for _, off, sz in mtp_views):
    failures.append("weight 0 leaves the MTP weights' gradients 0")
moonrl_ctypes.check(lib.mrl_model_set_mtp_loss(m.h, moonrl_ctypes.C.c_double(0.5)))
moonrl_ctypes.check(lib.mrl_model_set_mtp_loss(m.h, moonrl_ctypes.C.c_double(0.0)))
m.forward(tokens, targets, cu)
lib.mrl_model_zero_grad(m.h)
m.backward(a, None, None)
if not np.array_equal(g0, m.grads):
    failures.append("weight 0 again: the plain model's gradients")
print("weight 0: the plain model's gradients, none on the MTP weights  %s" % ("ok" if len(failures) == n_failed else "FAIL"))
lib.mrl_model_free(m.h)
if failures:
    print("FAILED:", ", ".join(failures))
    sys.exit(1)
print("all MTP training checks passed")
