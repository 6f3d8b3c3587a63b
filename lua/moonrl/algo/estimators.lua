-- Advantage estimators as recipes find them: by name (`grpo.advantage=rloo`), in one registry
-- (moonrl.registry; also moonrl.algo.estimators and moonrl.algo.advantages.register).
--
--   local algo = require('moonrl.algo')
--   algo.estimators.register('my_adv', function(samples, ctx)
--     local adv = {}
--     for i, s in ipairs(samples) do adv[i] = s.score - 0.5 end
--     return adv
--   end, 'score minus a fixed baseline')
--
-- An estimator is fn(samples, ctx) -> adv [, extra]:
--   samples   the step's samples, in order; each has .score (its scalar reward), .ids (response
--             tokens), .prompt_ids, .group (its prompt's index); ctx.group consecutive samples
--             share a prompt
--   ctx       { scores = double[n] (the samples' .score), nseq = n, group = G (samples per
--             prompt), cfg = the recipe's section (grpo.*: scale, gamma, lam, kl_coef ...), and,
--             when the recipe computed them (a critic: PPO), values, old_logprobs, ref_logprobs:
--             per-sample lists of per-token numbers }
--   adv       n numbers (a Lua list or a 0-based double array): one advantage per sample, or a Lua
--             list of n per-token lists (token-level estimators: REINFORCE++, GAE)
--   extra     optional { field = per-sample list }, set on each sample (GAE: returns)
-- An estimator whose entry says needs = { 'values' } is refused at start-up by a recipe without a
-- critic. The math itself is moonrl.algo.advantages (arrays); these wrap it for samples.
local A = require('moonrl.algo.advantages')

local M = require('moonrl.registry').new('advantage estimator')

local batch = require('moonrl.batch')

M.register('grpo', function(samples, ctx)
  return A.grpo({ scores = ctx.scores, nseq = ctx.nseq, group = ctx.group, scale = ctx.cfg.scale })
end, 'GRPO: (s − group mean) / (group std + 1e-6); grpo.scale = group | batch | none')

M.register('dr_grpo', function(samples, ctx)
  return A.grpo({ scores = ctx.scores, nseq = ctx.nseq, group = ctx.group, scale = 'none' })
end, 'Dr. GRPO: s − group mean, no std division')

M.register('rloo', function(samples, ctx)
  return A.rloo({ scores = ctx.scores, nseq = ctx.nseq, group = ctx.group })
end, 'RLOO: s − mean of the other samples of the group')

-- Per-token rewards of the packed samples: the score on the last response token, minus the KL
-- penalty kl_coef · (log π_old − log π_ref) when the recipe computed both.
local function token_rewards(b, ctx)
  local kl = ctx.ref_logprobs and ctx.old_logprobs and (ctx.cfg.kl_coef or 0) or 0
  return A.token_rewards({ scores = ctx.scores, cu_seqlens = b.cu_seqlens, nseq = b.n_seqs, mask = b.mask,
    old_logprob = ctx.old_logprobs and batch.scatter(b, ctx.old_logprobs),
    ref_logprob = ctx.ref_logprobs and batch.scatter(b, ctx.ref_logprobs), kl_coef = ctx.ref_logprobs and kl or 0 })
end

M.register('reinforce_pp', function(samples, ctx)
  local b = batch.pack(samples)
  local adv = A.reinforce_pp({ token_rewards = token_rewards(b, ctx), cu_seqlens = b.cu_seqlens, nseq = b.n_seqs,
    mask = b.mask, gamma = ctx.cfg.gamma or 1 })
  return batch.gather(b, adv)
end, 'REINFORCE++: discounted returns (gamma), whitened over the batch')

M.register('gae', function(samples, ctx)
  local b = batch.pack(samples)
  local adv, ret = A.gae({ token_rewards = token_rewards(b, ctx), values = batch.scatter(b, ctx.values),
    cu_seqlens = b.cu_seqlens, nseq = b.n_seqs, mask = b.mask, gamma = ctx.cfg.gamma, lam = ctx.cfg.lam })
  return batch.gather(b, adv), { returns = batch.gather(b, ret) }
end, { doc = "GAE over the critic's values (gamma, lam), whitened: PPO", needs = { 'values' } })

return M
