#!/usr/bin/env python3
"""moonrl convert (GGUF -> Hugging Face directory) on tiny random models of
each architecture, written here with llama.cpp's gguf-py the way llama.cpp's
converter writes them: llama with its Q/K rows permuted, qwen2 with q/k/v
biases, qwen3 with q/k norms and a head_dim of its own, tied and untied
heads; a byte-level BPE tokenizer (the GPT-2 byte alphabet, a few merges, a
control token) with the gpt2 and the qwen2 pre-tokenizers. Checks:
  - every tensor of the converted model.safetensors equals the original
    Hugging Face tensor bit for bit (names, shapes, Q/K order);
  - config.json holds the architecture's sizes;
  - moonrl's tokenizer on the converted tokenizer.json gives the ids of the
    `tokenizers` library built from the same vocabulary, merges and
    pre-tokenizer;
  - a file that is not GGUF, and a GGUF of an unknown architecture, are usage
    errors (exit 2) naming the file.

usage: ref_gguf_convert.py path/to/moonrl"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

import gguf
from safetensors.numpy import load_file
from tokenizers import Tokenizer, AddedToken, decoders, models, pre_tokenizers, Regex

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import checks  # noqa: E402
from checks import check  # noqa: E402

MOONRL = sys.argv[1] if len(sys.argv) > 1 else "build/moonrl"


def byte_alphabet():
    """GPT-2's bytes -> printable characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def gguf_writer(path, arch, L, D, F, Hq, Hk):
    """A GGUF writer with the sizes every architecture has (ref_gguf_moe.py's too)."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(Hq)
    w.add_head_count_kv(Hk)
    return w


def add_bpe_tokenizer(w, pre, tokens, types, merges):
    """A byte-level BPE tokenizer; its last two tokens the control tokens, the first of them BOS and EOS."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 2)


def llama_permute(w, heads):
    """What llama.cpp's converter does to q_proj / k_proj rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


QWEN2_RE = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def llama3_divisors(theta, hd, factor, low=1.0, high=4.0, old=8192):
    """The rope_freqs tensor llama.cpp's converter writes for Llama 3.1+ RoPE scaling."""
    out = []
    for i in range(0, hd, 2):
        wl = 2 * np.pi * theta ** (i / hd)
        if wl < old / high:
            out.append(1.0)
        elif wl > old / low:
            out.append(factor)
        else:
            smooth = (old / wl - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def make(arch, path, tied, pre, rng, rope_freqs=None, quant=None, meta=None):
    """A tiny model of arch written to path; quant: GGUF tensor name -> a ggml type to store it as;
    meta(w): more metadata written."""
    D, F, L, Hq, Hk = 32, 48, 2, 4, 2
    hd = 16 if arch == "qwen3" else D // Hq
    alphabet = byte_alphabet()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "1 2"]
    tokens = alphabet + [m.replace(" ", "") for m in merges] + ["<|endoftext|>", "<|im_start|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    V = len(tokens)
    hf = {"model.embed_tokens.weight": rng.standard_normal((V, D)), "model.norm.weight": rng.standard_normal(D)}
    if not tied:
        hf["lm_head.weight"] = rng.standard_normal((V, D))
    for l in range(L):
        p = "model.layers.%d." % l
        hf[p + "input_layernorm.weight"] = rng.standard_normal(D)
        hf[p + "post_attention_layernorm.weight"] = rng.standard_normal(D)
        hf[p + "self_attn.q_proj.weight"] = rng.standard_normal((Hq * hd, D))
        hf[p + "self_attn.k_proj.weight"] = rng.standard_normal((Hk * hd, D))
        hf[p + "self_attn.v_proj.weight"] = rng.standard_normal((Hk * hd, D))
        hf[p + "self_attn.o_proj.weight"] = rng.standard_normal((D, Hq * hd))
        hf[p + "mlp.gate_proj.weight"] = rng.standard_normal((F, D))
        hf[p + "mlp.up_proj.weight"] = rng.standard_normal((F, D))
        hf[p + "mlp.down_proj.weight"] = rng.standard_normal((D, F))
        if arch == "qwen2":
            for x, n in (("q", Hq), ("k", Hk), ("v", Hk)):
                hf[p + "self_attn.%s_proj.bias" % x] = rng.standard_normal(n * hd)
        if arch == "qwen3":
            hf[p + "self_attn.q_norm.weight"] = rng.standard_normal(hd)
            hf[p + "self_attn.k_norm.weight"] = rng.standard_normal(hd)
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    w = gguf_writer(path, arch, L, D, F, Hq, Hk)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(500000.0 if rope_freqs is not None else 10000.0)
    if arch == "qwen3":
        w.add_key_length(hd)
        w.add_value_length(hd)
    add_bpe_tokenizer(w, pre, tokens, types, merges)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    if meta:
        meta(w)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for k, v in hf.items():
        if k == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif k == "model.norm.weight":
            g = "output_norm.weight"
        elif k == "lm_head.weight":
            g = "output.weight"
        else:
            parts = k.split(".")
            g = "blk.%s.%s.%s" % (parts[2], names[".".join(parts[3:-1])], parts[-1])
        if arch == "llama" and k.endswith(("q_proj.weight", "k_proj.weight")):
            v = llama_permute(v, Hq if "q_proj" in k else Hk)
        if quant and g in quant:
            w.add_tensor(g, gguf.quants.quantize(v, quant[g]), raw_dtype=quant[g])
        else:
            w.add_tensor(g, np.ascontiguousarray(v))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tk = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges]))
    if pre == "qwen2":
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_RE), "isolated"),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre == "smollm":  # llama.cpp's smollm: single digits, then GPT-2's byte-level split
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    return hf, tk, dict(D=D, F=F, L=L, Hq=Hq, Hk=Hk, hd=hd, V=V)


