-- GRPO: group relative policy optimisation with rewards from the reward registry.
--
--   moonrl run grpo model.dir=/models/Qwen2.5-0.5B-Instruct data.path=gsm8k.jsonl reward=math
--
-- for each step:
--   prompts  <- next records of the shuffled dataset
--   generate grpo.samples completions per prompt with the engine (it reads the policy's weights)
--   rewards  <- the registry's reward (by name) of every completion
--   A_i      <- (r_i − mean of its group) / (std of its group + ε)         (one value per completion)
--   log π_ref <- the frozen initial policy (only when grpo.kl_coef > 0)
--   for each of grpo.epochs passes: micro-batches -> forward, PPO-clip loss on A (+ β·KL to the
--     reference, − entropy bonus) with the batch's global denominators -> backward; clip; AdamW step
-- One line and one metrics.jsonl record per step; the model saved in HF format at the end.
local moonrl = require('moonrl')
local algo = require('moonrl.algo')
local rewards = require('moonrl.rewards')
local R = require('moonrl.recipe')

local cfg = moonrl.config {
  model = { dir = moonrl.config.required('string', 'Hugging Face model directory'),
            tokenizer = moonrl.config.optional('string', 'tokenizer directory (default model.dir)') },
  data = { path = moonrl.config.required('string', 'JSONL with one prompt a line'),
           prompt = 'prompt', answer = 'answer', chat = true, system = '' },
  reward = 'math', -- a name in the reward registry (moonrl.rewards); 'reward_model' with reward_model.dir
  reward_model = { dir = moonrl.config.optional('string', 'a ...ForSequenceClassification checkpoint') },
  grpo = { steps = moonrl.config.integer(100), prompts = moonrl.config.integer(8), samples = moonrl.config.integer(8),
           temperature = 1.0, top_p = 1.0, top_k = moonrl.config.integer(0), max_tokens = moonrl.config.integer(256),
           loss = 'ppo', clip_low = 0.2, clip_high = 0.2, agg = 'token-mean', scale = 'group',
           kl_coef = 0.0, kl_estimator = 'k3', entropy_coef = 0.0, epochs = moonrl.config.integer(1) },
  train = { lr = 1e-6, schedule = 'constant', warmup = moonrl.config.integer(0), weight_decay = 0.0,
            max_grad_norm = 1.0, micro_batch_tokens = moonrl.config.integer(4096) },
  engine = { kv_cache_mb = moonrl.config.integer(512), max_batch_tokens = moonrl.config.integer(2048),
             max_seqs = moonrl.config.integer(256) },
  save = true,
}
local run = moonrl.run.start(cfg, { name = 'grpo', total_steps = cfg.grpo.steps })
local model, tok, tpl, tok_dir = R.load(cfg.model.dir, { tokenizer = cfg.model.tokenizer, chat = cfg.data.chat })
local ref = cfg.grpo.kl_coef > 0 and R.clone(model) or nil -- frozen copy of the initial policy
if cfg.reward_model.dir then require('rewards.reward_model').register('reward_model', cfg.reward_model.dir) end
local reward = rewards.get(cfg.reward)
local opt = R.adamw(model, { lr = cfg.train.lr, weight_decay = cfg.train.weight_decay })
local lr_at = moonrl.optim.schedule({ kind = cfg.train.schedule, warmup = cfg.train.warmup,
  total = cfg.grpo.steps, lr = cfg.train.lr })
local engine = moonrl.engine.new(model, { kv_cache_bytes = cfg.engine.kv_cache_mb * 2 ^ 20, block_size = 16,
  max_batch_tokens = cfg.engine.max_batch_tokens, max_seqs = cfg.engine.max_seqs, seed = cfg.run.seed })
local sampling = { temperature = cfg.grpo.temperature, top_p = cfg.grpo.top_p, top_k = cfg.grpo.top_k,
  max_tokens = cfg.grpo.max_tokens, eos_ids = R.eos_ids(tok, model), tokenizer = tok }
local _, next_batch = R.dataset(cfg.data.path, { prompt = cfg.data.prompt, answer = cfg.data.answer },
  cfg.run.seed, { answer = true })

local history = {}
for step = 1, cfg.grpo.steps do
  -- 1. prompts and rollouts
  local records = next_batch(cfg.grpo.prompts)
  for _, r in ipairs(records) do r.prompt_ids = r.prompt_ids or R.prompt_ids(tok, tpl, r.prompt, cfg.data.system) end
  local t0 = moonrl.now()
  sampling.step = step
  local results = run:phase('generate', function() return engine:generate(R.requests(records, cfg.grpo.samples), sampling) end)
  local gen_s = moonrl.now() - t0
  local samples = R.flatten(records, results)

  -- 2. rewards and group-normalised advantages
  local scores = run:phase('reward', function() return rewards.score_batch(reward, samples) end)
  local adv = algo.advantages.grpo({ scores = scores, nseq = #samples, group = cfg.grpo.samples, scale = cfg.grpo.scale })
  for i, s in ipairs(samples) do s.adv = adv[i - 1] end

  -- 3. the update: on-policy with one epoch (log π_old = log πθ); else log π_old computed first
  if cfg.grpo.epochs > 1 then
    local old = run:phase('old_logprobs', R.logprobs, model, samples, cfg.train.micro_batch_tokens,
      { temperature = cfg.grpo.temperature })
    for i, s in ipairs(samples) do s.old_logprobs = old[i] end
  end
  t0 = moonrl.now()
  local m, mismatch
  for epoch = 1, cfg.grpo.epochs do
    m = run:phase('train', R.policy_step, { model = model, opt = opt, samples = samples, ref = ref,
      measure_mismatch = epoch == 1,
      lr = lr_at(step), temperature = cfg.grpo.temperature, loss = cfg.grpo.loss, clip_low = cfg.grpo.clip_low,
      clip_high = cfg.grpo.clip_high, agg = cfg.grpo.agg, norm = cfg.grpo.max_tokens, kl_coef = cfg.grpo.kl_coef,
      kl_estimator = cfg.grpo.kl_estimator, entropy_coef = cfg.grpo.entropy_coef,
      micro_batch_tokens = cfg.train.micro_batch_tokens, max_grad_norm = cfg.train.max_grad_norm })
    mismatch = mismatch or m.mismatch -- engine vs trainer log-probs, before the first update
  end
  m.mismatch = mismatch

  -- 4. log
  m.reward, m.accuracy = R.reward_metrics(scores, #samples)
  m.response_length = R.length_metrics(samples)
  m.tokens_per_s = { generate = R.rate(m.tokens, gen_s), train = R.rate(m.tokens * cfg.grpo.epochs, moonrl.now() - t0) }
  history[step] = run:log(step, m)
  if R.check_stop(cfg, run) then break end
end

local dir = cfg.save and R.save(run, model, tok_dir) or nil
run:finish()
print('run directory: ' .. run.dir .. (dir and ('; model saved to ' .. dir) or ''))
return { history = history, dir = run.dir, model = model }
