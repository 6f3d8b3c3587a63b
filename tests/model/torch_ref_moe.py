"""A float64 PyTorch Qwen3-MoE (model_type qwen3_moe) written after Transformers'
modeling_qwen3_moe (Transformers itself is not needed): the reference of
ref_moe.py and ref_gguf_moe.py. P maps Hugging Face parameter names to tensors."""
import numpy as np
import torch

from torch_ref import dense_mlp, final_hidden


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
    """torch_ref.py's layers (Qwen3's attention) with the experts' MLP where the layer is sparse; each
    sparse layer's router logits appended to router_logits."""
    def mlp(l, p, h):
        if not is_sparse(cfg, l):
            return dense_mlp(l, p, h)
        y, logits = moe_block(cfg, p, h)
        router_logits.append(logits)
        return y
    return final_hidden(cfg, P, tok, mlp)


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
