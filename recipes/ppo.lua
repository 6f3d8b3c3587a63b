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
--   A, R   <- GAE(r, V_old, γ, λ); A whitened over the batch
--   for each of ppo.epochs: policy: PPO-clip on A; critic: clipped value loss ½ max((V − R)², ...)
--     (micro-batches with the batch's global denominators; one AdamW step each)
local moonrl = require('moonrl')
local ffi = require('ffi')
local algo = require('moonrl.algo')
local R = require('moonrl.recipe')

local cfg = moonrl.config {
  model = R.model_config(),
  data = R.data_config { prompt = 'prompt', answer = 'answer', chat = true, system = '' },
  reward = R.reward_config('math'),
  reward_model = { dir = moonrl.config.optional('string', 'a ...ForSequenceClassification checkpoint') },
  ppo = { steps = moonrl.config.integer(100), prompts = moonrl.config.integer(16), samples = moonrl.config.integer(1),
          temperature = 1.0, max_tokens = moonrl.config.integer(256), epochs = moonrl.config.integer(2),
          clip = 0.2, value_clip = 0.5, gamma = 1.0, lam = 0.95, kl_coef = 0.01, agg = 'token-mean' },
  train = R.train_config { lr = 1e-6, critic_lr = 5e-6 },
  engine = R.engine_config(),
  async = R.async_config(),
  save = true,
}
local S = R.start(cfg, { name = 'ppo', steps = cfg.ppo.steps, steps_key = 'ppo.steps', chat = cfg.data.chat,
  fields = { prompt = cfg.data.prompt, answer = cfg.data.answer }, optional = { answer = true } })
local policy = S.policy
local critic = S:model('critic', R.critic_from(policy))
local ref = cfg.ppo.kl_coef > 0 and S:reference() or nil
local critic_opt = S:optimizer('critic', R.adamw(critic, { lr = cfg.train.critic_lr, weight_decay = cfg.train.weight_decay }))
local sampling = { temperature = cfg.ppo.temperature, max_tokens = cfg.ppo.max_tokens,
  eos_ids = R.eos_ids(S.tok, policy), tokenizer = S.tok }
local mb_tokens = cfg.train.micro_batch_tokens

-- One AdamW step of the critic on the clipped value loss (global token denominator).
local function critic_step(samples)
  local tokens = 0
  for _, s in ipairs(samples) do tokens = tokens + #s.ids end
  local loss, clipfrac = 0, 0
  critic:zero_grad()
  local mine = S:local_samples(samples)
  for b, first in S:micro_batches(samples, mb_tokens) do
    local _, _, v = critic:forward(b, { values = true })
    local dv = ffi.new('float[?]', b.n_tokens)
    local l, m = algo.value_loss.clipped({ values = v, old_values = R.scatter(b, R.gather_field(mine, 'values'), first),
      returns = R.scatter(b, R.gather_field(mine, 'returns'), first), mask = b.mask, cu_seqlens = b.cu_seqlens,
      nseq = b.n_seqs, clip = cfg.ppo.value_clip, grad = dv, global_tokens = tokens })
    critic:backward(nil, nil, dv)
    local mt = 0
    for _, n in ipairs(b.len) do mt = mt + n end
    loss, clipfrac = loss + l, clipfrac + m.vf_clipfrac * mt / math.max(tokens, 1)
  end
  local m = S:sum({ loss = loss, clip_frac = clipfrac })
  m.grad_norm = critic_opt:clip_grad_norm(cfg.train.max_grad_norm)
  R.apply_update(S, critic_opt, cfg.train.critic_lr, m, { detectors = false })
  return m
end

-- 1. the rollout of batch `step`: prompts, completions, rewards (a failing reward drops its samples)
S:rollout(function(step)
  local records = S:prompts(cfg.ppo.prompts)
  sampling.step = step
  local results = S:phase('generate', function() return S.engine:generate(R.requests(records, cfg.ppo.samples), sampling) end)
  local scores, samples, rm = S:phase('reward', S.score, S, R.flatten(records, results), cfg.ppo.samples)
  for i, s in ipairs(samples) do s.score = scores[i - 1] end
  return samples, { reward = rm }
end)

local history = {}
for step in S:steps() do
  local samples, info = S:next_batch()
  local gen_s, rm, scores = info.gen_seconds, info.reward, R.scores(samples)
  if #samples == 0 then -- every reward failed: nothing to learn from this step
    S:log({ reward = rm, skipped = 1 })
    goto continue
  end

  -- 2. log π_old, log π_ref, V_old on the rollouts
  local old, refl, values = S:phase('logprobs', function()
    local o = R.logprobs(policy, samples, mb_tokens, { temperature = cfg.ppo.temperature })
    local r = ref and R.logprobs(ref, samples, mb_tokens, { temperature = cfg.ppo.temperature })
    local _, v = R.logprobs(critic, samples, mb_tokens, { values = true })
    return o, r, v
  end)

  -- 3. token rewards with the KL penalty, GAE advantages and returns (over the whole batch)
  local b = R.pack(samples)
  local cu, nseq, mask = b.cu_seqlens, b.n_seqs, b.mask
  local token_r = algo.advantages.token_rewards({ scores = scores, cu_seqlens = cu, nseq = nseq, mask = mask,
    old_logprob = R.scatter(b, old), ref_logprob = refl and R.scatter(b, refl), kl_coef = refl and cfg.ppo.kl_coef or 0 })
  local adv, ret = algo.advantages.gae({ token_rewards = token_r, values = R.scatter(b, values), cu_seqlens = cu,
    nseq = nseq, mask = mask, gamma = cfg.ppo.gamma, lam = cfg.ppo.lam })
  local adv_l, ret_l = R.gather(b, adv), R.gather(b, ret)
  for i, s in ipairs(samples) do
    if s.adv_scale then for k = 1, #adv_l[i] do adv_l[i][k] = adv_l[i][k] * s.adv_scale end end
  end
  local kl = 0
  for i, s in ipairs(samples) do
    s.old_logprobs, s.values, s.adv_tokens, s.returns = old[i], values[i], adv_l[i], ret_l[i]
    if refl then for k = 1, #s.ids do kl = kl + old[i][k] - refl[i][k] end end
  end

  -- 4. epochs of policy and critic updates
  local t0 = moonrl.now()
  local m, c, mismatch
  for epoch = 1, cfg.ppo.epochs do
    m = S:phase('train', R.policy_step, S:off_policy { session = S, model = policy, opt = S.opt, samples = samples, lr = S:lr(),
      measure_mismatch = epoch == 1,
      temperature = cfg.ppo.temperature, clip_low = cfg.ppo.clip, agg = cfg.ppo.agg,
      micro_batch_tokens = mb_tokens, max_grad_norm = cfg.train.max_grad_norm })
    c = S:phase('critic', critic_step, samples)
    mismatch = mismatch or m.mismatch -- engine vs trainer log-probs, before the first update
  end
  m.mismatch = mismatch

  -- 5. log
  m.reward, m.accuracy = R.reward_metrics(scores, #samples)
  m.reward.errors, m.reward.dropped_groups = rm.errors, rm.dropped_groups
  m.data = S:data_metrics()
  m.async = S:async_metrics(info)
  m.kl = kl / math.max(m.tokens, 1)
  m.critic = c
  m.response_length = R.length_metrics(samples)
  m.tokens_per_s = { generate = R.rate(m.tokens, gen_s), train = R.rate(2 * m.tokens * cfg.ppo.epochs, moonrl.now() - t0) }
  history[step] = S:log(m)
  ::continue::
end

local dirs = S:finish()
print('run directory: ' .. S.dir .. (dirs.policy and ('; policy saved to ' .. dirs.policy .. ', critic to ' .. dirs.critic) or ''))
return { history = history, dir = S.dir, model = policy, critic = critic }
