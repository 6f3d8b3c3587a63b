-- GRPO: group relative policy optimisation with rewards from the reward registry.
--
--   moonrl run grpo model.dir=/models/Qwen2.5-0.5B-Instruct data.path=gsm8k.jsonl reward=math
--
-- the rollout of a batch (run here, a step or more ahead, or on rollout ranks: async.mode,
-- dist.rollout_ranks; see moonrl.rollout):
--   prompts  <- next records of the shuffled dataset
--   generate grpo.samples completions per prompt with the engine (it reads the policy's weights)
--   rewards  <- the registry's reward (by name) of every completion
-- for each step, on its batch:
--   A_i      <- (r_i − mean of its group) / (std of its group + ε)         (one value per completion)
--   log π_ref <- the frozen initial policy (only when grpo.kl_coef > 0)
--   for each of grpo.epochs passes: micro-batches -> forward, PPO-clip loss on A (+ β·KL to the
--     reference, − entropy bonus) with the batch's global denominators -> backward; clip; AdamW step
-- One line and one metrics.jsonl record per step; the model saved in HF format at the end.
local moonrl = require('moonrl')
local algo = require('moonrl.algo')
local R = require('moonrl.recipe')

local cfg = moonrl.config {
  model = R.model_config(),
  data = R.data_config { prompt = 'prompt', answer = 'answer', chat = true, system = '' },
  reward = R.reward_config('math'), -- a name in the reward registry (moonrl.rewards); 'reward_model' with reward_model.dir
  reward_model = { dir = moonrl.config.optional('string', 'a ...ForSequenceClassification checkpoint') },
  grpo = { steps = moonrl.config.integer(100), prompts = moonrl.config.integer(8), samples = moonrl.config.integer(8),
           temperature = 1.0, top_p = 1.0, top_k = moonrl.config.integer(0), max_tokens = moonrl.config.integer(256),
           loss = 'ppo', clip_low = 0.2, clip_high = 0.2, agg = 'token-mean', scale = 'group',
           kl_coef = 0.0, kl_estimator = 'k3', entropy_coef = 0.0, epochs = moonrl.config.integer(1) },
  train = R.train_config { lr = 1e-6 },
  engine = R.engine_config(),
  async = R.async_config(),
  save = true,
}
local S = R.start(cfg, { name = 'grpo', steps = cfg.grpo.steps, steps_key = 'grpo.steps', chat = cfg.data.chat,
  fields = { prompt = cfg.data.prompt, answer = cfg.data.answer }, optional = { answer = true } })
local ref = cfg.grpo.kl_coef > 0 and S:reference() or nil -- frozen copy of the initial policy
local sampling = { temperature = cfg.grpo.temperature, top_p = cfg.grpo.top_p, top_k = cfg.grpo.top_k,
  max_tokens = cfg.grpo.max_tokens, eos_ids = R.eos_ids(S.tok, S.policy), tokenizer = S.tok }
local G = cfg.grpo.samples

-- 1. the rollout of batch `step`: prompts, completions, rewards (a failing reward drops its group)
S:rollout(function(step)
  local records = S:prompts(cfg.grpo.prompts)
  sampling.step = step
  local results = S:phase('generate', function() return S.engine:generate(R.requests(records, G), sampling) end)
  local scores, samples, rm = S:phase('reward', S.score, S, R.flatten(records, results), G)
  for i, s in ipairs(samples) do s.score = scores[i - 1] end
  return samples, { reward = rm }
end)

local history = {}
for step in S:steps() do
  -- 2. this step's batch and its group-normalised advantages
  local samples, info = S:next_batch()
  local gen_s, rm = info.gen_seconds, info.reward
  local scores = R.scores(samples)
  local adv = algo.advantages.grpo({ scores = scores, nseq = #samples, group = G, scale = cfg.grpo.scale })
  for i, s in ipairs(samples) do s.adv = adv[i - 1] * (s.adv_scale or 1) end

  -- 3. the update: on-policy with one epoch (log π_old = log πθ); else log π_old computed first
  if cfg.grpo.epochs > 1 and #samples > 0 then
    local old = S:phase('old_logprobs', R.logprobs, S.policy, samples, cfg.train.micro_batch_tokens,
      { temperature = cfg.grpo.temperature })
    for i, s in ipairs(samples) do s.old_logprobs = old[i] end
  end
  local t0 = moonrl.now()
  local m, mismatch = { tokens = 0 }, nil
  for epoch = 1, #samples > 0 and cfg.grpo.epochs or 0 do
    m = S:phase('train', R.policy_step, S:off_policy { session = S, model = S.policy, opt = S.opt, samples = samples, ref = ref,
      measure_mismatch = epoch == 1,
      lr = S:lr(), temperature = cfg.grpo.temperature, loss = cfg.grpo.loss, clip_low = cfg.grpo.clip_low,
      clip_high = cfg.grpo.clip_high, agg = cfg.grpo.agg, norm = cfg.grpo.max_tokens, kl_coef = cfg.grpo.kl_coef,
      kl_estimator = cfg.grpo.kl_estimator, entropy_coef = cfg.grpo.entropy_coef,
      micro_batch_tokens = cfg.train.micro_batch_tokens, max_grad_norm = cfg.train.max_grad_norm })
    mismatch = mismatch or m.mismatch -- engine vs trainer log-probs, before the first update
  end
  m.mismatch = mismatch

  -- 4. log
  m.reward, m.accuracy = R.reward_metrics(scores, #samples)
  m.reward.errors, m.reward.dropped_groups = rm.errors, rm.dropped_groups
  m.response_length = R.length_metrics(samples)
  m.data = S:data_metrics()
  m.async = S:async_metrics(info)
  m.tokens_per_s = { generate = R.rate(m.tokens, gen_s), train = R.rate(m.tokens * cfg.grpo.epochs, moonrl.now() - t0) }
  history[step] = S:log(m)
end

local dirs = S:finish()
print('run directory: ' .. S.dir .. (dirs.policy and ('; model saved to ' .. dirs.policy) or ''))
return { history = history, dir = S.dir, model = S.policy }
