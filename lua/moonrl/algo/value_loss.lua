-- PPO critic loss with value clipping.
--
--   loss = coef · ½ · agg( max((V − R)², (clip(V, V_old − ε, V_old + ε) − R)²) )
--
-- Inputs (cdata, 0-based), per token [ntok]: values (V, the critic's current output), old_values
-- (V_old, at rollout time), returns (R, from advantages.gae), mask; cu_seqlens [nseq+1], nseq.
-- args.clip (ε, default 0.5 as veRL's cliprange_value; false = unclipped ½(V − R)²), args.coef (1),
-- args.agg ('token-mean') with global denominators (agg.lua); args.grad [ntok] optional:
-- coef · dloss/dV is ADDED into it.
-- Returns loss, metrics {vf_loss (without coef), vf_clipfrac (share of tokens where the clipped term
-- is the larger), vpred_mean, return_mean}.
local agg = require('moonrl.algo.agg')

local M = {}

function M.clipped(args)
  local fn = 'value_loss.clipped'
  local _, ntok = agg.check_batch(args, fn)
  local v = agg.check_array(args, 'values', ntok, fn)
  local vold = agg.check_array(args, 'old_values', ntok, fn, args.clip == false)
  local ret = agg.check_array(args, 'returns', ntok, fn)
  local eps = args.clip
  if eps == nil then eps = 0.5 end
  local clipped = eps ~= false
  if clipped and (type(eps) ~= 'number' or eps < 0) then
    error(string.format('%s: clip must be a number >= 0 or false, got %s', fn, tostring(eps)), 2)
  end
  local n, nclip, vsum, rsum = 0, 0, 0, 0
  local loss, total = agg.token_loss(args, fn, 'token-mean', function(t, m)
    local vt, rt = v[t], ret[t]
    vsum, rsum, n = vsum + m * vt, rsum + m * rt, n + m
    local e1 = vt - rt
    local l1 = 0.5 * e1 * e1
    if clipped then
      local lo, hi = vold[t] - eps, vold[t] + eps
      local vc, gc = vt, 1
      if vt < lo then vc = lo; gc = 0 elseif vt > hi then vc = hi; gc = 0 end
      local e2 = vc - rt
      local l2 = 0.5 * e2 * e2
      if l2 > l1 then
        nclip = nclip + m
        return l2, e2 * gc
      end
    end
    return l1, e1
  end)
  local inv = n > 0 and 1 / n or 0
  return loss, { vf_loss = total, vf_clipfrac = nclip * inv, vpred_mean = vsum * inv, return_mean = rsum * inv }
end

return M
