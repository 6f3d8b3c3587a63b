#!/usr/bin/env python3
"""A tiny random Qwen3-MoE written as a GGUF (architecture qwen3moe) with
llama.cpp's gguf-py, the way llama.cpp's converter lays it out: the router
blk.N.ffn_gate_inp [E, D], each kind of expert matrix stacked into one
[E, rows, cols] tensor (ffn_gate_exps, ffn_up_exps, ffn_down_exps),
expert_count / expert_used_count / expert_feed_forward_length; one layer
dense (ffn_gate/up/down: mlp_only_layers), one stacked tensor in Q8_0.
Then `moonrl convert FILE.gguf DIR` and checks:
  - every tensor of the converted model.safetensors equals the original
    Hugging Face tensor (mlp.gate.weight, mlp.experts.{e}.*_proj.weight)
    bit for bit (the Q8_0 one: equal to gguf-py's own dequantization);
  - config.json: model_type qwen3_moe, the expert sizes, norm_topk_prob,
    mlp_only_layers;
  - the converted directory loaded by libmoonrl gives the log-probs and
    entropies of the float64 reference (torch_ref_moe.py) on the original
    weights, relative error < 1e-5.

usage: ref_gguf_moe.py path/to/moonrl path/to/libmoonrl.so"""
import json
import os
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

D, F, L, Hq, Hk, hd, E, K, Fe = 32, 48, 3, 4, 2, 16, 4, 2, 24
DENSE = 1  # layer 1 keeps the dense MLP
Q8 = "model.layers.2.mlp.experts.*.up_proj.weight"  # stored in Q8_0


def make(path, rng):
    tokens = byte_alphabet() + ["<|endoftext|>", "<|im_start|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    V = len(tokens)
    hf = {"model.embed_tokens.weight": 0.3 * rng.standard_normal((V, D)), "model.norm.weight": 1 + 0.2 * rng.standard_normal(D),
          "lm_head.weight": 0.3 * rng.standard_normal((V, D))}
    g = {}  # GGUF name -> array
    for l in range(L):
        p, b = "model.layers.%d." % l, "blk.%d." % l
        for hn, gn, shape in (("input_layernorm", "attn_norm", (D,)), ("post_attention_layernorm", "ffn_norm", (D,)),
                              ("self_attn.q_norm", "attn_q_norm", (hd,)), ("self_attn.k_norm", "attn_k_norm", (hd,))):
            hf[p + hn + ".weight"] = 1 + 0.2 * rng.standard_normal(shape)
            g[b + gn + ".weight"] = hf[p + hn + ".weight"]
        for hn, gn, shape in (("self_attn.q_proj", "attn_q", (Hq * hd, D)), ("self_attn.k_proj", "attn_k", (Hk * hd, D)),
                              ("self_attn.v_proj", "attn_v", (Hk * hd, D)), ("self_attn.o_proj", "attn_output", (D, Hq * hd))):
            hf[p + hn + ".weight"] = 0.2 * rng.standard_normal(shape)
            g[b + gn + ".weight"] = hf[p + hn + ".weight"]
        if l == DENSE:
            for hn, gn, shape in (("gate_proj", "ffn_gate", (F, D)), ("up_proj", "ffn_up", (F, D)), ("down_proj", "ffn_down", (D, F))):
                hf[p + "mlp." + hn + ".weight"] = 0.2 * rng.standard_normal(shape)
                g[b + gn + ".weight"] = hf[p + "mlp." + hn + ".weight"]
            continue
        hf[p + "mlp.gate.weight"] = 0.8 * rng.standard_normal((E, D))
        g[b + "ffn_gate_inp.weight"] = hf[p + "mlp.gate.weight"]
        for hn, gn, shape in (("gate_proj", "ffn_gate_exps", (Fe, D)), ("up_proj", "ffn_up_exps", (Fe, D)),
                              ("down_proj", "ffn_down_exps", (D, Fe))):
            stack = 0.2 * rng.standard_normal((E,) + shape)
            for e in range(E):
                hf[p + "mlp.experts.%d.%s.weight" % (e, hn)] = stack[e]
            g[b + gn + ".weight"] = stack
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    w = gguf_writer(path, "qwen3moe", L, D, F, Hq, Hk)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    w.add_expert_feed_forward_length(Fe)
    add_bpe_tokenizer(w, "qwen2", tokens, types, [])
    w.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", hf["model.norm.weight"])
    w.add_tensor("output.weight", hf["lm_head.weight"])
    for name, a in g.items():
        a = np.ascontiguousarray(a.astype(np.float32))
        if name == "blk.2.ffn_up_exps.weight":  # Q8_0: what moonrl must give is gguf-py's dequantization
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            back = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(a.shape).astype(np.float32)
            for e in range(E):
                hf["model.layers.2.mlp.experts.%d.up_proj.weight" % e] = back[e]
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf, V


def main():
    rng = np.random.default_rng(7)
    with tempfile.TemporaryDirectory() as tmp:
        path, out = os.path.join(tmp, "tiny-qwen3moe.gguf"), os.path.join(tmp, "hf")
        hf, V = make(path, rng)
        if not convert(MOONRL, path, out, "qwen3moe"):
            return
        same_tensors(out, hf, "every tensor bit-identical to the original (%s from Q8_0)" % Q8)
        cfg = json.load(open(os.path.join(out, "config.json")))
        want = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": E,
                "num_experts_per_tok": K, "moe_intermediate_size": Fe, "intermediate_size": F, "norm_topk_prob": True,
                "mlp_only_layers": [DENSE], "num_hidden_layers": L, "head_dim": hd, "vocab_size": V}
        check(all(cfg.get(k) == v for k, v in want.items()), "config.json %s" % {k: cfg.get(k) for k in want})
        against_reference(lib, out, cfg, hf, rng, [9, 17, 4], "qwen3moe")


main()
checks.done()
