-- Supervised fine-tuning: cross-entropy on the response tokens, the prompt masked out.
--
--   loss = coef · agg(−log πθ)        dloss/dlogπ_t = −coef · w_i · m_t
--
-- Inputs (cdata, 0-based): logprob [ntok] (log πθ of each target token, from the core), mask [ntok]
-- (1 on tokens that are trained on, 0 on the prompt), cu_seqlens [nseq+1], nseq; args.agg
-- ('token-mean', the usual SFT loss; 'seq-mean-token-mean' weights every sample alike) with global
-- denominators (agg.lua); args.coef (1); args.grad [ntok] optional: dloss/dlogπ is ADDED into it.
-- Returns loss, metrics {nll (agg of −log π without coef), ppl = exp(token-mean nll), tokens}.
local agg = require('moonrl.algo.agg')

local M = {}

local function nll_token(lp, t) return -lp[t], -1 end

function M.loss(args)
  local fn = 'sft.loss'
  local _, ntok = agg.check_batch(args, fn)
  local lp = agg.check_array(args, 'logprob', ntok, fn)
  local loss, nll = agg.token_loss(args, fn, 'token-mean', nll_token, lp)
  local sum, n = agg.masked_sums(lp, args.mask, ntok)
  local mean = n > 0 and -sum / n or 0
  return loss, { nll = nll, ppl = math.exp(math.min(mean, 700)), tokens = n }
end

return M
