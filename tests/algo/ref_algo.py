"""Independent PyTorch reference for moonrl.algo (run by tests/algo/test_algo_ref.lua).

Reads a JSON file of cases that the Lua test wrote: each case holds its inputs (packed per-token
arrays with cu_seqlens), its options, and what moonrl computed (values, metrics, gradients). This
script recomputes everything from the inputs the way veRL / TRL write it — padded [B, T] tensors,
float64, torch.autograd for gradients — and compares. Exit status 1 and a list of mismatches when
any value differs by more than atol + rtol·|want|.

    /usr/bin/python3 tests/algo/ref_algo.py cases.json
"""
import json
import math
import sys
from collections import OrderedDict

import torch
import torch.nn.functional as F

torch.set_default_dtype(torch.float64)
ATOL, RTOL = 1e-8, 1e-7
failures = []
checked = 0


def close(name, got, want):
    global checked
    got = torch.as_tensor(got, dtype=torch.float64).flatten()
    want = torch.as_tensor(want, dtype=torch.float64).flatten()
    checked += 1
    if got.shape != want.shape:
        failures.append(f"{name}: shape {tuple(got.shape)} vs reference {tuple(want.shape)}")
        return
    err = (got - want).abs()
    bad = err > ATOL + RTOL * want.abs()
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        failures.append(f"{name}: element {i}: moonrl {got[i].item():.12g} vs reference {want[i].item():.12g}"
                        f" ({int(bad.sum())} of {got.numel()} differ)")


# ---------------------------------------------------------------- packed <-> padded

def pad(x, cu, fill=0.0):
    b = len(cu) - 1
    t = max([cu[i + 1] - cu[i] for i in range(b)] + [1])
    out = torch.full((b, t), fill)
    for i in range(b):
        n = cu[i + 1] - cu[i]
        out[i, :n] = torch.tensor(x[cu[i]:cu[i + 1]], dtype=torch.float64)
    return out


def unpad(x, cu):
    parts = [x[i, :cu[i + 1] - cu[i]] for i in range(len(cu) - 1)]
    return torch.cat(parts) if parts else torch.zeros(0)


def masked_mean(x, m):
    return (x * m).sum() / m.sum() if m.sum() > 0 else torch.tensor(0.0)


def masked_whiten(x, m, eps=1e-8):
    sel = x[m.bool()]
    mean = sel.mean()
    var = sel.var() if sel.numel() > 1 else torch.tensor(0.0)  # unbiased (n-1)
    return (x - mean) * torch.rsqrt(var + eps) * m


def agg(L, m, mode, o):
    # an empty denominator (no token counts) gives 0, with a zero gradient
    if mode == "token-mean":
        d = o.get("global_tokens", m.sum())
        return (L * m).sum() / d if d > 0 else (L * m).sum() * 0
    if mode == "seq-mean-token-sum-norm":
        return (L * m).sum() / o["norm"]
    lens = m.sum(-1)
    valid = lens > 0
    seq = (L * m).sum(-1)
    if mode == "seq-mean-token-mean":
        seq = seq / lens.clamp(min=1)
    d = o.get("global_seqs", valid.sum())
    return seq[valid].sum() / d if d > 0 else (L * m).sum() * 0


def masked_max(x, m):
    sel = x[m.bool()]
    return sel.max() if sel.numel() else torch.tensor(0.0)


# ---------------------------------------------------------------- advantages

def groups(ids):
    g = OrderedDict()
    for i, k in enumerate(ids):
        g.setdefault(k, []).append(i)
    return list(g.values())


def ref_grpo(c):
    s = torch.tensor(c["scores"])
    o = c["opts"]
    scale, eps, mode = o.get("scale", "group"), o.get("eps", 1e-6), o.get("eps_mode", "std")
    out = torch.zeros_like(s)
    bstd = s.std() if s.numel() > 1 else torch.tensor(1.0)
    for idx in groups(c["group_ids"]):
        g = s[idx]
        mean, std = (g.mean(), g.std()) if len(idx) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
        if scale == "batch":
            std = bstd
        if scale == "none":
            out[idx] = g - mean
        elif mode == "std":
            out[idx] = (g - mean) / (std + eps)
        else:
            out[idx] = (g - mean) / torch.sqrt(std * std + eps)
    close(c["name"] + " advantages", c["out"]["adv"], out)
    m = torch.tensor(c["mask"])
    cu = c["cu"]
    tok = torch.cat([out[i] * m[cu[i]:cu[i + 1]] for i in range(len(cu) - 1)])
    close(c["name"] + " to_tokens", c["out"]["tok"], tok)


