-- LoRA against full training and base decode, paired in one run on the same model and inputs:
--   1. the training step (forward + backward + AdamW): the whole model against LoRA adapters of
--      `rank` on every projection, alternating, the median of `reps` each;
--   2. what each holds (moonrl's accounted bytes by category after its steps: parameters, their
--      bf16 copies, gradients, optimizer state) and the bytes a weight-sync version sends (the
--      whole model's tensors, or the adapters' PEFT file);
--   3. decode: `prompts` requests of `decode` new tokens on the base alone, on the model's own
--      adapters, and spread over `adapters` adapter sets in one batch (multi-LoRA), alternating.
--
--   moonrl run bench/lora/lora_bench.lua                          -- SmolLM2's shape (135M), bf16 where fast
--   moonrl run bench/lora/lora_bench.lua size=100m rank=8 dtype=fp32
--   moonrl run bench/lora/lora_bench.lua side=lora decode=0   -- one side alone: its peak memory (the
--                                                              process's resident peak, moonrl's accounted peak)
local moonrl = require('moonrl')
local models_mod = require('moonrl.train.models')

local cfg = moonrl.config {
  size = 'smollm2',                      -- a preset of bench/models.json
  dtype = 'auto',                        -- fp32 | bf16 | auto (bf16 where the CPU has it fast)
  rank = moonrl.config.integer(16, { min = 1 }),
  seqs = moonrl.config.integer(8, { min = 1 }), seq = moonrl.config.integer(256, { min = 2 }),
  reps = moonrl.config.integer(3, { min = 1 }),
  prompts = moonrl.config.integer(16, { min = 1 }), decode = moonrl.config.integer(32, { min = 1 }),
  adapters = moonrl.config.integer(4, { min = 1, max = 64 }),
  train = true, -- false: decode only
  side = 'both', -- full | lora: that side alone (its peak memory), no decode
}
local mcfg = dofile(moonrl.home .. '/bench/models.lua')(cfg.size, { max_position_embeddings = math.max(cfg.seq, 512) })
local dtype = moonrl.model.resolve_dtype(cfg.dtype, mcfg)
local cpu = (io.popen('grep -m1 "model name" /proc/cpuinfo'):read('*l') or ''):gsub('.*: ', '')

