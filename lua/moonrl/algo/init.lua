-- moonrl.algo: the algorithm math over packed per-token arrays. Every loss returns
-- (loss, metrics) and ADDS its gradient with respect to the core's per-token outputs (log-probs,
-- entropy, values) into args.grad, so several terms combine into one gradient.
--
--   local algo = require('moonrl.algo')
--   local adv = algo.advantages.grpo{scores = s, nseq = n, group = 8}
--   local tok_adv = algo.advantages.to_tokens{values = adv, cu_seqlens = cu, nseq = n, mask = m}
--   local loss, metrics = algo.policy_loss.ppo{logprob = lp, old_logprob = old, advantages = tok_adv,
--     cu_seqlens = cu, nseq = n, mask = m, clip_high = 0.28, grad = g}
--
-- Modules: advantages, policy_loss, correction (off-policy weights: TIS, MIS), kl, value_loss, dpo,
-- sft, agg (see each file's top for the arrays it reads).
--
-- The registries recipes look these up in by name (moonrl.registry: register(name, fn, doc),
-- get, check, names, doc), checked at start-up:
--   algo.estimators      advantage estimators, fn(samples, ctx) -> adv  (estimators.lua):
--                        grpo, dr_grpo, rloo, reinforce_pp, gae         `grpo.advantage=NAME`
--   algo.losses          policy losses, fn(args) -> loss, metrics (policy_loss.lua):
--                        ppo, dual_clip, gspo, reinforce, decoupled_ppo `grpo.loss=NAME`
--   algo.kl_estimators   KL estimators, fn(lp, ref, clamp) -> k, dk/dlogπ (kl.lua):
--                        k1, k2, k3 (and aliases)                       `grpo.kl_estimator=NAME`
-- algo.advantages.register, algo.policy_loss.register and algo.kl.register are the same calls.
local M = {
  advantages = require('moonrl.algo.advantages'),
  policy_loss = require('moonrl.algo.policy_loss'),
  correction = require('moonrl.algo.correction'),
  kl = require('moonrl.algo.kl'),
  value_loss = require('moonrl.algo.value_loss'),
  dpo = require('moonrl.algo.dpo'),
  sft = require('moonrl.algo.sft'),
  agg = require('moonrl.algo.agg'),
  estimators = require('moonrl.algo.estimators'),
}
M.losses = M.policy_loss.losses
M.kl_estimators = M.kl.estimators
M.advantages.register = M.estimators.register

return M
