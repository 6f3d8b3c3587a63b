-- Policy-gradient losses over packed per-token arrays: PPO-clip (with DAPO clip-higher, dual-clip,
-- log-ratio clamp, truncated importance sampling, per-token correction weights), GSPO
-- (sequence-level ratio), plain REINFORCE (no ratio, no clip) and decoupled PPO (AReaL: a
-- proximal policy and a behaviour weight). Recipes find them by name in moonrl.algo.losses
-- (M.register below; `grpo.loss=NAME`).
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
--   per-token weights (args.weights [ntok], e.g. from algo.correction.weights): L ← L · w_t, w_t data
--   (no gradient through it): dL/dlogprob ← w_t · dL/dlogprob
-- and loss = coef · agg(L) (args.agg, default 'token-mean'; global_tokens / global_seqs / norm for
-- gradient accumulation, see agg.lua).
local agg = require('moonrl.algo.agg')
local correction = require('moonrl.algo.correction')

local M = {}
local exp, min, max = math.exp, math.min, math.max

-- A loss's metrics (see ppo) from its sums over the n (masked) tokens: the clipped counts, the
-- k1 and k3 KL sums, the ratio's sum and max, and the TIS weights' sum (false: no TIS).
local function metrics_of(total, n, n_low, n_high, n_dual, kl1, kl3, rsum, rmax, tis_sum)
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
  if tis_sum then metrics.tis_weight_mean = tis_sum * inv end
  return metrics
end

local function clip_loss(args, gspo, fn)
  local nseq, ntok = agg.check_batch(args, fn)
  local lp = agg.check_array(args, 'logprob', ntok, fn)
  local old = agg.check_array(args, 'old_logprob', ntok, fn)
  local adv = agg.check_array(args, 'advantages', ntok, fn)
  local grad = agg.check_array(args, 'grad', ntok, fn, true)
  local roll = agg.check_array(args, 'rollout_logprob', ntok, fn, true)
  local wts = agg.check_array(args, 'weights', ntok, fn, true)
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
        if wts ~= nil then
          local wt = wts[t]
          L, dL = L * wt, dL * wt
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
  return coef * total, metrics_of(total, n, n_low, n_high, n_dual, kl1, kl3, rsum, rmax, roll ~= nil and tis_sum)
end

-- PPO-clip (see the top of this file).
--   args.clip_low (0.2), args.clip_high (= clip_low; DAPO clip-higher: 0.28), args.dual_clip
--   (off; c = 3 typical), args.log_ratio_clamp (20, veRL; false = none: TRL, AReaL, NeMo-RL),
--   args.rollout_logprob + args.tis_cap (2; slime 2, TRL 3), args.weights (per-token multipliers,
--   detached: algo.correction.weights), args.coef (1), args.agg ('token-mean').
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

-- REINFORCE: the plain policy gradient, no ratio and no clip. Per token
--   L_t = −A_t · log πθ_t,   dL_t/dlogπ_t = −A_t
-- (with leave-one-out advantages this is RLOO; with group-normalised ones, on-policy GRPO without
-- its clip). args: logprob, advantages, cu_seqlens, nseq, mask, grad, coef (1), agg ('token-mean')
-- and the global denominators (agg.lua); old_logprob (optional) only feeds the metrics (approx_kl,
-- ratio_mean against the policy that sampled); rollout_logprob + tis_cap and weights multiply L_t
-- as in ppo. Metrics: ppo's keys (clipfrac and its parts 0), pg_loss, tokens.
function M.reinforce(args)
  local fn = 'policy_loss.reinforce'
  local nseq, ntok = agg.check_batch(args, fn)
  local lp = agg.check_array(args, 'logprob', ntok, fn)
  local adv = agg.check_array(args, 'advantages', ntok, fn)
  local old = agg.check_array(args, 'old_logprob', ntok, fn, true)
  local grad = agg.check_array(args, 'grad', ntok, fn, true)
  local roll = agg.check_array(args, 'rollout_logprob', ntok, fn, true)
  local wts = agg.check_array(args, 'weights', ntok, fn, true)
  local tis_cap, coef = args.tis_cap or 2, args.coef or 1
  local w = agg.seq_weights(args, args.agg or 'token-mean')
  local cu, mask = args.cu_seqlens, args.mask
  local total, n, kl1, kl3, rsum, rmax, tis_sum = 0, 0, 0, 0, 0, -math.huge, 0
  for i = 0, nseq - 1 do
    local wi, s = w[i], 0
    for t = cu[i], cu[i + 1] - 1 do
      local m = mask[t]
      if m ~= 0 then
        local L, dL = -adv[t] * lp[t], -adv[t]
        if roll ~= nil then
          local iw = min(exp(min((old ~= nil and old[t] or lp[t]) - roll[t], 20)), tis_cap)
          L, dL = L * iw, dL * iw
          tis_sum = tis_sum + m * iw
        end
        if wts ~= nil then L, dL = L * wts[t], dL * wts[t] end
        s = s + m * L
        if grad ~= nil then grad[t] = grad[t] + coef * wi * m * dL end
        if old ~= nil then
          local x = min(max(old[t] - lp[t], -20), 20)
          local r = exp(-x)
          kl1, kl3, rsum, rmax = kl1 + m * x, kl3 + m * (exp(x) - x - 1), rsum + m * r, max(rmax, r)
        else
          rsum, rmax = rsum + m, 1
        end
        n = n + m
      end
    end
    total = total + wi * s
  end
  return coef * total, metrics_of(total, n, 0, 0, 0, kl1, kl3, rsum, rmax, roll ~= nil and tis_sum)
