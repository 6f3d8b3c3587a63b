#!/usr/bin/env python3
"""Training throughput: moonrl's CPU model against a plain PyTorch
implementation of the same Llama-style model (same weights, same batch,
fp32, the same number of threads), plus the machine's measured sgemm peak.

One training step = forward to per-token log-probs and entropy, a loss
sum(a * logprob + b * entropy) with fixed random per-token a, b, and the
backward into the gradients (the AdamW step is left out on both sides until
moonrl's optimizer is merged). Each side runs in its own child process so
that its peak memory (max RSS) is its own.

usage: /usr/bin/python3 bench/train_bench.py [--model small|100m] [--threads 2] [--steps 5]
                                             [--lib build/libmoonrl.so] [--recompute]
"""
import argparse
import ctypes
import ctypes.util
import json
import math
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "model"))

MODELS = {
    # the target of the issue: hidden 256, 4 layers, 4 heads / 2 KV heads, SwiGLU 768, vocab 4096
    "small": dict(cfg=dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=768,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=False, rms_norm_eps=1e-5), batch=8, seq=256),
    # about 100M parameters
    "100m": dict(cfg=dict(model_type="llama", vocab_size=32000, hidden_size=768, intermediate_size=2048,
                          num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
                          tie_word_embeddings=False, rms_norm_eps=1e-5), batch=4, seq=256),
}


def batch_arrays(cfg, B, L, np):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg["vocab_size"], (B, L)).astype(np.int32)
    targets = np.concatenate([tokens[:, 1:], np.full((B, 1), -1, np.int32)], 1)
    a = rng.standard_normal((B, L)).astype(np.float32) / (B * L)
    b = rng.standard_normal((B, L)).astype(np.float32) / (B * L)
    return tokens, targets, a, b


def init_weights(views, params, np):
    rng = np.random.default_rng(1)
    for n, off, shape, _ in views:
        size = int(np.prod(shape))
        params[off:off + size] = 1.0 if "norm" in n else 0.02 * rng.standard_normal(size)


def run_moonrl(args, spec):
    import numpy as np
    import moonrl_ctypes
    lib = moonrl_ctypes.load(args.lib)
    lib.mrl_parallel_set_threads(args.threads)
    m = moonrl_ctypes.Moonrl(spec["cfg"])
    lib.mrl_model_set_recompute(m.h, int(args.recompute))
    init_weights(m.views, m.params, np)
    B, L = spec["batch"], spec["seq"]
    tokens, targets, a, b = batch_arrays(spec["cfg"], B, L, np)
    tokens, targets, a, b = tokens.ravel(), targets.ravel(), a.ravel(), b.ravel()
    cu = (np.arange(B + 1) * L).astype(np.int32)
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        lp, ent, _ = m.forward(tokens, targets, cu)
        lib.mrl_model_zero_grad(m.h)
        m.backward(a, b, None)
        times.append(time.perf_counter() - t0)
    stats = (ctypes.c_int64 * 14)()
    lib.mrl_mem_get_stats(stats)
    loss = float((a * lp).sum() + (b * ent).sum())
    return dict(step_s=min(times[1:]), loss=loss, n_params=int(m.params.size),
                activations_peak=int(stats[6 + 3]), total_peak=int(stats[13]))


def run_torch(args, spec):
    import numpy as np
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(args.threads)
    cfg = spec["cfg"]
    D, H, Hk, V = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    hd, eps = D // H, cfg["rms_norm_eps"]

    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(D))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.weight

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = Norm(), Norm()
            self.q = torch.nn.Linear(D, H * hd, bias=False)
            self.k = torch.nn.Linear(D, Hk * hd, bias=False)
            self.v = torch.nn.Linear(D, Hk * hd, bias=False)
            self.o = torch.nn.Linear(H * hd, D, bias=False)
            self.g = torch.nn.Linear(D, cfg["intermediate_size"], bias=False)
            self.u = torch.nn.Linear(D, cfg["intermediate_size"], bias=False)
            self.d = torch.nn.Linear(cfg["intermediate_size"], D, bias=False)

        def forward(self, x, cos, sin, mask):
            B, L, _ = x.shape
            h = self.ln1(x)
            q = self.q(h).view(B, L, H, hd).transpose(1, 2)
            k = self.k(h).view(B, L, Hk, hd).transpose(1, 2)
            v = self.v(h).view(B, L, Hk, hd).transpose(1, 2)
            rot = lambda t: torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], -1)
            q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
            k, v = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, -1) @ v
            x = x + self.o(att.transpose(1, 2).reshape(B, L, D))
            h = self.ln2(x)
            return x + self.d(F.silu(self.g(h)) * self.u(h))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(V, D)
            self.layers = torch.nn.ModuleList([Layer() for _ in range(cfg["num_hidden_layers"])])
            self.norm = Norm()
            self.lm_head = torch.nn.Linear(D, V, bias=False)

        def forward(self, tokens):
            L = tokens.shape[1]
            inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
            ang = torch.arange(L).float()[:, None] * inv[None, :]
            emb = torch.cat([ang, ang], -1)
            cos, sin = emb.cos(), emb.sin()
            mask = torch.full((L, L), float("-inf")).triu(1)
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x, cos, sin, mask)
            return self.lm_head(self.norm(x))

    model = Model()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    B, L = spec["batch"], spec["seq"]
    tokens, targets, a, b = batch_arrays(cfg, B, L, np)
    tokens, targets = torch.tensor(tokens.astype(np.int64)), torch.tensor(targets.astype(np.int64))
    a, b = torch.tensor(a), torch.tensor(b)
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        logp = torch.log_softmax(model(tokens), -1)
        lp = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * (targets >= 0)
        ent = -(logp.exp() * logp).sum(-1)
        loss = (a * lp).sum() + (b * ent).sum()
        model.zero_grad(set_to_none=False)
        loss.backward()
        times.append(time.perf_counter() - t0)
    return dict(step_s=min(times[1:]), loss=float(loss), n_params=sum(p.numel() for p in model.parameters()))


