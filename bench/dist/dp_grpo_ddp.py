#!/usr/bin/env python3
"""PyTorch's side of bench/dist/dp_grpo.sh: the GRPO step of recipes/grpo.lua written out in plain
PyTorch 1.13 (Debian's torch: no transformers, no TRL), data parallel with
torch.nn.parallel.DistributedDataParallel over gloo, --ranks processes of --threads threads each.

The model is the same Llama as moonrl's side, loaded from the model directory moonrl saved
(model.safetensors, config.json); the prompts, sampling, reward and update are those of
bench/grpo/grpo_step.lua / grpo_step_trl.py. Each rank takes a contiguous share of the --prompts prompts
(a group never crosses ranks) and, per step:
  generate  --samples completions per prompt with a KV-cache loop over its rows as one batch
            (temperature 1, multinomial sampling; a row stops at EOS or --max-tokens, and the batch
            runs until its last row stops: what HF `generate` does)
  reward    the share of '7's in the decoded completion; the scores all-gathered; group advantages
            (r - mean) / (std + 1e-4) over each prompt's samples
  train     one forward over the rank's rows padded to its longest (HF / TRL style), log-probs and
            entropy, the on-policy PPO-clip loss token-mean over the global batch's response tokens,
            backward with DDP's bucketed all-reduce (gloo), clip_grad_norm_(1.0), AdamW (lr 1e-6,
            no weight decay)
--warmup steps are not timed; then --steps timed steps. Rank 0 prints one JSON line: per step the
seconds of the whole step and of its phases, and the global response tokens.

usage: /usr/bin/python3 bench/dist/dp_grpo_ddp.py MODEL_DIR [--ranks 2] [--threads 1] [--prompts 16]
       [--samples 8] [--max-tokens 64] [--steps 6] [--warmup 1] [--port 29533]
"""
import argparse
import json
import math
import os
import struct
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = bytearray(f.read())
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", t["dtype"]
        a, b = t["data_offsets"]
        out[name] = torch.frombuffer(data, dtype=torch.float32, offset=a, count=(b - a) // 4).reshape(t["shape"]).clone()
    return out


def build(cfg):
    D, H, Hk, V = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    hd, eps, L = cfg.get("head_dim", D // H), cfg["rms_norm_eps"], cfg["num_hidden_layers"]
    G = H // Hk
    theta = cfg.get("rope_theta", 10000.0)
    lin = lambda i, o: torch.nn.Linear(i, o, bias=False)
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.arange(cfg["max_position_embeddings"]).float()[:, None] * inv[None, :]
    COS, SIN = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rot(t):
        return torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], -1)

    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(D))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.weight

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = lin(D, H * hd), lin(D, Hk * hd), lin(D, Hk * hd)
            self.o_proj = lin(H * hd, D)

        def forward(self, h, pos0, mask, cache):
            B, S, _ = h.shape
            cos, sin = COS[pos0:pos0 + S], SIN[pos0:pos0 + S]
            q = self.q_proj(h).view(B, S, H, hd).transpose(1, 2)
            k = self.k_proj(h).view(B, S, Hk, hd).transpose(1, 2)
            v = self.v_proj(h).view(B, S, Hk, hd).transpose(1, 2)
            q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
            if cache is not None:  # generation: the KV cache [B, Hk, max, hd], written in place
                kc, vc = cache
                kc[:, :, pos0:pos0 + S], vc[:, :, pos0:pos0 + S] = k, v
                k, v = kc[:, :, :pos0 + S], vc[:, :, :pos0 + S]
            n = k.shape[2]
            # grouped-query attention without repeating K, V: heads h = kv * G + g
            s = q.reshape(B, Hk, G * S, hd) @ k.transpose(-1, -2) / math.sqrt(hd)
            if mask is not None:
                s = (s.view(B, Hk, G, S, n) + mask).view(B, Hk, G * S, n)
            att = (torch.softmax(s, -1) @ v).view(B, H, S, hd)
            return self.o_proj(att.transpose(1, 2).reshape(B, S, H * hd))

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            I = cfg["intermediate_size"]
            self.gate_proj, self.up_proj, self.down_proj = lin(D, I), lin(D, I), lin(I, D)

        def forward(self, h):
            return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm, self.post_attention_layernorm = Norm(), Norm()
            self.self_attn, self.mlp = Attention(), MLP()

        def forward(self, x, pos0, mask, cache):
            x = x + self.self_attn(self.input_layernorm(x), pos0, mask, cache)
            return x + self.mlp(self.post_attention_layernorm(x))

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(V, D)
            self.layers = torch.nn.ModuleList([Layer() for _ in range(L)])
            self.norm = Norm()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()
            self.lm_head = lin(D, V)

        def forward(self, tokens, pos0=0, caches=None, last_only=False):
            S = tokens.shape[1]
            n = pos0 + S
            mask = torch.full((S, n), float("-inf")).triu(pos0 + 1) if S > 1 else None
            x = self.model.embed_tokens(tokens)
            for i, layer in enumerate(self.model.layers):
                x = layer(x, pos0, mask, caches[i] if caches is not None else None)
            if last_only:
                x = x[:, -1]
            return self.lm_head(self.model.norm(x))

    return Model(), (L, Hk, hd)


