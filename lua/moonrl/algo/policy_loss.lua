-- Policy-gradient losses over packed per-token arrays: PPO-clip (with DAPO clip-higher, dual-clip,
-- log-ratio clamp, truncated importance sampling) and GSPO (sequence-level ratio).
--
-- Inputs (cdata arrays, 0-based):
--   per token [ntok]: logprob (log πθ, from the core), old_logprob (log π_old, the policy that
--     collected the batch, or the same as logprob when on-policy), advantages (already broadcast to
--     tokens, e.g. advantages.to_tokens), mask; optional rollout_logprob (the inference engine's
--     log-probs, for truncated importance sampling)
--   cu_seqlens [nseq+1], nseq
-- Output: loss (number), metrics (table); when args.grad [ntok] is given, coef · dloss/dlogprob is
-- ADDED into it (zero it first; several terms then sum into one gradient).
--
-- Per token, with Δ = logprob − old_logprob and r = exp(Δ):
--   L = max(−A·r, −A·clip(r, 1 − clip_low, 1 + clip_high))
--   dual-clip (args.dual_clip = c, typically 3; only where A < 0): L = min(L, −c·A)
--   truncated IS (args.rollout_logprob given): L ← L · min(exp(old_logprob − rollout_logprob), tis_cap),
--   the weight detached
-- and loss = coef · agg(L) (args.agg, default 'token-mean'; global_tokens / global_seqs / norm for
-- gradient accumulation, see agg.lua).
local agg = require('moonrl.algo.agg')

local M = {}
local exp, min, max = math.exp, math.min, math.max

local function clip_loss(args, gspo, fn)
  local nseq, ntok = agg.check_batch(args, fn)
  local lp = agg.check_array(args, 'logprob', ntok, fn)
  local old = agg.check_array(args, 'old_logprob', ntok, fn)
  local adv = agg.check_array(args, 'advantages', ntok, fn)
  local grad = agg.check_array(args, 'grad', ntok, fn, true)
  local roll = agg.check_array(args, 'rollout_logprob', ntok, fn, true)
  local lo = args.clip_low or (gspo and 3e-4 or 0.2)
  local hi = args.clip_high or (gspo and 4e-4 or lo)
  if lo < 0 or lo >= 1 or hi < 0 then
    error(string.format('%s: clip_low must be in [0, 1) and clip_high >= 0, got %s and %s', fn, lo, hi), 3)
  end
  local dual = args.dual_clip or 0
  if dual ~= 0 and (gspo or dual <= 1) then
    error(string.format('%s: dual_clip must be a number > 1 (PPO only), got %s', fn, tostring(dual)), 3)
  end
  local cap = args.log_ratio_clamp
  if cap == nil then cap = gspo and 10 or 20 end
  if cap == false then cap = math.huge end
  local tis_cap = args.tis_cap or 2
  local coef = args.coef or 1
  local w = agg.seq_weights(args, args.agg or (gspo and 'seq-mean-token-mean' or 'token-mean'))
  local cu, mask = args.cu_seqlens, args.mask
  local rlo, rhi = 1 - lo, 1 + hi

  local total = 0
  local n, n_low, n_high, n_dual = 0, 0, 0, 0
  local kl1, kl3, rsum, rmax, tis_sum = 0, 0, 0, -math.huge, 0
  for i = 0, nseq - 1 do
    local t0, t1 = cu[i], cu[i + 1] - 1
    local wi = w[i]
    -- GSPO: the sequence's mean log-ratio, the same value for all its tokens (upper clamp only, veRL)
    local seq_logr, seq_g = 0, 1
    if gspo then
      local sd, sm = 0, 0
      for t = t0, t1 do
        local m = mask[t]
        sd = sd + m * (lp[t] - old[t])
        sm = sm + m
      end
      seq_logr = sd / max(sm, 1)
      if seq_logr > cap then seq_logr = cap; seq_g = 0 end
    end
    local s = 0
    for t = t0, t1 do
      local m = mask[t]
      if m ~= 0 then
        local d = lp[t] - old[t]
        local logr, g = seq_logr, seq_g
        if not gspo then
          logr, g = d, 1
          if logr > cap then logr = cap; g = 0 elseif logr < -cap then logr = -cap; g = 0 end
        end
        local r = exp(logr)
        local a = adv[t]
        local pg1 = -a * r
        local pg2 = -a * min(max(r, rlo), rhi)
        local L, dLdr = pg1, -a
        if pg2 > pg1 then
          L, dLdr = pg2, 0
          if a > 0 then n_high = n_high + m else n_low = n_low + m end
        end
        if dual ~= 0 and a < 0 and L > -a * dual then
          L, dLdr = -a * dual, 0
          n_dual = n_dual + m
        end
        local dL = dLdr * r * g
        if roll ~= nil then
          local iw = min(exp(min(old[t] - roll[t], 20)), tis_cap)
          L, dL = L * iw, dL * iw
          tis_sum = tis_sum + m * iw
        end
        s = s + m * L
        if grad ~= nil then grad[t] = grad[t] + coef * wi * m * dL end
        -- metrics: old vs new policy, per token
        local x, ex
        if gspo then
          x = min(max(-d, -cap), cap)
          ex = exp(x)
        else
          x, ex = -logr, 1 / r   -- the same clamp; exp(−logr) = 1/r saves an exp per token
        end
        kl1 = kl1 + m * x
        kl3 = kl3 + m * (ex - x - 1)
        rsum = rsum + m * r
        rmax = max(rmax, r)
        n = n + m
      end
    end
    total = total + wi * s
  end
  local inv = n > 0 and 1 / n or 0
  local metrics = {
    pg_loss = total,
    clipfrac = (n_low + n_high) * inv,
    clipfrac_low = n_low * inv,
    clipfrac_high = n_high * inv,
    dual_clipfrac = n_dual * inv,
    approx_kl = kl1 * inv,
    approx_kl_k3 = kl3 * inv,
    ratio_mean = rsum * inv,
    ratio_max = n > 0 and rmax or 0,
    tokens = n,
  }
  if roll ~= nil then metrics.tis_weight_mean = tis_sum * inv end
  return coef * total, metrics
