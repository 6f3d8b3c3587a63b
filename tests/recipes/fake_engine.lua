-- TESTS ONLY: a stand-in for moonrl.engine with the same Lua API, for tiny vocabularies, used
-- while the real engine is not merged (and to cross-check it). It has no KV cache: each new
-- token costs a forward over vocab_size copies of every running sequence, each copy with one
-- candidate next token as the target of its last position, which yields the full next-token
-- distribution from the model's per-token log-probs.
--
--   package.loaded['moonrl.engine'] = dofile('tests/recipes/fake_engine.lua')
local ffi = require('ffi')
local moonrl = require('moonrl')
local model_mod = require('moonrl.model')

local M = { fake = true }
local Engine = {}
Engine.__index = Engine

function M.new(model, opts)
  return setmetatable({ model = model, opts = opts or {}, calls = 0 }, Engine)
end

-- a Lehmer generator seeded from (seed, step, prompt, sample): deterministic, exact in doubles
local function rng(seed)
  local s = seed % 2147483646 + 1
  for _ = 1, 3 do s = (s * 48271) % 2147483647 end
  return function()
    s = (s * 48271) % 2147483647
    return s / 2147483647
  end
end

function Engine:generate(requests, o)
  o = o or {}
  local temp = o.temperature or 1.0
  local max_tokens = o.max_tokens or 16
  local V = self.model.config.vocab_size
  local stop = {}
  for _, id in ipairs(o.eos_ids or {}) do stop[id] = true end
  for _, id in ipairs(o.stop_ids or {}) do stop[id] = true end
  self.calls = self.calls + 1
  local seqs = {}
  local results = {}
  for i, r in ipairs(requests) do
    results[i] = {}
    for j = 1, r.n or 1 do
      local s = { i = i, j = j, prompt = r.prompt_ids, ids = {}, logprobs = {}, done = false,
        rand = rng((self.opts.seed or 0) * 1000003 + (o.step or self.calls) * 7919 + i * 131 + j) }
      seqs[#seqs + 1] = s
    end
  end
  local targets_of = {}
  for _ = 1, max_tokens do
    local live = {}
    for _, s in ipairs(seqs) do if not s.done then live[#live + 1] = s end end
    if #live == 0 then break end
    local batch, tg = {}, {}
    for _, s in ipairs(live) do
      local seq = {}
      for k = 1, #s.prompt do seq[k] = s.prompt[k] end
      for k = 1, #s.ids do seq[#s.prompt + k] = s.ids[k] end
      local base = {}
      for k = 1, #seq do base[k] = -1 end
      for v = 0, V - 1 do
        local t = targets_of[#seq .. ':' .. v]
        if not t then
          t = {}
          for k = 1, #seq do t[k] = -1 end
          t[#seq] = v
          targets_of[#seq .. ':' .. v] = t
        end
        batch[#batch + 1] = seq
        tg[#tg + 1] = t
      end
    end
    local b = model_mod.batch(batch, { targets = tg })
    local lp = self.model:forward(b, { temperature = temp > 0 and temp or 1.0 })
    for n, s in ipairs(live) do
      local best, best_lp, pick, pick_lp = 0, -math.huge, nil, nil
      local u = s.rand()
      local acc = 0
      for v = 0, V - 1 do
        local q = (n - 1) * V + v
        local l = lp[b.cu_seqlens[q + 1] - 1]
        if l > best_lp then best, best_lp = v, l end
        acc = acc + math.exp(l)
        if not pick and u < acc then pick, pick_lp = v, l end
      end
      if temp <= 0 or not pick then pick, pick_lp = best, best_lp end
      s.ids[#s.ids + 1] = pick
      s.logprobs[#s.logprobs + 1] = pick_lp
      if stop[pick] then s.done, s.reason = true, 'stop'
      elseif #s.ids >= max_tokens then s.done, s.reason = true, 'length' end
    end
  end
  for _, s in ipairs(seqs) do
    local out = { ids = s.ids, logprobs = s.logprobs, finish_reason = s.reason or 'length' }
    if o.tokenizer then out.text = o.tokenizer:decode(s.ids, { skip_special = true }) end
    results[s.i][s.j] = out
  end
  return results
end

return M
