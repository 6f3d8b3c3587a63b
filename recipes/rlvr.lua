-- RLVR: GRPO with verifiable rewards and DAPO's changes (dynamic sampling, clip-higher, token-mean
-- loss, soft overlong penalty, no KL term).
--
--   moonrl run rlvr model.dir=/models/Qwen2.5-0.5B-Instruct data.path=gsm8k.jsonl reward=math
--
-- the rollout of a step's batch (here, ahead, or on rollout ranks: async.mode, dist.rollout_ranks):
--   repeat (at most rlvr.max_gen_batches times) until rlvr.prompts groups are kept:
--     prompts; generate rlvr.samples completions each; score = verifier reward + overlong penalty
--     keep only the groups whose scores are NOT all equal (an all-right or all-wrong group has zero
--     advantage and teaches nothing)
-- for each step, on its batch:
--   A_i <- group-normalised scores of the kept groups
--   PPO-clip with clip-higher (ε_low 0.2, ε_high 0.28), token-mean over the whole batch; AdamW step
-- Overlong penalty (DAPO): with L = rlvr.max_tokens and a buffer B, a response of length ℓ gets
--   0 when ℓ <= L − B,  (L − B − ℓ)/B · overlong.factor when L − B < ℓ <= L.
local moonrl = require('moonrl')
local algo = require('moonrl.algo')
local R = require('moonrl.recipe')

local cfg = moonrl.config {
  model = R.model_config(),
  data = R.data_config { prompt = 'prompt', answer = 'answer', chat = true, system = '' },
  reward = R.reward_config('math'),
  rlvr = { steps = moonrl.config.integer(100), prompts = moonrl.config.integer(8), samples = moonrl.config.integer(8),
           max_gen_batches = moonrl.config.integer(4), temperature = 1.0, top_p = 1.0,
           max_tokens = moonrl.config.integer(512), clip_low = 0.2, clip_high = 0.28, agg = 'token-mean',
           kl_coef = 0.0 },
  overlong = { enable = true, buffer = moonrl.config.integer(128), factor = 1.0 },
  train = R.train_config { lr = 1e-6 },
  engine = R.engine_config(),
  async = R.async_config(),
  save = true,
}
local S = R.start(cfg, { name = 'rlvr', steps = cfg.rlvr.steps, steps_key = 'rlvr.steps', chat = cfg.data.chat,
  fields = { prompt = cfg.data.prompt, answer = cfg.data.answer }, optional = { answer = true } })
local ref = cfg.rlvr.kl_coef > 0 and S:reference() or nil
local sampling = { temperature = cfg.rlvr.temperature, top_p = cfg.rlvr.top_p, max_tokens = cfg.rlvr.max_tokens,
  eos_ids = R.eos_ids(S.tok, S.policy), tokenizer = S.tok }
local G = cfg.rlvr.samples

local function overlong_penalty(len)
  if not cfg.overlong.enable then return 0 end
  local L, B = cfg.rlvr.max_tokens, math.min(cfg.overlong.buffer, cfg.rlvr.max_tokens)
  if len <= L - B or B == 0 then return 0 end
  return (L - B - len) / B * cfg.overlong.factor
end

-- 1. the rollout, with dynamic sampling: generate and score until enough groups carry a signal;
-- the kept groups train, the metrics are over everything generated
S:rollout(function(step)
  local kept, seen, gen_batches, gen_tokens, correct = {}, {}, 0, 0, 0
  local rm = { errors = 0, dropped_groups = 0 }
  local t0 = moonrl.now()
  while #kept < cfg.rlvr.prompts * G and gen_batches < cfg.rlvr.max_gen_batches do
    gen_batches = gen_batches + 1
    local records = S:prompts(cfg.rlvr.prompts)
    sampling.step = step * 1000 + gen_batches
    local results = S:phase('generate', function() return S.engine:generate(R.requests(records, G), sampling) end)
    local verdicts, samples, m = S:phase('reward', S.score, S, R.flatten(records, results), G)
    rm.errors, rm.dropped_groups = rm.errors + m.errors, rm.dropped_groups + m.dropped_groups
    for i, s in ipairs(samples) do
      s.correct = verdicts[i - 1]
      s.score = s.correct + overlong_penalty(#s.ids)
      gen_tokens = gen_tokens + #s.ids
      seen[#seen + 1] = s
    end
    for g = 0, #samples / G - 1 do
      local first, all_equal = samples[g * G + 1], true
      for j = 2, G do
        if samples[g * G + j].score ~= first.score then all_equal = false end
      end
      if not all_equal and #kept < cfg.rlvr.prompts * G then
        for j = 1, G do kept[#kept + 1] = samples[g * G + j] end
      end
    end
  end
  local gen_s = moonrl.now() - t0
  for _, s in ipairs(seen) do if s.correct >= 1 then correct = correct + 1 end end
  local all_scores = {}
  for i, s in ipairs(seen) do all_scores[i] = s.score end
  local mean, std = R.stats(all_scores)
  return kept, { gen_s = gen_s, gen_tokens = gen_tokens, reward = { mean = mean, std = std, errors = rm.errors,
    dropped_groups = rm.dropped_groups }, accuracy = #seen > 0 and correct / #seen or 0,
    response_length = R.length_metrics(seen), dynamic_sampling = { gen_batches = gen_batches, kept_groups = #kept / G,
    kept_ratio = #seen > 0 and #kept / #seen or 0 } }
end)

local history = {}
for step in S:steps() do
  local kept, info = S:next_batch()

  -- 2. advantages over the kept groups, and the update (skipped when no group had a signal)
  local m = { skipped = 1 }
  local t0 = moonrl.now()
  if #kept > 0 then
    local scores = require('ffi').new('double[?]', #kept)
    for i, s in ipairs(kept) do scores[i - 1] = s.score end
    local adv = algo.advantages.grpo({ scores = scores, nseq = #kept, group = G })
    for i, s in ipairs(kept) do s.adv = adv[i - 1] * (s.adv_scale or 1) end
    m = S:phase('train', R.policy_step, S:off_policy { session = S, model = S.policy, opt = S.opt, samples = kept, ref = ref, lr = S:lr(),
      temperature = cfg.rlvr.temperature, clip_low = cfg.rlvr.clip_low, clip_high = cfg.rlvr.clip_high,
      agg = cfg.rlvr.agg, norm = cfg.rlvr.max_tokens, kl_coef = cfg.rlvr.kl_coef,
      micro_batch_tokens = cfg.train.micro_batch_tokens, max_grad_norm = cfg.train.max_grad_norm })
    m.skipped = 0
  end

  -- 3. log (rewards and lengths over everything generated; the update over the kept groups)
  m.reward, m.accuracy, m.response_length = info.reward, info.accuracy, info.response_length
  m.dynamic_sampling = info.dynamic_sampling
  m.data = S:data_metrics()
  m.async = S:async_metrics(info)
  m.tokens_per_s = { generate = R.rate(info.gen_tokens, info.gen_s), train = R.rate(m.tokens or 0, moonrl.now() - t0) }
  history[step] = S:log(m)
end

local dirs = S:finish()
print('run directory: ' .. S.dir .. (dirs.policy and ('; model saved to ' .. dirs.policy) or ''))
return { history = history, dir = S.dir, model = S.policy }
