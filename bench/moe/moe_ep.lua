-- Expert parallelism against plain data parallel, paired in one run on the same ranks: the
-- forward and backward of a qwen3_moe model on this rank's share of a batch, with the experts
-- split over the ranks (mrl_model_set_expert_parallel: every sparse layer's rows dispatched to
-- their experts' ranks and combined back) and without (every rank runs every expert on its own
-- tokens), alternating so that the machine's load hits both; plus the gradient all-reduce both
-- need. Rank 0 prints one line per measurement and the ratio of the medians.
--
--   mpirun -n 2 --bind-to none moonrl run bench/moe/moe_ep.lua [reps=5] [tokens=2048] [dtype=bf16]
local moonrl = require('moonrl')
local dist = require('moonrl.train.dist')
local ffi = require('ffi')

local cfg = moonrl.config {
  reps = moonrl.config.integer(5),      -- timed steps per mode (the median is kept)
  tokens = moonrl.config.integer(2048), -- the global batch: sequences of 256 tokens, split over the ranks
  dtype = 'fp32',                       -- fp32 | bf16
  experts = moonrl.config.integer(16),
}
local w = dist.world()
local shape = dofile(moonrl.home .. '/bench/models.lua')('qwen3-moe', { num_experts = cfg.experts }) -- bench/models.json

local n_seqs = math.floor(cfg.tokens / 256)
local first, last = w:share(n_seqs)
local seqs = {}
for i = first, last do
  local q = {}
  for k = 1, 256 do q[k] = (i * 7919 + k * 104729) % shape.vocab_size end
  seqs[#seqs + 1] = q
end
local batch = moonrl.model.batch(seqs)
local dlp = ffi.new('float[?]', batch.n_tokens)
for t = 0, batch.n_tokens - 1 do dlp[t] = math.cos(t) * 1e-3 end

local models = {}
for _, mode in ipairs({ 'dp', 'ep' }) do
  local m = moonrl.model.new(shape, { seed = 1 })
  if cfg.dtype == 'bf16' then m:set_dtype('bf16') end
  if mode == 'ep' then m:set_expert_parallel(w) end
  models[mode] = m
end
local n_params = models.dp.n_params

local function step(m)
  w:barrier()
  local t0 = moonrl.now()
  m:zero_grad()
  m:forward(batch)
  m:backward(dlp)
  w:allreduce(m:grads(), n_params, 'f32', 'sum')
  local t = moonrl.now() - t0
  return w:max(t) -- the step of the slowest rank
end

step(models.dp)
step(models.ep) -- warm: the first products and buffers
local times = { dp = {}, ep = {} }
for r = 1, cfg.reps do
  for _, mode in ipairs(r % 2 == 1 and { 'dp', 'ep' } or { 'ep', 'dp' }) do
    local t = step(models[mode])
    times[mode][#times[mode] + 1] = t
    if w.rank == 0 then print(string.format('%s rep %d: %.3f s', mode, r, t)) end
  end
end
local function median(list)
  table.sort(list)
  return list[math.floor((#list + 1) / 2)]
end
local dp, ep = median(times.dp), median(times.ep)
local e0, ne = models.ep:expert_range()
if w.rank == 0 then
  print(string.format('%d ranks, %d experts (rank 0 runs %d..%d), %d tokens a step, %s: data parallel %.3f s, ' ..
    'expert parallel %.3f s a step (median of %d): ep / dp = %.2f', w.size, shape.num_experts, e0, e0 + ne - 1,
    n_seqs * 256, cfg.dtype, dp, ep, cfg.reps, ep / dp))
end
