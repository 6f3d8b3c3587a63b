-- moonrl's side of bench/grpo/grpo_step.sh: one GRPO step (generate prompts x samples with the engine,
-- score with a registered reward, group advantages, log-probs + PPO-clip update with AdamW) on the
-- model directory MODEL. WARMUP warm-up steps, then STEPS timed steps; prints one JSON line with
-- the mean seconds per step and per phase and the mean response length.
-- env: MODEL, PROMPTS (16), SAMPLES (8), MAX_TOKENS (64), THREADS (2), STEPS (3), WARMUP (2),
--      LENGTHS: natural (default: a completion ends at EOS or MAX_TOKENS) or fixed (no EOS: every
--      completion runs to MAX_TOKENS, so both sides do exactly the same arithmetic), DTYPE (fp32)
local moonrl = require('moonrl')
local json = require('moonrl.io.json')
local algo = require('moonrl.algo')
local rewards = require('moonrl.rewards')
local batch = require('moonrl.batch')
local models = require('moonrl.train.models')
local prompts = require('moonrl.train.prompts')
local train = require('moonrl.train.step')

local P, G = tonumber(os.getenv('PROMPTS') or 16), tonumber(os.getenv('SAMPLES') or 8)
local max_tokens = tonumber(os.getenv('MAX_TOKENS') or 64)
local steps, warmup = tonumber(os.getenv('STEPS') or 3), tonumber(os.getenv('WARMUP') or 2)
local lengths = os.getenv('LENGTHS') or 'natural'
assert(lengths == 'natural' or lengths == 'fixed', 'LENGTHS must be natural or fixed')
moonrl.C.mrl_parallel_set_threads(tonumber(os.getenv('THREADS') or 2))
local model, tok = models.load(os.getenv('MODEL'))
model:set_dtype(os.getenv('DTYPE') or 'fp32')
local engine = moonrl.engine.new(model, { kv_cache_bytes = 256 * 2 ^ 20, block_size = 16,
  max_batch_tokens = 2048, max_seqs = 256, seed = 1 })
local opt = models.adamw(model, { lr = 1e-6, weight_decay = 0.0 })
-- the same reward as the TRL side: the share of the characters '7' in the completion
rewards.register('sevens', function(s)
  local _, n = s.response:gsub('7', '')
  return n / math.max(#s.response, 1)
end)
local records = {}
for i = 1, P do
  local prompt = string.format('%d+%d=', 10 + i, 30 + 2 * i)
  records[i] = { prompt = prompt, prompt_ids = tok:encode(prompt) }
end
local eos_ids = lengths == 'natural' and prompts.eos_ids(tok, model) or {}

local function step(k)
  local t = {}
  local t0 = moonrl.now()
  local results = engine:generate(batch.requests(records, G), { temperature = 1.0, max_tokens = max_tokens,
    eos_ids = eos_ids, tokenizer = tok, step = k })
  t.generate = moonrl.now() - t0
  local samples = batch.flatten(records, results)
  local t1 = moonrl.now()
  local scores = rewards.score_batch('sevens', samples)
  local adv = algo.advantages.grpo({ scores = scores, nseq = #samples, group = G })
  for i, s in ipairs(samples) do s.adv = adv[i - 1] end
  t.reward = moonrl.now() - t1
  t1 = moonrl.now()
  local m = train.policy_step({ model = model, opt = opt, samples = samples, lr = 1e-6, micro_batch_tokens = 8192 })
  t.train = moonrl.now() - t1
  t.total = moonrl.now() - t0
  t.response_tokens = m.tokens
  return t
end

for k = 1, warmup do step(k) end -- first touch of the activation and cache memory, as batches grow
local sum = { generate = 0, reward = 0, train = 0, total = 0, response_tokens = 0 }
local totals = {}
for k = warmup + 1, warmup + steps do
  local t = step(k)
  for key, v in pairs(t) do sum[key] = sum[key] + v end
  totals[#totals + 1] = t.total
end
local out = { steps = totals, lengths = lengths }
for key, v in pairs(sum) do out[key] = v / steps end
out.mean_length = out.response_tokens / (P * G)
print(json.encode(out))
