-- DPO-family losses on summed sequence log-probs of chosen / rejected completions.
--
-- Inputs (cdata, 0-based):
--   logprob [ntok]        log πθ of every token (from the core)
--   ref_logprob [ntok]    log π_ref per token, OR ref_seq [nseq]: Σ_t m_t log π_ref already summed
--   mask [ntok]           1 on completion tokens (the prompt is masked out)
--   cu_seqlens [nseq+1], nseq = 2 · pairs
--   layout                'interleaved' (default: sequence 2k is pair k's chosen, 2k+1 its rejected)
--                         or 'halves' (the first nseq/2 sequences are chosen, the rest rejected, in
--                         the same pair order: TRL's concatenated batch)
-- With S = Σ_t m_t log πθ and R likewise for the reference (divided by Σ m when length_normalize,
-- as TRL does for IPO), Δ_w = S_w − R_w, Δ_l = S_l − R_l, h = Δ_w − Δ_l, z = β h:
--   'sigmoid'  −(1 − ε) log σ(z) − ε log σ(−z)    (ε = label_smoothing: cDPO; 0 = plain DPO)
--   'ipo'      (h − 1/(2β))²
--   'hinge'    max(0, 1 − z)
-- loss = coef · Σ_pairs loss_k / P, P = args.global_pairs or this batch's pair count.
-- args.beta (0.1), args.loss_type ('sigmoid'), args.label_smoothing (0), args.length_normalize
-- (false), args.coef (1); args.grad [ntok] optional: coef · dloss/dlogπ_t is ADDED into it (every
-- token of pair k gets ± dloss_k/dh · m_t / P, divided by Σ m when length_normalize).
-- Metrics (means over pairs): rewards_chosen (β Δ_w), rewards_rejected (β Δ_l), rewards_margin,
-- rewards_accuracy (share with β Δ_w > β Δ_l), logps_chosen, logps_rejected, loss (without coef).
local agg = require('moonrl.algo.agg')

local M = {}
local exp, log = math.exp, math.log

-- log σ(z), stable for large |z|
local function log_sigmoid(z)
  if z >= 0 then return -log(1 + exp(-z)) end
  return z - log(1 + exp(z))
end
local function sigmoid(z)
  if z >= 0 then return 1 / (1 + exp(-z)) end
  local e = exp(z)
  return e / (1 + e)
end
M.log_sigmoid = log_sigmoid

-- loss_k and dloss_k/dh for one pair.
local function pair_loss(kind, h, beta, eps)
  local z = beta * h
  if kind == 'sigmoid' then
    local l = -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)
    return l, beta * (-(1 - eps) * sigmoid(-z) + eps * sigmoid(z))
  elseif kind == 'ipo' then
    local d = h - 1 / (2 * beta)
    return d * d, 2 * d
  else -- hinge
    if z < 1 then return 1 - z, -beta end
    return 0, 0
  end
end

local KINDS = { sigmoid = true, ipo = true, hinge = true }

function M.loss(args)
  local fn = 'dpo.loss'
  local nseq, ntok = agg.check_batch(args, fn)
  if nseq % 2 ~= 0 then error(string.format('%s: nseq must be even (chosen/rejected pairs), got %d', fn, nseq), 2) end
  local lp = agg.check_array(args, 'logprob', ntok, fn)
  local ref_tok = agg.check_array(args, 'ref_logprob', ntok, fn, true)
  local ref_seq = agg.check_array(args, 'ref_seq', nseq, fn, ref_tok ~= nil)
  local grad = agg.check_array(args, 'grad', ntok, fn, true)
  local kind = args.loss_type or 'sigmoid'
  if not KINDS[kind] then
    error(string.format("%s: unknown loss_type '%s' (known: sigmoid, ipo, hinge)", fn, tostring(kind)), 2)
  end
  local layout = args.layout or 'interleaved'
  if layout ~= 'interleaved' and layout ~= 'halves' then
    error(string.format("%s: layout must be 'interleaved' or 'halves', got '%s'", fn, tostring(layout)), 2)
  end
  local beta = args.beta or 0.1
  local eps = args.label_smoothing or 0
  if beta <= 0 then error(fn .. ': beta must be > 0', 2) end
  local norm = args.length_normalize == true
  local coef = args.coef or 1
  local npairs = nseq / 2
  local P = args.global_pairs or npairs
  local cu, mask = args.cu_seqlens, args.mask

  -- per sequence: policy and reference (normalised) log-probs, and the token count
  local S, R, N = agg.scratch('dpo_S', nseq), agg.scratch('dpo_R', nseq), agg.scratch('dpo_N', nseq)
  for i = 0, nseq - 1 do
    local s, r, n = 0, 0, 0
    for t = cu[i], cu[i + 1] - 1 do
      local m = mask[t]
      s = s + m * lp[t]
      if ref_tok ~= nil then r = r + m * ref_tok[t] end
      n = n + m
    end
    if ref_tok == nil then r = ref_seq[i] end
    if norm and n > 0 then s, r = s / n, r / n end
    S[i], R[i], N[i] = s, r, n
  end

  local total, acc, rc, rr, lc, lr = 0, 0, 0, 0, 0, 0
  for k = 0, npairs - 1 do
    local iw, il = 2 * k, 2 * k + 1
    if layout == 'halves' then iw, il = k, npairs + k end
    local dw, dl = S[iw] - R[iw], S[il] - R[il]
    local l, dh = pair_loss(kind, dw - dl, beta, eps)
    total = total + l
    rc, rr = rc + beta * dw, rr + beta * dl
    lc, lr = lc + S[iw], lr + S[il]
    if beta * dw > beta * dl then acc = acc + 1 end
    if grad ~= nil and P > 0 then
      local gw, gl = coef * dh / P, -coef * dh / P
      if norm then
        gw = N[iw] > 0 and gw / N[iw] or 0
        gl = N[il] > 0 and gl / N[il] or 0
      end
      for t = cu[iw], cu[iw + 1] - 1 do grad[t] = grad[t] + gw * mask[t] end
      for t = cu[il], cu[il + 1] - 1 do grad[t] = grad[t] + gl * mask[t] end
    end
  end
  local inv = npairs > 0 and 1 / npairs or 0
  local loss = P > 0 and total / P or 0
  return coef * loss, {
    loss = loss,
    rewards_chosen = rc * inv, rewards_rejected = rr * inv, rewards_margin = (rc - rr) * inv,
    rewards_accuracy = acc * inv, logps_chosen = lc * inv, logps_rejected = lr * inv,
  }
end

return M