def ref_rloo(c):
    s = torch.tensor(c["scores"])
    out = torch.zeros_like(s)
    for idx in groups(c["group_ids"]):
        for i in idx:
            others = [j for j in idx if j != i]
            out[i] = s[i] - (s[others].mean() if others else 0.0)
    close(c["name"] + " advantages", c["out"]["adv"], out)


def kl_value(lp, ref, est, clamp):
    if est in ("k1", "kl"):
        return lp - ref
    if est in ("k2", "mse"):
        return 0.5 * (lp - ref) ** 2
    x = ref - lp
    if clamp:
        x = torch.clamp(x, -20, 20)
    k = torch.exp(x) - x - 1
    return torch.clamp(k, -10, 10) if clamp else k


def token_rewards(c, cu, m):
    """veRL: the score on the last response token, plus −β·KL(old, ref) on response tokens."""
    o = c["opts"]
    r = torch.zeros_like(m)
    if o.get("kl_coef"):
        k = kl_value(pad(c["old_logprob"], cu), pad(c["ref_logprob"], cu), o.get("kl_estimator", "k1"), True)
        r = r - o["kl_coef"] * k * m
    for i, s in enumerate(c["scores"]):
        pos = m[i].nonzero()
        if len(pos):
            r[i, int(pos[-1])] += s
    return r


def ref_reinforce_pp(c):
    cu = c["cu"]
    m = pad(c["mask"], cu)
    r = token_rewards(c, cu, m)
    close(c["name"] + " token_rewards", c["out"]["token_rewards"], unpad(r, cu))
    gamma = c["opts"].get("gamma", 1.0)
    ret = torch.zeros_like(r)
    running = torch.zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        running = r[:, t] + gamma * running
        ret[:, t] = running
        running = running * m[:, t]
    close(c["name"] + " returns", c["out"]["returns"], unpad(ret, cu))
    close(c["name"] + " advantages", c["out"]["adv"], unpad(masked_whiten(ret, m), cu))


def ref_gae(c):
    cu = c["cu"]
    m = pad(c["mask"], cu)
    r = token_rewards(c, cu, m)
    v = pad(c["values"], cu)
    o = c["opts"]
    gamma, lam = o.get("gamma", 1.0), o.get("lam", 1.0)
    nextv = torch.zeros(r.shape[0])
    last = torch.zeros(r.shape[0])
    adv = torch.zeros_like(r)
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * nextv - v[:, t]
        new = delta + gamma * lam * last
        nextv = v[:, t] * m[:, t] + (1 - m[:, t]) * nextv
        last = new * m[:, t] + (1 - m[:, t]) * last
        adv[:, t] = last
    ret = (adv + v) * m
    close(c["name"] + " returns", c["out"]["returns"], unpad(ret, cu))
    a = masked_whiten(adv, m) if o.get("whiten", True) else adv * m
    close(c["name"] + " advantages", c["out"]["adv"], unpad(a, cu))


# ---------------------------------------------------------------- losses (autograd)

def check_loss(c, loss, metrics, wrt, gname="grad"):
    close(c["name"] + " loss", c["out"]["loss"], loss.detach())
    for k, v in metrics.items():
        close(c["name"] + " metric " + k, c["out"]["metrics"][k], v)
    loss.backward()
    close(c["name"] + " gradient", c["out"][gname], unpad(wrt.grad, c["cu"]))


