-- RLVR: GRPO with verifiable rewards and DAPO's changes (dynamic sampling, clip-higher, token-mean
-- loss, soft overlong penalty, no KL term).
--
--   moonrl run rlvr model.dir=/models/Qwen2.5-0.5B-Instruct data.path=gsm8k.jsonl reward=math
--
-- for each step:
--   repeat (at most rlvr.max_gen_batches times) until rlvr.prompts groups are kept:
--     prompts; generate rlvr.samples completions each; score = verifier reward + overlong penalty
--     keep only the groups whose scores are NOT all equal (an all-right or all-wrong group has zero
--     advantage and teaches nothing)
--   A_i <- group-normalised scores of the kept groups
--   PPO-clip with clip-higher (ε_low 0.2, ε_high 0.28), token-mean over the whole batch; AdamW step
-- Overlong penalty (DAPO): with L = rlvr.max_tokens and a buffer B, a response of length ℓ gets
--   0 when ℓ <= L − B,  (L − B − ℓ)/B · overlong.factor when L − B < ℓ <= L.
local moonrl = require('moonrl')
local algo = require('moonrl.algo')
local rewards = require('moonrl.rewards')
local R = require('moonrl.recipe')

local cfg = moonrl.config {
  model = { dir = moonrl.config.required('string', 'Hugging Face model directory'),
            tokenizer = moonrl.config.optional('string', 'tokenizer directory (default model.dir)') },
  data = { path = moonrl.config.required('string', 'JSONL with one prompt a line'),
           prompt = 'prompt', answer = 'answer', chat = true, system = '' },
  reward = 'math',
  rlvr = { steps = moonrl.config.integer(100), prompts = moonrl.config.integer(8), samples = moonrl.config.integer(8),
           max_gen_batches = moonrl.config.integer(4), temperature = 1.0, top_p = 1.0,
           max_tokens = moonrl.config.integer(512), clip_low = 0.2, clip_high = 0.28, agg = 'token-mean',
           kl_coef = 0.0 },
  overlong = { enable = true, buffer = moonrl.config.integer(128), factor = 1.0 },
  train = { lr = 1e-6, weight_decay = 0.0, max_grad_norm = 1.0, micro_batch_tokens = moonrl.config.integer(4096) },
  engine = { kv_cache_mb = moonrl.config.integer(512), max_batch_tokens = moonrl.config.integer(2048),
             max_seqs = moonrl.config.integer(256) },
  save = true,
}
local run = moonrl.run.start(cfg, { name = 'rlvr', total_steps = cfg.rlvr.steps })
local model, tok, tpl, tok_dir = R.load(cfg.model.dir, { tokenizer = cfg.model.tokenizer, chat = cfg.data.chat })
local ref = cfg.rlvr.kl_coef > 0 and R.clone(model) or nil
local verifier = rewards.get(cfg.reward)
local opt = R.adamw(model, { lr = cfg.train.lr, weight_decay = cfg.train.weight_decay })
local engine = moonrl.engine.new(model, { kv_cache_bytes = cfg.engine.kv_cache_mb * 2 ^ 20, block_size = 16,
  max_batch_tokens = cfg.engine.max_batch_tokens, max_seqs = cfg.engine.max_seqs, seed = cfg.run.seed })
local sampling = { temperature = cfg.rlvr.temperature, top_p = cfg.rlvr.top_p, max_tokens = cfg.rlvr.max_tokens,
  eos_ids = R.eos_ids(tok, model), tokenizer = tok }
local _, next_batch = R.dataset(cfg.data.path, { prompt = cfg.data.prompt, answer = cfg.data.answer },
  cfg.run.seed, { answer = true })
local G = cfg.rlvr.samples

local function overlong_penalty(len)
  if not cfg.overlong.enable then return 0 end
  local L, B = cfg.rlvr.max_tokens, math.min(cfg.overlong.buffer, cfg.rlvr.max_tokens)
  if len <= L - B or B == 0 then return 0 end
  return (L - B - len) / B * cfg.overlong.factor
end

local history = {}
for step = 1, cfg.rlvr.steps do
  -- 1. dynamic sampling: generate and score until enough groups carry a signal
  local kept, seen, gen_batches, gen_tokens, correct = {}, {}, 0, 0, 0
  local t0 = moonrl.now()
  while #kept < cfg.rlvr.prompts * G and gen_batches < cfg.rlvr.max_gen_batches do
    gen_batches = gen_batches + 1
    local records = next_batch(cfg.rlvr.prompts)
    for _, r in ipairs(records) do r.prompt_ids = R.prompt_ids(tok, tpl, r.prompt, cfg.data.system) end
    sampling.step = step * 1000 + gen_batches
    local results = run:phase('generate', function() return engine:generate(R.requests(records, G), sampling) end)
    local samples = R.flatten(records, results)
    run:phase('reward', function()
      for _, s in ipairs(samples) do
        s.correct = verifier(s)
        s.score = s.correct + overlong_penalty(#s.ids)
        gen_tokens = gen_tokens + #s.ids
        seen[#seen + 1] = s
      end
    end)
    for g = 0, #records - 1 do
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

  -- 2. advantages over the kept groups, and the update (skipped when no group had a signal)
  local m = { skipped = 1 }
  t0 = moonrl.now()
  if #kept > 0 then
    local scores = require('ffi').new('double[?]', #kept)
    for i, s in ipairs(kept) do scores[i - 1] = s.score end
    local adv = algo.advantages.grpo({ scores = scores, nseq = #kept, group = G })
    for i, s in ipairs(kept) do s.adv = adv[i - 1] end
    m = run:phase('train', R.policy_step, { model = model, opt = opt, samples = kept, ref = ref, lr = cfg.train.lr,
      temperature = cfg.rlvr.temperature, clip_low = cfg.rlvr.clip_low, clip_high = cfg.rlvr.clip_high,
      agg = cfg.rlvr.agg, norm = cfg.rlvr.max_tokens, kl_coef = cfg.rlvr.kl_coef,
      micro_batch_tokens = cfg.train.micro_batch_tokens, max_grad_norm = cfg.train.max_grad_norm })
    m.skipped = 0
  end

  -- 3. log (rewards and lengths over everything generated; the update over the kept groups)
  local all_scores = {}
  for i, s in ipairs(seen) do all_scores[i] = s.score end
  local mean, std = R.stats(all_scores)
  m.reward = { mean = mean, std = std }
  m.accuracy = correct / #seen
  m.response_length = R.length_metrics(seen)
  m.dynamic_sampling = { gen_batches = gen_batches, kept_groups = #kept / G, kept_ratio = #kept / #seen }
  m.tokens_per_s = { generate = R.rate(gen_tokens, gen_s), train = R.rate(m.tokens or 0, moonrl.now() - t0) }
  history[step] = run:log(step, m)
  if R.check_stop(cfg, run) then break end
end

local dir = cfg.save and R.save(run, model, tok_dir) or nil
run:finish()
print('run directory: ' .. run.dir .. (dir and ('; model saved to ' .. dir) or ''))
return { history = history, dir = run.dir, model = model }
