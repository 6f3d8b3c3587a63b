"""A small PyTorch implementation of the architectures moonrl runs (Llama, Qwen2,
Qwen3), float64 by the caller's default dtype: the reference of model_ref.py and
ref_gguf_model.py. P maps Hugging Face parameter names to tensors."""
import math

import numpy as np
import torch


# ---- the PyTorch reference -------------------------------------------------------

def inv_freq_of(cfg, hd):
    """float32, as Transformers computes it (with 'llama3' rescaling)."""
    inv = 1.0 / (cfg.get("rope_theta", 10000.0) ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    rs = cfg.get("rope_scaling")
    if rs and rs.get("rope_type") == "llama3":
        old, lo, hi, f = rs["original_max_position_embeddings"], rs["low_freq_factor"], rs["high_freq_factor"], rs["factor"]
        wl = 2 * math.pi / inv
        out = torch.where(wl > old / lo, inv / f, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / f + smooth * out
        medium = ~(wl < old / hi) * ~(wl > old / lo)
        inv = torch.where(medium, smoothed, out)
    if rs and (rs.get("rope_type") or rs.get("type")) == "yarn":  # the YaRN paper's ramp between interpolation and extrapolation
        base, old = cfg.get("rope_theta", 10000.0), rs["original_max_position_embeddings"]
        f = rs.get("factor") or cfg["max_position_embeddings"] / old

        def dim_of(rot):  # the dimension whose frequency makes `rot` turns over the original context
            return hd * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = dim_of(rs.get("beta_fast") or 32), dim_of(rs.get("beta_slow") or 1)
        if rs.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, hd - 1)
        if lo == hi:
            hi += 0.001
        pos = base ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd)
        keep = 1 - torch.clamp((torch.arange(hd // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
        inv = 1.0 / (f * pos) * (1 - keep) + 1.0 / pos * keep
    return inv.float()


def attention_factor_of(cfg):
    """What YaRN multiplies cos and sin by (1 otherwise): given, or 0.1 ln(factor) + 1 (DeepSeek's
    mscale / mscale_all_dim ratio when both are given)."""
    rs = cfg.get("rope_scaling")
    if not rs or (rs.get("rope_type") or rs.get("type")) != "yarn":  # (old configs: "type")
        return 1.0
    if rs.get("attention_factor"):
        return rs["attention_factor"]
    f = rs.get("factor") or cfg["max_position_embeddings"] / rs["original_max_position_embeddings"]

    def m(scale, ms):
        return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0
    if rs.get("mscale") and rs.get("mscale_all_dim"):
        return m(f, rs["mscale"]) / m(f, rs["mscale_all_dim"])
    return m(f, 1.0)


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, inv_freq, L, af=1.0):  # x [L, H, hd], rotate_half convention; af: YaRN's factor on cos and sin
    ang = (torch.arange(L, dtype=torch.int64).float()[:, None] * inv_freq[None, :]).double()
    emb = torch.cat([ang, ang], -1)[:, None, :]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * (emb.cos() * af) + rot * (emb.sin() * af)


def linear(P, l, name, x):
    """x @ W^T of layer l's matrix `name` ("self_attn.q_proj"), or P["__linear__"](l, name, x) where the
    caller computes it (ref_lora.py: LoRA with dropout, which no merged weight expresses)."""
    if "__linear__" in P:
        return P["__linear__"](l, name, x)
    return x @ P["model.layers.%d.%s.weight" % (l, name)].T


def dense_mlp(l, p, h, P=None):
    """The SwiGLU MLP of layer l (p: its parameters by name) on h [L, D]."""
    if P is not None and "__linear__" in P:
        g, u = linear(P, l, "mlp.gate_proj", h), linear(P, l, "mlp.up_proj", h)
        return linear(P, l, "mlp.down_proj", torch.nn.functional.silu(g) * u)
    return (torch.nn.functional.silu(h @ p("mlp.gate_proj.weight").T) * (h @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T


def mla_scale(cfg):
    """DeepSeek-V3's attention scale: (dn + dr)^-1/2, times yarn's mscale(factor, mscale_all_dim)^2."""
    s = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    rs = cfg.get("rope_scaling")
    if rs and (rs.get("rope_type") or rs.get("type")) == "yarn" and rs.get("mscale_all_dim"):
        f = rs.get("factor") or cfg["max_position_embeddings"] / rs["original_max_position_embeddings"]
        m = 0.1 * rs["mscale_all_dim"] * math.log(f) + 1.0 if f > 1 else 1.0
        s = s * m * m
    return s


def mla_attention(cfg, P, l, h, L):
    """Multi-head latent attention (DeepSeek-V2/V3) of layer l on h [L, D], written from the paper's equations:
    low-rank queries (q_lora_rank) or q_proj, the latent and the decoupled rope key from kv_a_proj_with_mqa,
    kv_b_proj's per-head keys and values; RoPE on the rope parts (pairs (2i, 2i+1) when rope_interleave)."""
    p = lambda n: P["model.layers.%d.%s" % (l, n)]
    H, dn, dr, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    rkv, eps = cfg["kv_lora_rank"], cfg.get("rms_norm_eps", 1e-6)
    if cfg.get("q_lora_rank"):
        q = rmsnorm(linear(P, l, "self_attn.q_a_proj", h), p("self_attn.q_a_layernorm.weight"), eps)
        q = linear(P, l, "self_attn.q_b_proj", q)
    else:
        q = linear(P, l, "self_attn.q_proj", h)
    q = q.view(L, H, dn + dr)
    ckv = linear(P, l, "self_attn.kv_a_proj_with_mqa", h)
    c, kr = ckv[:, :rkv], ckv[:, rkv:]
    kv = linear(P, l, "self_attn.kv_b_proj", rmsnorm(c, p("self_attn.kv_a_layernorm.weight"), eps)).view(L, H, dn + dv)
    inv, af = inv_freq_of(cfg, dr), attention_factor_of(cfg)
    qr, kr = q[..., dn:], kr.view(L, 1, dr)
    if cfg.get("rope_interleave", True):  # the pairs (2i, 2i+1): put them at (i, i + dr/2), then rotate_half
        qr = torch.cat([qr[..., 0::2], qr[..., 1::2]], -1)
        kr = torch.cat([kr[..., 0::2], kr[..., 1::2]], -1)
    qr, kr = rope(qr, inv, L, af), rope(kr, inv, L, af)
    q = torch.cat([q[..., :dn], qr], -1)
    k = torch.cat([kv[..., :dn], kr.expand(L, H, dr)], -1)
    v = kv[..., dn:]
    sc = torch.einsum("ihe,jhe->hij", q, k) * mla_scale(cfg)
    sc = sc.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    att = torch.einsum("hij,jhe->ihe", sc.softmax(-1), v).reshape(L, H * dv)
    return linear(P, l, "self_attn.o_proj", att)


def final_hidden(cfg, P, tok, mlp=dense_mlp):
    """The final normed hidden states [L, D] of one sequence (tok: int64 tensor [L]); mlp(l, p, h): layer l's
    MLP on h (p: the layer's parameters by name), the dense one unless told (torch_ref_moe.py: experts)."""
    D, Hq = cfg["hidden_size"], cfg["num_attention_heads"]
    Hk = cfg.get("num_key_value_heads", Hq)
    hd = cfg.get("head_dim") or D // Hq
    eps = cfg.get("rms_norm_eps", 1e-6)
    qwen2, qwen3 = cfg["model_type"] == "qwen2", cfg["model_type"] in ("qwen3", "qwen3_moe")
    inv, af = inv_freq_of(cfg, hd), attention_factor_of(cfg)
    L = len(tok)
    x = P["model.embed_tokens.weight"][tok]
    for l in range(cfg["num_hidden_layers"]):
        p = lambda n: P["model.layers.%d.%s" % (l, n)]
        h = rmsnorm(x, p("input_layernorm.weight"), eps)
        if cfg["model_type"] == "deepseek_v3":
            x = x + mla_attention(cfg, P, l, h, L)
            h = rmsnorm(x, p("post_attention_layernorm.weight"), eps)
            x = x + (mlp(l, p, h, P) if mlp is dense_mlp else mlp(l, p, h))
            continue
        q, k, v = (linear(P, l, "self_attn.q_proj", h), linear(P, l, "self_attn.k_proj", h),
                   linear(P, l, "self_attn.v_proj", h))
        if qwen2:
            q, k, v = q + p("self_attn.q_proj.bias"), k + p("self_attn.k_proj.bias"), v + p("self_attn.v_proj.bias")
        q, k, v = q.view(L, Hq, hd), k.view(L, Hk, hd), v.view(L, Hk, hd)
        if qwen3:
            q, k = rmsnorm(q, p("self_attn.q_norm.weight"), eps), rmsnorm(k, p("self_attn.k_norm.weight"), eps)
        q, k = rope(q, inv, L, af), rope(k, inv, L, af)
        k, v = k.repeat_interleave(Hq // Hk, 1), v.repeat_interleave(Hq // Hk, 1)
        sc = torch.einsum("ihe,jhe->hij", q, k) / math.sqrt(hd)
        sc = sc.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
        att = torch.einsum("hij,jhe->ihe", sc.softmax(-1), v).reshape(L, Hq * hd)
        x = x + linear(P, l, "self_attn.o_proj", att)
        h = rmsnorm(x, p("post_attention_layernorm.weight"), eps)
        x = x + (mlp(l, p, h, P) if mlp is dense_mlp else mlp(l, p, h))
    return rmsnorm(x, P["model.norm.weight"], eps)


def head_weight(cfg, P):
    return P["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else P["lm_head.weight"]


def last_logprobs(cfg, P, tokens):
    """Log-probs over the vocabulary after the sequence `tokens` (its last position)."""
    h = final_hidden(cfg, P, torch.tensor(np.asarray(tokens).astype(np.int64)))
    return torch.log_softmax(h[-1] @ head_weight(cfg, P).T, -1)


def reference(cfg, P, tokens, targets, cu, temperature, value_head):
    lm = head_weight(cfg, P)
    lps, ents, vals = [], [], []
    for s in range(len(cu) - 1):
        tok = torch.tensor(tokens[cu[s]:cu[s + 1]].astype(np.int64))
        L = len(tok)
        h = final_hidden(cfg, P, tok)
        logp = torch.log_softmax(h @ lm.T / temperature, -1)
        tg = torch.tensor(targets[cu[s]:cu[s + 1]].astype(np.int64))
        lps.append(torch.where(tg >= 0, logp.gather(1, tg.clamp(min=0)[:, None])[:, 0], torch.zeros(L)))
        ents.append(-(logp.exp() * logp).sum(-1))
        if value_head:
            vals.append((h @ P["score.weight"].T)[:, 0])
    return torch.cat(lps), torch.cat(ents), torch.cat(vals) if value_head else None
