"""A float64 PyTorch Qwen3-MoE (model_type qwen3_moe) written after Transformers'
modeling_qwen3_moe (Transformers itself is not needed): the reference of
ref_moe.py and ref_gguf_moe.py. P maps Hugging Face parameter names to tensors."""
import numpy as np
import torch

from torch_ref import dense_mlp, final_hidden


def is_sparse(cfg, l):
    """Transformers' Qwen3MoeDecoderLayer: experts unless l is in mlp_only_layers; DeepseekV3DecoderLayer: from
    first_k_dense_replace on."""
    if cfg["model_type"] == "deepseek_v3":
        return cfg.get("n_routed_experts", 0) > 0 and l >= cfg["first_k_dense_replace"]
    return (l not in cfg.get("mlp_only_layers", [])) and cfg["num_experts"] > 0 and \
        (l + 1) % cfg.get("decoder_sparse_step", 1) == 0


def deepseek_block(cfg, p, h, forced=None):
    """DeepseekV3MoE on h [L, D], written after Transformers' DeepseekV3TopkRouter (noaux_tc): sigmoid scores, the
    choice scores with e_score_correction_bias, n_group groups scored by their two best choices, the topk_group best
    groups, the top-k choices among their experts, weights = the scores there (/ their sum + 1e-20 when
    norm_topk_prob) * routed_scaling_factor; plus the shared experts. (output, router logits, picks); forced as
    moe_block's."""
    E, K, G, TG = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["n_group"], cfg["topk_group"]
    logits = h @ p("mlp.gate.weight").T
    scores = logits.sigmoid()
    choice = scores + p("mlp.gate.e_score_correction_bias")
    group = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
    gidx = torch.topk(group, k=TG, dim=-1)[1]
    gmask = torch.zeros_like(group).scatter_(1, gidx, 1)
    emask = gmask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
    sel = torch.topk(choice.detach().masked_fill(~emask.bool(), float("-inf")), K, dim=-1)[1]
    if forced is not None:
        f = torch.tensor(forced.astype(np.int64))
        sel = torch.where(f[:, :1] >= 0, f.clamp(min=0), sel)
    w = scores.gather(1, sel)
    if cfg.get("norm_topk_prob", True):
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * cfg.get("routed_scaling_factor", 1.0)
    out = experts_sum(p, h, sel, w, E)
    if cfg.get("n_shared_experts", 1):
        ps = lambda n: p("mlp.shared_experts.%s.weight" % n)
        out = out + (torch.nn.functional.silu(h @ ps("gate_proj").T) * (h @ ps("up_proj").T)) @ ps("down_proj").T
    return out, logits, sel


def experts_sum(p, h, sel, w, E):
    """The picked experts' SwiGLU MLPs of h [L, D], weighted by w [L, k] at sel [L, k], summed (index_add_ per
    expert, as Transformers)."""
    out = torch.zeros_like(h)
    for e in range(E):
        tok, j = torch.where(sel == e)
        if len(tok) == 0:
            continue
        x = h[tok]
        pe = lambda n: p("mlp.experts.%d.%s.weight" % (e, n))
        y = (torch.nn.functional.silu(x @ pe("gate_proj").T) * (x @ pe("up_proj").T)) @ pe("down_proj").T
        out = out.index_add(0, tok, y * w[tok, j, None])
    return out


def moe_block(cfg, p, h, forced=None):
    """Qwen3MoeSparseMoeBlock on h [L, D]: (output, router logits, the picks used). forced [L, k]
    (routing replay, mrl_batch.routing): the rows not -1 replace torch.topk's picks; their weights
    are the router's own probabilities at the forced experts."""
    E, K = cfg["num_experts"], cfg["num_experts_per_tok"]
    logits = h @ p("mlp.gate.weight").T
    probs = torch.softmax(logits, -1)
    w, sel = torch.topk(probs, K, dim=-1)
    if forced is not None:
        f = torch.tensor(forced.astype(np.int64))
        keep = (f[:, :1] >= 0)
        sel = torch.where(keep, f.clamp(min=0), sel)
        w = probs.gather(1, sel)
    if cfg.get("norm_topk_prob"):
        w = w / w.sum(-1, keepdim=True)
    out = experts_sum(p, h, sel, w, E)
    return out, logits, sel


def forward_seq(cfg, P, tok, router_logits, routing=None, picks=None):
    """torch_ref.py's layers (Qwen3's attention) with the experts' MLP where the layer is sparse; each
    sparse layer's router logits appended to router_logits (and its picks to picks). routing
    [L, sparse layers, k] or None: the picks forced on each sparse layer (moe_block)."""
    order = [l for l in range(cfg["num_hidden_layers"]) if is_sparse(cfg, l)]

    def mlp(l, p, h):
        if not is_sparse(cfg, l):
            return dense_mlp(l, p, h)
        forced = routing[:, order.index(l)] if routing is not None else None
        block = deepseek_block if cfg["model_type"] == "deepseek_v3" else moe_block
        y, logits, sel = block(cfg, p, h, forced)
        router_logits.append(logits)
        if picks is not None:
            picks.append(sel)
        return y
    return final_hidden(cfg, P, tok, mlp)


def load_balancing_loss(cfg, router_logits, picks=None):
    """Transformers' load_balancing_loss_func with attention_mask None; picks (the experts used,
    under routing replay) in place of the top-k of the logits when given."""
    E, K = cfg["num_experts"], cfg["num_experts_per_tok"]
    g = torch.cat(router_logits, 0)
    rw = torch.softmax(g, -1)
    _, sel = torch.topk(rw, K, dim=-1)
    if picks is not None:
        sel = torch.cat(picks, 0)
    mask = torch.nn.functional.one_hot(sel, E).double()
    tokens_per_expert = mask.mean(0)
    prob_per_expert = rw.mean(0)
    return (tokens_per_expert * prob_per_expert[None]).sum() * E


def reference(cfg, P, tokens, targets, cu, temperature=1.0, routing=None):
    """routing [T, sparse layers, k] or None: forced picks (mrl_batch.routing)."""
    lm = P["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else P["lm_head.weight"]
    lps, ents, logits, picks = [], [], [], []
    for s in range(len(cu) - 1):
        tok = torch.tensor(tokens[cu[s]:cu[s + 1]].astype(np.int64))
        h = forward_seq(cfg, P, tok, logits, routing[cu[s]:cu[s + 1]] if routing is not None else None, picks)
        logp = torch.log_softmax(h @ lm.T / temperature, -1)
        tg = torch.tensor(targets[cu[s]:cu[s + 1]].astype(np.int64))
        lps.append(torch.where(tg >= 0, logp.gather(1, tg.clamp(min=0)[:, None])[:, 0], torch.zeros(len(tok))))
        ents.append(-(logp.exp() * logp).sum(-1))
    aux = load_balancing_loss(cfg, logits, picks if routing is not None else None) \
        if logits and cfg["model_type"] != "deepseek_v3" else torch.zeros(())  # (DeepSeek's router has none)
    return torch.cat(lps), torch.cat(ents), aux
