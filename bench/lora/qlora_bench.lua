-- LoRA over a quantized base (model.lora.quantized_base) against LoRA over the same GGUF model
-- dequantized (fp32, or in bf16 stored in bf16 as a run stores it: models.freeze_base), on the
-- real SmolLM2-135M-Instruct Q4_1 file: each side in a process of its own (its peak resident memory
-- is its own), the sides alternating `rounds` times:
--   1. memory: moonrl's accounted parameter bytes after a training step (the quantized side's
--      blocks, the other tensors and what is in use then), the process's peak resident memory;
--   2. the log-probs of one batch under the adapters (rank `rank`, random non-zero B): the
--      largest difference between the sides (the quantized base computes the dequantized
--      model's bits: 0 expected);
--   3. the training step (forward + backward + AdamW of the adapters), median of `reps`;
--   4. decode with the model's own adapters: `prompts` requests of `decode` new tokens (the
--      dequantized side with its weight panels, its fastest).
--
--   moonrl run bench/lora/qlora_bench.lua                 -- both sides, a table
--   moonrl run bench/lora/qlora_bench.lua side=quantized  -- one side's figures (what the table runs)
local moonrl = require('moonrl')
local ffi = require('ffi')
local models = require('moonrl.train.models')

local cfg = moonrl.config {
  gguf = (os.getenv('MOONRL_CACHE') or (os.getenv('HOME') .. '/.cache/moonrl')) .. '/models/SmolLM2-135M-Instruct.Q4_1.gguf',
  dtype = 'auto', -- fp32 | bf16 | auto (bf16 where the CPU has it fast)
  rank = moonrl.config.integer(16, { min = 1 }),
  seqs = moonrl.config.integer(8, { min = 1 }), seq = moonrl.config.integer(256, { min = 2 }),
  reps = moonrl.config.integer(3, { min = 1 }), rounds = moonrl.config.integer(2, { min = 1 }),
  prompts = moonrl.config.integer(16, { min = 1 }), decode = moonrl.config.integer(32, { min = 1 }),
  side = 'both', -- quantized | dequantized: that side alone, its figures as JSON on stdout's last line
  out = moonrl.config.optional('string', 'the side\'s log-probs file'),
}
local cpu = (io.popen('grep -m1 "model name" /proc/cpuinfo'):read('*l') or ''):gsub('.*: ', '')
local function mib(b) return b / 2 ^ 20 end
local function median(t)
  local s = { unpack(t) }
  table.sort(s)
  return s[math.floor((#s + 1) / 2)]
end

if cfg.side ~= 'both' then
  local quantized = cfg.side == 'quantized'
  local model = models.load(cfg.gguf, { quantized = quantized })
  local dtype = moonrl.model.resolve_dtype(cfg.dtype, model.config)
  model:set_dtype(dtype)
  model:set_lora({ rank = cfg.rank, alpha = 32, seed = 2 })
  models.freeze_base({}, model) -- (the dequantized base in bf16: stored in bf16 alone, as a run's)
  local p, n = model:lora_buffer()
  for i = 0, n - 1 do p[i] = 0.01 * math.sin(i) end -- (B too: the adapters change the log-probs)
  model:trained()
  local opt = models.adamw(model, { lr = 1e-4, weight_decay = 0 })
  opt:create()
  local batch, _, train_step = dofile(moonrl.home .. '/bench/train_batch.lua')(model.config.vocab_size, cfg.seqs,
    cfg.seq)
  local lp = model:forward(batch)
  local f = assert(io.open(cfg.out, 'wb'))
  f:write(ffi.string(lp, 4 * batch.n_tokens))
  f:close()
  local function step() return train_step(model, opt) end
  step() -- (warm-up)
  local params = moonrl.memory().params
  local times = {}
  for i = 1, cfg.reps do times[i] = step() end
  opt = nil
  collectgarbage()
  local e = moonrl.engine.new(model, { kv_cache_bytes = 256 * 2 ^ 20, max_batch_tokens = 2048, max_seqs = 64, seed = 1 })
  local reqs = {}
  for i = 1, cfg.prompts do reqs[i] = { prompt_ids = { 1 + i % 7, 2, 3, 4, 5, 6, 7, 8 }, n = 1 } end
  e:generate({ { prompt_ids = { 1, 2, 3 }, n = 1 } }, { temperature = 1.0, max_tokens = 2, eos_ids = {} }) -- warm up
  local t0 = moonrl.now()
  local out = e:generate(reqs, { temperature = 1.0, max_tokens = cfg.decode, eos_ids = {} })
  local toks = 0
  for i = 1, #reqs do toks = toks + #out[i][1].ids end
  local rss = io.open('/proc/self/status'):read('*a'):match('VmHWM:%s*(%d+) kB')
  print(require('moonrl.io.json').encode({ dtype = dtype, params = params, rss = tonumber(rss) * 1024,
    step = median(times), decode = toks / (moonrl.now() - t0), blocks = model.quantized or 0,
    blocks_params = model.quantized_params or 0, n_params = model.n_params }))
  return
end

-- both sides, alternating, each a process of its own
local sides = { quantized = {}, dequantized = {} }
local files = {}
for r = 1, cfg.rounds do
  for _, side in ipairs({ 'quantized', 'dequantized' }) do
    files[side] = os.tmpname()
    local cmd = string.format('%s run %s/bench/lora/qlora_bench.lua side=%s gguf=%s dtype=%s rank=%d seqs=%d seq=%d ' ..
      'reps=%d prompts=%d decode=%d out=%s', rawget(_G, 'MOONRL_EXE') or 'moonrl', moonrl.home, side, cfg.gguf,
      cfg.dtype, cfg.rank, cfg.seqs, cfg.seq, cfg.reps, cfg.prompts, cfg.decode, files[side])
    local p = io.popen(cmd)
    local last
    for line in p:lines() do last = line end
    assert(p:close(), cmd .. ': failed')
    sides[side][r] = require('moonrl.io.json').decode(last)
  end
end
local function best(side, key, most)
  local v = sides[side][1][key]
  for r = 2, cfg.rounds do v = (most and math.max or math.min)(v, sides[side][r][key]) end
  return v
end
local a, b = io.open(files.quantized, 'rb'):read('*a'), io.open(files.dequantized, 'rb'):read('*a')
local n = #a / 4
local pa, pb = ffi.cast('const float *', a), ffi.cast('const float *', b)
local d = 0
for i = 0, n - 1 do d = math.max(d, math.abs(pa[i] - pb[i])) end
os.remove(files.quantized)
os.remove(files.dequantized)
local q = sides.quantized[1]
print(string.format('%s; %s (%.1fM parameters), %s, LoRA rank %d; %d x %d tokens; best of %d rounds, alternating',
  cpu, cfg.gguf:match('[^/]*$'), q.n_params / 1e6, q.dtype, cfg.rank, cfg.seqs, cfg.seq, cfg.rounds))
print(string.format('the blocks: %.1f MiB for %.1fM weights (%.1f MiB in fp32)', mib(q.blocks), q.blocks_params / 1e6,
  mib(4 * q.blocks_params)))
print('| | dequantized base | quantized base | ratio |\n|---|---|---|---|')
local rows = { { 'parameters held (accounted, after a step)', 'params', false, mib, 'MiB' },
  { 'peak resident memory', 'rss', false, mib, 'MiB' }, { 'training step', 'step', false, nil, 's' },
  { 'decode, the model\'s own adapters', 'decode', true, nil, 'tok/s' } }
for _, r in ipairs(rows) do
  local x, y = best('dequantized', r[2], r[3]), best('quantized', r[2], r[3])
  local f = r[4] or function(v) return v end
  print(string.format('| %s | %.3f %s | %.3f %s | %.2fx |', r[1], f(x), r[5], f(y), r[5], y / x))
end
print(string.format('log-probs of %d tokens under the adapters: max |quantized - dequantized| = %.3g', n, d))