def sgemm_peak(threads):
    """GFLOP/s of OpenBLAS sgemm (the library moonrl links) on 2048^3, best of 3."""
    import numpy as np
    os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
    blas = ctypes.CDLL(ctypes.util.find_library("openblas"))
    blas.openblas_set_num_threads(threads)
    n = 2048
    A = np.random.rand(n, n).astype(np.float32)
    Bm, Cm = A.copy(), np.zeros_like(A)
    p = lambda x: x.ctypes.data_as(ctypes.c_void_p)
    best = 1e9
    for _ in range(4):
        t0 = time.perf_counter()
        blas.cblas_sgemm(101, 111, 111, n, n, n, ctypes.c_float(1), p(A), n, p(Bm), n, ctypes.c_float(0), p(Cm), n)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best / 1e9


def train_flops(spec, n_params):
    """6 * matmul params * tokens + attention (causal: half of the 4 L^2 D per layer, forward; 3x with backward)."""
    cfg = spec["cfg"]
    D, Lyr, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    tokens = spec["batch"] * spec["seq"]
    matmul_params = n_params - V * D  # the embedding lookup is no matmul
    attn = 3 * Lyr * spec["batch"] * 2 * spec["seq"] ** 2 * D
    return 6 * matmul_params * tokens + attn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small", choices=sorted(MODELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lib", default=os.path.join(ROOT, "build", "libmoonrl.so"))
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--side", choices=["moonrl", "torch"])
    args = ap.parse_args()
    spec = MODELS[args.model]
    if args.side:
        out = run_moonrl(args, spec) if args.side == "moonrl" else run_torch(args, spec)
        out["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps(out))
        return
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), OPENBLAS_NUM_THREADS=str(args.threads),
               MOONRL_THREADS=str(args.threads))
    res = {}
    for side in ("torch", "moonrl"):
        cmd = [sys.executable, os.path.abspath(__file__), "--side", side] + sys.argv[1:]
        res[side] = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
    peak = sgemm_peak(args.threads)
    tokens = spec["batch"] * spec["seq"]
    flops = train_flops(spec, res["moonrl"]["n_params"])
    mt, tt = tokens / res["moonrl"]["step_s"], tokens / res["torch"]["step_s"]
    print("model %s: %.1fM parameters, batch %d x %d, %d threads%s" % (
        args.model, res["moonrl"]["n_params"] / 1e6, spec["batch"], spec["seq"], args.threads,
        ", recompute" if args.recompute else ""))
    print("  pytorch %s: %8.0f tokens/s  (step %.3f s, max RSS %.0f MiB)" % (
        "1.13", tt, res["torch"]["step_s"], res["torch"]["max_rss"] / 2 ** 20))
    print("  moonrl     : %8.0f tokens/s  (step %.3f s, max RSS %.0f MiB, activations peak %.0f MiB)" % (
        mt, res["moonrl"]["step_s"], res["moonrl"]["max_rss"] / 2 ** 20, res["moonrl"]["activations_peak"] / 2 ** 20))
    print("  ratio moonrl / pytorch: %.2fx" % (mt / tt))
    print("  moonrl: %.1f GFLOP/s = %.0f%% of measured sgemm peak %.1f GFLOP/s (2048^3, %d threads)" % (
        flops / res["moonrl"]["step_s"] / 1e9, 100 * flops / res["moonrl"]["step_s"] / 1e9 / peak, peak, args.threads))
    print("  loss check: moonrl %.6f, pytorch %.6f (different random weights: same scale only)" % (
        res["moonrl"]["loss"], res["torch"]["loss"]))


if __name__ == "__main__":
    main()
