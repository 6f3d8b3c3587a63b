#!/usr/bin/env python3
"""Qwen3-MoE (model_type qwen3_moe) against a float64 PyTorch reference written
here after Transformers' modeling_qwen3_moe (Transformers is not needed):
qwen3 attention; in each sparse layer the router softmax over the experts in
float, torch.topk, the weights renormalised when norm_topk_prob, and the
weighted sum of the picked experts' SwiGLU MLPs (index_add_ per expert);
dense layers (mlp_only_layers, decoder_sparse_step) keep the dense MLP; the
load-balancing loss as load_balancing_loss_func (all sparse layers' router
logits concatenated, no attention mask).

On tiny random models, a packed batch of several sequences:
  - log-probs and entropy, relative error < 1e-5;
  - the gradient of every parameter (router and every expert included) for
    L = sum_t a_t logprob_t + b_t entropy_t (+ coef * aux), relative < 1e-4;
  - the aux loss value, with and without a coefficient in the backward;
  - recomputation bit-identical; the reference kernels;
  - finite differences of the router weights (moonrl's own loss, central
    differences in fp32 with a step that leaves the picks unchanged);
  - bf16: the same model in bf16 within bf16's error of fp32;
  - routing replay (mrl_batch.routing): replaying the model's own picks is
    bit-identical to no replay (log-probs, entropy, every gradient, with and
    without recomputation); forced picks different from the router's (some
    tokens and layers left to the router, -1) against the float64 reference
    given the same picks (log-probs, entropy, aux loss, every gradient) and
    finite differences of the router weights; bad routings are errors
    naming the token, layer and pick.

usage: ref_moe.py path/to/libmoonrl.so
"""
import ctypes as C
import os
import sys

import numpy as np
import torch

torch.set_default_dtype(torch.float64)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moonrl_ctypes  # noqa: E402
from moonrl_ctypes import Moonrl, batch, randomize, rel  # noqa: E402
from torch_ref_moe import is_sparse, reference  # noqa: E402

lib = moonrl_ctypes.load(sys.argv[1])

failures = []


def forced_routing(cfg, m, T, rng):
    """k distinct random experts per token and sparse layer (mostly not the router's picks); about
    a fifth of the tokens, and a tenth of the other (token, layer) pairs, left to the router (-1)."""
    nm, E, K = lib.mrl_model_num_moe_layers(m.h), cfg["num_experts"], cfg["num_experts_per_tok"]
    r = np.stack([rng.permutation(E)[:K] for _ in range(T * nm)]).reshape(T, nm, K).astype(np.int16)
    r[rng.random(T) < 0.2] = -1
    r[rng.random((T, nm)) < 0.1] = -1
    return r


def replay_stats(m):
    replayed, differ = C.c_int64(), C.c_int64()
    lib.mrl_model_routing_replay_stats(m.h, C.byref(replayed), C.byref(differ))
    return replayed.value, differ.value


def routing_of(m, cfg, T):
    """The experts the last forward used [T, sparse layers, k] (mrl_model_get_routing)."""
    out = np.zeros((T, lib.mrl_model_num_moe_layers(m.h), cfg["num_experts_per_tok"]), np.int16)
    moonrl_ctypes.check(lib.mrl_model_get_routing(m.h, out.ctypes.data_as(C.c_void_p), out.size))
    return out


