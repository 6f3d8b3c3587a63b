-- KL to a reference policy (as a loss term or as a reward penalty) and the entropy bonus.
--
-- Per token, with x = log π_ref − log πθ:
--   'k1' (alias 'kl')              k = −x              dk/dlogπ = 1
--   'k2' (alias 'mse')             k = ½ x²            dk/dlogπ = −x
--   'k3' (aliases 'low_var_kl')    k = eˣ − x − 1      dk/dlogπ = 1 − eˣ
-- Clamps (veRL, NeMo-RL; on by default, args.clamp = false turns them off): for k3, x is clamped to
-- [−20, 20] and k to [−10, 10]; a clamped value passes no gradient. k1 and k2 are not clamped.
--
-- Estimators are found by name in M.estimators (a moonrl.registry; also moonrl.algo.kl_estimators):
--   require('moonrl.algo').kl.register('k1_sq', function(lp, ref, clamp) return k, dk_dlogp end, 'doc')
-- adds one that kl.loss, kl.penalty and `grpo.kl_estimator=k1_sq` then take.
local agg = require('moonrl.algo.agg')

local M = {}

local ESTIMATORS = { k1 = 1, kl = 1, k2 = 2, mse = 2, k3 = 3, low_var_kl = 3 }
M.estimators = require('moonrl.registry').new('KL estimator')
function M.register(name, fn, doc) return M.estimators.register(name, fn, doc) end

-- The built-in estimator's id (its own compiled loop), or a registered estimator's function.
local function estimator_id(name, fn)
  local id = ESTIMATORS[name or 'k3']
  if id then return id end
  local e = M.estimators.entry(name)
  if not e then
    error(string.format("%s: unknown KL estimator '%s' (known: %s)", fn, tostring(name),
      table.concat(M.estimators.names(), ', ')), 3)
  end
  return e.fn
end

-- One token: returns k, dk/dlogπ. lp = log πθ, ref = log π_ref; clamp: boolean (k3 only).
-- One function per estimator, so that each call site and trace sees one callee.
local exp = math.exp
local function kl_k1(lp, ref) return lp - ref, 1 end
local function kl_k2(lp, ref)
  local x = ref - lp
  return 0.5 * x * x, -x
end
local function kl_k3(lp, ref, clamp)
  local x = ref - lp
  local g = 1
  if clamp then
    if x > 20 then x = 20; g = 0 elseif x < -20 then x = -20; g = 0 end
  end
  local e = exp(x)
  local k = e - x - 1
  if clamp and k > 10 then return 10, 0 end -- k3 >= 0, so only the upper clamp can bite
  return k, g * (1 - e)
end
local KL_TOKEN = { kl_k1, kl_k2, kl_k3 }
function M.kl_token(id, lp, ref, clamp) return KL_TOKEN[id](lp, ref, clamp) end
M.register('k1', kl_k1, 'log πθ − log π_ref (alias kl)')
M.register('kl', kl_k1, 'alias of k1')
M.register('k2', kl_k2, '½ (log π_ref − log πθ)² (alias mse)')
M.register('mse', kl_k2, 'alias of k2')
M.register('k3', kl_k3, 'e^x − x − 1, x = log π_ref − log πθ, clamped (alias low_var_kl; veRL default)')
M.register('low_var_kl', kl_k3, 'alias of k3')

-- One loop per estimator (each its own trace; see agg.token_loss).
local kl_loss_tokens = {
  function(s, t) return kl_k1(s.lp[t], s.ref[t]) end,
  function(s, t) return kl_k2(s.lp[t], s.ref[t]) end,
  function(s, t) return kl_k3(s.lp[t], s.ref[t], s.clamp) end,
}
local function kl_registered(s, t) return s.f(s.lp[t], s.ref[t], s.clamp) end

-- KL as a loss term: loss = coef · agg(k).
--   args.logprob [ntok] log πθ; args.ref_logprob [ntok] log π_ref; cu_seqlens, nseq, mask
--   args.estimator ('k3' default, veRL), args.coef (default 0.001, veRL kl_loss_coef), args.clamp
--   args.agg (default 'token-mean') with global_tokens / global_seqs / norm (see agg.lua)
--   args.grad [ntok] optional: coef · dloss/dlogπ is ADDED into it
-- Returns loss, metrics {kl = agg(k) without coef}.
function M.loss(args)
  local fn = 'kl.loss'
  local _, ntok = agg.check_batch(args, fn)
  local lp = agg.check_array(args, 'logprob', ntok, fn)
  local ref = agg.check_array(args, 'ref_logprob', ntok, fn)
  local id = estimator_id(args.estimator, fn)
  local clamp = args.clamp ~= false
  local a = setmetatable({ coef = args.coef or 0.001 }, { __index = args })
  local builtin = type(id) == 'number'
  local loss, kl = agg.token_loss(a, fn, 'token-mean', builtin and kl_loss_tokens[id] or kl_registered,
    { lp = lp, ref = ref, clamp = clamp, f = not builtin and id or nil })
  return loss, { kl = kl }
end

-- KL as a reward penalty: out[t] −= coef · k(logprob, ref_logprob) on tokens with m ≠ 0 (no gradient).
--   args.logprob [ntok] (the rollout/old policy's log-probs), args.ref_logprob [ntok];
--   cu_seqlens, nseq, mask; args.coef (default 0.01, OpenRLHF's init_kl_coef); args.estimator
--   (default 'k1', the usual reward-penalty form), args.clamp; args.out [ntok] (allocated zeroed when
--   nil). Returns out, the masked mean of k.
function M.penalty(args)
  local fn = 'kl.penalty'
  local _, ntok = agg.check_batch(args, fn)
  local lp = agg.check_array(args, 'logprob', ntok, fn)
  local ref = agg.check_array(args, 'ref_logprob', ntok, fn)
  local out = args.out or agg.zeros(ntok)
  local id = estimator_id(args.estimator or 'k1', fn)
  local coef = args.coef or 0.01
  local clamp = args.clamp ~= false
  local mask = args.mask
  local s, n = 0, 0
  local kl_token = type(id) == 'number' and KL_TOKEN[id] or id
  for t = 0, ntok - 1 do
    local m = mask[t]
    if m ~= 0 then
      local k = kl_token(lp[t], ref[t], clamp)
      out[t] = out[t] - coef * k
      s = s + m * k
      n = n + m
    end
  end
  return out, n > 0 and s / n or 0
end

local function entropy_token(h, t) return h[t], 1 end

-- Entropy bonus: loss = −coef · agg(H), so minimising it raises the entropy.
--   args.entropy [ntok] per-token entropy from the core; cu_seqlens, nseq, mask; args.coef (0.001);
--   args.agg (default 'token-mean') and global denominators; args.grad [ntok] optional:
--   dloss/dH = −coef · w_i · m_t is ADDED into it.
-- Returns loss, metrics {entropy = agg(H)}.
function M.entropy_bonus(args)
  local fn = 'kl.entropy_bonus'
  local _, ntok = agg.check_batch(args, fn)
  local h = agg.check_array(args, 'entropy', ntok, fn)
  local a = setmetatable({ coef = -(args.coef or 0.001) }, { __index = args })
  local loss, total = agg.token_loss(a, fn, 'token-mean', entropy_token, h)
  return loss, { entropy = total }
end

return M
