-- fp32 against bf16 (model.dtype, moonrl.model "precision"), paired in one run on the same
-- model and inputs: the training step (forward + backward + AdamW, and the bf16 refresh after
-- it) and engine decode tokens/s at batch 1 and 16, each measured alternately fp32 / bf16 so
-- that a change in the machine's load hits both.
--
--   moonrl run bench/train/bf16_model.lua                 -- the ~30M Llama below
--   moonrl run bench/train/bf16_model.lua size=default    -- the default example's model (128 x 2 layers)
--   moonrl run bench/train/bf16_model.lua reps=5 tokens=2048 decode=64
--
-- Prints one line per measurement and the ratios.
local moonrl = require('moonrl')

local cfg = moonrl.config {
  size = '30m',                      -- 30m | default
  tokens = moonrl.config.integer(2048), -- training batch: tokens / 256 sequences of 256
  reps = moonrl.config.integer(3),   -- timed training steps per dtype (the median is kept), alternating
  decode = moonrl.config.integer(64), -- new tokens per sequence in the decode runs
  threads = moonrl.config.integer(0), -- 0: the default (all cores)
  train = true, -- false: decode only
}
if cfg.threads > 0 then moonrl.C.mrl_parallel_set_threads(cfg.threads) end

-- bench/models.json's 30m and default (the default example's shape, here with 4 KV heads and 512 positions)
local preset = dofile(moonrl.home .. '/bench/models.lua')
local shapes = {
  ['30m'] = { max_position_embeddings = 512 },
  default = { num_key_value_heads = 4, max_position_embeddings = 512 },
}
if not shapes[cfg.size] then moonrl.usage_error("size must be 30m or default, got '" .. tostring(cfg.size) .. "'") end
local mcfg = preset(cfg.size, shapes[cfg.size])

local function median(t)
  local s = {}
  for i, v in ipairs(t) do s[i] = v end
  table.sort(s)
  return s[math.floor((#s + 1) / 2)]
end

-- two models with the same weights, one per dtype
local models = {}
for _, d in ipairs({ 'fp32', 'bf16' }) do
  local m = moonrl.model.new(mcfg, { seed = 1 })
  m:set_dtype(d)
  models[d] = m
end
local n_params = models.fp32.n_params
print(string.format('model: %s, %.1fM parameters; bf16 products: %s; threads %d', cfg.size, n_params / 1e6,
  moonrl.model.bf16_products() or 'none', tonumber(moonrl.C.mrl_parallel_threads())))

-- ---- training step ----
local seq = 256
local n_seqs = math.max(1, math.floor(cfg.tokens / seq))
local batch, grad = dofile(moonrl.home .. '/bench/train_batch.lua')(mcfg.vocab_size, n_seqs, seq)
local opts = {}
for d, m in pairs(models) do opts[d] = require('moonrl.train.models').adamw(m, { lr = 1e-4, weight_decay = 0.0 }) end

local function train_step(d)
  local m, opt = models[d], opts[d]
  local t0 = moonrl.now()
  m:zero_grad()
  local lp = m:forward(batch)
  m:backward(grad)
  opt:step()
  local t1 = moonrl.now()
  local loss = 0
  for i = 0, batch.n_tokens - 1 do loss = loss - lp[i] end
  return t1 - t0, loss / batch.n_tokens
end

local times = { fp32 = {}, bf16 = {} }
local losses = { fp32 = {}, bf16 = {} }
local train = { fp32 = 0 / 0, bf16 = 0 / 0 }
if cfg.train then
for d in pairs(models) do train_step(d) end -- warm up (activations, oneDNN primitives)
for r = 1, cfg.reps do
  for _, d in ipairs({ 'fp32', 'bf16' }) do
    local t, loss = train_step(d)
    times[d][r], losses[d][r] = t, loss
  end
end
for _, d in ipairs({ 'fp32', 'bf16' }) do
  train[d] = median(times[d])
  print(string.format('train %s: %d tokens/step, %.3f s/step (median of %d), %.0f tokens/s, loss after %d steps %.4f',
    d, batch.n_tokens, train[d], cfg.reps, batch.n_tokens / train[d], cfg.reps + 1, losses[d][cfg.reps]))
end
end

-- the refresh alone: the one pass over the matrices after an update
do
  local m = models.bf16
  local t0 = moonrl.now()
  for _ = 1, 5 do m:weights_changed(); moonrl.C.mrl_model_refresh_bf16(m.handle) end
  print(string.format('bf16 refresh (one pass over the matrices): %.2f ms', (moonrl.now() - t0) / 5 * 1000))
end

-- ---- decode ----
local function decode(d, n)
  local e = moonrl.engine.new(models[d], { kv_cache_bytes = 256 * 2 ^ 20, block_size = 16, max_batch_tokens = 2048,
    max_seqs = 64, seed = 1 })
  local reqs = {}
  for i = 1, n do reqs[i] = { prompt_ids = { 1 + i % 7, 2, 3, 4, 5, 6, 7, 8 }, n = 1 } end
  local gen = { temperature = 1.0, max_tokens = cfg.decode, eos_ids = {} } -- no eos: every sample runs to the end
  e:generate({ { prompt_ids = { 1, 2, 3 }, n = 1 } }, { temperature = 1.0, max_tokens = 4, eos_ids = {} }) -- warm up
  local t0 = moonrl.now()
  local out = e:generate(reqs, gen)
  local secs = moonrl.now() - t0
  local toks = 0
  for i = 1, n do toks = toks + #out[i][1].ids end
  e = nil
  collectgarbage()
  return toks / secs
end

local dec = { fp32 = {}, bf16 = {} }
for _, n in ipairs({ 1, 16 }) do
  local r = { fp32 = {}, bf16 = {} }
  for _ = 1, 2 do
    for _, d in ipairs({ 'fp32', 'bf16' }) do r[d][#r[d] + 1] = decode(d, n) end
  end
  for _, d in ipairs({ 'fp32', 'bf16' }) do
    dec[d][n] = math.max(r[d][1], r[d][2])
    print(string.format('decode %s batch %d: %.0f tokens/s (best of 2, %d new tokens each)', d, n, dec[d][n], cfg.decode))
  end
end

print(string.format('bf16 / fp32: training step %.2fx faster; decode %.2fx (batch 1), %.2fx (batch 16)',
  train.fp32 / train.bf16, dec.bf16[1] / dec.fp32[1], dec.bf16[16] / dec.fp32[16]))
