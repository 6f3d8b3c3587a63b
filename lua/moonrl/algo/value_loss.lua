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

-- One token: ½·max(...), its derivative in V, and whether the clipped term was the larger.
local function value_token(s, t)
  local vt, rt = s.v[t], s.ret[t]
  local e1 = vt - rt
  local l1 = 0.5 * e1 * e1
  if s.clipped then
    local vo, eps = s.vold[t], s.eps
    local vc, gc = vt, 1
    if vt < vo - eps then vc = vo - eps; gc = 0 elseif vt > vo + eps then vc = vo + eps; gc = 0 end
    local e2 = vc - rt
    local l2 = 0.5 * e2 * e2
    if l2 > l1 then return l2, e2 * gc, true end
  end
  return l1, e1, false
end

function M.clipped(args)
  local fn = 'value_loss.clipped'
  local _, ntok = agg.check_batch(args, fn)
  local st = {
    v = agg.check_array(args, 'values', ntok, fn),
    vold = agg.check_array(args, 'old_values', ntok, fn, args.clip == false),
    ret = agg.check_array(args, 'returns', ntok, fn),
    eps = args.clip, clipped = args.clip ~= false,
  }
  if st.eps == nil then st.eps = 0.5 end
  if st.clipped and (type(st.eps) ~= 'number' or st.eps < 0) then
    error(string.format('%s: clip must be a number >= 0 or false, got %s', fn, tostring(st.eps)), 2)
  end
  local loss, total = agg.token_loss(args, fn, 'token-mean', value_token, st)
  -- metrics over the tokens of this micro-batch
  local mask, nclip = args.mask, 0
  for t = 0, ntok - 1 do
    local m = mask[t]
    if m ~= 0 then
      local _, _, c = value_token(st, t)
      if c then nclip = nclip + m end
    end
  end
  local vsum, n = agg.masked_sums(st.v, mask, ntok)
  local rsum = agg.masked_sums(st.ret, mask, ntok)
  local inv = n > 0 and 1 / n or 0
  return loss, { vf_loss = total, vf_clipfrac = nclip * inv, vpred_mean = vsum * inv, return_mean = rsum * inv }
end

return M