def run_case(name, cfg, lens, coef=0.0, kernels=0, recompute=False, seed=0, temperature=1.0, forced=False):
    rng = np.random.default_rng(seed)
    m = Moonrl(cfg)
    lib.mrl_model_set_kernels(m.h, kernels)
    lib.mrl_model_set_recompute(m.h, int(recompute))
    if coef:
        lib.mrl_model_set_router_aux_coef(m.h, coef)
    randomize(m, rng)
    P = {n: torch.tensor(m.tensor(m.params, n).astype(np.float64), requires_grad=True) for n, _, _, _ in m.views}
    tokens, targets, cu = batch(cfg, lens, rng)
    routing = forced_routing(cfg, m, cu[-1], rng) if forced else None
    lp, ent, _ = m.forward(tokens, targets, cu, temperature, routing=routing)
    aux = lib.mrl_model_router_aux_loss(m.h)
    if forced:  # the replay counts: every pair not -1 replayed, most of them unlike the router's own picks
        replayed, differ = replay_stats(m)
        want = int((routing[:, :, 0] >= 0).sum())
        if replayed != want or not differ > want // 2 or not np.array_equal(routing_of(m, cfg, cu[-1])[routing >= 0],
                                                                            routing[routing >= 0]):
            failures.append(name + " (replay counts)")
            print("  replayed %d (want %d), differ %d" % (replayed, want, differ))
    rlp, rent, raux = reference(cfg, P, tokens, targets, cu, temperature, routing)
    errs = {"logprob": rel(lp, rlp.detach()), "entropy": rel(ent, rent.detach()),
            "aux": abs(aux - raux.item()) / max(abs(raux.item()), 1e-30)}
    T = cu[-1]
    a, b = rng.standard_normal(T).astype(np.float32), rng.standard_normal(T).astype(np.float32)
    lib.mrl_model_zero_grad(m.h)
    m.backward(a, b, None)
    loss = (torch.tensor(a, dtype=torch.float64) * rlp).sum() + (torch.tensor(b, dtype=torch.float64) * rent).sum()
    ref_coef = coef or (cfg["router_aux_loss_coef"] if cfg.get("output_router_logits") else 0.0)
    if ref_coef:
        loss = loss + ref_coef * raux
    loss.backward()
    worst, worst_name, router = 0.0, "", 0.0
    for n, _, _, _ in m.views:
        want = P[n].grad.numpy() if P[n].grad is not None else np.zeros(P[n].shape)  # an expert nobody picked
        e = rel(m.tensor(m.grads, n), want)
        if n.endswith("mlp.gate.weight"):
            router = max(router, e)
        if e > worst:
            worst, worst_name = e, n
    ok = errs["logprob"] < 1e-5 and errs["entropy"] < 1e-5 and errs["aux"] < 1e-5 and worst <= 1e-4
    print("%-44s T=%3d  logprob %.1e  entropy %.1e  aux %.1e (%.4f)  grad %.1e (%s)  router grad %.1e  %s" % (
        name, T, errs["logprob"], errs["entropy"], errs["aux"], aux, worst, worst_name, router, "ok" if ok else "FAIL"))
    if not ok:
        failures.append(name)
    g1 = m.grads.copy()
    out = (lp.copy(), ent.copy(), g1)
    return m, out, (tokens, targets, cu, a, b, routing)


def finite_differences(name, cfg, lens, coef, seed=11, forced=False):
    """moonrl's router gradient against central differences of moonrl's own loss (forced: under
    a replayed routing, the same picks at every evaluation)."""
    m, _, (tokens, targets, cu, a, b, routing) = run_case(name + " (analytic)", cfg, lens, coef=coef, seed=seed,
                                                          forced=forced)
    analytic = m.grads.copy()

    def loss():
        lp, ent, _ = m.forward(tokens, targets, cu, routing=routing)
        return float(np.dot(a.astype(np.float64), lp) + np.dot(b.astype(np.float64), ent)) + \
            coef * lib.mrl_model_router_aux_loss(m.h)

    worst, checked = 0.0, 0
    for n, off, shape, _ in m.views:
        if not n.endswith("mlp.gate.weight"):
            continue
        g = analytic[off:off + int(np.prod(shape))]
        for i in np.argsort(-np.abs(g))[:6]:  # the largest entries: a meaningful relative error
            h, x0 = 2e-3, m.params[off + i]
            m.params[off + i] = x0 + h
            up = loss()
            m.params[off + i] = x0 - h
            down = loss()
            m.params[off + i] = x0
            fd = (up - down) / (2 * h)
            worst = max(worst, abs(fd - g[i]) / max(abs(g[i]), 1e-3))
            checked += 1
    ok = worst < 2e-2
    print("%-44s %d router entries: max relative |fd - analytic| %.1e  %s" % (name, checked, worst, "ok" if ok else "FAIL"))
    if not ok:
        failures.append(name)
    lib.mrl_model_free(m.h)


