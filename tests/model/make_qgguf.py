#!/usr/bin/env python3
"""Tiny GGUF models whose layer matrices are stored as Q4_0, Q4_1 and Q8_0
blocks (gguf-py's quantizer), for the quantized base (QLoRA) tests: a tied
llama (its q/k rows in llama.cpp's order), an untied qwen3 and a qwen3moe
with stacked experts; one matrix of each stays F16 (a type the base does not
keep: dequantized with the dense tensors), and bad.gguf has a NaN block scale.

usage: make_qgguf.py DIR   (writes DIR/llama.gguf, qwen3.gguf, qwen3moe.gguf, bad.gguf)
       make_qgguf.py --run MOONRL TEST.lua [gpu]
                             (writes them to a temporary directory and runs the test on
                             them: MOONRL_QGGUF_DIR, and MOONRL_QLORA_GPU=1 with gpu; skipped,
                             exit 77, without numpy and gguf-py)"""
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "io"))
    import gguf  # noqa: E402
    from ref_gguf_convert import add_bpe_tokenizer, byte_alphabet, gguf_writer, llama_permute  # noqa: E402
except ImportError as e:
    print("skipped: %s (./dev.sh deps installs numpy and gguf)" % e)
    sys.exit(77)

T = gguf.GGMLQuantizationType
CYCLE = [T.Q4_0, T.Q4_1, T.Q8_0]
D, F, L, Hq, Hk, E, K, Fe = 64, 96, 2, 4, 2, 4, 2, 32
MATS = (("attn_q", "q"), ("attn_k", "k"), ("attn_v", "v"), ("attn_output", "o"), ("ffn_gate", "g"),
        ("ffn_up", "u"), ("ffn_down", "d"))


def make(path, arch, rng, nan_scale=False):
    hd = 16 if arch != "llama" else D // Hq
    tokens = byte_alphabet() + ["<|endoftext|>", "<|im_start|>"]
    V = len(tokens)
    w = gguf_writer(path, arch, L, D, F, Hq, Hk)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch != "llama":
        w.add_key_length(hd)
        w.add_value_length(hd)
    if arch == "qwen3moe":
        w.add_expert_count(E)
        w.add_expert_used_count(K)
        w.add_expert_feed_forward_length(Fe)
    add_bpe_tokenizer(w, "qwen2" if arch != "llama" else "gpt2", tokens, [1] * (V - 2) + [3, 3], [])
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    def f32(a):
        return np.ascontiguousarray(a.astype(np.float32))

    w.add_tensor("token_embd.weight", f32(0.5 * rng.standard_normal((V, D))))
    w.add_tensor("output_norm.weight", f32(1 + 0.2 * rng.standard_normal(D)))
    if arch != "llama":
        w.add_tensor("output.weight", f32(0.3 * rng.standard_normal((V, D))))
    k = 0
    for l in range(L):
        b = "blk.%d." % l
        w.add_tensor(b + "attn_norm.weight", f32(1 + 0.2 * rng.standard_normal(D)))
        w.add_tensor(b + "ffn_norm.weight", f32(1 + 0.2 * rng.standard_normal(D)))
        if arch != "llama":
            w.add_tensor(b + "attn_q_norm.weight", f32(1 + 0.2 * rng.standard_normal(hd)))
            w.add_tensor(b + "attn_k_norm.weight", f32(1 + 0.2 * rng.standard_normal(hd)))
        shapes = {"q": (Hq * hd, D), "k": (Hk * hd, D), "v": (Hk * hd, D), "o": (D, Hq * hd), "g": (F, D),
                  "u": (F, D), "d": (D, F)}
        moe = arch == "qwen3moe" and l == 1
        for g, m in MATS:
            if moe and m in "gud":
                continue
            a = 0.3 * rng.standard_normal(shapes[m])
            if arch == "llama" and m in "qk":
                a = llama_permute(a, Hq if m == "q" else Hk)
            if l == 1 and m == "v":  # one matrix the base does not keep as blocks
                w.add_tensor(b + g + ".weight", np.ascontiguousarray(a.astype(np.float16)), raw_dtype=T.F16)
                continue
            t = CYCLE[k % 3]
            k += 1
            q = gguf.quants.quantize(f32(a), t)
            if nan_scale and l == 1 and m == "o":
                q = q.copy()
                q.view(np.uint8).reshape(-1)[0:2] = np.array([0x00, 0x7e], dtype=np.uint8)  # fp16 NaN
            w.add_tensor(b + g + ".weight", q, raw_dtype=t)
        if moe:
            w.add_tensor(b + "ffn_gate_inp.weight", f32(0.8 * rng.standard_normal((E, D))))
            for i, (g, shape) in enumerate((("ffn_gate_exps", (Fe, D)), ("ffn_up_exps", (Fe, D)),
                                            ("ffn_down_exps", (D, Fe)))):
                a = f32(0.3 * rng.standard_normal((E,) + shape))
                w.add_tensor(b + g + ".weight", gguf.quants.quantize(a, CYCLE[i]), raw_dtype=CYCLE[i])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write(out):
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(11)
    for arch in ("llama", "qwen3", "qwen3moe"):
        make(os.path.join(out, arch + ".gguf"), arch, rng)
    make(os.path.join(out, "bad.gguf"), "qwen3", rng, nan_scale=True)


def main():
    if sys.argv[1] != "--run":
        write(sys.argv[1])
        return
    with tempfile.TemporaryDirectory() as tmp:
        write(tmp)
        env = dict(os.environ, MOONRL_QGGUF_DIR=tmp)
        if sys.argv[4:] == ["gpu"]:
            env["MOONRL_QLORA_GPU"] = "1"
        sys.exit(subprocess.run([sys.argv[2], "run", sys.argv[3]], env=env).returncode)


if __name__ == "__main__":
    main()
