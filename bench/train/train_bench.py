#!/usr/bin/env python3
"""Training throughput: moonrl's CPU model against a plain PyTorch
implementation of the same Llama-style model (same weights, same batch,
fp32, the same number of threads), plus the machine's measured sgemm peak.

One training step = forward to per-token log-probs and entropy, a loss
sum(a * logprob + b * entropy) with fixed random per-token a, b, the
backward into the gradients and an AdamW step (moonrl: mrl_adamw_*;
PyTorch: torch.optim.AdamW; weight decay 0.01 on matrices only). The two
sides start from the same weights (moonrl's init, handed over in a raw f32
file) so their losses agree. Each side runs in its own child process, one
after the other, so that its peak memory (max RSS) is its own.

--dtype bf16: moonrl's model.dtype=bf16 (fp32 master weights and AdamW,
bf16 copies refreshed after each step, bf16 products with fp32 sums)
against PyTorch's torch.autocast("cpu", dtype=torch.bfloat16) around the
forward (fp32 weights and AdamW, bf16 matmuls: what TRL's bf16=True does on
a CPU); the log-softmax and the loss in fp32 on both sides.

usage: /usr/bin/python3 bench/train/train_bench.py [--model small|100m|smollm2] [--threads 2] [--steps 5]
            [--rounds 2] [--lib build/libmoonrl.so] [--recompute] [--omp-wait-policy active|passive]
            [--dtype fp32|bf16]
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
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "model"))

sys.path.insert(0, os.path.join(ROOT, "bench"))
from models import preset  # noqa: E402  (bench/models.json)

MODELS = {
    # the target of the issue: hidden 256, 4 layers, 4 heads / 2 KV heads, SwiGLU 768, vocab 4096
    "small": dict(cfg=preset("small"), batch=8, seq=256),
    # about 100M parameters
    "100m": dict(cfg=preset("100m"), batch=4, seq=256),
    # SmolLM2-135M's shape (weights random): the "8 x 256 tokens" step of a real 135M model
    "smollm2": dict(cfg=preset("smollm2"), batch=8, seq=256),
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


def rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class AdamWConfig(ctypes.Structure):
    _fields_ = [(k, ctypes.c_double) for k in ("lr", "beta1", "beta2", "eps", "weight_decay")]


def run_moonrl(args, spec):
    import numpy as np
    import moonrl_ctypes
    lib = moonrl_ctypes.load(args.lib)
    lib.mrl_parallel_set_threads(args.threads)
    rss0 = rss_now()
    m = moonrl_ctypes.Moonrl(spec["cfg"], seed=1)
    lib.mrl_model_set_recompute(m.h, int(args.recompute))
    lib.mrl_model_set_head_chunk(m.h, ctypes.c_int64(args.head_chunk))
    bf16 = args.dtype == "bf16"
    if bf16:
        moonrl_ctypes.check(lib.mrl_model_set_dtype(m.h, 1))
    m.params.tofile(args.weights)  # the torch side starts from these
    with open(args.weights + ".json", "w") as f:
        json.dump([(n, off, shape) for n, off, shape, _ in m.views], f)
    opt = ctypes.c_void_p()
    cfg = AdamWConfig(1e-4, 0.9, 0.999, 1e-8, 0.01)
    moonrl_ctypes.check(lib.mrl_adamw_create(moonrl_ctypes.ptr(m.params), moonrl_ctypes.ptr(m.grads),
                                             ctypes.c_int64(m.params.size), ctypes.byref(cfg), ctypes.byref(opt)))
    nd = [x for n, off, shape, decay in m.views if not decay for x in (off, int(np.prod(shape)))]
    nd = (ctypes.c_int64 * len(nd))(*nd)
    moonrl_ctypes.check(lib.mrl_adamw_set_no_decay(opt, nd, ctypes.c_int64(len(nd) // 2)))
    lib.mrl_adamw_step.argtypes = [ctypes.c_void_p, ctypes.c_double]
    B, L = spec["batch"], spec["seq"]
    tokens, targets, a, b = batch_arrays(spec["cfg"], B, L, np)
    tokens, targets, a, b = tokens.ravel(), targets.ravel(), a.ravel(), b.ravel()
    cu = (np.arange(B + 1) * L).astype(np.int32)
    times, losses = [], []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        lp, ent, _ = m.forward(tokens, targets, cu)
        lib.mrl_model_zero_grad(m.h)
        m.backward(a, b, None)
        moonrl_ctypes.check(lib.mrl_adamw_step(opt, -1.0))
        if bf16:
            lib.mrl_model_weights_changed(m.h)  # the copies are refreshed by the next forward: in the step
        times.append(time.perf_counter() - t0)
        losses.append(float((a * lp).sum() + (b * ent).sum()))
    stats = (ctypes.c_int64 * 14)()
    lib.mrl_mem_get_stats(stats)
    return dict(step_s=min(times[1:]), losses=losses, n_params=int(m.params.size), rss0=rss0,
                activations_peak=int(stats[6 + 3]), total_peak=int(stats[13]))


def run_torch(args, spec):
    import numpy as np
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(args.threads)
    cfg = spec["cfg"]
    D, H, Hk, V = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    hd, eps = D // H, cfg["rms_norm_eps"]

    rss0 = rss_now()

    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(D))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.weight

    lin = lambda i, o: torch.nn.Linear(i, o, bias=False)

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = lin(D, H * hd), lin(D, Hk * hd), lin(D, Hk * hd)
            self.o_proj = lin(H * hd, D)

        def forward(self, h, cos, sin, mask):
            B, L, _ = h.shape
            q = self.q_proj(h).view(B, L, H, hd).transpose(1, 2)
            k = self.k_proj(h).view(B, L, Hk, hd).transpose(1, 2)
            v = self.v_proj(h).view(B, L, Hk, hd).transpose(1, 2)
            rot = lambda t: torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], -1)
            q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
            k, v = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, -1) @ v
            return self.o_proj(att.transpose(1, 2).reshape(B, L, H * hd))

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            F_ = cfg["intermediate_size"]
            self.gate_proj, self.up_proj, self.down_proj = lin(D, F_), lin(D, F_), lin(F_, D)

        def forward(self, h):
            return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm, self.post_attention_layernorm = Norm(), Norm()
            self.self_attn, self.mlp = Attention(), MLP()

        def forward(self, x, cos, sin, mask):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
            return x + self.mlp(self.post_attention_layernorm(x))

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(V, D)
            self.layers = torch.nn.ModuleList([Layer() for _ in range(cfg["num_hidden_layers"])])
            self.norm = Norm()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()
            if not cfg["tie_word_embeddings"]:  # tied: the head is the embedding table
                self.lm_head = lin(D, V)

        def forward(self, tokens):
            L = tokens.shape[1]
            inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
            ang = torch.arange(L).float()[:, None] * inv[None, :]
            emb = torch.cat([ang, ang], -1)
            cos, sin = emb.cos(), emb.sin()
            mask = torch.full((L, L), float("-inf")).triu(1)
            x = self.model.embed_tokens(tokens)
            for layer in self.model.layers:
                x = layer(x, cos, sin, mask)
            h = self.model.norm(x)
            if cfg["tie_word_embeddings"]:
                return F.linear(h, self.model.embed_tokens.weight)
            return self.lm_head(h)

    model = Model()
    flat = np.fromfile(args.weights, np.float32)
    with open(args.weights + ".json") as f:
        views = json.load(f)
    state = {n: torch.from_numpy(flat[off:off + int(np.prod(shape))].reshape(shape).copy()) for n, off, shape in views}
    model.load_state_dict(state)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.01), dict(params=no_decay, weight_decay=0.0)],
                            lr=1e-4, betas=(0.9, 0.999), eps=1e-8)
    B, L = spec["batch"], spec["seq"]
    tokens, targets, a, b = batch_arrays(cfg, B, L, np)
    tokens, targets = torch.tensor(tokens.astype(np.int64)), torch.tensor(targets.astype(np.int64))
    a, b = torch.tensor(a), torch.tensor(b)
    times, losses = [], []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        if args.dtype == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(tokens)
            logp = torch.log_softmax(logits.float(), -1)
        else:
            logp = torch.log_softmax(model(tokens), -1)
        lp = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * (targets >= 0)
        ent = -(logp.exp() * logp).sum(-1)
        loss = (a * lp).sum() + (b * ent).sum()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return dict(step_s=min(times[1:]), losses=losses, n_params=sum(p.numel() for p in model.parameters()), rss0=rss0,
                version=torch.__version__)


def sgemm_peak(threads):
    """GFLOP/s of OpenBLAS sgemm (the library moonrl links) on 2048^3, best of 5:
    with OpenBLAS's own threads, and one thread times `threads` (how moonrl runs
    it: one slice per thread); the larger is the peak."""
    import numpy as np
    blas = ctypes.CDLL(ctypes.util.find_library("openblas"))
    n = 2048
    A = np.random.rand(n, n).astype(np.float32)
    Bm, Cm = A.copy(), np.zeros_like(A)
    p = lambda x: x.ctypes.data_as(ctypes.c_void_p)

    def best(nthreads):
        blas.openblas_set_num_threads(nthreads)
        t = 1e9
        for _ in range(5):
            t0 = time.perf_counter()
            blas.cblas_sgemm(101, 111, 111, n, n, n, ctypes.c_float(1), p(A), n, p(Bm), n, ctypes.c_float(0), p(Cm), n)
            t = min(t, time.perf_counter() - t0)
        return 2.0 * n ** 3 / t / 1e9

    return max(best(threads), threads * best(1))


def bf16_peak(threads):
    """GFLOP/s of a bf16 matrix product of 2048^3 (fp32 sums), the best of those run in 3 s (at
    least 6), through PyTorch's bfloat16 matmul (oneDNN: AVX512-BF16 or AMX where the CPU has it):
    the machine's measured bf16 product rate that the issue's ">= 50%" target is taken against.
    (The best of 6, 0.25 s, once came out at half the rate: taken while the host was busy.)"""
    import torch
    torch.set_num_threads(threads)
    n = 2048
    A = torch.randn(n, n).bfloat16()
    Bm = torch.randn(n, n).bfloat16()
    t, runs, start = 1e9, 0, time.perf_counter()
    while runs < 6 or time.perf_counter() - start < 3.0:
        t0 = time.perf_counter()
        A @ Bm
        t = min(t, time.perf_counter() - t0)
        runs += 1
    return 2.0 * n ** 3 / t / 1e9


def train_flops(spec, n_params):
    """6 * matmul params * tokens + attention (causal: half of the 4 L^2 D per layer, forward; 3x with backward)."""
    cfg = spec["cfg"]
    D, Lyr, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    tokens = spec["batch"] * spec["seq"]
    matmul_params = n_params - V * D  # the embedding lookup is no matmul
    if cfg["tie_word_embeddings"]:
        matmul_params += V * D  # but the head it doubles as is
    attn = 3 * Lyr * spec["batch"] * 2 * spec["seq"] ** 2 * D
    return 6 * matmul_params * tokens + attn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small", choices=sorted(MODELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lib", default=os.path.join(ROOT, "build", "libmoonrl.so"))
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--head-chunk", type=int, default=0,
                    help="moonrl's tokens per head chunk (0: the model's default budget)")
    ap.add_argument("--omp-wait-policy", choices=["active", "passive"],
                    help="set OMP_WAIT_POLICY for both sides (default: the environment as it is)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--side", choices=["moonrl", "torch"])
    ap.add_argument("--weights", help=argparse.SUPPRESS)
    args = ap.parse_args()
    spec = MODELS[args.model]
    if args.side:
        out = run_moonrl(args, spec) if args.side == "moonrl" else run_torch(args, spec)
        out["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps(out))
        return
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), OPENBLAS_NUM_THREADS=str(args.threads),
               MOONRL_THREADS=str(args.threads))
    if args.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    res = {}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        # the sides alternate for --rounds rounds and each keeps its best step
        # (moonrl first: it writes the weights), so that load from other jobs
        # on a shared machine is less likely to favour one side
        for _ in range(args.rounds):
            for side in ("moonrl", "torch"):
                cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--weights",
                       os.path.join(tmp, "weights.f32")] + sys.argv[1:]
                run = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if run.returncode != 0:
                    sys.exit("%s side failed:\n%s" % (side, run.stderr))
                r = json.loads(run.stdout)
                if side not in res or r["step_s"] < res[side]["step_s"]:
                    res[side] = r
                loads.append(os.getloadavg()[0])
    peak = sgemm_peak(args.threads)
    tokens = spec["batch"] * spec["seq"]
    flops = train_flops(spec, res["moonrl"]["n_params"])
    mt, tt = tokens / res["moonrl"]["step_s"], tokens / res["torch"]["step_s"]
    mib = lambda x: x / 2 ** 20
    print("model %s: %.1fM parameters, batch %d x %d, %d threads%s%s, %s, step = forward + backward + AdamW" % (
        args.model, res["moonrl"]["n_params"] / 1e6, spec["batch"], spec["seq"], args.threads,
        ", recompute" if args.recompute else "",
        ", OMP_WAIT_POLICY=" + args.omp_wait_policy if args.omp_wait_policy else "",
        "bf16 (moonrl model.dtype=bf16; pytorch autocast bf16)" if args.dtype == "bf16" else "fp32"))
    for side, label in (("torch", "pytorch %s" % res["torch"].get("version", "")), ("moonrl", "moonrl")):
        r = res[side]
        print("  %-14s %8.0f tokens/s  (step %.3f s; max RSS %5.0f MiB, %5.0f MiB above the process at start)" % (
            label, tokens / r["step_s"], r["step_s"], mib(r["max_rss"]), mib(r["max_rss"] - r["rss0"])))
    print("  moonrl memory accounted: %.0f MiB peak, of which activations %.0f MiB" % (
        mib(res["moonrl"]["total_peak"]), mib(res["moonrl"]["activations_peak"])))
    print("  ratio moonrl / pytorch: %.2fx   (best of %d alternating rounds; load average %.1f-%.1f meanwhile)" % (
        mt / tt, args.rounds, min(loads), max(loads)))
    print("  moonrl: %.1f GFLOP/s (useful: 6 x matmul params x tokens + attention) = %.0f%% of measured sgemm peak %.1f GFLOP/s (OpenBLAS, 2048^3, %d threads)" % (
        flops / res["moonrl"]["step_s"] / 1e9, 100 * flops / res["moonrl"]["step_s"] / 1e9 / peak, peak, args.threads))
    if args.dtype == "bf16":
        bpeak = bf16_peak(args.threads)
        print("  moonrl: %.0f%% of the measured bf16 product rate %.1f GFLOP/s (PyTorch bf16 matmul, 2048^3, %d threads)" % (
            100 * flops / res["moonrl"]["step_s"] / 1e9 / bpeak, bpeak, args.threads))
    dl = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(res["moonrl"]["losses"], res["torch"]["losses"]))
    print("  same weights and batch: losses over %d steps agree to %.1e (relative)" % (len(res["torch"]["losses"]), dl))

if __name__ == "__main__":
    main()