def bf16_case(name, cfg, lens, seed=21):
    """The same model and batch in bf16: log-probs and gradients within bf16's error of fp32."""
    m, (lp32, ent32, g32), (tokens, targets, cu, a, b, _) = run_case(name + " (fp32)", cfg, lens, seed=seed)
    moonrl_ctypes.check(lib.mrl_model_set_dtype(m.h, 1))
    lp, ent, _ = m.forward(tokens, targets, cu)
    lib.mrl_model_zero_grad(m.h)
    m.backward(a, b, None)
    e_lp, e_g = rel(lp, lp32), rel(m.grads, g32)
    ok = e_lp < 2e-2 and e_g < 1e-1 and np.all(np.isfinite(m.grads))
    print("%-44s bf16 vs fp32: logprob %.1e  grad %.1e  %s" % (name, e_lp, e_g, "ok" if ok else "FAIL"))
    if not ok:
        failures.append(name)
    lib.mrl_model_free(m.h)


moe = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=97, hidden_size=48,
           intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
           router_aux_loss_coef=0.01, output_router_logits=False)
lens = [7, 1, 12, 20]
m, base, _ = run_case("qwen3_moe 8 experts top-2, renormalised", moe, lens)
lib.mrl_model_free(m.h)
m, other, _ = run_case("  the same, recomputing", moe, lens, recompute=True)
lib.mrl_model_free(m.h)
if not all(np.array_equal(x, y) for x, y in zip(base, other)):
    failures.append("recompute not bit-identical")
    print("  recompute: results differ from the plain run")
for name, cfg, kw in (
        ("top-3 of 6, not renormalised, tied", dict(moe, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                                                   tie_word_embeddings=True), dict(seed=1)),
        ("3 layers, mlp_only_layers [1]", dict(moe, num_hidden_layers=3, mlp_only_layers=[1]), dict(seed=2)),
        ("4 layers, decoder_sparse_step 2", dict(moe, num_hidden_layers=4, decoder_sparse_step=2), dict(seed=3)),
        ("aux loss coef 0.05 in the backward", moe, dict(seed=4, coef=0.05)),
        ("aux loss, not renormalised, top-1", dict(moe, num_experts_per_tok=1, norm_topk_prob=False),
         dict(seed=5, coef=0.3)),
        ("reference kernels, temperature 0.8", moe, dict(seed=6, kernels=1, temperature=0.8)),
        ("recompute, mixed dense + sparse", dict(moe, num_hidden_layers=3, mlp_only_layers=[0]),
         dict(seed=7, recompute=True))):
    m, _, _ = run_case(name, cfg, kw.pop("lens", lens), **kw)
    lib.mrl_model_free(m.h)
# a long batch: every expert gets many rows, products split over threads
m, _, _ = run_case("300 tokens, 16 experts top-4", dict(moe, num_experts=16, num_experts_per_tok=4), [150, 90, 60], seed=8)
lib.mrl_model_free(m.h)
# output_router_logits from the config turns the aux loss on with router_aux_loss_coef
m, _, _ = run_case("output_router_logits true (coef from config)", dict(moe, output_router_logits=True), lens, seed=9,
                   coef=0.0)
lib.mrl_model_free(m.h)
finite_differences("router finite differences", moe, [9, 14], coef=0.0)
finite_differences("router finite differences, aux coef 0.2", dict(moe, norm_topk_prob=False), [9, 14], coef=0.2)
bf16_case("bf16", moe, lens)


def replay_own(name, cfg, lens, seed, recompute=False):
    """Replaying the model's own routing (what mrl_model_get_routing says it used) gives the same
    bits as not replaying: log-probs, entropy and every gradient."""
    m, (lp, ent, g), (tokens, targets, cu, a, b, _) = run_case(name + " (own routing)", cfg, lens, seed=seed,
                                                              recompute=recompute)
    own = routing_of(m, cfg, cu[-1])
    lp2, ent2, _ = m.forward(tokens, targets, cu, routing=own)
    replayed, differ = replay_stats(m)
    lib.mrl_model_zero_grad(m.h)
    m.backward(a, b, None)
    same = np.array_equal(lp.view(np.uint32), lp2.view(np.uint32)) and \
        np.array_equal(ent.view(np.uint32), ent2.view(np.uint32)) and np.array_equal(g.view(np.uint32), m.grads.view(np.uint32))
    ok = same and replayed == own.shape[0] * own.shape[1] and differ == 0
    print("%-44s bit-identical %s, replayed %d (token, layer) pairs, %d differ  %s" % (
        name, same, replayed, differ, "ok" if ok else "FAIL"))
    if not ok:
        failures.append(name)
    lib.mrl_model_free(m.h)