def ref_policy(c, gspo, behav_weight=None, extra_metrics=None):
    cu, o = c["cu"], c["opts"]
    lp = pad(c["logprob"], cu).requires_grad_(True)
    old, adv, m = pad(c["old_logprob"], cu), pad(c["advantages"], cu), pad(c["mask"], cu)
    lo = o.get("clip_low", 3e-4 if gspo else 0.2)
    hi = o.get("clip_high", 4e-4 if gspo else lo)
    cap = o.get("log_ratio_clamp", 10 if gspo else 20)
    neg = lp - old
    if gspo:
        seq = (neg * m).sum(-1) / m.sum(-1).clamp(min=1)
        logr = lp - lp.detach() + seq.detach().unsqueeze(-1)
        if cap is not False:
            logr = torch.clamp(logr, max=cap)
    else:
        logr = torch.clamp(neg, -cap, cap) if cap is not False else neg
    ratio = torch.exp(logr)
    x = -neg.detach()
    if cap is not False:
        x = torch.clamp(x, -cap, cap)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - lo, 1 + hi)
    pg = torch.maximum(pg1, pg2)
    clipped = (pg2 > pg1).double()
    metrics = {
        "clipfrac": masked_mean(clipped, m),
        "clipfrac_low": masked_mean(clipped * (adv < 0), m),
        "clipfrac_high": masked_mean(clipped * (adv > 0), m),
        "ratio_mean": masked_mean(ratio.detach(), m),
        "ratio_max": masked_max(ratio.detach(), m),
        "approx_kl": masked_mean(x, m),
        "approx_kl_k3": masked_mean(torch.exp(x) - x - 1, m),
    }
    if o.get("dual_clip"):
        pg3 = -adv * o["dual_clip"]
        metrics["dual_clipfrac"] = masked_mean(((pg > pg3) & (adv < 0)).double(), m)
        pg = torch.where(adv < 0, torch.minimum(pg, pg3), pg)
    if "rollout_logprob" in c:
        w = torch.clamp(torch.exp(old - pad(c["rollout_logprob"], cu)), max=o.get("tis_cap", 2))
        metrics["tis_weight_mean"] = masked_mean(w, m)
        pg = pg * w
    if behav_weight is not None:  # decoupled PPO: the behaviour weight multiplies the clipped term
        pg = pg * behav_weight
    if "weights" in c:  # per-token correction weights (data)
        pg = pg * pad(c["weights"], cu)
    metrics.update(extra_metrics or {})
    mode = o.get("agg", "seq-mean-token-mean" if gspo else "token-mean")
    loss = o.get("coef", 1.0) * agg(pg, m, mode, o)
    check_loss(c, loss, metrics, lp)


def ref_reinforce(c):
    """Plain REINFORCE: L = -A * log pi (no ratio, no clip); the ratio metrics against old."""
    cu, o = c["cu"], c["opts"]
    lp = pad(c["logprob"], cu).requires_grad_(True)
    adv, m = pad(c["advantages"], cu), pad(c["mask"], cu)
    pg = -adv * lp
    metrics = {"clipfrac": 0.0, "clipfrac_low": 0.0, "clipfrac_high": 0.0, "dual_clipfrac": 0.0}
    if "old_logprob" in c:
        x = torch.clamp(pad(c["old_logprob"], cu) - lp.detach(), -20, 20)
        metrics.update({"approx_kl": masked_mean(x, m), "approx_kl_k3": masked_mean(torch.exp(x) - x - 1, m),
                        "ratio_mean": masked_mean(torch.exp(-x), m), "ratio_max": masked_max(torch.exp(-x), m)})
    if "rollout_logprob" in c:
        base = pad(c["old_logprob"], cu) if "old_logprob" in c else lp.detach()
        w = torch.clamp(torch.exp(base - pad(c["rollout_logprob"], cu)), max=o.get("tis_cap", 2))
        metrics["tis_weight_mean"] = masked_mean(w, m)
        pg = pg * w
    if "weights" in c:
        pg = pg * pad(c["weights"], cu)
    loss = o.get("coef", 1.0) * agg(pg, m, o.get("agg", "token-mean"), o)
    check_loss(c, loss, metrics, lp)


# ---------------------------------------------------------------- off-policy corrections

SAFETY_BOUND = 20.0  # verl rollout_corr_helper: exponentials of logs clamped to ±20