end

-- PPO-clip (see the top of this file).
--   args.clip_low (0.2), args.clip_high (= clip_low; DAPO clip-higher: 0.28), args.dual_clip
--   (off; c = 3 typical), args.log_ratio_clamp (20, veRL; false = none: TRL, AReaL, NeMo-RL),
--   args.rollout_logprob + args.tis_cap (2; slime 2, TRL 3), args.coef (1), args.agg ('token-mean').
-- Metrics (masked token means over this micro-batch): clipfrac, clipfrac_low (A < 0 and r clipped at
-- 1 − clip_low), clipfrac_high (A > 0, r clipped at 1 + clip_high), dual_clipfrac, approx_kl (k1:
-- mean of log π_old − log πθ, that difference clamped to ±log_ratio_clamp), approx_kl_k3 (e^x − x − 1
-- of the same x), ratio_mean, ratio_max, tis_weight_mean, pg_loss, tokens.
function M.ppo(args) return clip_loss(args, false, 'policy_loss.ppo') end

-- GSPO (veRL form): the ratio is the sequence's s_i = exp(Σ_t m_t Δ_t / Σ_t m_t), the same for all
-- its tokens; per token the log-ratio is sg(log s_i) + log πθ_t − sg(log πθ_t), so token t's
-- gradient flows through its own log-prob only: dL_t/dlogπ_t = dL_t/ds · s_i. log s_i is clamped
-- from above at args.log_ratio_clamp (default 10, veRL). Defaults: clip_low 3e-4, clip_high 4e-4
-- (GSPO paper), agg 'seq-mean-token-mean'. No dual-clip. Other args and metrics as ppo.
-- With a sequence-level advantage (constant over the sequence's tokens) and seq-mean-token-mean this
-- is the exact gradient of the loss; with per-token advantages it is veRL's stop-gradient form.
function M.gspo(args) return clip_loss(args, true, 'policy_loss.gspo') end

return M