def bad_routing(name, cfg, lens, seed=41):
    """Routings that cannot be replayed fail the forward with a message naming the entry."""
    rng = np.random.default_rng(seed)
    m = Moonrl(cfg)
    tokens, targets, cu = batch(cfg, lens, rng)
    T = cu[-1]
    good = forced_routing(cfg, m, T, rng)
    good[:, :, :] = np.arange(cfg["num_experts_per_tok"], dtype=np.int16)
    cases = []
    r = good.copy(); r[3, 1, 1] = r[3, 1, 0]; cases.append((r, "token 3, sparse layer 1 names expert 0 twice"))
    r = good.copy(); r[5, 0, 1] = cfg["num_experts"]; cases.append((r, "token 5, sparse layer 0, pick 1 is %d" % cfg["num_experts"]))
    r = good.copy(); r[2, 1, 0] = -1; cases.append((r, "token 2, sparse layer 1, pick 1 is 1"))
    ok = True
    for r, want in cases:
        b_ = moonrl_ctypes.Batch(tokens.ctypes.data_as(C.POINTER(C.c_int32)), targets.ctypes.data_as(C.POINTER(C.c_int32)),
                                 cu.ctypes.data_as(C.POINTER(C.c_int32)), T, len(cu) - 1, None,
                                 r.ctypes.data_as(C.POINTER(C.c_int16)))
        st = lib.mrl_model_forward(m.h, C.byref(b_), C.c_float(1.0), None, None, None)
        msg = lib.mrl_last_error().decode()
        if st == 0 or want not in msg:
            ok = False
            print("  expected an error with '%s', got status %d: %s" % (want, st, msg))
    try:
        m.forward(tokens, targets, cu, routing=good)
    except RuntimeError as e:
        ok = False
        print("  a good routing failed:", e)
    print("%-44s %d bad routings refused with their entry named  %s" % (name, len(cases), "ok" if ok else "FAIL"))
    if not ok:
        failures.append(name)
    lib.mrl_model_free(m.h)


replay_own("replay of the own routing", moe, lens, seed=51)
replay_own("replay of the own routing, recomputing", dict(moe, num_hidden_layers=3, mlp_only_layers=[1]), lens, seed=52,
           recompute=True)
for name, cfg, kw in (
        ("forced routing, top-2 of 8, renormalised", moe, dict(seed=53)),
        ("forced routing, top-3 of 6, not renormalised", dict(moe, num_experts=6, num_experts_per_tok=3,
                                                               norm_topk_prob=False), dict(seed=54)),
        ("forced routing, aux coef 0.1, mlp_only [1]", dict(moe, num_hidden_layers=3, mlp_only_layers=[1]),
         dict(seed=55, coef=0.1)),
        ("forced routing, recompute, reference kernels", moe, dict(seed=56, recompute=True, kernels=1))):
    m, _, _ = run_case(name, cfg, lens, forced=True, **kw)
    lib.mrl_model_free(m.h)
finite_differences("forced routing: router finite differences", moe, [9, 14], coef=0.0, seed=57, forced=True)
finite_differences("forced routing: router fd, aux coef 0.2", dict(moe, norm_topk_prob=False), [9, 14], coef=0.2,
                   seed=58, forced=True)
bad_routing("bad routings", moe, lens)


