"""A float64 PyTorch Qwen3-MoE (model_type qwen3_moe) written after Transformers'
modeling_qwen3_moe (Transformers itself is not needed): the reference of
ref_moe.py and ref_gguf_moe.py. P maps Hugging Face parameter names to tensors."""
import math

import numpy as np
import torch

from torch_ref import inv_freq_of, rmsnorm, rope


def is_sparse(cfg, l):
    """Transformers' Qwen3MoeDecoderLayer: experts unless l is in mlp_only_layers."""
    return (l not in cfg.get("mlp_only_layers", [])) and cfg["num_experts"] > 0 and \
        (l + 1) % cfg.get("decoder_sparse_step", 1) == 0


def moe_block(cfg, p, h):
    """Qwen3MoeSparseMoeBlock on h [L, D]: (output, router logits)."""
    E, K = cfg["num_experts"], cfg["num_experts_per_tok"]
    logits = h @ p("mlp.gate.weight").T
    probs = torch.softmax(logits, -1)
    w, sel = torch.topk(probs, K, dim=-1)
    if cfg.get("norm_topk_prob"):
        w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    for e in range(E):
        tok, j = torch.where(sel == e)
        if len(tok) == 0:
            continue
        x = h[tok]
        pe = lambda n: p("mlp.experts.%d.%s.weight" % (e, n))
        y = (torch.nn.functional.silu(x @ pe("gate_proj").T) * (x @ pe("up_proj").T)) @ pe("down_proj").T
        out = out.index_add(0, tok, y * w[tok, j, None])
    return out, logits


def forward_seq(cfg, P, tok, router_logits):
    Hq, Hk, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    inv = inv_freq_of(cfg, hd)
    L = len(tok)
    x = P["model.embed_tokens.weight"][tok]
    for l in range(cfg["num_hidden_layers"]):
        p = lambda n: P["model.layers.%d.%s" % (l, n)]
        h = rmsnorm(x, p("input_layernorm.weight"), eps)
        q, k, v = h @ p("self_attn.q_proj.weight").T, h @ p("self_attn.k_proj.weight").T, h @ p("self_attn.v_proj.weight").T
        q, k, v = q.view(L, Hq, hd), k.view(L, Hk, hd), v.view(L, Hk, hd)
        q, k = rmsnorm(q, p("self_attn.q_norm.weight"), eps), rmsnorm(k, p("self_attn.k_norm.weight"), eps)
        q, k = rope(q, inv, L), rope(k, inv, L)
        k, v = k.repeat_interleave(Hq // Hk, 1), v.repeat_interleave(Hq // Hk, 1)
        sc = torch.einsum("ihe,jhe->hij", q, k) / math.sqrt(hd)
        sc = sc.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
        att = torch.einsum("hij,jhe->ihe", sc.softmax(-1), v).reshape(L, Hq * hd)
        x = x + att @ p("self_attn.o_proj.weight").T
        h = rmsnorm(x, p("post_attention_layernorm.weight"), eps)
        if is_sparse(cfg, l):
            y, logits = moe_block(cfg, p, h)
            router_logits.append(logits)
            x = x + y
        else:
            x = x + (torch.nn.functional.silu(h @ p("mlp.gate_proj.weight").T) * (h @ p("mlp.up_proj.weight").T)) @ \
                p("mlp.down_proj.weight").T
    return rmsnorm(x, P["model.norm.weight"], eps)


def load_balancing_loss(cfg, router_logits):
    """Transformers' load_balancing_loss_func with attention_mask None."""
    E, K = cfg["num_experts"], cfg["num_experts_per_tok"]
    g = torch.cat(router_logits, 0)
    rw = torch.softmax(g, -1)
    _, sel = torch.topk(rw, K, dim=-1)
    mask = torch.nn.functional.one_hot(sel, E).double()
    tokens_per_expert = mask.mean(0)
    prob_per_expert = rw.mean(0)
    return (tokens_per_expert * prob_per_expert[None]).sum() * E


def reference(cfg, P, tokens, targets, cu, temperature=1.0):
    lm = P["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else P["lm_head.weight"]
    lps, ents, logits = [], [], []
    for s in range(len(cu) - 1):
        tok = torch.tensor(tokens[cu[s]:cu[s + 1]].astype(np.int64))
        h = forward_seq(cfg, P, tok, logits)
        logp = torch.log_softmax(h @ lm.T / temperature, -1)
        tg = torch.tensor(targets[cu[s]:cu[s + 1]].astype(np.int64))
        lps.append(torch.where(tg >= 0, logp.gather(1, tg.clamp(min=0)[:, None])[:, 0], torch.zeros(len(tok))))
        ents.append(-(logp.exp() * logp).sum(-1))
    aux = load_balancing_loss(cfg, logits) if logits else torch.zeros(())
    return torch.cat(lps), torch.cat(ents), aux
