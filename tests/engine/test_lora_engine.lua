-- LoRA in the engine: the model's own adapters read in place (its log-probs are the trainer's
-- forward), several adapter sets served in one batch (multi-LoRA: each request's tokens and
-- log-probs those of a model with its adapters alone), the prefix cache kept apart by adapter,
-- merged weights within fp32 rounding of the unmerged adapters, bad slots refused.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local tiny = dofile('tests/lib/models.lua')

local function fill(ad, scale, f)
  local p, n = ad:buffer()
  for i = 0, n - 1 do p[i] = scale * f(i) end
end

local function engine(m) return moonrl.engine.new(m, { kv_cache_bytes = 8 * 2 ^ 20, max_batch_tokens = 256, max_seqs = 16, seed = 1 }) end

-- a model whose own adapters are ad's values (the trainer's view of "base + ad")
local function with_own(ad, seed)
  local m = tiny.model('digits', {}, { seed = seed })
  local info = ad:info()
  m:set_lora(info)
  local src, n = ad:buffer()
  local dst = m:lora_buffer()
  require('ffi').copy(dst, src, 4 * n)
  m:trained()
  return m
end

local PROMPT = {}
for i = 1, 40 do PROMPT[i] = 1 + (i * 7) % 13 end -- (past two KV blocks of 16: the prefix cache has something to share)

t.test('multi-LoRA: a mixed batch gives each request its adapter\'s tokens and log-probs', function()
  local m = tiny.model('digits', {}, { seed = 3 })
  local a1 = m:new_adapter({ rank = 4, alpha = 8, seed = 1 })
  fill(a1, 0.3, math.sin)
  local a2 = m:new_adapter({ rank = 2, alpha = 8, targets = { 'q_proj', 'v_proj' }, seed = 2 })
  fill(a2, 0.5, math.cos)
  local e = engine(m)
  e:set_adapter(1, a1)
  e:set_adapter(5, a2)
  local reqs = { { prompt_ids = PROMPT, n = 2 }, { prompt_ids = PROMPT, n = 2, adapter = 1 },
    { prompt_ids = { 3, 1, 4 }, n = 1, adapter = 5 }, { prompt_ids = { 3, 1, 4 }, n = 1 } }
  local opts = { temperature = 1.0, max_tokens = 6, seed = 9 }
  local mixed = e:generate(reqs, opts)
  -- each request on an engine of a model with only that adapter (its own, or none)
  local refs = { [0] = tiny.model('digits', {}, { seed = 3 }), [1] = with_own(a1, 3), [5] = with_own(a2, 3) }
  for i, q in ipairs(reqs) do
    local alone = engine(refs[q.adapter or 0]):generate({ { prompt_ids = q.prompt_ids, n = q.n, prompt_index = i - 1 } }, opts)
    for j = 1, q.n do
      t.eq(table.concat(mixed[i][j].ids, ' '), table.concat(alone[1][j].ids, ' '), 'request ' .. i .. ' sample ' .. j .. ' tokens')
      for k = 1, #alone[1][j].logprobs do
        t.near(mixed[i][j].logprobs[k], alone[1][j].logprobs[k], 1e-5, 'request ' .. i .. ' log-prob ' .. k)
      end
    end
  end
  t.truthy(table.concat(mixed[1][1].ids, ' ') ~= table.concat(mixed[2][1].ids, ' ') or
    math.abs(mixed[1][1].logprobs[1] - mixed[2][1].logprobs[1]) > 1e-3, 'the adapter changes the samples')
end)

t.test('the prefix cache is kept apart by adapter, and a slot set again is another adapter', function()
  local m = tiny.model('digits', {}, { seed = 4 })
  local a1, a2 = m:new_adapter({ rank = 4, seed = 1 }), m:new_adapter({ rank = 4, seed = 2 })
  fill(a1, 0.3, math.sin)
  fill(a2, 0.3, math.cos)
  local e = engine(m)
  e:set_adapter(1, a1)
  e:set_adapter(2, a2)
  -- a server's way (add, step, release: never a reset), so that the cache keeps what it computed
  local function first_logprob(adapter)
    local id = e:add({ prompt_ids = PROMPT, adapter = adapter }, { temperature = 0, max_tokens = 2 })
    while e:step() > 0 do end
    local _, lps = e:output(id, 0)
    local v = lps[0]
    e:release(id)
    return v
  end
  local function hits() return e:stats().prefix_hit_tokens end
  first_logprob(1)
  local h = hits()
  local second = first_logprob(2)
  t.eq(hits(), h, 'adapter 2 reuses none of adapter 1\'s blocks')
  local fresh = engine(with_own(a2, 4)):generate({ { prompt_ids = PROMPT } }, { temperature = 0, max_tokens = 2 })
  t.near(second, fresh[1][1].logprobs[1], 1e-5, 'adapter 2 computed with its own K/V')
  first_logprob(2)
  t.truthy(hits() > h, 'the same adapter reuses its blocks')
  h = hits()
  e:set_adapter(2, a1) -- slot 2 now holds another adapter: its old blocks are not reused
  local again = first_logprob(2)
  t.eq(hits(), h, 'a slot set again shares nothing with its former adapter')
  local want = engine(with_own(a1, 4)):generate({ { prompt_ids = PROMPT } }, { temperature = 0, max_tokens = 2 })
  t.near(again, want[1][1].logprobs[1], 1e-5)
end)

t.test('the model\'s own adapters: the engine\'s log-probs are the trainer\'s; merged within fp32 rounding', function()
  local m = tiny.model('digits', {}, { seed = 5 })
  m:set_lora({ rank = 8, alpha = 16, seed = 1 })
  local p, n = m:lora_buffer()
  for i = 0, n - 1 do p[i] = 0.2 * math.sin(3 * i) end
  m:trained()
  local out = engine(m):generate({ { prompt_ids = { 2, 7, 1 }, n = 3 } }, { temperature = 1, max_tokens = 8, seed = 4 })
  for j = 1, 3 do
    local ids = { 2, 7, 1 }
    for _, x in ipairs(out[1][j].ids) do ids[#ids + 1] = x end
    local lp = m:forward(moonrl.model.batch({ ids }))
    for k, v in ipairs(out[1][j].logprobs) do t.near(v, lp[2 + k - 1], 1e-5, 'sample ' .. j .. ' token ' .. k) end
  end
  local merged = require('moonrl.train.models').merged(m)
  local a = m:forward(moonrl.model.batch({ PROMPT }))
  local b = merged:forward(moonrl.model.batch({ PROMPT }))
  for i = 0, #PROMPT - 2 do t.near(b[i], a[i], 1e-5, 'merged = unmerged at ' .. i) end
end)

t.test('bad slots and adapters are errors', function()
  local m = tiny.model('digits', {}, { seed = 6 })
  local e = engine(m)
  local ok, err = pcall(e.generate, e, { { prompt_ids = { 1, 2 }, adapter = 3 } }, { max_tokens = 2 })
  t.truthy(not ok and tostring(err):find('no LoRA adapter in slot 3', 1, true), tostring(err))
  ok, err = pcall(e.set_adapter, e, 65, m:new_adapter({ rank = 2 }))
  t.truthy(not ok and tostring(err):find('slot 65', 1, true), tostring(err))
  local moe = tiny.model('qwen3_moe', {}, { seed = 1 })
  local em = engine(moe)
  ok, err = pcall(em.set_adapter, em, 1, moe:new_adapter({ rank = 2 }))
  t.truthy(not ok and tostring(err):find('mixture-of-experts', 1, true), tostring(err))
end)
