"""moonrl.algo (LuaJIT over packed arrays) vs PyTorch CPU (padded tensors, veRL-style code, autograd)
on the same sizes: PPO-clip loss + gradient, GRPO advantages + broadcast, GAE. Prints seconds per
call for both and the ratio torch / moonrl (> 1: moonrl faster).

    /usr/bin/python3 bench/algo/algo_losses.py [build/moonrl] [nseq] [len]
"""
import json
import subprocess
import sys
import time

import torch

moonrl = sys.argv[1] if len(sys.argv) > 1 else "build/moonrl"
nseq = int(sys.argv[2]) if len(sys.argv) > 2 else 256
length = int(sys.argv[3]) if len(sys.argv) > 3 else 1024

out = subprocess.run([moonrl, "run", "bench/algo/algo_losses.lua", f"nseq={nseq}", f"len={length}"],
                     check=True, capture_output=True, text=True).stdout
ours = json.loads(out.strip().splitlines()[-1])

torch.manual_seed(0)
shape = (nseq, length)
lp = (torch.rand(shape) * -2.9 - 0.1).requires_grad_(True)
old = torch.rand(shape) * -2.9 - 0.1
adv = torch.rand(shape) * 2 - 1
values = torch.rand(shape) * 2 - 1
mask = torch.zeros(shape)
mask[:, length // 4:] = 1
scores = torch.rand(nseq)


def timed(fn, reps=10):
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def ppo():
    lp.grad = None
    ratio = torch.exp(torch.clamp(lp - old, -20, 20))
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 0.8, 1.28)
    pg = torch.maximum(pg1, pg2)
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * 3), pg)
    loss = (pg * mask).sum() / mask.sum()
    loss.backward()


def grpo():
    g = scores.view(-1, 8)
    a = ((g - g.mean(-1, keepdim=True)) / (g.std(-1, keepdim=True) + 1e-6)).view(-1)
    return a.unsqueeze(-1) * mask


rewards = torch.zeros(shape)
rewards[:, -1] = scores


def gae():
    with torch.no_grad():
        nextv = torch.zeros(nseq)
        last = torch.zeros(nseq)
        rev = []
        for t in reversed(range(length)):
            delta = rewards[:, t] + 0.99 * nextv - values[:, t]
            new = delta + 0.99 * 0.95 * last
            nextv = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextv
            last = new * mask[:, t] + (1 - mask[:, t]) * last
            rev.append(last)
        a = torch.stack(rev[::-1], dim=1)
        sel = a[mask.bool()]
        return (a - sel.mean()) * torch.rsqrt(sel.var() + 1e-8) * mask


theirs = {"ppo": timed(ppo), "grpo": timed(grpo), "gae": timed(gae, 3)}
print(f"tokens {ours['ntok']} (nseq {nseq} x {length}), torch threads {torch.get_num_threads()}")
for k in ("ppo", "grpo", "gae"):
    print(f"{k:5s} moonrl {ours[k] * 1e3:9.3f} ms   torch {theirs[k] * 1e3:9.3f} ms   ratio {theirs[k] / ours[k]:6.2f}")