def save_load(name, cfg, lens, seed=31):
    """mrl_model_save_dir -> a Hugging Face directory (Qwen3MoeForCausalLM's names and config keys)
    -> mrl_model_load_dir: the same parameters bit for bit, the same log-probs."""
    import json
    import tempfile
    from safetensors.numpy import load_file
    rng = np.random.default_rng(seed)
    m = Moonrl(cfg)
    randomize(m, rng)
    tokens, targets, cu = batch(cfg, lens, rng)
    lp, _, _ = m.forward(tokens, targets, cu)
    with tempfile.TemporaryDirectory() as d:
        moonrl_ctypes.check(lib.mrl_model_save_dir(m.h, d.encode()))
        saved = json.load(open(os.path.join(d, "config.json")))
        keys = ("model_type", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits",
                "intermediate_size")
        same_cfg = all(saved.get(k) == cfg[k] for k in keys) and saved["architectures"] == ["Qwen3MoeForCausalLM"]
        st = load_file(os.path.join(d, "model.safetensors"))
        want = set()
        for l in range(cfg["num_hidden_layers"]):
            pre = "model.layers.%d." % l
            want |= {pre + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                       "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                       "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")}
            if is_sparse(cfg, l):
                want.add(pre + "mlp.gate.weight")
                want |= {pre + "mlp.experts.%d.%s.weight" % (e, w) for e in range(cfg["num_experts"])
                         for w in ("gate_proj", "up_proj", "down_proj")}
            else:
                want |= {pre + "mlp.%s.weight" % w for w in ("gate_proj", "up_proj", "down_proj")}
        want |= {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
        same_names = set(st) == want and st["model.layers.0.mlp.gate.weight"].shape == (cfg["num_experts"], cfg["hidden_size"])
        h = C.c_void_p()
        moonrl_ctypes.check(lib.mrl_model_load_dir(d.encode(), C.byref(h)))
    n = lib.mrl_model_num_params(h)
    back = np.ctypeslib.as_array(lib.mrl_model_params(h), (n,)).copy()
    same_params = n == len(m.params) and np.array_equal(back.view(np.uint32), m.params.view(np.uint32))
    lib.mrl_model_free(m.h)
    m.h = h
    lp2, _, _ = m.forward(tokens, targets, cu)
    ok = same_cfg and same_names and same_params and np.array_equal(lp, lp2)
    print("%-44s config %s, %d tensors named as Transformers, parameters bit-identical %s, log-probs equal %s  %s" % (
        name, same_cfg, len(st), same_params, np.array_equal(lp, lp2), "ok" if ok else "FAIL"))
    if not ok:
        failures.append(name)
    lib.mrl_model_free(h)


save_load("save -> load (HF directory)", dict(moe, num_hidden_layers=3, mlp_only_layers=[1], output_router_logits=True),
          lens)

# DeepSeek-V3's mixture of experts (torch_ref_moe.deepseek_block): MLA attention, a dense first layer, sigmoid
# scores with the choice bias, 8 experts in 4 groups (2 taken), top-3, the shared expert, the scaling factor
ds = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=97, hidden_size=48,
          intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
          kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=8, rms_norm_eps=1e-6,
          tie_word_embeddings=False, first_k_dense_replace=1, n_routed_experts=8, num_experts=8, num_experts_per_tok=3,
          n_group=4, topk_group=2, moe_intermediate_size=16, n_shared_experts=1, routed_scaling_factor=2.5,
          norm_topk_prob=True)
m, base, _ = run_case("deepseek_v3 8 experts in 4 groups, top-3, shared", ds, lens, seed=61)
lib.mrl_model_free(m.h)
m, other, _ = run_case("  the same, recomputing", ds, lens, seed=61, recompute=True)
lib.mrl_model_free(m.h)
if not all(np.array_equal(x, y) for x, y in zip(base, other)):
    failures.append("deepseek_v3 recompute not bit-identical")
for name, cfg, kw in (
        ("deepseek_v3 not renormalised, no shared, one group", dict(ds, norm_topk_prob=False, n_shared_experts=0, n_group=1,
                                                                    topk_group=1, routed_scaling_factor=1.0), dict(seed=62)),
        ("deepseek_v3 16 experts top-4, 2 shared, reference kernels", dict(ds, n_routed_experts=16, num_experts=16,
         num_experts_per_tok=4, n_shared_experts=2, first_k_dense_replace=0), dict(seed=63, kernels=1)),
        ("deepseek_v3 forced routing", ds, dict(seed=64, forced=True))):
    m, _, _ = run_case(name, cfg, lens, **kw)
    lib.mrl_model_free(m.h)
finite_differences("deepseek_v3 router finite differences", ds, [9, 14], coef=0.0, seed=65)
finite_differences("deepseek_v3 router fd, not renormalised", dict(ds, norm_topk_prob=False), [9, 14], coef=0.0, seed=66)
replay_own("deepseek_v3 replay of the own routing", ds, lens, seed=67)
bf16_case("deepseek_v3 bf16", ds, lens, seed=68)

if failures:
    print("FAILED:", ", ".join(failures))
    sys.exit(1)
print("all qwen3_moe and deepseek_v3 mixture-of-experts reference checks passed")