local function median(t)
  local s = { unpack(t) }
  table.sort(s)
  return s[math.floor((#s + 1) / 2)]
end
local function mib(b) return b / 2 ^ 20 end

-- one batch, -1/T per token of the log-probs (the loss's gradient)
local batch, _, train_step = dofile(moonrl.home .. '/bench/train_batch.lua')(mcfg.vocab_size, cfg.seqs, cfg.seq)

-- a side: its model (same seed: the same base), optimizer and what it held after its first step
local function held()
  local m = moonrl.memory()
  return { params = m.params, grads = m.grads, optim = m.optim }
end
local sides = {}
local names = cfg.side == 'both' and { 'full', 'lora' } or { cfg.side }
for _, name in ipairs(names) do
  local before = held()
  local m = moonrl.model.new(mcfg, { seed = 1 })
  m:set_dtype(dtype)
  if name == 'lora' then -- (in bf16 the frozen base is stored in bf16 alone, as a run does: models.freeze_base)
    m:set_lora({ rank = cfg.rank, alpha = 32, seed = 2 })
    models_mod.freeze_base({}, m)
  end
  local opt = models_mod.adamw(m, { lr = 1e-4, weight_decay = 0 })
  opt:create()
  local side = { name = name, model = m, opt = opt, times = {} }
  function side.step() return train_step(m, opt) end
  side.step() -- (warm-up: activations, bf16 copies, the kernels' own)
  local after = held()
  side.held = {}
  for k, v in pairs(after) do side.held[k] = v - before[k] end
  sides[name] = side
end
if cfg.side ~= 'both' then -- one side: a few steps, then its peaks
  local s = sides[cfg.side]
  for _ = 1, cfg.reps do s.step() end
  local rss = io.open('/proc/self/status'):read('*a'):match('VmHWM:%s*(%d+) kB')
  print(string.format('%s; model %s, %s, %d x %d tokens, %s%s: peak resident %.0f MiB, moonrl\'s accounted peak %.0f MiB',
    cpu, cfg.size, dtype, cfg.seqs, cfg.seq, cfg.side, cfg.side == 'lora' and ' rank ' .. cfg.rank or '',
    tonumber(rss) / 1024, mib(moonrl.memory().total_peak)))
  return
end
local n_params = sides.full.model.n_params
local lora_n = sides.lora.model:lora().n
print(string.format('%s; model %s (%.1fM parameters), %s, %d x %d tokens; LoRA rank %d on all projections: %.2fM trainable (%.2f%%)',
  cpu, cfg.size, n_params / 1e6, dtype, cfg.seqs, cfg.seq, cfg.rank, lora_n / 1e6, 100 * lora_n / n_params))

for _ = 1, cfg.train and cfg.reps or 0 do
  for _, name in ipairs({ 'full', 'lora' }) do
    local s = sides[name]
    s.times[#s.times + 1] = s.step()
  end
end
for _, name in ipairs(cfg.train and { 'full', 'lora' } or {}) do
  local s = sides[name]
  s.time = median(s.times)
  print(string.format('train %-4s: %.3f s/step (median of %d), %.0f tokens/s; holds parameters %.0f MiB, gradients %.0f MiB, optimizer %.0f MiB',
    name, s.time, cfg.reps, batch.n_tokens / s.time, mib(s.held.params), mib(s.held.grads), mib(s.held.optim)))
end

-- a weight-sync version: every tensor of the model (fp32; bf16 halves it), or the adapters' PEFT file
local dir = os.tmpname()
os.remove(dir)
sides.lora.model:save_lora(dir)
local f = io.open(dir .. '/adapter_model.safetensors', 'rb')
local adapter_bytes = f:seek('end')
f:close()
require('moonrl.io.fs').remove(dir)
print(string.format('weight sync a version: the whole model %.1f MB (fp32; %.1f MB bf16), the adapters %.2f MB (fp32): %.0fx fewer bytes',
  n_params * 4 / 1e6, n_params * 2 / 1e6, adapter_bytes / 1e6, n_params * 4 / adapter_bytes))

-- ---- decode: base alone, the model's own adapters, `adapters` sets spread over the requests ----
local base = sides.full.model
sides.full.opt, sides.lora.opt = nil, nil
collectgarbage()
local sets = {}
for k = 1, cfg.adapters do
  local ad = base:new_adapter({ rank = cfg.rank, alpha = 32, seed = 10 + k })
  local p, n = ad:buffer()
  for i = 0, n - 1 do p[i] = 0.01 * math.sin(i * k) end
  sets[k] = ad
end
local function decode(model, spread)
  local e = moonrl.engine.new(model, { kv_cache_bytes = 256 * 2 ^ 20, max_batch_tokens = 2048, max_seqs = 64, seed = 1 })
  if spread then for k, ad in ipairs(sets) do e:set_adapter(k, ad) end end
  local reqs = {}
  for i = 1, cfg.prompts do
    reqs[i] = { prompt_ids = { 1 + i % 7, 2, 3, 4, 5, 6, 7, 8 }, n = 1, adapter = spread and 1 + (i - 1) % cfg.adapters or 0 }
  end
  local gen = { temperature = 1.0, max_tokens = cfg.decode, eos_ids = {} }
  e:generate({ { prompt_ids = { 1, 2, 3 }, n = 1 } }, { temperature = 1.0, max_tokens = 2, eos_ids = {} }) -- warm up
  local t0 = moonrl.now()
  local out = e:generate(reqs, gen)
  local secs = moonrl.now() - t0
  local toks = 0
  for i = 1, #reqs do toks = toks + #out[i][1].ids end
  return toks / secs
end
local rates = { base = {}, own = {}, multi = {} }
for _ = 1, 2 do
  rates.base[#rates.base + 1] = decode(base, false)
  rates.own[#rates.own + 1] = decode(sides.lora.model, false)
  rates.multi[#rates.multi + 1] = decode(base, true)
end
local best = {}
for k, v in pairs(rates) do best[k] = math.max(unpack(v)) end
print(string.format('decode, %d requests x %d tokens: base %.0f tok/s; the model\'s own adapters %.0f tok/s (%.2fx the base\'s time); %d adapter sets in one batch %.0f tok/s (%.2fx)',
  cfg.prompts, cfg.decode, best.base, best.own, best.base / best.own, cfg.adapters, best.multi, best.base / best.multi))
print(string.format('LoRA step / full step: %.2fx the time; holds %.0f MiB against %.0f MiB (parameters, gradients, optimizer)',
  (sides.lora.time or 0 / 0) / (sides.full.time or 0 / 0), mib(sides.lora.held.params + sides.lora.held.grads + sides.lora.held.optim),
  mib(sides.full.held.params + sides.full.held.grads + sides.full.held.optim)))