end

-- Decoupled PPO with a proximal policy (AReaL: Fu et al. 2025, "AReaL: a large-scale asynchronous
-- reinforcement learning system for language reasoning"; after Hilton et al. 2021, "Batch
-- size-invariance for policy optimization"). Three policies: πθ (args.logprob), the proximal policy
-- π_prox (args.proximal_logprob, else args.old_logprob: the trainer's log-probs recomputed before
-- the update) and the behaviour policy μ that sampled the tokens (args.behavior_logprob: the
-- engine's log-probs). Per token, with r_t = πθ/π_prox and w_t = π_prox/μ:
--   L_t = −w_t · min(r_t A_t, clip(r_t, 1 − clip_low, 1 + clip_high) A_t)
-- (dual-clip, as ppo, applies to the clipped term before the weight, as AReaL's ppo_actor_loss_fn).
-- w_t is data (no gradient): exp(log π_prox − log μ), the log clamped to ±20. Cap
-- (args.behav_imp_weight_cap, off by default; AReaL requires > 1): with args.behav_cap_mode =
-- 'mask' (default, AReaL) a token whose w_t exceeds the cap gets weight 0 (it still counts in the
-- denominators, as in AReaL); with 'truncate' w_t ← min(w_t, cap). args.weights, when given,
-- multiply w_t (e.g. a correction.weights mis_geo mask). Other args (clip_low, clip_high,
-- dual_clip, log_ratio_clamp, agg, coef, global_tokens / global_seqs / norm) as ppo.
-- Metrics: ppo's (r against π_prox), and correction.weights' metrics of w prefixed with 'behav_'
-- (behav_weight_mean, behav_ratio_mean, behav_ratio_max, behav_masked_frac: dropped by the cap,
-- behav_clipfrac: truncated by it, behav_kl_k1, behav_kl_k3, behav_tokens, behav_seqs).
function M.decoupled_ppo(args)
  local fn = 'policy_loss.decoupled_ppo'
  local nseq, ntok = agg.check_batch(args, fn)
  if args.rollout_logprob ~= nil then
    error(fn .. ': pass the engine\'s log-probs as behavior_logprob (rollout_logprob is ppo\'s truncated IS)', 2)
  end
  local prox = agg.check_array(args, args.proximal_logprob ~= nil and 'proximal_logprob' or 'old_logprob', ntok, fn)
  local behav = agg.check_array(args, 'behavior_logprob', ntok, fn)
  local cap, cap_mode = args.behav_imp_weight_cap, args.behav_cap_mode or 'mask'
  if cap ~= nil and (type(cap) ~= 'number' or not (cap > 0)) then
    error(string.format('%s: behav_imp_weight_cap must be a number > 0, got %s', fn, tostring(cap)), 2)
  end
  if cap_mode ~= 'mask' and cap_mode ~= 'truncate' then
    error(string.format("%s: behav_cap_mode must be 'mask' or 'truncate', got %s", fn, tostring(cap_mode)), 2)
  end
  local extra = agg.check_array(args, 'weights', ntok, fn, true)
  local w = agg.scratch('decoupled_ppo', ntok)
  local cargs = { proximal_logprob = prox, behavior_logprob = behav, mask = args.mask,
    cu_seqlens = args.cu_seqlens, nseq = nseq, out = w, weight = 'ratio' }
  if cap and cap_mode == 'mask' then
    cargs.mode, cargs.lower, cargs.upper = 'mis_token', 0, cap
  else
    cargs.mode, cargs.clip = 'tis', cap or math.huge
  end
  local _, cm = correction.weights(cargs)
  if extra ~= nil then
    for t = 0, ntok - 1 do w[t] = w[t] * extra[t] end
  end
  local a = {}
  for k, v in pairs(args) do a[k] = v end
  a.old_logprob, a.weights = prox, w
  local loss, metrics = clip_loss(a, false, fn)
  for k, v in pairs(cm) do
    if k ~= 'seq_masked_frac' then metrics['behav_' .. k] = v end
  end
  if not (cap and cap_mode == 'mask') then metrics.behav_masked_frac = nil end
  if not (cap and cap_mode == 'truncate') then metrics.behav_clipfrac = nil end
  return loss, metrics
end

-- ---- the registry recipes find a loss in (`grpo.loss=NAME`): name -> fn(args) -> loss, metrics ----
-- A registered loss takes the arrays above (logprob, old_logprob, advantages, mask, cu_seqlens,
-- nseq, grad, agg and the global denominators, clip_low / clip_high / dual_clip, rollout_logprob,
-- weights) and ADDS its gradient into args.grad, as ppo does; train.policy_step calls it per micro-batch.
M.losses = require('moonrl.registry').new('policy loss')
function M.register(name, fn, doc) return M.losses.register(name, fn, doc) end
M.register('ppo', M.ppo, 'PPO-clip on the token ratio (clip_low, clip_high: DAPO clip-higher)')
M.register('dual_clip', function(args)
  return M.ppo(setmetatable({ dual_clip = args.dual_clip or 3 }, { __index = args }))
end, 'PPO-clip with the dual clip (c = 3) for A < 0')
M.register('gspo', M.gspo, 'GSPO: the sequence-level ratio (seq-mean-token-mean)')
M.register('reinforce', M.reinforce, 'plain REINFORCE: −A·log π, no ratio, no clip')
M.register('decoupled_ppo', M.decoupled_ppo, 'AReaL decoupled PPO: a proximal policy and behaviour weights (async)')

return M
