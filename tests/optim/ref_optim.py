"""AdamW, gradient clipping and lr schedules against PyTorch.

Random parameters split into weight / bias / norm tensors; biases and norms
get no weight decay (moonrl: no-decay ranges over one flat buffer; torch:
a second param group with weight_decay=0). Each of 6 steps: new random
gradients at scales that make clipping act on some steps and not others,
clip_grad_norm_(max_norm=1), a cosine-with-warm-up lr, AdamW.step. Final
parameters and the m / v state must match torch.optim.AdamW to a relative
error <= 1e-6 (of each tensor's largest magnitude: fp32 roundings differ
in order), the pre-clip norms to 1e-6, and the lr schedules the Python
formulas of transformers' get_*_schedule_with_warmup to 1e-12."""
import math
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

MOONRL = os.environ.get("MOONRL_EXE", "build/moonrl")
STEPS, WARMUP, TOTAL = 6, 2, 10
LR, BETAS, EPS, WD, MAX_NORM = 1e-2, (0.9, 0.95), 1e-8, 0.1, 1.0
SHAPES = [("embed", (50, 24), True), ("q.weight", (24, 24), True), ("q.bias", (24,), False),
          ("norm", (24,), False), ("mlp.weight", (24, 61), True), ("mlp.bias", (61,), False)]
GRAD_SCALES = [0.001, 0.5, 0.002, 2.0, 0.01, 5.0]


# The lr factor formulas of transformers.optimization (constant / linear /
# cosine with warm-up, cosine with a min-lr ratio).
def lr_constant(step, warmup):
    return step / max(1.0, warmup) if step < warmup else 1.0


def lr_linear(step, warmup, total):
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def lr_cosine(step, warmup, total, num_cycles=0.5, min_lr_rate=None):
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    f = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    if min_lr_rate is not None:
        f = f * (1.0 - min_lr_rate) + min_lr_rate
    return max(0.0, f)


def main():
    torch.manual_seed(7)
    params = [torch.randn(shape) for _, shape, _ in SHAPES]
    flat = torch.cat([p.reshape(-1) for p in params])
    n = flat.numel()
    grads = [[torch.randn(p.shape) * GRAD_SCALES[s] for p in params] for s in range(STEPS)]
    no_decay, off = [], 0
    for (_, shape, decay), p in zip(SHAPES, params):
        if not decay:
            no_decay.append("%d,%d" % (off, p.numel()))
        off += p.numel()
    meta = {"n": str(n), "steps": str(STEPS), "lr": repr(LR), "beta1": repr(BETAS[0]), "beta2": repr(BETAS[1]),
            "eps": repr(EPS), "weight_decay": repr(WD), "max_norm": repr(MAX_NORM), "warmup": str(WARMUP),
            "total": str(TOTAL), "no_decay": ";".join(no_decay)}

    with tempfile.TemporaryDirectory() as tmp:
        inp, out = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
        data = {"p0": flat.clone()}
        for s in range(STEPS):
            data["g%d" % s] = torch.cat([g.reshape(-1) for g in grads[s]])
        save_file(data, inp, metadata=meta)
        env = dict(os.environ, OPT_IN=inp, OPT_OUT=out)
        r = subprocess.run([MOONRL, "run", "tests/optim/optim_run.lua"], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            print("moonrl failed:", r.stdout, r.stderr)
            return 1
        got = load_file(out)

    # torch
    tparams = [p.clone().requires_grad_(True) for p in params]
    groups = [{"params": [p for p, (_, _, d) in zip(tparams, SHAPES) if d], "weight_decay": WD},
              {"params": [p for p, (_, _, d) in zip(tparams, SHAPES) if not d], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    norms = []
    for s in range(STEPS):
        for p, g in zip(tparams, grads[s]):
            p.grad = g.clone()
        norms.append(float(torch.nn.utils.clip_grad_norm_(tparams, MAX_NORM)))
        for group in opt.param_groups:
            group["lr"] = LR * lr_cosine(s + 1, WARMUP, TOTAL)
        opt.step()

    fails = 0

    def compare(name, a, b, tol):
        nonlocal fails
        err = (a.double() - b.double()).abs().max().item() / max(b.double().abs().max().item(), 1e-30)
        ok = err <= tol
        fails += not ok
        print("%s %-16s max relative error %.3g (tolerance %g)" % ("ok  " if ok else "FAIL", name, err, tol))

    off = 0
    for (name, _, _), p in zip(SHAPES, tparams):
        k = p.numel()
        st = opt.state[p]
        compare("p " + name, got["p"][off:off + k], p.detach().reshape(-1), 1e-6)
        compare("m " + name, got["m"][off:off + k], st["exp_avg"].reshape(-1), 1e-6)
        compare("v " + name, got["v"][off:off + k], st["exp_avg_sq"].reshape(-1), 1e-6)
        off += k
    compare("norms", got["norms"], torch.tensor(norms, dtype=torch.float64), 1e-6)
    nl = TOTAL + 3
    want = [[3e-4 * lr_constant(s, 3) for s in range(nl)],
            [3e-4 * lr_linear(s, 3, TOTAL) for s in range(nl)],
            [3e-4 * lr_cosine(s, 3, TOTAL) for s in range(nl)],
            [3e-4 * lr_cosine(s, 0, TOTAL, min_lr_rate=0.1) for s in range(nl)],
            [3e-4 * lr_cosine(s, 2, TOTAL, num_cycles=1.5) for s in range(nl)]]
    for k, name in enumerate(["constant", "linear", "cosine", "cosine min_lr", "cosine 1.5 cycles"]):
        compare("lr " + name, got["lrs"][k], torch.tensor(want[k], dtype=torch.float64), 1e-12)
    clipped = sum(1 for x in norms if x > MAX_NORM)
    print("steps clipped: %d of %d" % (clipped, STEPS))
    if not (0 < clipped < STEPS):
        fails += 1
        print("FAIL the test should clip on some steps only")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
