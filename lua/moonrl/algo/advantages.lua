-- Advantage estimators: GRPO (and Dr. GRPO / TRL scaling), RLOO, REINFORCE++, GAE; broadcast of
-- sequence-level values to tokens; scalar scores placed on the last response token.
--
-- Arrays are cdata, 0-based. "per sequence" = [nseq], "per token" = [ntok] with ntok = cu_seqlens[nseq].
-- Groups (the samples of one prompt) are given by args.group: either a number G (sequences
-- 0..G-1 are group 0, G..2G-1 group 1, ...; nseq must be a multiple of G) or an array [nseq] of
-- group ids (any numbers; sequences with equal ids form a group, in any order).
local agg = require('moonrl.algo.agg')
local kl = require('moonrl.algo.kl')

local M = {}

-- Groups as a Lua list of lists of 0-based sequence indexes.
local function groups_of(args, nseq, fn)
  local g = args.group
  local out = {}
  if type(g) == 'number' then
    if g < 1 or g % 1 ~= 0 or nseq % g ~= 0 then
      error(string.format('%s: group size %s must be a positive integer dividing nseq = %d', fn, tostring(g), nseq), 3)
    end
    for k = 0, nseq / g - 1 do
      local list = {}
      for j = 0, g - 1 do list[j + 1] = k * g + j end
      out[#out + 1] = list
    end
  elseif type(g) == 'cdata' then
    agg.check_array(args, 'group', nseq, fn)
    local index = {}
    for i = 0, nseq - 1 do
      local id = tonumber(g[i])
      local list = index[id]
      if not list then
        list = {}
        index[id] = list
        out[#out + 1] = list
      end
      list[#list + 1] = i
    end
  else
    error(fn .. ': argument group must be a group size (number) or an array of group ids [nseq]', 3)
  end
  return out
end
M.groups_of = function(args, nseq) return groups_of(args, nseq, 'advantages.groups_of') end

local function check_scores(args, fn)
  local nseq = args.nseq
  if type(nseq) ~= 'number' or nseq < 0 or nseq % 1 ~= 0 then
    error(string.format('%s: argument nseq must be a non-negative integer, got %s', fn, tostring(nseq)), 3)
  end
  return nseq, agg.check_array(args, 'scores', nseq, fn)
end

-- Mean and unbiased (n-1) standard deviation of scores over a list of sequence indexes.
local function mean_std(scores, list)
  local n, s = #list, 0
  for k = 1, n do s = s + scores[list[k]] end
  local mean = s / n
  if n < 2 then return mean, 0 end
  local ss = 0
  for k = 1, n do
    local d = scores[list[k]] - mean
    ss = ss + d * d
  end
  return mean, math.sqrt(ss / (n - 1))
end

-- GRPO advantages, one per sequence.
--   args.scores   [nseq] scalar reward of each sample
--   args.nseq, args.group (see top)
--   args.scale    'group' (default; divide by the group's std: veRL, TRL default),
--                 'batch' (divide by the std over all nseq scores: TRL scale_rewards='batch'),
--                 'none'  (no division: Dr. GRPO, veRL norm_adv_by_std_in_grpo=false)
--   args.eps      default 1e-6 (veRL; TRL 1e-4, OpenRLHF 1e-9, AReaL 1e-5)
--   args.eps_mode 'std' (default: A = (s - μ)/(σ + eps)) or 'sqrt' (A = (s - μ)/sqrt(σ² + eps))
--   args.out      [nseq] output (double array allocated when nil)
-- σ uses the n-1 divisor. A group of one sample takes μ = 0, σ = 1 (veRL), so A = s/(1 + eps).
-- With 'batch', σ is over the whole batch (taken as 1 when nseq < 2). Returns out.
function M.grpo(args)
  local fn = 'advantages.grpo'
  local nseq, scores = check_scores(args, fn)
  local scale = args.scale or 'group'
  if scale ~= 'group' and scale ~= 'batch' and scale ~= 'none' then
    error(string.format("%s: scale must be 'group', 'batch' or 'none', got '%s'", fn, tostring(scale)), 2)
  end
  local eps = args.eps or 1e-6
  local eps_mode = args.eps_mode or 'std'
  if eps_mode ~= 'std' and eps_mode ~= 'sqrt' then
    error(string.format("%s: eps_mode must be 'std' or 'sqrt', got '%s'", fn, tostring(eps_mode)), 2)
  end
  local out = args.out or agg.zeros(nseq)
  local groups = groups_of(args, nseq, fn)
  local batch_std = 1
  if scale == 'batch' and nseq >= 2 then
    local all = {}
    for i = 1, nseq do all[i] = i - 1 end
    local _
    _, batch_std = mean_std(scores, all)
  end
  for _, list in ipairs(groups) do
    local mean, std = mean_std(scores, list)
    if #list == 1 then mean, std = 0, 1 end
    if scale == 'batch' then std = batch_std end
    local div = 1
    if scale ~= 'none' then
      div = eps_mode == 'std' and std + eps or math.sqrt(std * std + eps)
    end
    for k = 1, #list do
      local i = list[k]
      out[i] = (scores[i] - mean) / div
    end
  end
  return out
end

-- RLOO advantages, one per sequence: A_i = s_i - mean of the OTHER samples of its group
-- (= n/(n-1) · (s_i - μ)). A group of one has no baseline: A = s. args as grpo (scores, nseq, group, out).
function M.rloo(args)
  local fn = 'advantages.rloo'
  local nseq, scores = check_scores(args, fn)
  local out = args.out or agg.zeros(nseq)
  for _, list in ipairs(groups_of(args, nseq, fn)) do
    local n, s = #list, 0
    for k = 1, n do s = s + scores[list[k]] end
    for k = 1, n do
      local i = list[k]
      out[i] = n > 1 and scores[i] - (s - scores[i]) / (n - 1) or scores[i]
    end
  end
  return out
end

-- Broadcast per-sequence values to tokens: out[t] = values[i] · m_t for t in sequence i.
--   args.values [nseq]; args.cu_seqlens, nseq, mask; args.out [ntok] (allocated when nil). Returns out.
function M.to_tokens(args)
  local fn = 'advantages.to_tokens'
  local nseq, ntok = agg.check_batch(args, fn)
  local v = agg.check_array(args, 'values', nseq, fn)
  local out = args.out or agg.zeros(ntok)
  local cu, mask = args.cu_seqlens, args.mask
  for i = 0, nseq - 1 do
    local a = v[i]
    for t = cu[i], cu[i + 1] - 1 do out[t] = a * mask[t] end
  end
  return out
end

-- Per-token rewards: the scalar score of sequence i on its LAST token with m = 1 (nothing when the
-- sequence has none), 0 elsewhere; optionally a KL penalty on every response token:
--   r_t -= kl_coef · k(log π_old − log π_ref)   (k: args.kl_estimator, default 'k1', see kl.lua)
--   args.scores [nseq]; cu_seqlens, nseq, mask; optional old_logprob, ref_logprob [ntok], kl_coef;
--   args.out [ntok]. Returns out.
function M.token_rewards(args)
  local fn = 'advantages.token_rewards'
  local nseq, ntok = agg.check_batch(args, fn)
  local scores = agg.check_array(args, 'scores', nseq, fn)
  local out = args.out or agg.zeros(ntok)
  local cu, mask = args.cu_seqlens, args.mask
  for t = 0, ntok - 1 do out[t] = 0 end
  if args.kl_coef and args.kl_coef ~= 0 then
    kl.penalty({ logprob = agg.check_array(args, 'old_logprob', ntok, fn),
      ref_logprob = agg.check_array(args, 'ref_logprob', ntok, fn),
      cu_seqlens = cu, nseq = nseq, mask = mask, coef = args.kl_coef, estimator = args.kl_estimator,
      clamp = args.kl_clamp, out = out })
  end
  for i = 0, nseq - 1 do
    for t = cu[i + 1] - 1, cu[i], -1 do
      if mask[t] ~= 0 then
        out[t] = out[t] + scores[i]
        break
      end
    end
  end
  return out
end

-- REINFORCE++ advantages per token (veRL): per sequence, backwards over its tokens,
--   G_t = r_t + γ G_{t+1};  the running return is reset (multiplied by m_t) after each token,
-- so it restarts at masked positions; then masked whitening over the batch with unbiased variance,
-- (G − μ)/sqrt(var + 1e-8), and 0 on masked tokens.
--   args.token_rewards [ntok] (see token_rewards); cu_seqlens, nseq, mask; args.gamma (default 1);
--   args.out [ntok] advantages; args.returns [ntok] optional: the un-whitened returns.
-- Returns out (advantages), returns.
function M.reinforce_pp(args)
  local fn = 'advantages.reinforce_pp'
  local nseq, ntok = agg.check_batch(args, fn)
  local r = agg.check_array(args, 'token_rewards', ntok, fn)
  local out = args.out or agg.zeros(ntok)
  local ret = args.returns and agg.check_array(args, 'returns', ntok, fn)
  local gamma = args.gamma or 1
  local cu, mask = args.cu_seqlens, args.mask
  for i = 0, nseq - 1 do
    local g = 0
    for t = cu[i + 1] - 1, cu[i], -1 do
      g = r[t] + gamma * g
      out[t] = g
      g = g * mask[t]
    end
  end
  if ret then
    for t = 0, ntok - 1 do ret[t] = out[t] end
  end
  agg.masked_whiten(out, mask, ntok, args.whiten_eps or 1e-8)
  return out, ret
end

-- GAE for PPO with a critic (veRL semantics: masked tokens are skipped, not bootstrapped through).
-- Per sequence, backwards over its tokens with m_t = 1:
--   δ_t = r_t + γ V_next − V_t;  A_t = δ_t + γλ A_next;  then V_next = V_t, A_next = A_t
-- (V_next = A_next = 0 after the last response token). returns_t = A_t + V_t; then A is whitened
-- over the batch (masked, unbiased variance, eps 1e-8) unless args.whiten == false. Masked tokens
-- get A = returns = 0.
--   args.token_rewards [ntok]: scalar on the last response token (+ KL penalty), see token_rewards
--   args.values [ntok]: V(t) of the critic at each token (the old values)
--   cu_seqlens, nseq, mask; args.gamma (1), args.lam (1)
--   args.out [ntok] advantages, args.returns [ntok] (both allocated when nil)
-- Returns out, returns.
function M.gae(args)
  local fn = 'advantages.gae'
  local nseq, ntok = agg.check_batch(args, fn)
  local r = agg.check_array(args, 'token_rewards', ntok, fn)
  local v = agg.check_array(args, 'values', ntok, fn)
  local out = args.out or agg.zeros(ntok)
  local ret = args.returns and agg.check_array(args, 'returns', ntok, fn) or agg.zeros(ntok)
  local gamma, lam = args.gamma or 1, args.lam or 1
  local cu, mask = args.cu_seqlens, args.mask
  for i = 0, nseq - 1 do
    local vnext, anext = 0, 0
    for t = cu[i + 1] - 1, cu[i], -1 do
      if mask[t] ~= 0 then
        local delta = r[t] + gamma * vnext - v[t]
        anext = delta + gamma * lam * anext
        vnext = v[t]
        out[t] = anext
        ret[t] = anext + v[t]
      else
        out[t] = 0
        ret[t] = 0
      end
    end
  end
  if args.whiten ~= false then agg.masked_whiten(out, mask, ntok, args.whiten_eps or 1e-8) end
  return out, ret
end

return M