def correction_weights(prox, behav, m, o):
    """verl's rollout correction (IS weights / rejection masks) on padded [B, T] tensors."""
    mode = o.get("mode", "tis")
    C = o.get("clip", 2.0)
    upper = o.get("upper", 1.01 if mode == "mis_geo" else 2.0)
    lower = o.get("lower", 1.0 / upper)
    keep_ratio = o.get("weight", "mask") == "ratio"
    lo = math.log(lower) if lower > 0 else -math.inf
    hi = math.log(upper) if upper < math.inf else math.inf
    logC = math.log(C) if C < math.inf else math.inf
    lr = prox - behav
    tok_ratio = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    n = m.sum(-1)
    valid = n > 0
    S = (lr * m).sum(-1)
    G = S / n.clamp(min=1)
    ones = torch.ones_like(lr)
    clipped = torch.zeros_like(lr)
    rejected = torch.zeros_like(lr)
    seq_level = None
    if mode == "none":
        w = ones
    elif mode == "tis":
        w = tok_ratio.clamp(max=C)
        clipped = (lr > logC).double()
    elif mode == "mis_token":
        acc = (lr >= lo) & (lr <= hi)
        w = torch.where(acc, tok_ratio if keep_ratio else ones, torch.zeros_like(lr))
        rejected = (~acc).double()
    else:
        L = G if mode == "mis_geo" else S
        seq_level = torch.exp(L.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        if mode == "tis_seq":
            w = seq_level.clamp(max=C).unsqueeze(-1) * ones
            clipped = (L > logC).double().unsqueeze(-1) * ones
        else:
            acc = (L >= lo) & (L <= hi)
            w = torch.where(acc, seq_level if keep_ratio else torch.ones_like(L), torch.zeros_like(L)).unsqueeze(-1) * ones
            rejected = (~acc).double().unsqueeze(-1) * ones
    w = w * m
    seq_hit = ((rejected * m).sum(-1) > 0) & valid
    nvalid = valid.sum()
    metrics = {
        "ratio_mean": masked_mean(tok_ratio, m), "ratio_max": masked_max(tok_ratio, m),
        "weight_mean": masked_mean(w, m), "clipfrac": masked_mean(clipped, m),
        "masked_frac": masked_mean(rejected, m),
        "seq_masked_frac": seq_hit.sum() / nvalid if nvalid > 0 else torch.tensor(0.0),
        "kl_k1": masked_mean(-lr, m),
        "kl_k3": masked_mean(tok_ratio - lr.clamp(-SAFETY_BOUND, SAFETY_BOUND) - 1, m),
        "tokens": m.sum(), "seqs": nvalid,
    }
    if seq_level is not None:
        sv = seq_level[valid]
        metrics["seq_ratio_mean"] = sv.mean() if sv.numel() else torch.tensor(0.0)
        metrics["seq_ratio_max"] = sv.max() if sv.numel() else torch.tensor(0.0)
    return w, metrics


def ref_correction(c):
    cu, o = c["cu"], c["opts"]
    m = pad(c["mask"], cu)
    w, metrics = correction_weights(pad(c["proximal_logprob"], cu), pad(c["behavior_logprob"], cu), m, o)
    close(c["name"] + " weights", c["out"]["weights"], unpad(w, cu))
    for k, v in metrics.items():
        close(c["name"] + " metric " + k, c["out"]["metrics"][k], v)
    if set(c["out"]["metrics"]) != set(metrics):
        failures.append(f"{c['name']}: metric names {sorted(c['out']['metrics'])} vs reference {sorted(metrics)}")


def ref_decoupled_ppo(c):
    """AReaL's ppo_actor_loss_fn with use_decoupled_loss: −(π_prox/μ)·min(rA, clip(r)A), r = πθ/π_prox;
    behav_imp_weight_cap drops the tokens whose weight exceeds it (or truncates, behav_cap_mode)."""
    cu, o = c["cu"], c["opts"]
    prox_key = "proximal_logprob" if "proximal_logprob" in c else "old_logprob"
    c = dict(c, old_logprob=c[prox_key])
    prox, behav, m = pad(c[prox_key], cu), pad(c["behavior_logprob"], cu), pad(c["mask"], cu)
    cap, cap_mode = o.get("behav_imp_weight_cap"), o.get("behav_cap_mode", "mask")
    lr = prox - behav
    bw = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    if cap is not None and cap_mode == "mask":
        bw = torch.where(lr <= math.log(cap), bw, torch.zeros_like(bw))
        _, stats = correction_weights(prox, behav, m, {"mode": "mis_token", "lower": 0, "upper": cap, "weight": "ratio"})
    else:
        bw = bw.clamp(max=cap if cap is not None else math.inf)
        _, stats = correction_weights(prox, behav, m, {"mode": "tis", "clip": cap if cap is not None else math.inf})
    stats.pop("seq_masked_frac")
    if not (cap is not None and cap_mode == "mask"):
        stats.pop("masked_frac")
    if not (cap is not None and cap_mode == "truncate"):
        stats.pop("clipfrac")
    ref_policy(c, False, behav_weight=bw, extra_metrics={"behav_" + k: v for k, v in stats.items()})


def ref_kl(c):
    cu, o = c["cu"], c["opts"]
    lp = pad(c["logprob"], cu).requires_grad_(True)
    ref, m = pad(c["ref_logprob"], cu), pad(c["mask"], cu)
    k = kl_value(lp, ref, o.get("estimator", "k3"), o.get("clamp", True))
    kl = agg(k, m, o.get("agg", "token-mean"), o)
    check_loss(c, o.get("coef", 0.001) * kl, {"kl": kl.detach()}, lp)


def ref_entropy(c):
    cu, o = c["cu"], c["opts"]
    h = pad(c["entropy"], cu).requires_grad_(True)
    m = pad(c["mask"], cu)
    e = agg(h, m, o.get("agg", "token-mean"), o)
    check_loss(c, -o.get("coef", 0.001) * e, {"entropy": e.detach()}, h)


def ref_value(c):
    cu, o = c["cu"], c["opts"]
    v = pad(c["values"], cu).requires_grad_(True)
    vold, ret, m = pad(c["old_values"], cu), pad(c["returns"], cu), pad(c["mask"], cu)
    eps = o.get("clip", 0.5)
    l1 = (v - ret) ** 2
    vc = torch.max(torch.min(v, vold + eps), vold - eps)
    l2 = (vc - ret) ** 2
    L = torch.maximum(l1, l2)
    vf = 0.5 * agg(L, m, o.get("agg", "token-mean"), o)
    metrics = {"vf_loss": vf.detach(), "vf_clipfrac": masked_mean((l2 > l1).double(), m)}
    check_loss(c, o.get("coef", 1.0) * vf, metrics, v)


def ref_dpo(c):
    cu, o = c["cu"], c["opts"]
    lp = pad(c["logprob"], cu).requires_grad_(True)
    m = pad(c["mask"], cu)
    n = m.sum(-1)
    S = (lp * m).sum(-1)
    R = (pad(c["ref_logprob"], cu) * m).sum(-1) if "ref_logprob" in c else torch.tensor(c["ref_seq"])
    if o.get("length_normalize"):
        S, R = S / n.clamp(min=1), R / n.clamp(min=1)
    b = len(cu) - 1
    if o.get("layout", "interleaved") == "interleaved":
        w, l = list(range(0, b, 2)), list(range(1, b, 2))
    else:
        w, l = list(range(b // 2)), list(range(b // 2, b))
    beta, eps = o.get("beta", 0.1), o.get("label_smoothing", 0.0)
    dw, dl = S[w] - R[w], S[l] - R[l]
    h = dw - dl
    kind = o.get("loss_type", "sigmoid")
    if kind == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif kind == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        losses = torch.relu(1 - beta * h)
    loss = losses.sum() / o.get("global_pairs", len(w))
    cr, rr = beta * dw.detach(), beta * dl.detach()
    metrics = {"loss": loss.detach(), "rewards_chosen": cr.mean(), "rewards_rejected": rr.mean(),
               "rewards_margin": (cr - rr).mean(), "rewards_accuracy": (cr > rr).double().mean(),
               "logps_chosen": S[w].detach().mean(), "logps_rejected": S[l].detach().mean()}
    check_loss(c, o.get("coef", 1.0) * loss, metrics, lp)


def ref_sft(c):
    cu, o = c["cu"], c["opts"]
    lp = pad(c["logprob"], cu).requires_grad_(True)
    m = pad(c["mask"], cu)
    nll = agg(-lp, m, o.get("agg", "token-mean"), o)
    check_loss(c, o.get("coef", 1.0) * nll, {"nll": nll.detach()}, lp)


REFS = {"grpo": ref_grpo, "rloo": ref_rloo, "reinforce_pp": ref_reinforce_pp, "gae": ref_gae,
        "ppo": lambda c: ref_policy(c, False), "gspo": lambda c: ref_policy(c, True), "kl": ref_kl,
        "reinforce": ref_reinforce,
        "correction": ref_correction, "decoupled_ppo": ref_decoupled_ppo,
        "entropy": ref_entropy, "value": ref_value, "dpo": ref_dpo, "sft": ref_sft}


def main():
    with open(sys.argv[1]) as f:
        cases = json.load(f)["cases"]
    kinds = set()
    for c in cases:
        REFS[c["kind"]](c)
        kinds.add(c["kind"])
    missing = set(REFS) - kinds
    if missing:
        failures.append("no cases for: " + ", ".join(sorted(missing)))
    for msg in failures:
        print("MISMATCH", msg)
    print(f"{len(cases)} cases, {checked} comparisons, {len(failures)} mismatches")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
