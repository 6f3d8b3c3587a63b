-- Training MFU on one GPU (tests/gpu/run.sh runs it): the training step (forward to per-token
-- log-probs, backward, AdamW over the fp32 master buffer and the bf16 refresh) of a
-- Qwen2.5-0.5B-shaped model (random weights) with model.dtype=bf16 and model.device=cuda, on
-- packed batches of `seqs` sequences of `seq` tokens.
--
--   moonrl run bench/gpu/gpu_train.lua                       -- qwen0.5b, 16 x 1024 tokens a step
--   moonrl run bench/gpu/gpu_train.lua size=tiny steps=2     -- a check of the script itself (an emulated GPU)
--
-- MFU = model FLOPs per second / the GPU's dense bf16 peak (peak_tflops; H200 SXM: 989). Model
-- FLOPs per token (the PaLM / llm.c count, no recomputation counted): 6 x the parameters of
-- every matrix product (the layers' seven matrices and the lm_head), plus the causal attention's
-- 6 x layers x seq x hidden (QK^T and PV forward, x3 with the backward, over seq / 2 keys on
-- average). Prints one JSON line.
local moonrl = require('moonrl')

local cfg = moonrl.config {
  size = 'qwen0.5b',                       -- qwen0.5b | tiny
  seq = moonrl.config.integer(1024),      -- tokens a sequence
  seqs = moonrl.config.integer(16),       -- sequences a step
  steps = moonrl.config.integer(6),       -- timed steps (after 2 warm-up steps); the median is kept
  peak_tflops = 989.0,                    -- dense bf16 peak of the GPU (H200 SXM)
  device = 'cuda',
  dtype = 'bf16',
  recompute = false,
}

local preset = dofile(moonrl.home .. '/bench/models.lua') -- bench/models.json
local shapes = {
  -- Qwen2.5-0.5B: 494M parameters (136M of them the tied embedding)
  ['qwen0.5b'] = preset('qwen0.5b'),
  tiny = preset('qwen2-tiny', { max_position_embeddings = 256 }),
}
local shape = shapes[cfg.size]
if not shape then moonrl.usage_error("size must be qwen0.5b or tiny, got '" .. tostring(cfg.size) .. "'") end
if cfg.size == 'tiny' and cfg.seq > 128 then cfg.seq, cfg.seqs = 64, 2 end

local model = moonrl.model.new(shape, { seed = 1 })
model:set_dtype(cfg.dtype)
model:to_device(cfg.device)
if cfg.recompute then moonrl.C.mrl_model_set_recompute(model.handle, 1) end
local opt = require('moonrl.train.models').adamw(model, { lr = 1e-5, weight_decay = 0.01 })

local batch, grad = dofile(moonrl.home .. '/bench/train_batch.lua')(shape.vocab_size, cfg.seqs, cfg.seq)
local T = batch.n_tokens

local p, n = model:param_buffer()
local function step()
  local t0 = moonrl.now()
  model:zero_grad()
  local lp = model:forward(batch)
  model:backward(grad)
  opt:step()
  require('moonrl.train.ops').sum(p, n) -- waits for the step's last kernels (the AdamW update) on the GPU
  local loss = 0
  for i = 0, T - 1 do loss = loss - lp[i] end
  return moonrl.now() - t0, loss / T
end

step()
step()
local times, loss = {}, nil
for i = 1, cfg.steps do times[i], loss = step() end
table.sort(times)
local secs = times[math.floor((#times + 1) / 2)]

-- the FLOPs of the products: every 2-D view but the embedding (tied: it is the lm_head, counted once)
local matmul = 0
for _, v in ipairs(model:views()) do
  if #v.shape == 2 then matmul = matmul + v.numel end
end
if not shape.tie_word_embeddings then matmul = matmul - shape.vocab_size * shape.hidden_size end
local flops_per_token = 6 * matmul + 6 * shape.num_hidden_layers * cfg.seq * shape.hidden_size
local achieved = flops_per_token * T / secs
print(require('moonrl.io.json').encode({ size = cfg.size, device = model:device_description(), dtype = model:dtype(),
  n_params = n, matmul_params = matmul, tokens_per_step = T, seq = cfg.seq, seconds_per_step = secs,
  tokens_per_s = T / secs, tflops = achieved / 1e12, mfu = achieved / (cfg.peak_tflops * 1e12), loss = loss,
  recompute = cfg.recompute }))
