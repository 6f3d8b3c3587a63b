-- PPO with a critic: token-level advantages from GAE over a learned value function.
--
--   moonrl run ppo model.dir=/models/Qwen2.5-0.5B-Instruct data.path=gsm8k.jsonl reward=math
--
-- critic <- the initial policy's weights plus a scalar value head (a second model)
-- the rollout of a batch (here, ahead, or on rollout ranks: async.mode, dist.rollout_ranks):
--   prompts; generate ppo.samples completions each; scalar reward of each completion
-- for each step, on its batch:
--   log π_old (policy), log π_ref (frozen initial policy, when kl_coef > 0), V_old (critic)
--   r_t    <- reward on the last response token − kl_coef · (log π_old − log π_ref) on every token
--   A, R   <- the estimator ppo.advantage (gae: GAE(r, V_old, γ, λ), A whitened over the batch)
--   for each of ppo.epochs: policy: the loss ppo.loss (PPO-clip) on A; critic: clipped value loss
--     ½ max((V − R)², ...) (micro-batches with the batch's global denominators; one AdamW step each)
-- The loop and the rollout are moonrl.rl's; this file adds the critic (setup, advantages, update).
local moonrl = require('moonrl')
local ffi = require('ffi')
local algo = require('moonrl.algo')
local rl = require('moonrl.rl')
local config = require('moonrl.config')
local batch = require('moonrl.batch')
local metrics = require('moonrl.train.metrics')
local models = require('moonrl.train.models')
local train = require('moonrl.train.step')

local ppo = rl.recipe {
  name = 'ppo',
  provides = { values = true }, -- the critic's: the estimators that need them (gae) may be chosen
  config = {
    ppo = { steps = config.integer(100), prompts = config.integer(16), samples = config.integer(1),
            temperature = 1.0, max_tokens = config.integer(256), epochs = config.integer(2),
            advantage = 'gae', loss = 'ppo', clip = 0.2, value_clip = config.number(0.5, { min = 0 }),
            gamma = config.number(1.0, { min = 0, max = 1 }), lam = config.number(0.95, { min = 0, max = 1 }),
            kl_coef = 0.01, agg = 'token-mean' },
    train = { critic_lr = config.number(5e-6, { min = 0 }) },
  },
}

function ppo:setup()
  local S = self.S
  self.critic = S:model('critic', models.critic_from(S.policy))
  rl.Recipe.setup(self) -- the reference policy (kl_coef > 0: in the reward), the sampling options
  self.sampling.top_p, self.sampling.top_k = nil, nil
  self.critic_opt = S:optimizer('critic', models.adamw(self.critic, { lr = self.cfg.train.critic_lr,
    weight_decay = self.cfg.train.weight_decay }))
end

-- log π_old, log π_ref and V_old on the rollouts, then the estimator (GAE: advantages and returns).
function ppo:advantages(samples, info)
  local S, mb, temp = self.S, self.cfg.train.micro_batch_tokens, self.c.temperature
  local old, refl, values = S:phase('logprobs', function()
    local o = train.logprobs(S.policy, samples, mb, { temperature = temp })
    local r = self.ref and train.logprobs(self.ref, samples, mb, { temperature = temp })
    local _, v = train.logprobs(self.critic, samples, mb, { values = true })
    return o, r, v
  end)
  local ctx = self:advantage_context(samples)
  ctx.old_logprobs, ctx.ref_logprobs, ctx.values = old, refl, values
  rl.set_advantages(samples, algo.estimators.get(self.c.advantage)(samples, ctx))
  local kl = 0
  for i, s in ipairs(samples) do
    s.old_logprobs, s.values = old[i], values[i]
    if refl then for k = 1, #s.ids do kl = kl + old[i][k] - refl[i][k] end end
  end
  self.kl_sum = kl
end

-- One AdamW step of the critic on the clipped value loss (global token denominator).
function ppo:critic_step(samples)
  local S, critic = self.S, self.critic
  local tokens = 0
  for _, s in ipairs(samples) do tokens = tokens + batch.loss_tokens(s) end
  critic:zero_grad()
  local mine = S:local_samples(samples)
  -- (an empty batch serves the policy's experts: the critic has none; dist.pp: 1F1B, train.run_micro_batches)
  local sums = train.run_micro_batches(critic, S:micro_batches(samples, self.cfg.train.micro_batch_tokens),
    function(b, first, _, acc)
      local _, _, v = critic:forward(b, { values = true })
      local dv = ffi.new('float[?]', b.n_tokens)
      local l, m = algo.value_loss.clipped({ values = v, old_values = batch.scatter(b, batch.gather_field(mine, 'values'), first),
        returns = batch.scatter(b, batch.gather_field(mine, 'returns'), first), mask = b.mask, cu_seqlens = b.cu_seqlens,
        nseq = b.n_seqs, clip = self.c.value_clip, grad = dv, global_tokens = tokens })
      critic:backward(nil, nil, dv)
      local mt = 0
      for _, n in ipairs(b.len) do mt = mt + n end
      acc.loss, acc.clip_frac = acc.loss + l, acc.clip_frac + m.vf_clipfrac * mt / math.max(tokens, 1)
    end, { loss = 0, clip_frac = 0 })
  local m = S:sum(sums)
  m.grad_norm = self.critic_opt:clip_grad_norm(self.cfg.train.max_grad_norm)
  train.apply_update(S, self.critic_opt, self.cfg.train.critic_lr, m, { detectors = false })
  return m
end

function ppo:policy_options(samples, epoch)
  local S, c, t = self.S, self.c, self.cfg.train
  local off = train.off_policy(self.cfg) -- async.*: the correction weights, or decoupled PPO's loss
  return { session = S, model = S.policy, opt = S.opt, samples = samples, lr = S:lr(),
    loss = off.decoupled and 'decoupled_ppo' or c.loss, correction = off.correction,
    behav_imp_weight_cap = off.behav_imp_weight_cap,
    measure_mismatch = epoch == 1, temperature = c.temperature, clip_low = c.clip, agg = c.agg,
    micro_batch_tokens = t.micro_batch_tokens, max_grad_norm = t.max_grad_norm }
end

-- Epochs of policy and critic updates.
function ppo:update(samples, info)
  self.update_t0 = moonrl.now()
  local m, c, mismatch
  for epoch = 1, self.c.epochs do
    m = self.S:phase('train', train.policy_step, self:policy_options(samples, epoch))
    c = self.S:phase('critic', self.critic_step, self, samples)
    mismatch = mismatch or m.mismatch -- engine vs trainer log-probs, before the first update
  end
  m.mismatch, m.critic = mismatch, c
  return m
end

function ppo:metrics(m, samples, info)
  rl.Recipe.metrics(self, m, samples, info)
  m.kl = self.kl_sum / math.max(m.tokens, 1)
  m.tokens_per_s.train = metrics.rate(2 * m.tokens * self.c.epochs, moonrl.now() - self.update_t0)
end

-- Every reward failed: nothing to learn from this step.
function ppo:train_step(step, samples, info)
  if #samples == 0 then return self.S:log({ reward = info.reward, skipped = 1 }) end
  return rl.Recipe.train_step(self, step, samples, info)
end

function ppo:finish()
  local S = self.S
  S:finish() -- the policy in RUN_DIR/model, the critic in RUN_DIR/critic
  return { history = self.history, dir = S.dir, model = S.policy, critic = self.critic }
end

return ppo:main()
