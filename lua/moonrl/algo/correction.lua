-- Off-policy corrections for the gap between the policy that sampled the tokens (the inference
-- engine's log-probs: the behaviour policy μ) and the trainer's policy (the proximal policy
-- π_prox, the trainer's log-probs recomputed before the update, i.e. old_logprob): per-token
-- weights that the policy losses multiply into their per-token terms (policy_loss's args.weights),
-- and the statistics that tell how far apart the two are.
--
--   local w, m = algo.correction.weights{ mode = 'tis', clip = 2,
--     proximal_logprob = old, behavior_logprob = rollout, mask = mask, cu_seqlens = cu, nseq = n }
--   algo.policy_loss.ppo{ ..., weights = w }
--
-- Inputs (cdata arrays, 0-based): per token [ntok] proximal_logprob (log π_prox), behavior_logprob
-- (log μ), mask; cu_seqlens [nseq+1], nseq. Output: out [ntok] (args.out, any numeric array; a
-- new double array when not given) and metrics. The weights are DATA: no gradient flows through
-- them (sg[w]), as in every source below. Tokens with m = 0 get weight 0.
--
-- Per token Δ_t = log π_prox − log μ (the log of the importance ratio ρ_t = π_prox/μ); per sequence
-- S_i = Σ_t m_t Δ_t (log of the product of its ratios) and G_i = S_i / Σ_t m_t (log of their
-- geometric mean). Every exponential is taken of a log clamped to ±20 (verl's SAFETY_BOUND);
-- every comparison with a bound is made in log space on the unclamped value.
-- Modes (args.mode):
--   'none'       w_t = 1. Metrics only (verl's rollout correction 'disabled').
--   'tis'        truncated importance sampling, token level: w_t = min(ρ_t, C), C = args.clip
--                (default 2). Yao et al. 2025, "Your efficient RL framework secretly brings you
--                off-policy RL training"; verl rollout_is = 'token', rollout_is_threshold 2.0.
--   'tis_seq'    sequence level: w_t = min(exp(S_i), C) on every token of sequence i (verl
--                rollout_is = 'sequence').
--   'mis_token'  masked importance sampling / rejection, token level: w_t = 0 when ρ_t is outside
--                [lower, upper], else 1 (args.weight = 'mask', default: verl rollout_rs = 'token')
--                or ρ_t (args.weight = 'ratio': MIS of Liu, Li et al. 2025, "When speed kills
--                stability", ρ·1[lower ≤ ρ ≤ upper]).
--   'mis_seq'    sequence level: the whole sequence gets 0 when exp(S_i) is outside [lower, upper],
--                else 1 (or exp(S_i) with weight = 'ratio') (verl rollout_rs = 'sequence').
--   'mis_geo'    geometric: the same with exp(G_i) (verl rollout_rs = 'geometric'; SkyRL's
--                geometric mask).
-- Bounds: upper = args.upper (default 2; 1.01 for 'mis_geo', SkyRL), lower = args.lower (default
-- 1/upper, verl). A token or sequence exactly at a bound is kept.
-- The weights leave the losses' denominators alone: a masked token still counts in token-mean's
-- D_tok (AReaL's behav_imp_weight_cap does the same); verl's rejection sampling removes it from
-- the response mask instead, which is the same as passing mask·w as the mask.
--
-- Metrics (over the tokens with m ≠ 0 of this call; `seqs` = sequences with Σ m > 0):
--   ratio_mean, ratio_max   of ρ_t (clamped as above)
--   weight_mean             of w_t
--   clipfrac                fraction of tokens whose weight was truncated at C (tis: ρ_t > C;
--                           tis_seq: the tokens of sequences with exp(S_i) > C)
--   masked_frac             fraction of tokens given weight 0 by a mis mode
--   seq_masked_frac         fraction of the sequences with at least one such token
--   seq_ratio_mean, seq_ratio_max   of exp(S_i) (tis_seq, mis_seq) or exp(G_i) (mis_geo), over seqs
--   kl_k1, kl_k3            the mismatch KL(μ ‖ π_prox) per token: mean of −Δ_t and of
--                           ρ_t − Δ_t − 1 (k3, with the clamped Δ)
--   tokens, seqs
-- M.accumulator / M.accumulate / M.reduce / M.summary combine the metrics of several calls
-- (micro-batches, ranks) into those of the whole batch.
local ffi = require('ffi')
local agg = require('moonrl.algo.agg')

local M = {}
local exp, log, min, max = math.exp, math.log, math.min, math.max
local BOUND = 20
local HUGE = math.huge

-- mode -> code: token-level modes < 2, sequence-level >= 2
local CODE = { none = 0, tis = 1, mis_token = 2, tis_seq = 3, mis_seq = 4, mis_geo = 5 }
M.MODES = {}
for k in pairs(CODE) do M.MODES[#M.MODES + 1] = k end
table.sort(M.MODES)

local function check_options(args, fn)
  local mode = args.mode or 'tis'
  local code = CODE[mode]
  if not code then
    error(string.format("%s: unknown mode '%s' (known: %s)", fn, tostring(mode), table.concat(M.MODES, ', ')), 3)
  end
  local C = args.clip or 2
  if type(C) ~= 'number' or not (C > 0) then
    error(string.format('%s: clip must be a number > 0, got %s', fn, tostring(C)), 3)
  end
  local upper = args.upper or (mode == 'mis_geo' and 1.01 or 2)
  local lower = args.lower or 1 / upper
  if type(upper) ~= 'number' or type(lower) ~= 'number' or not (lower >= 0 and upper >= lower and upper > 0) then
    error(string.format('%s: bounds must satisfy 0 <= lower <= upper, upper > 0, got lower %s and upper %s',
      fn, tostring(lower), tostring(upper)), 3)
  end
  local weight = args.weight or 'mask'
  if weight ~= 'mask' and weight ~= 'ratio' then
    error(string.format("%s: weight must be 'mask' or 'ratio', got %s", fn, tostring(weight)), 3)
  end
  return code, C, lower, upper, weight == 'ratio'
end
jit.off(check_options)

-- The data loop (compiled). Returns the metric sums.
local function weights_loop(code, nseq, cu, mask, prox, behav, out, logC, C, llo, lhi, keep_ratio)
  local n, ns, rsum, rmax, wsum, nclip, nmask, nseqmask, k1, k3 = 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
  local srsum, srmax = 0, 0
  for i = 0, nseq - 1 do
    local t0, t1 = cu[i], cu[i + 1] - 1
    -- pass 1: the token statistics, and S_i, Σ m
    local S, sm = 0, 0
    for t = t0, t1 do
      local m = mask[t]
      if m ~= 0 then
        local d = prox[t] - behav[t]
        local dc = min(max(d, -BOUND), BOUND)
        local r = exp(dc)
        S = S + m * d
        sm = sm + m
        rsum = rsum + m * r
        if r > rmax then rmax = r end
        k1 = k1 - m * d
        k3 = k3 + m * (r - dc - 1)
      end
    end
    if sm > 0 then ns = ns + 1 end
    n = n + sm
    -- the sequence's weight (sequence-level modes)
    local ws, rejected = 1, false
    if code >= 3 and sm > 0 then
      local L = code == 5 and S / sm or S
      local sr = exp(min(max(L, -BOUND), BOUND))
      srsum = srsum + sr
      if sr > srmax then srmax = sr end
      if code == 3 then
        ws = min(sr, C)
        if L > logC then nclip = nclip + sm end
      elseif L < llo or L > lhi then
        ws, rejected = 0, true
        nmask = nmask + sm
      elseif keep_ratio then
        ws = sr
      end
    end
    -- pass 2: the weights
    local seq_hit = rejected
    for t = t0, t1 do
      local m = mask[t]
      local w = 0
      if m ~= 0 then
        if code == 1 then
          local d = prox[t] - behav[t]
          w = min(exp(min(max(d, -BOUND), BOUND)), C)
          if d > logC then nclip = nclip + m end
        elseif code == 2 then
          local d = prox[t] - behav[t]
          if d < llo or d > lhi then
            w = 0
            nmask = nmask + m
            seq_hit = true
          elseif keep_ratio then
            w = exp(min(max(d, -BOUND), BOUND))
          else
            w = 1
          end
        else
          w = ws
        end
        wsum = wsum + m * w
      end
      out[t] = w
    end
    if seq_hit then nseqmask = nseqmask + 1 end
  end
  return n, ns, rsum, rmax, wsum, nclip, nmask, nseqmask, k1, k3, srsum, srmax
end

-- Per-token weights and metrics (see the top of this file). args: mode ('tis'), proximal_logprob,
-- behavior_logprob, mask, cu_seqlens, nseq, clip (C, 2), lower, upper, weight ('mask'), out.
-- Returns out, metrics.
function M.weights(args)
  local fn = 'correction.weights'
  local code, C, lower, upper, keep_ratio = check_options(args, fn)
  local nseq, ntok = agg.check_batch(args, fn)
  local prox = agg.check_array(args, 'proximal_logprob', ntok, fn)
  local behav = agg.check_array(args, 'behavior_logprob', ntok, fn)
  local out = agg.check_array(args, 'out', ntok, fn, true) or ffi.new('double[?]', math.max(ntok, 1))
  local logC = C == HUGE and HUGE or log(C)
  local llo = lower > 0 and log(lower) or -HUGE
  local lhi = upper == HUGE and HUGE or log(upper)
  local n, ns, rsum, rmax, wsum, nclip, nmask, nseqmask, k1, k3, srsum, srmax =
    weights_loop(code, nseq, args.cu_seqlens, args.mask, prox, behav, out, logC, C, llo, lhi, keep_ratio)
  local inv = n > 0 and 1 / n or 0
  local sinv = ns > 0 and 1 / ns or 0
  local metrics = {
    ratio_mean = rsum * inv, ratio_max = rmax, weight_mean = wsum * inv,
    clipfrac = nclip * inv, masked_frac = nmask * inv, seq_masked_frac = nseqmask * sinv,
    kl_k1 = k1 * inv, kl_k3 = k3 * inv, tokens = n, seqs = ns,
  }
  if code >= 3 then
    metrics.seq_ratio_mean, metrics.seq_ratio_max = srsum * sinv, srmax
  end
  return out, metrics
end

-- ---------------------------------------------------------------- combining calls

-- Sums of the metrics over calls: accumulate each call's metrics (micro-batches), reduce over
-- ranks (world: moonrl.train.dist's; nil or size 1 does nothing), then summary() for the means.
-- prefix: read the metrics under prefix .. name (e.g. 'behav_' for policy_loss.decoupled_ppo's).
local MEAN_T = { 'ratio_mean', 'weight_mean', 'clipfrac', 'masked_frac', 'kl_k1', 'kl_k3' }
local MEAN_S = { 'seq_masked_frac', 'seq_ratio_mean' }
local MAXES = { 'ratio_max', 'seq_ratio_max' }

function M.accumulator()
  local acc = { sum = { tokens = 0, seqs = 0 }, max = {} }
  for _, k in ipairs(MEAN_T) do acc.sum[k] = 0 end
  for _, k in ipairs(MEAN_S) do acc.sum[k] = 0 end
  for _, k in ipairs(MAXES) do acc.max[k] = 0 end
  return acc
end

function M.accumulate(acc, metrics, prefix)
  prefix = prefix or ''
  local n, ns = metrics[prefix .. 'tokens'] or 0, metrics[prefix .. 'seqs'] or 0
  local s = acc.sum
  s.tokens, s.seqs = s.tokens + n, s.seqs + ns
  for _, k in ipairs(MEAN_T) do s[k] = s[k] + (metrics[prefix .. k] or 0) * n end
  for _, k in ipairs(MEAN_S) do s[k] = s[k] + (metrics[prefix .. k] or 0) * ns end
  for _, k in ipairs(MAXES) do acc.max[k] = max(acc.max[k], metrics[prefix .. k] or 0) end
  return acc
end

function M.reduce(acc, world)
  if world and world.size > 1 then
    world:sum(acc.sum)
    world:max(acc.max)
  end
  return acc
end

function M.summary(acc)
  local s = acc.sum
  local inv = s.tokens > 0 and 1 / s.tokens or 0
  local sinv = s.seqs > 0 and 1 / s.seqs or 0
  local out = { tokens = s.tokens, seqs = s.seqs }
  for _, k in ipairs(MEAN_T) do out[k] = s[k] * inv end
  for _, k in ipairs(MEAN_S) do out[k] = s[k] * sinv end
  for _, k in ipairs(MAXES) do out[k] = acc.max[k] end
  return out
end

return M
