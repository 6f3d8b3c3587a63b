#!/usr/bin/env python3
"""A tiny random DeepSeek-V3 written as a GGUF (architecture deepseek2) with
llama.cpp's gguf-py, the way llama.cpp's converter lays it out: multi-head
latent attention as multi-query attention over the latent (head_count_kv 1,
key_length kv_lora_rank + rope, value_length kv_lora_rank, the per-head sizes
in key_length_mla / value_length_mla), kv_b_proj split into attn_k_b (each
head's key rows transposed) and attn_v_b; the router ffn_gate_inp with its
choice bias exp_probs_b.bias, the experts stacked [E, rows, cols], the shared
expert (*_shexp), leading_dense_block_count, expert_gating_func 2, the
groups, scale and normalisation; yarn with its log multiplier. An older file
(attn_kv_b whole, key_length and value_length per head, q_proj without the
low-rank queries) too. Then `moonrl convert FILE.gguf DIR` and checks:
  - every tensor of the converted model.safetensors equals the original
    Hugging Face tensor bit for bit;
  - config.json holds DeepSeek-V3's keys;
  - the converted directory loaded by libmoonrl gives the log-probs and
    entropies of the float64 reference (torch_ref_moe.py) on the original
    weights, relative error < 1e-5;
  - a softmax router (expert_gating_func 1: DeepSeek-V2's) is a usage error
    naming the key.

usage: ref_gguf_deepseek.py path/to/moonrl path/to/libmoonrl.so"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

import gguf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "io"))  # ref_gguf_convert
import moonrl_ctypes  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import checks  # noqa: E402
from checks import check  # noqa: E402
from ref_gguf_convert import add_bpe_tokenizer, byte_alphabet, gguf_writer  # noqa: E402
from gguf_moe_checks import against_reference, convert, same_tensors  # noqa: E402

MOONRL = sys.argv[1]
lib = moonrl_ctypes.load(sys.argv[2])

D, F, L, H, E, K, Fe, G, TG = 32, 48, 3, 4, 6, 2, 16, 3, 2
RQ, RKV, DN, DR, DV = 16, 12, 6, 4, 8


def make(path, rng, split_kv=True, low_rank_q=True, gating=2):
    """The HF tensors (float32) and config of the model written to path."""
    tokens = byte_alphabet() + ["<|endoftext|>", "<|im_start|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    V = len(tokens)
    hf = {"model.embed_tokens.weight": 0.3 * rng.standard_normal((V, D)), "model.norm.weight": 1 + 0.2 * rng.standard_normal(D),
          "lm_head.weight": 0.3 * rng.standard_normal((V, D))}
    g = {}

    def both(hn, gn, a):
        hf[hn] = a
        g[gn] = a

    for l in range(L):
        p, b = "model.layers.%d." % l, "blk.%d." % l
        both(p + "input_layernorm.weight", b + "attn_norm.weight", 1 + 0.2 * rng.standard_normal(D))
        both(p + "post_attention_layernorm.weight", b + "ffn_norm.weight", 1 + 0.2 * rng.standard_normal(D))
        if low_rank_q:
            both(p + "self_attn.q_a_proj.weight", b + "attn_q_a.weight", 0.2 * rng.standard_normal((RQ, D)))
            both(p + "self_attn.q_a_layernorm.weight", b + "attn_q_a_norm.weight", 1 + 0.2 * rng.standard_normal(RQ))
            both(p + "self_attn.q_b_proj.weight", b + "attn_q_b.weight", 0.2 * rng.standard_normal((H * (DN + DR), RQ)))
        else:
            both(p + "self_attn.q_proj.weight", b + "attn_q.weight", 0.2 * rng.standard_normal((H * (DN + DR), D)))
        both(p + "self_attn.kv_a_proj_with_mqa.weight", b + "attn_kv_a_mqa.weight", 0.2 * rng.standard_normal((RKV + DR, D)))
        both(p + "self_attn.kv_a_layernorm.weight", b + "attn_kv_a_norm.weight", 1 + 0.2 * rng.standard_normal(RKV))
        kvb = 0.2 * rng.standard_normal((H * (DN + DV), RKV))
        hf[p + "self_attn.kv_b_proj.weight"] = kvb
        if split_kv:  # llama.cpp's converter: k_b transposed [H, RKV, DN], v_b [H, DV, RKV]
            kv = kvb.reshape(H, DN + DV, RKV)
            g[b + "attn_k_b.weight"] = np.ascontiguousarray(kv[:, :DN, :].transpose(0, 2, 1))
            g[b + "attn_v_b.weight"] = np.ascontiguousarray(kv[:, DN:, :])
        else:
            g[b + "attn_kv_b.weight"] = kvb
        both(p + "self_attn.o_proj.weight", b + "attn_output.weight", 0.2 * rng.standard_normal((D, H * DV)))
        if l == 0:  # the leading dense layer
            for hn, gn, shape in (("gate_proj", "ffn_gate", (F, D)), ("up_proj", "ffn_up", (F, D)), ("down_proj", "ffn_down", (D, F))):
                both(p + "mlp." + hn + ".weight", b + gn + ".weight", 0.2 * rng.standard_normal(shape))
            continue
        both(p + "mlp.gate.weight", b + "ffn_gate_inp.weight", 0.8 * rng.standard_normal((E, D)))
        both(p + "mlp.gate.e_score_correction_bias", b + "exp_probs_b.bias", 0.1 * rng.standard_normal(E))
        for hn, gn, shape in (("gate_proj", "ffn_gate", (Fe, D)), ("up_proj", "ffn_up", (Fe, D)), ("down_proj", "ffn_down", (D, Fe))):
            stack = 0.2 * rng.standard_normal((E,) + shape)
            for e in range(E):
                hf[p + "mlp.experts.%d.%s.weight" % (e, hn)] = stack[e]
            g[b + gn + "_exps.weight"] = stack
            both(p + "mlp.shared_experts.%s.weight" % hn, b + gn + "_shexp.weight", 0.2 * rng.standard_normal(shape))
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    w = gguf_writer(path, "deepseek2", L, D, F, H, 1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if low_rank_q:
        w.add_q_lora_rank(RQ)
    w.add_kv_lora_rank(RKV)
    if split_kv:
        w.add_key_length(RKV + DR)
        w.add_value_length(RKV)
        w.add_key_length_mla(DN + DR)
        w.add_value_length_mla(DV)
    else:
        w.add_key_length(DN + DR)
        w.add_value_length(DV)
    w.add_rope_dimension_count(DR)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    w.add_rope_scaling_orig_ctx_len(64)
    w.add_rope_scaling_yarn_log_mul(0.1 * 0.8)
    w.add_leading_dense_block_count(1)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    w.add_expert_feed_forward_length(Fe)
    w.add_expert_shared_count(1)
    w.add_expert_weights_scale(2.5)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType(gating))
    w.add_expert_group_count(G)
    w.add_expert_group_used_count(TG)
    add_bpe_tokenizer(w, "qwen2", tokens, types, [])
    w.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", hf["model.norm.weight"])
    w.add_tensor("output.weight", hf["lm_head.weight"])
    for name, a in g.items():
        w.add_tensor(name, np.ascontiguousarray(a.astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = dict(model_type="deepseek_v3", vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
               num_attention_heads=H, q_lora_rank=RQ if low_rank_q else None, kv_lora_rank=RKV, qk_nope_head_dim=DN,
               qk_rope_head_dim=DR, v_head_dim=DV, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128,
               rope_interleave=True, first_k_dense_replace=1, n_routed_experts=E, num_experts_per_tok=K, n_group=G,
               topk_group=TG, moe_intermediate_size=Fe, n_shared_experts=1, routed_scaling_factor=2.5,
               norm_topk_prob=True, rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                                                       mscale=0.8, mscale_all_dim=0.8))
    return hf, cfg


def main():
    rng = np.random.default_rng(11)
    with tempfile.TemporaryDirectory() as tmp:
        for tag, kw in (("llama.cpp's current layout (attn_k_b, attn_v_b; low-rank queries)", {}),
                        ("an older file (attn_kv_b whole, key_length per head; q_proj)", dict(split_kv=False, low_rank_q=False))):
            path, out = os.path.join(tmp, "ds.gguf"), os.path.join(tmp, "hf-%d" % len(kw))
            hf, cfg = make(path, rng, **kw)
            if not convert(MOONRL, path, out, tag):
                continue
            same_tensors(out, hf, "%s: every tensor bit-identical to the original" % tag)
            saved = json.load(open(os.path.join(out, "config.json")))
            keys = ("model_type", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "num_key_value_heads", "first_k_dense_replace", "n_routed_experts", "num_experts_per_tok", "n_group",
                    "topk_group", "moe_intermediate_size", "n_shared_experts", "routed_scaling_factor", "norm_topk_prob",
                    "rope_interleave")
            want = dict(cfg, num_key_value_heads=H)
            check(all(saved.get(k) == want[k] for k in keys), "%s: config.json %s" % (tag, {k: saved.get(k) for k in keys}))
            rs = saved.get("rope_scaling") or {}
            check(rs.get("factor") == 4 and abs(rs.get("mscale_all_dim", 0) - 0.8) < 1e-6,  # (the file's float32)
                  "%s: yarn, mscale_all_dim from the log multiplier: %s" % (tag, rs))
            against_reference(lib, out, cfg, hf, rng, [9, 17, 40], tag)
        path = os.path.join(tmp, "softmax.gguf")
        make(path, rng, gating=1)
        r = subprocess.run([MOONRL, "convert", path, os.path.join(tmp, "o")], capture_output=True, text=True, timeout=120)
        check(r.returncode == 2 and "expert_gating_func is 1" in r.stderr,
              "a softmax router (DeepSeek-V2's): a usage error naming the key: " + r.stderr.strip()[-200:])


main()
checks.done()
