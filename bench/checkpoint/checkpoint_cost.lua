-- The cost of one checkpoint, against the cost of one training step measured in the same run.
--
--   build/moonrl run bench/checkpoint/checkpoint_cost.lua size=default     # the default example's model
--   build/moonrl run bench/checkpoint/checkpoint_cost.lua size=100m         # a ~110M-parameter Llama
--
-- Writes `repeats` checkpoints of the model and its AdamW state through moonrl.train.session (exactly
-- what a run does: model + tokenizer files, optimizer.safetensors, state, manifest with CRC-32C,
-- fsync of every file and directory, rename), verifies and restores the last one, and times
-- `steps` training steps (forward + backward + clip + AdamW) on `batch` x `seq` tokens.
-- Prints seconds, bytes and the checkpoint's share of a step.
local moonrl = require('moonrl')
local ffi = require('ffi')
local algo = require('moonrl.algo')
local ckpt = require('moonrl.train.checkpoint')
local fs = require('moonrl.io.fs')
local models = require('moonrl.train.models')
local session = require('moonrl.train.session')

local cfg = moonrl.config {
  size = 'default', -- default (hidden 128, 2 layers, vocab 15) or 100m (hidden 768, 12 layers, vocab 32000)
  repeats = moonrl.config.integer(3),
  steps = moonrl.config.integer(3),
  batch = moonrl.config.integer(0), seq = moonrl.config.integer(0), -- 0: the size's default
}
local preset = dofile(moonrl.home .. '/bench/models.lua') -- bench/models.json
local SIZES = {
  -- a GRPO step of the default run: 32 prompts x 8 samples of ~8 tokens
  default = { model = preset('default'), batch = 256, seq = 8 },
  ['100m'] = { model = preset('110m'), batch = 8, seq = 256 }, -- a ~110M-parameter Llama
}
local size = SIZES[cfg.size] or moonrl.usage_error('size must be default or 100m')
local batch = cfg.batch > 0 and cfg.batch or size.batch
local seq = cfg.seq > 0 and cfg.seq or size.seq
local model = moonrl.model.new(size.model, { seed = 1 })
local S = session.start(cfg, { name = 'checkpoint_cost', steps = cfg.steps, policy = model,
  tokenizer_dir = cfg.size == 'default' and (moonrl.home .. '/examples/default') or nil })
local opt = S:optimizer('policy', models.adamw(model, { lr = 1e-4, weight_decay = 0.0 }))
print(string.format('%s model: %.1fM parameters; step: %d x %d tokens; threads %d; cpu: %s', cfg.size,
  model.n_params / 1e6, batch, seq, moonrl.version().threads, moonrl.version().kernels))

-- training steps
local state = 1
local function tok()
  state = (state * 48271) % 2147483647
  return state % size.model.vocab_size
end
local step_times = {}
for step in S:steps() do
  local seqs = {}
  for b = 1, batch do
    local s = {}
    for i = 1, seq do s[i] = tok() end
    seqs[b] = s
  end
  local bt = moonrl.model.batch(seqs)
  local mask = ffi.new('float[?]', bt.n_tokens)
  for i = 0, bt.n_tokens - 1 do mask[i] = bt.targets[i] >= 0 and 1 or 0 end
  local t0 = moonrl.now()
  model:zero_grad()
  local lp = model:forward(bt)
  local grad = ffi.new('float[?]', bt.n_tokens)
  algo.sft.loss({ logprob = lp, mask = mask, cu_seqlens = bt.cu_seqlens, nseq = bt.n_seqs, grad = grad })
  model:backward(grad)
  opt:clip_grad_norm(1.0)
  opt:step(1e-4)
  step_times[#step_times + 1] = moonrl.now() - t0
  S:log({}, { quiet = true })
end
table.sort(step_times)
local step_s = step_times[math.ceil(#step_times / 2)]

-- checkpoints
local times = {}
for i = 1, cfg.repeats do
  local t0 = moonrl.now()
  S:checkpoint('bench')
  times[i] = moonrl.now() - t0
end
table.sort(times)
local write_s = times[math.ceil(#times / 2)]
local bytes = S.last_checkpoint.bytes
local path = S.last_checkpoint.path
local t0 = moonrl.now()
assert(ckpt.verify(path))
local verify_s = moonrl.now() - t0
t0 = moonrl.now()
S:restore(path, ckpt.read(path).state)
local restore_s = moonrl.now() - t0
print(string.format('checkpoint: %.1f MB, write %.3f s (median of %d; min %.3f, max %.3f), %.0f MB/s', bytes / 1e6,
  write_s, #times, times[1], times[#times], bytes / 1e6 / write_s))
print(string.format('resume: verify %.3f s, restore %.3f s', verify_s, restore_s))
print(string.format('training step: %.3f s (median of %d) -> one checkpoint = %.2f steps', step_s, #step_times,
  write_s / step_s))
S:finish({ save = false })
fs.remove(S.dir)
