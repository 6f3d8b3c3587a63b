#!/usr/bin/env python3
"""Generation throughput: moonrl's engine (moonrl.engine through `moonrl run
bench/decode/generate_bench.lua`) against a plain PyTorch KV-cache generation loop of
the same Llama-style model (the same weights: moonrl saves the model in
Hugging Face format, PyTorch reads its model.safetensors), fp32, the same
number of threads on both sides. --dtype bf16: moonrl's model.dtype=bf16 (bf16
weight panels of the matrices, fp32 sums, its KV cache in bf16) against the PyTorch
loop with the model and its KV cache in bfloat16 (what model.to(torch.bfloat16)
gives a transformers user).

Cases (prompt 128 tokens, 256 new tokens, no EOS, every sample runs to the end):
  batch 1, 16, 64       greedy, distinct prompts
  grpo 8x8              8 prompts x 8 samples at temperature 1 (moonrl prefills each prompt once
                        and forks; PyTorch runs the 64 rows as a batch)
  independent 64        64 distinct prompts x 1 sample at temperature 1 (the same work without sharing)
Each case runs moonrl (in a child process) then PyTorch (in this process), one after the other, so
both see the same load. Also: the machine's copy bandwidth (numpy copy of 512 MiB, read + write), its
read bandwidth (torch.sum over 512 MiB on the same threads) and the bandwidth moonrl achieves
(weights + KV cache read per decode step, over the whole case time) as a share of each.

usage: /usr/bin/python3 bench/decode/generate_bench.py [--threads 2] [--moonrl build/moonrl] [--model small|100m|smollm2]
                                                [--cases 1,16,64,grpo,indep] [--repeats 1] [--dtype fp32|bf16]
"""
import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

sys.path.insert(0, os.path.join(ROOT, "bench"))
from models import preset  # noqa: E402  (bench/models.json)

# small (hidden 256, 4 layers, 4 heads / 2 KV heads, SwiGLU 768, vocab 4096: 5.2M parameters), 100m,
# smollm2 (SmolLM2-135M's shape, random weights: hidden 576, 30 layers, 9 heads / 3 KV heads, vocab 49152, tied)
MODELS = {name: preset(name, max_position_embeddings=1024) for name in ("small", "100m", "smollm2")}

CASES = {
    "1": dict(prompts=1, n=1, temperature=0.0),
    "16": dict(prompts=16, n=1, temperature=0.0),
    "64": dict(prompts=64, n=1, temperature=0.0),
    "grpo": dict(prompts=8, n=8, temperature=1.0),
    "indep": dict(prompts=64, n=1, temperature=1.0),
}
PROMPT_LEN, NEW = 128, 256


def read_safetensors(path, np):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", t["dtype"]
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data[a:b], np.float32).reshape(t["shape"])
    return out


def prompts_of(P, V, np):
    k = np.arange(PROMPT_LEN)
    return np.stack([(k * 31 + i * 7 + 1) % V for i in range(P)]).astype(np.int64)


