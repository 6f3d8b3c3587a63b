-- Multi-head latent attention's caches (engine.mla_cache) on one DeepSeek-V3-shaped model with
-- random weights, in one process, alternating `rounds` times:
--   1. the KV cache's bytes a token (every layer), latent against expanded, and the ratio the
--      config gives (2 * heads * head_dim / (kv_lora_rank + qk_rope_head_dim));
--   2. decode: `prompts` requests of `decode` new tokens after a prompt of `prompt` tokens
--      (greedy), generated tokens a second; and the greedy tokens of the two, compared.
-- The model: DeepSeek-V3's head shapes (nope 128, rope 64, values 128; a latent of 512, queries
-- through a rank of 1536) with fewer heads and layers, the dense MLP.
--   moonrl run bench/deepseek/mla_cache.lua [heads=16] [layers=4] [dtype=auto]
local moonrl = require('moonrl')

local cfg = moonrl.config {
  heads = moonrl.config.integer(16, { min = 1 }), layers = moonrl.config.integer(4, { min = 1 }),
  hidden = moonrl.config.integer(1024, { min = 64 }), dtype = 'auto',
  prompts = moonrl.config.integer(16, { min = 1 }), prompt = moonrl.config.integer(256, { min = 1 }),
  decode = moonrl.config.integer(64, { min = 1 }), rounds = moonrl.config.integer(2, { min = 1 }),
}
local cpu = (io.popen('grep -m1 "model name" /proc/cpuinfo'):read('*l') or ''):gsub('.*: ', '')
local mc = { model_type = 'deepseek_v3', vocab_size = 8192, hidden_size = cfg.hidden, intermediate_size = 2816,
  num_hidden_layers = cfg.layers, num_attention_heads = cfg.heads, num_key_value_heads = cfg.heads,
  q_lora_rank = 1536, kv_lora_rank = 512, qk_nope_head_dim = 128, qk_rope_head_dim = 64, v_head_dim = 128,
  max_position_embeddings = 4096, first_k_dense_replace = cfg.layers, initializer_range = 0.02 }
local model = moonrl.model.new(mc, { seed = 1 })
local dtype = moonrl.model.resolve_dtype(cfg.dtype, model.config)
model:set_dtype(dtype)
local reqs = {}
for i = 1, cfg.prompts do
  local p = {}
  for j = 1, cfg.prompt do p[j] = (i * 7919 + j * 104729) % 8000 + 3 end
  reqs[i] = { prompt_ids = p }
end

local res, bytes, toks = {}, {}, {}
local engines = {}
for _, cache in ipairs({ 'latent', 'expanded' }) do
  engines[cache] = moonrl.engine.new(model, { kv_cache_bytes = 1024 * 2 ^ 20, max_batch_tokens = 4096,
    max_seqs = 64, mla_cache = cache, prefix_caching = false })
  engines[cache]:generate({ { prompt_ids = { 5, 6, 7 } } }, { temperature = 0, max_tokens = 2, eos_ids = {} }) -- warm up
  res[cache] = {}
end
for r = 1, cfg.rounds do
  for _, cache in ipairs({ 'latent', 'expanded' }) do
    local e = engines[cache]
    -- the prompts prefilled (one step of decode each), then timed: the decode steps alone
    local t0 = moonrl.now()
    local out = e:generate(reqs, { temperature = 0, max_tokens = 1, eos_ids = {} })
    local t1 = moonrl.now()
    out = e:generate(reqs, { temperature = 0, max_tokens = 1 + cfg.decode, eos_ids = {} })
    local t2 = moonrl.now()
    local n = 0
    for i = 1, #reqs do n = n + #out[i][1].ids end
    -- (the second call prefills again: its decode's time is the difference of the two calls)
    res[cache][r] = (n - #reqs) / ((t2 - t1) - (t1 - t0))
    bytes[cache] = e:stats().kv_bytes_per_token
    toks[cache] = out
  end
end
local function best(cache)
  local v = res[cache][1]
  for r = 2, cfg.rounds do v = math.max(v, res[cache][r]) end
  return v
end
local same, total = 0, 0
for i = 1, #reqs do
  local a, b = toks.latent[i][1].ids, toks.expanded[i][1].ids
  for j = 1, #a do
    total = total + 1
    if a[j] == b[j] then same = same + 1 end
  end
end
local hd = math.max(128 + 64, 128)
print(string.format('%s; deepseek_v3 shapes, %d layers, %d heads, hidden %d, %s; %d prompts of %d, %d new tokens ' ..
  'greedy; best of %d rounds, alternating', cpu, cfg.layers, cfg.heads, cfg.hidden, dtype, cfg.prompts, cfg.prompt,
  cfg.decode, cfg.rounds))
print('| | expanded | latent | ratio |\n|---|---|---|---|')
print(string.format('| KV cache, bytes a token | %d | %d | %.1fx smaller (expected %.1fx) |', bytes.expanded,
  bytes.latent, bytes.expanded / bytes.latent, 2 * cfg.heads * hd / (512 + 64)))
print(string.format('| decode, tokens/s | %.1f | %.1f | %.2fx |', best('expanded'), best('latent'),
  best('latent') / best('expanded')))
print(string.format('greedy tokens: %d of %d the same', same, total))