def converted(tmp, tag, arch, pre, rng, **kw):
    """A tied model of arch made (make's kw) and run through moonrl convert: the result, its config.json
    (empty when it failed) and that config's rope_scaling."""
    path, out = os.path.join(tmp, tag + ".gguf"), os.path.join(tmp, "hf-" + tag)
    make(arch, path, True, pre, rng, **kw)
    r = subprocess.run([MOONRL, "convert", path, out], capture_output=True, text=True, timeout=120)
    cfg = json.load(open(os.path.join(out, "config.json"))) if r.returncode == 0 else {}
    return r, cfg, cfg.get("rope_scaling") or {}


TEXTS = ["the cat in the hat", "12 123 1234", "<|im_start|>hi<|endoftext|>", "naïve — 東京\n\n  x"]


def main():
    rng = np.random.default_rng(3)
    with tempfile.TemporaryDirectory() as tmp:
        for arch, tied, pre in (("llama", True, "gpt2"), ("llama", False, "smollm"), ("qwen2", False, "qwen2"),
                                ("qwen3", True, "qwen2")):
            tag = "%s (%s, %s)" % (arch, "tied" if tied else "untied", pre)
            path = os.path.join(tmp, "%s-%s.gguf" % (arch, pre))
            hf, tk, sz = make(arch, path, tied, pre, rng)
            out = os.path.join(tmp, "hf-%s-%s" % (arch, pre))
            r = subprocess.run([MOONRL, "convert", path, out], capture_output=True, text=True, timeout=120)
            check(r.returncode == 0, "%s: moonrl convert: %s" % (tag, r.stderr.strip()[-300:]))
            if r.returncode:
                continue
            got = load_file(os.path.join(out, "model.safetensors"))
            same = set(got) == set(hf) and all(got[k].shape == hf[k].shape and np.array_equal(got[k].view(np.uint32),
                                               hf[k].view(np.uint32)) for k in hf)
            check(same, "%s: every tensor bit-identical to the original (%d tensors)" % (tag, len(hf)))
            if not same:
                for k in sorted(set(hf) | set(got)):
                    if k not in got or k not in hf or not np.array_equal(got[k], hf[k]):
                        print("   differs:", k)
            cfg = json.load(open(os.path.join(out, "config.json")))
            want = {"model_type": arch, "hidden_size": sz["D"], "intermediate_size": sz["F"], "num_hidden_layers": sz["L"],
                    "num_attention_heads": sz["Hq"], "num_key_value_heads": sz["Hk"], "head_dim": sz["hd"],
                    "vocab_size": sz["V"], "tie_word_embeddings": tied}
            check(all(cfg.get(k) == v for k, v in want.items()), "%s: config.json %s" % (tag, {k: cfg.get(k) for k in want}))
            for s in TEXTS:
                r = subprocess.run([MOONRL, "tokenize", "--tokenizer", out], input=s, capture_output=True, text=True)
                ids = [int(x) for x in r.stdout.split()]
                want_ids = tk.encode(s, add_special_tokens=False).ids
                check(ids == want_ids, "%s: ids of %r: %s vs tokenizers %s" % (tag, s, ids, want_ids))
        # Llama 3.1+: RoPE scaling as the rope_freqs tensor -> the config's rope_scaling (head_dim 8:
        # one frequency in each regime: unscaled, blended, scaled); other divisors: an error
        for divs, ok in ((llama3_divisors(500000.0, 8, 32.0), True), (np.array([1, 2, 3, 4], np.float32), False)):
            r, cfg, rs = converted(tmp, "llama3-%s" % ok, "llama", "gpt2", rng, rope_freqs=divs)
            if ok:
                check(r.returncode == 0 and rs.get("rope_type") == "llama3" and rs.get("factor") == 32 and
                      rs.get("low_freq_factor") == 1 and rs.get("high_freq_factor") == 4 and
                      rs.get("original_max_position_embeddings") == 8192 and cfg.get("rope_theta") == 500000,
                      "llama 3 rope_freqs -> rope_scaling llama3 (factor 32): %s %s" % (rs, r.stderr.strip()[-200:]))
            else:
                check(r.returncode == 2 and "is not Llama 3 RoPE scaling" in r.stderr,
                      "other rope_freqs: a usage error naming them: " + r.stderr.strip()[-200:])
        # a Qwen config's yarn (llama.cpp's converter: rope.scaling.type, .factor, .original_context_length)
        # -> the config's rope_scaling; without its factor: an error naming the key
        for ok in (True, False):
            def yarn(w, ok=ok):
                w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
                w.add_rope_scaling_orig_ctx_len(32)
                if ok:
                    w.add_rope_scaling_factor(4.0)
            r, cfg, rs = converted(tmp, "yarn-%s" % ok, "qwen2", "qwen2", rng, meta=yarn)
            if ok:
                check(r.returncode == 0 and rs.get("rope_type") == "yarn" and rs.get("factor") == 4 and
                      rs.get("original_max_position_embeddings") == 32,
                      "yarn metadata -> rope_scaling yarn (factor 4 from 32): %s %s" % (rs, r.stderr.strip()[-200:]))
            else:
                check(r.returncode == 2 and "rope.scaling.factor" in r.stderr,
                      "yarn without its factor: a usage error naming the key: " + r.stderr.strip()[-200:])
        bad = os.path.join(tmp, "bad.gguf")
        with open(bad, "wb") as f:
            f.write(b"not a gguf file at all")
        r = subprocess.run([MOONRL, "convert", bad, os.path.join(tmp, "o")], capture_output=True, text=True)
        check(r.returncode == 2 and bad in r.stderr, "not a GGUF file: a usage error naming it: " + r.stderr.strip())
        w = gguf.GGUFWriter(os.path.join(tmp, "gpt2.gguf"), "gpt2")
        w.add_tensor("x", np.zeros(4, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        r = subprocess.run([MOONRL, "convert", os.path.join(tmp, "gpt2.gguf"), os.path.join(tmp, "o")],
                           capture_output=True, text=True)
        check(r.returncode == 2 and "architecture 'gpt2' is not supported" in r.stderr, "unknown architecture: " + r.stderr.strip())
    checks.done()


if __name__ == "__main__":  # ref_gguf_moe.py imports its helpers
    main()