def torch_generate(cfg, W, case, threads, repeats, dtype="fp32"):
    import numpy as np
    import torch
    torch.set_num_threads(threads)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    D, H, Hk, V = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    L, hd, eps, G = cfg["num_hidden_layers"], D // H, cfg["rms_norm_eps"], H // Hk
    T = {k: torch.from_numpy(v.copy()).to(dt) for k, v in W.items()}
    if "lm_head.weight" not in T:  # tied embeddings
        T["lm_head.weight"] = T["model.embed_tokens.weight"]
    lw = [{k: T["model.layers.%d.%s" % (l, k)] for k in (
        "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight")} for l in range(L)]
    emb, normf, head = T["model.embed_tokens.weight"], T["model.norm.weight"], T["lm_head.weight"]
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.arange(PROMPT_LEN + NEW).float()[:, None] * inv[None, :]
    COS, SIN = torch.cat([ang, ang], -1).cos().to(dt), torch.cat([ang, ang], -1).sin().to(dt)
    F = torch.nn.functional

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rot(t):
        return torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], -1)

    def step(tokens, pos0, kc, vc):
        """tokens [B, S] at positions pos0..pos0+S; caches [L][B, Hk, max, hd] written in place."""
        B, S = tokens.shape
        cos, sin = COS[pos0:pos0 + S], SIN[pos0:pos0 + S]
        x = F.embedding(tokens, emb)
        n_ctx = pos0 + S
        mask = None
        if S > 1:
            mask = torch.full((S, n_ctx), float("-inf"), dtype=dt).triu(pos0 + 1)
        for l in range(L):
            w = lw[l]
            h = norm(x, w["input_layernorm.weight"])
            q = F.linear(h, w["self_attn.q_proj.weight"]).view(B, S, H, hd).transpose(1, 2)
            k = F.linear(h, w["self_attn.k_proj.weight"]).view(B, S, Hk, hd).transpose(1, 2)
            v = F.linear(h, w["self_attn.v_proj.weight"]).view(B, S, Hk, hd).transpose(1, 2)
            q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
            kc[l][:, :, pos0:n_ctx] = k
            vc[l][:, :, pos0:n_ctx] = v
            K, Vv = kc[l][:, :, :n_ctx], vc[l][:, :, :n_ctx]                  # [B, Hk, n, hd]
            qg = q.reshape(B, Hk, G * S, hd) if S == 1 else q.reshape(B, Hk, G, S, hd).reshape(B, Hk, G * S, hd)
            s = qg @ K.transpose(-1, -2) / math.sqrt(hd)                         # [B, Hk, G*S, n]
            if mask is not None:
                s = s.view(B, Hk, G, S, n_ctx) + mask
                s = s.view(B, Hk, G * S, n_ctx)
            att = (torch.softmax(s, -1) @ Vv).view(B, H, S, hd)                  # heads h = kv * G + g
            x = x + F.linear(att.transpose(1, 2).reshape(B, S, D), w["self_attn.o_proj.weight"])
            h = norm(x, w["post_attention_layernorm.weight"])
            x = x + F.linear(F.silu(F.linear(h, w["mlp.gate_proj.weight"])) * F.linear(h, w["mlp.up_proj.weight"]),
                             w["mlp.down_proj.weight"])
        return F.linear(norm(x[:, -1], normf), head)                              # [B, V]

    prompts = torch.from_numpy(prompts_of(case["prompts"], V, np)).repeat_interleave(case["n"], 0)
    B = prompts.shape[0]
    best = math.inf
    with torch.inference_mode():
        for _ in range(repeats):
            gen = torch.Generator().manual_seed(0)
            t0 = time.perf_counter()
            kc = [torch.empty(B, Hk, PROMPT_LEN + NEW, hd, dtype=dt) for _ in range(L)]
            vc = [torch.empty(B, Hk, PROMPT_LEN + NEW, hd, dtype=dt) for _ in range(L)]
            logits = step(prompts, 0, kc, vc)
            out = []
            for i in range(NEW):
                if case["temperature"] > 0:
                    tok = torch.multinomial(torch.softmax(logits.float() / case["temperature"], -1), 1, generator=gen)
                else:
                    tok = logits.argmax(-1, keepdim=True)
                out.append(tok)
                if i + 1 < NEW:
                    logits = step(tok, PROMPT_LEN + i, kc, vc)
            best = min(best, time.perf_counter() - t0)
    return dict(seconds=best, generated=B * NEW, version=torch.__version__)


def copy_bandwidth():
    """Bytes moved per second by a numpy copy of 512 MiB (read + write), best of 5."""
    import numpy as np
    a = np.ones(2 ** 27, np.float32)
    b = np.empty_like(a)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best


def read_bandwidth(threads):
    """Bytes read per second by torch.sum over 512 MiB of fp32 on `threads` threads, best of 5: the
    bound a decode step that only reads its weights and K/V can reach (the copy above also writes)."""
    import torch
    torch.set_num_threads(threads)
    a = torch.ones(2 ** 27, dtype=torch.float32)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        float(a.sum())
        best = min(best, time.perf_counter() - t0)
    return a.numel() * 4 / best