def worker(rank, a):
    torch.set_num_threads(a.threads)
    if a.ranks > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank, world_size=a.ranks)
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    vocab = json.load(open(os.path.join(a.model, "tokenizer.json")))["model"]["vocab"]
    text_of = {i: s for s, i in vocab.items() if not s.startswith("<|")}
    bos, eos, pad = vocab["<|bos|>"], cfg["eos_token_id"], vocab["<|pad|>"]
    model, (L, Hk, hd) = build(cfg)
    model.load_state_dict(read_safetensors(os.path.join(a.model, "model.safetensors")))
    ddp = torch.nn.parallel.DistributedDataParallel(model) if a.ranks > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    # this rank's prompts: a contiguous share (the first P % ranks ranks one more)
    P, Gs = a.prompts, a.samples
    base, extra = divmod(P, a.ranks)
    first = rank * base + min(rank, extra)
    mine = list(range(first, first + base + (rank < extra)))
    prompts = [[bos] + [vocab[c] for c in f"{10 + i}+{30 + 2 * i}="] for i in range(1, P + 1)]
    gen = torch.Generator().manual_seed(1 + rank)
    records = []
    for k in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        # ---- generate
        rows = torch.tensor([prompts[i] for i in mine for _ in range(Gs)], dtype=torch.int64)
        B, Pl = rows.shape
        out = torch.full((B, a.max_tokens), pad, dtype=torch.int64)
        lens = torch.full((B,), a.max_tokens, dtype=torch.int64)
        done = torch.zeros(B, dtype=torch.bool)
        with torch.inference_mode():
            caches = [(torch.empty(B, Hk, Pl + a.max_tokens, hd), torch.empty(B, Hk, Pl + a.max_tokens, hd))
                      for _ in range(L)]
            logits = model(rows, 0, caches, last_only=True)
            for t in range(a.max_tokens):
                tok = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
                tok = torch.where(done, torch.full_like(tok, pad), tok)
                out[:, t] = tok
                newly = (tok == eos) & ~done
                lens[newly] = t + 1  # the EOS is part of the completion (as in moonrl and TRL)
                done |= newly
                if bool(done.all()) or t + 1 == a.max_tokens:
                    break
                logits = model(tok[:, None], Pl + t, caches, last_only=True)
        t1 = time.perf_counter()
        # ---- reward and group advantages over the whole batch
        texts = ["".join(text_of.get(int(x), "") for x in out[r, :lens[r]]) for r in range(B)]
        scores = torch.tensor([s.count("7") / max(len(s), 1) for s in texts], dtype=torch.float64)
        if a.ranks > 1:
            counts = [None] * a.ranks
            dist.all_gather_object(counts, scores.tolist())
            all_scores = torch.tensor([x for c in counts for x in c], dtype=torch.float64)
        else:
            all_scores = scores
        g = all_scores.view(-1, Gs)
        adv_all = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view(-1)
        adv = adv_all[first * Gs:(first + len(mine)) * Gs].float()
        t2 = time.perf_counter()
        # ---- train: rows padded to the longest completion of this rank
        Lmax = int(lens.max())
        seq = torch.cat([rows, out[:, :Lmax]], 1)
        mask = (torch.arange(Lmax)[None, :] < lens[:, None]).float()
        n_tok = mask.sum()
        global_tokens = n_tok.clone()
        if a.ranks > 1:
            dist.all_reduce(global_tokens)
        logp_all = torch.log_softmax(ddp(seq[:, :-1]), -1)[:, Pl - 1:]  # the outputs that predict the completion
        lp = logp_all.gather(-1, seq[:, Pl:, None])[..., 0]
        with torch.no_grad():
            entropy = float(-((logp_all.exp() * logp_all).sum(-1) * mask).sum() / n_tok)
        ratio = torch.exp(lp - lp.detach())  # on-policy, one epoch: log pi_old = log pi
        a_ = adv[:, None]
        pg = torch.max(-a_ * ratio, -a_ * ratio.clamp(0.8, 1.2))
        # token-mean over the global batch; DDP averages gradients over ranks, hence the * ranks
        loss = (pg * mask).sum() / global_tokens * a.ranks
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        t3 = time.perf_counter()
        tokens = torch.tensor([float(lens.sum()), float(B * (Pl + Lmax - 1))])
        if a.ranks > 1:
            dist.all_reduce(tokens)
        records.append(dict(step=k + 1, total=t3 - t0, generate=t1 - t0, reward=t2 - t1, train=t3 - t2,
                            tokens=int(tokens[0]), padded_tokens=int(tokens[1]), entropy=entropy, grad_norm=gnorm,
                            reward_mean=float(all_scores.mean())))
    if rank == 0:
        timed = records[a.warmup:]
        med = lambda key: sorted(r[key] for r in timed)[len(timed) // 2] if len(timed) % 2 else \
            0.5 * sum(sorted(r[key] for r in timed)[len(timed) // 2 - 1:len(timed) // 2 + 1])
        print(json.dumps({"side": "torch", "ranks": a.ranks, "threads": a.threads, "torch": torch.__version__,
                          "median": {k: med(k) for k in ("total", "generate", "reward", "train")},
                          "tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["total"] for r in timed),
                          "train_tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["train"] for r in timed),
                          "steps": records}), flush=True)
    if a.ranks > 1:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--port", type=int, default=29533)
    a = ap.parse_args()
    if a.ranks > 1:
        mp.spawn(worker, args=(a,), nprocs=a.ranks, join=True)
    else:
        worker(0, a)


if __name__ == "__main__":
    main()
