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
--   A_i <- the estimator rlvr.advantage over the kept groups (grpo: group-normalised scores)
--   the loss rlvr.loss (ppo) with clip-higher (ε_low 0.2, ε_high 0.28), token-mean over the whole
--   batch; AdamW step (skipped when no group had a signal)
-- Overlong penalty (DAPO): with L = rlvr.max_tokens and a buffer B, a response of length ℓ gets
--   0 when ℓ <= L − B,  (L − B − ℓ)/B · overlong.factor when L − B < ℓ <= L.
-- The loop and the other stages are moonrl.rl's; this file overrides rollout, update and metrics.
local moonrl = require('moonrl')
local rl = require('moonrl.rl')
local config = require('moonrl.config')
local metrics = require('moonrl.train.metrics')

local rlvr = rl.recipe {
  name = 'rlvr',
  config = {
    rlvr = { steps = config.integer(100), prompts = config.integer(8), samples = config.integer(8),
             max_gen_batches = config.integer(4, { min = 1 }), temperature = 1.0, top_p = 1.0,
             max_tokens = config.integer(512), advantage = 'grpo', loss = 'ppo', clip_low = 0.2, clip_high = 0.28,
             agg = 'token-mean', kl_coef = 0.0 },
    overlong = { enable = true, buffer = config.integer(128, { min = 0 }), factor = config.number(1.0, { min = 0 }) },
  },
}

function rlvr:overlong_penalty(len)
  local o = self.cfg.overlong
  if not o.enable then return 0 end
  local L, B = self.c.max_tokens, math.min(o.buffer, self.c.max_tokens)
  if len <= L - B or B == 0 then return 0 end
  return (L - B - len) / B * o.factor
end

-- Dynamic sampling: generate and score until enough groups carry a signal; the kept groups
-- train, the metrics are over everything generated.
function rlvr:rollout(step)
  local G, want = self.group, self.c.prompts * self.group
  local kept, seen, gen_batches, gen_tokens, correct = {}, {}, 0, 0, 0
  local rm = { errors = 0, dropped_groups = 0 }
  local t0 = moonrl.now()
  while #kept < want and gen_batches < self.c.max_gen_batches do
    gen_batches = gen_batches + 1
    local samples, m = self:score(self:generate(self:prompts(step), step * 1000 + gen_batches))
    rm.errors, rm.dropped_groups = rm.errors + m.errors, rm.dropped_groups + m.dropped_groups
    for _, s in ipairs(samples) do
      s.correct = s.score -- the verifier's verdict
      s.score = s.correct + self:overlong_penalty(#s.ids)
      gen_tokens = gen_tokens + #s.ids
      seen[#seen + 1] = s
    end
    for g = 0, #samples / G - 1 do
      local first, all_equal = samples[g * G + 1], true
      for j = 2, G do
        if samples[g * G + j].score ~= first.score then all_equal = false end
      end
      if not all_equal and #kept < want then
        for j = 1, G do kept[#kept + 1] = samples[g * G + j] end
      end
    end
  end
  local gen_s = moonrl.now() - t0
  for _, s in ipairs(seen) do if s.correct >= 1 then correct = correct + 1 end end
  local all_scores = {}
  for i, s in ipairs(seen) do all_scores[i] = s.score end
  local mean, std = metrics.stats(all_scores)
  return kept, { gen_s = gen_s, gen_tokens = gen_tokens, reward = { mean = mean, std = std, errors = rm.errors,
    dropped_groups = rm.dropped_groups }, accuracy = #seen > 0 and correct / #seen or 0,
    response_length = metrics.length_metrics(seen), dynamic_sampling = { gen_batches = gen_batches, kept_groups = #kept / G,
    kept_ratio = #seen > 0 and #kept / #seen or 0 } }
end

function rlvr:update(kept, info)
  if #kept == 0 then return { skipped = 1 } end -- no group had a signal
  local m = rl.Recipe.update(self, kept, info)
  m.skipped = 0
  return m
end

-- Rewards and lengths over everything generated (the rollout's), the update over the kept groups.
function rlvr:metrics(m, kept, info)
  m.reward, m.accuracy, m.response_length = info.reward, info.accuracy, info.response_length
  m.dynamic_sampling = info.dynamic_sampling
  m.data = self.S:data_metrics()
  m.async = self.S.rollouts:metrics(info)
  m.tokens_per_s = { generate = metrics.rate(info.gen_tokens, info.gen_s),
    train = metrics.rate(m.tokens or 0, moonrl.now() - (self.update_t0 or moonrl.now())) }
end

return rlvr:main()