def moonrl_bytes(cfg, n_params, B, weight_bytes=4):
    """Bytes a decode step must read, summed over the case's decode steps: the weights (the embedding
    table only for the B rows looked up, the tied head once more), weight_bytes each (2: bf16
    copies), and each sequence's K/V context of every layer, weight_bytes each too (the KV cache
    is bf16 with a bf16 model: engine kv_cache_dtype auto)."""
    D, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    K = cfg["num_key_value_heads"] * (D // cfg["num_attention_heads"])
    head = V * D if cfg["tie_word_embeddings"] else 0
    weights = (n_params - V * D + B * D + head) * weight_bytes
    kv = sum(B * ctx * L * 2 * K * weight_bytes for ctx in range(PROMPT_LEN + 1, PROMPT_LEN + NEW))
    return weights * (NEW - 1) + kv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--moonrl", default=os.path.join(ROOT, "build", "moonrl"))
    ap.add_argument("--model", default="small", choices=sorted(MODELS))
    ap.add_argument("--cases", default="1,16,64,grpo,indep")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = ap.parse_args()
    import numpy as np
    cfg = MODELS[args.model]
    env = dict(os.environ, MOONRL_THREADS=str(args.threads), BENCH_DTYPE=args.dtype)
    lua = os.path.join(ROOT, "bench", "decode", "generate_bench.lua")
    res = {}
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([args.moonrl, "run", lua], env=dict(env, BENCH_MODE="save", BENCH_DIR=d,
                                                           BENCH_CONFIG=json.dumps(cfg)), check=True)
        W = read_safetensors(os.path.join(d, "model.safetensors"), np)
        for name in args.cases.split(","):
            case = dict(CASES[name], prompt_len=PROMPT_LEN, new=NEW, repeats=args.repeats)
            run = subprocess.run([args.moonrl, "run", lua], env=dict(env, BENCH_MODE="run", BENCH_DIR=d,
                                                                      BENCH_CASE=json.dumps(case)),
                                 capture_output=True, text=True)
            if run.returncode != 0:
                sys.exit("moonrl failed on case %s:\n%s%s" % (name, run.stdout, run.stderr))
            m = json.loads(run.stdout.strip().splitlines()[-1])
            t = torch_generate(cfg, W, case, args.threads, args.repeats, args.dtype)
            res[name] = (case, m, t)
            print("  case %-6s done: moonrl %.2f s, pytorch %.2f s" % (name, m["seconds"], t["seconds"]), flush=True)
    bw, rbw = copy_bandwidth(), read_bandwidth(args.threads)
    n_params = res[next(iter(res))][1]["n_params"]
    print("model %s: %.1fM parameters, %s, %d threads; prompt %d + %d new tokens, no EOS; load average %s" % (
        args.model, n_params / 1e6, args.dtype, args.threads, PROMPT_LEN, NEW, os.getloadavg()[0]))
    print("machine copy bandwidth (numpy, 512 MiB, read + write): %.1f GB/s; read bandwidth (torch.sum, %d threads): "
          "%.1f GB/s" % (bw / 1e9, args.threads, rbw / 1e9))
    print("%-22s %12s %12s %7s %22s" % ("case", "moonrl tok/s", "torch tok/s", "ratio", "moonrl GB/s (of copy, read)"))
    for name, (case, m, t) in res.items():
        B = case["prompts"] * case["n"]
        mt, tt = m["generated"] / m["seconds"], t["generated"] / t["seconds"]
        gbs = moonrl_bytes(cfg, n_params, B, 2 if args.dtype == "bf16" else 4) / m["seconds"] / 1e9
        label = {"1": "batch 1 greedy", "16": "batch 16 greedy", "64": "batch 64 greedy",
                 "grpo": "grpo 8 prompts x 8", "indep": "64 independent T=1"}[name]
        print("%-22s %12.0f %12.0f %6.2fx %8.1f (%2.0f%%, %2.0f%%)" % (label, mt, tt, mt / tt, gbs, 100 * gbs * 1e9 / bw,
                                                                100 * gbs * 1e9 / rbw))
    if "grpo" in res and "indep" in res:
        g, i = res["grpo"][1], res["indep"][1]
        print("grpo 8x8 vs 64 independent (moonrl): %.2f s vs %.2f s (%.2fx), prefill tokens %d vs %d" % (
            g["seconds"], i["seconds"], i["seconds"] / g["seconds"], g["prefill_tokens"], i["prefill_tokens"]))


if __name__ == "__main__":
    main()
