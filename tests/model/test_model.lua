-- moonrl.model from Lua: construction from a config table, packed batches,
-- forward/backward, views, a finite-difference check of one gradient,
-- save/load, errors.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local ffi = require('ffi')
local tiny = dofile('tests/lib/models.lua')

local cfg = tiny.config('qwen2', { vocab_size = 40, initializer_range = 0.1 })

t.test('new, batch, forward', function()
  local m = moonrl.model.new(cfg, { seed = 5 })
  t.eq(m.config.model_type, 'qwen2')
  t.eq(m.config.head_dim, 8)
  local b = moonrl.model.batch({ { 1, 2, 3, 4 }, { 5 }, { 6, 7, 8 } })
  t.eq(b.n_tokens, 8)
  t.eq(b.n_seqs, 3)
  t.eq(b.targets[0], 2)
  t.eq(b.targets[3], -1)
  t.eq(b.targets[4], -1)
  local lp, ent = m:forward(b)
  for i = 0, 7 do
    t.truthy(lp[i] <= 0 and ent[i] > 0 and ent[i] <= math.log(40) + 1e-4, 'log-prob and entropy in range')
  end
  t.eq(lp[3], 0, 'no target: log-prob 0')
  -- the same sequence alone gives the same numbers (no attention across sequences)
  local lp2 = m:forward(moonrl.model.batch({ { 6, 7, 8 } }))
  for i = 0, 2 do t.near(lp2[i], lp[5 + i], 1e-5) end
end)

t.test('views and buffers', function()
  local m = moonrl.model.new(cfg, { seed = 1, value_head = true })
  local v = m:views()
  t.eq(v[1].name, 'model.embed_tokens.weight')
  t.eq(v[#v].name, 'score.weight')
  t.eq(v[#v].offset + v[#v].numel, m.n_params)
  local _, n = m:params()
  t.eq(n, m.n_params)
  local nd = 0
  for _, r in ipairs(m:no_decay_ranges()) do nd = nd + r[2] end
  t.eq(nd, 2 * (32 + 32 + 32 + 16 + 16) + 32, 'norm weights and biases are not decayed')
end)

t.test('weight slices in Hugging Face coordinates: pieces of any layout land by name, a subset, mismatches named', function()
  local src, dst = moonrl.model.new(cfg, { seed = 3 }), moonrl.model.new(cfg, { seed = 4 })
  local sp, n = src:params()
  local dp = dst:params()
  -- three uneven pieces of the buffer (shards), each placed through its own slice table
  local cuts = { 0, 7, math.floor(n / 2) + 3, n }
  for i = 1, 3 do
    local off, cnt = cuts[i], cuts[i + 1] - cuts[i]
    local slices = src:slices(off, cnt)
    t.eq(slices[1].at, 0)
    local sum = 0
    for _, s in ipairs(slices) do sum = sum + s.count end
    t.eq(sum, cnt, 'the slices cover the piece')
    for _, c in ipairs(dst:slice_plan(slices)) do ffi.copy(dp + c.to, sp + off + c.at, 4 * c.count) end
  end
  t.eq(ffi.string(dp, 4 * n), ffi.string(sp, 4 * n), 'the pieces rebuild the weights bit for bit')
  t.eq(#dst:slice_plan(src:slices()), 1, 'the same layout: one copy')
  -- a sender of another layout: the tensors packed in reverse order, each slice addressed by name
  local whole, packed, at = src:slices(), ffi.new('float[?]', n), 0
  local rev = {}
  for i = #whole, 1, -1 do
    local s = whole[i]
    ffi.copy(packed + at, sp + s.at, 4 * s.count)
    rev[#rev + 1] = { name = s.name, shape = s.shape, offset = s.offset, count = s.count, at = at }
    at = at + s.count
  end
  local other = moonrl.model.new(cfg, { seed = 5 })
  local op = other:params()
  for _, c in ipairs(other:slice_plan(rev)) do ffi.copy(op + c.to, packed + c.at, 4 * c.count) end
  t.eq(ffi.string(op, 4 * n), ffi.string(sp, 4 * n), 'another layout\'s slices land by name')
  -- a receiver taking only the tensors it needs
  local part = moonrl.model.new(cfg, { seed = 6 })
  local pp = part:params()
  local before = ffi.string(pp, 4 * n)
  local plan = part:slice_plan(whole, function(name) return name:find('^model%.layers%.0%.') ~= nil end)
  for _, c in ipairs(plan) do ffi.copy(pp + c.to, sp + c.at, 4 * c.count) end
  for _, v in ipairs(part:views()) do
    local want = v.name:find('^model%.layers%.0%.') and sp or ffi.cast('float *', before)
    t.eq(ffi.string(pp + v.offset, 4 * v.numel), ffi.string(want + v.offset, 4 * v.numel), v.name)
  end
  -- what cannot be placed is named
  local wide = moonrl.model.new(tiny.config('qwen2', { vocab_size = 40, hidden_size = 48 }), { seed = 1 })
  local ok, err = pcall(wide.slice_plan, wide, whole)
  t.truthy(not ok and err:find('model.embed_tokens.weight is [40, 48] here, [40, 32]', 1, true), err)
  ok, err = pcall(src.slice_plan, src, { { name = 'lm_head.bias', shape = { 40 }, offset = 0, count = 40, at = 0 } })
  t.truthy(not ok and err:find('no tensor lm_head.bias', 1, true), err)
  ok, err = pcall(src.slice_plan, src, { { name = 'model.norm.weight', shape = { 32 }, offset = 30, count = 4, at = 0 } })
  t.truthy(not ok and err:find('model.norm.weight slice [30, +4) is past its 32 elements', 1, true), err)
end)

t.test('gradient of one parameter against a finite difference', function()
  local m = moonrl.model.new(cfg, { seed = 2 })
  local b = moonrl.model.batch({ { 3, 9, 27, 1, 4 }, { 2, 8 } })
  local n = b.n_tokens
  local ones = ffi.new('float[?]', n)
  for i = 0, n - 1 do ones[i] = 1 end
  local function loss()
    local lp, ent = m:forward(b)
    local s = 0
    for i = 0, n - 1 do s = s + lp[i] + 0.5 * ent[i] end
    return s
  end
  loss()
  local half = ffi.new('float[?]', n)
  for i = 0, n - 1 do half[i] = 0.5 end
  m:zero_grad()
  m:backward(ones, half)
  local p, _ = m:params()
  local g = m:grads()
  local idx = m:views()[3].offset + 7 -- a q_proj weight
  local keep, h = p[idx], 1e-2
  p[idx] = keep + h; local up = loss()
  p[idx] = keep - h; local down = loss()
  p[idx] = keep
  t.near(g[idx], (up - down) / (2 * h), 2e-3 * math.max(1, math.abs(g[idx])))
end)

t.test('save and load', function()
  local m = moonrl.model.new(cfg, { seed = 3 })
  local dir = os.tmpname()
  os.remove(dir)
  m:save(dir)
  local m2 = moonrl.model.load(dir)
  local p1, n = m:params()
  local p2 = m2:params()
  local same = true
  for i = 0, n - 1 do if p1[i] ~= p2[i] then same = false break end end
  t.truthy(same, 'parameters identical after save/load')
  t.eq(m2.config.model_type, 'qwen2')
  os.execute("rm -rf '" .. dir .. "'")
end)

t.test('yarn rope scaling: the config table, a copy and a saved model compute the same (the float64 check: model_ref.py)', function()
  local c = { model_type = 'qwen3', vocab_size = 50, hidden_size = 32, intermediate_size = 48, num_hidden_layers = 1,
    num_attention_heads = 2, num_key_value_heads = 1, head_dim = 16, max_position_embeddings = 64,
    rope_scaling = { type = 'yarn', original_max_position_embeddings = 16, mscale = 1.0, mscale_all_dim = 0.707, beta_fast = 16 } }
  local m = moonrl.model.new(c, { seed = 1 })
  t.eq(m.config.rope_scaling.rope_type, 'yarn')
  t.eq(m.config.rope_scaling.factor, 4, 'factor: max_position_embeddings / original_max_position_embeddings')
  local dir = os.tmpname()
  os.remove(dir)
  m:save(dir)
  local ids = {}
  for i = 1, 40 do ids[i] = i end -- (past the original 16 positions)
  local b = moonrl.model.batch({ ids })
  local want = {}
  local lp = m:forward(b)
  for i = 0, 38 do want[i] = lp[i] end
  local plain = moonrl.model.new({ model_type = 'qwen3', vocab_size = 50, hidden_size = 32,
    intermediate_size = 48, num_hidden_layers = 1, num_attention_heads = 2, num_key_value_heads = 1, head_dim = 16,
    max_position_embeddings = 64 }, { seed = 1 })
  for _, other in ipairs({ moonrl.model.new(m.config, { seed = 1 }), moonrl.model.load(dir) }) do
    lp = other:forward(b)
    for i = 0, 38 do t.eq(lp[i], want[i], 'log-prob ' .. i) end
  end
  lp = plain:forward(b)
  local differ = 0
  for i = 0, 38 do differ = math.max(differ, math.abs(lp[i] - want[i])) end
  t.truthy(differ > 1e-4, 'and not the model without it: ' .. differ)
  os.execute("rm -rf '" .. dir .. "'")
end)

t.test('errors name the problem', function()
  local function rope(rs) return { model_type = 'llama', vocab_size = 10, hidden_size = 8, intermediate_size = 8,
    num_hidden_layers = 1, num_attention_heads = 2, rope_scaling = rs } end
  t.raises(function() moonrl.model.new(rope({ rope_type = 'yarn', factor = 2 })) end, 'original_max_position_embeddings')
  t.raises(function() moonrl.model.new(rope({ rope_type = 'dynamic', factor = 2 })) end, "type 'dynamic'")
  t.raises(function() moonrl.model.new(rope({ rope_type = 'yarn', factor = -2, original_max_position_embeddings = 4 })) end,
    'rope_scaling yarn needs factor')
  t.raises(function() moonrl.model.new({ model_type = 'gpt2' }) end, 'gpt2')
  local m = moonrl.model.new(cfg)
  t.raises(function() m:forward(moonrl.model.batch({ { 1, 99 } })) end, 'outside')
  t.raises(function() moonrl.model.load('/nonexistent/dir') end, 'nonexistent')
end)

t.test('precision: set_dtype, auto, and the copies following writes through params()', function()
  local m = moonrl.model.new(cfg, { seed = 3 })
  t.eq(m:dtype(), 'fp32')
  local b = moonrl.model.batch({ { 1, 5, 9, 2, 7 }, { 3, 4 } })
  local lp32 = m:forward(b)
  t.eq(m:set_dtype('bf16'), 'bf16')
  t.eq(m:dtype(), 'bf16')
  local lp16 = m:forward(b)
  local moved = 0
  for i = 0, b.n_tokens - 1 do
    t.near(lp16[i], lp32[i], 0.05, 'bf16 log-prob ' .. i)
    moved = math.max(moved, math.abs(lp16[i] - lp32[i]))
  end
  t.truthy(moved > 0, 'bf16 computes in bf16')
  -- a write through params() is seen by the next forward (params() marks the weights changed)
  local p, n = m:params()
  for i = 0, n - 1 do p[i] = p[i] * 1.5 end
  local lp_new = m:forward(b)
  local fresh = moonrl.model.new(cfg, { seed = 3 })
  local q = fresh:params()
  for i = 0, n - 1 do q[i] = q[i] * 1.5 end
  fresh:set_dtype('bf16')
  local lp_fresh = fresh:forward(b)
  for i = 0, b.n_tokens - 1 do t.eq(lp_new[i], lp_fresh[i], 'after the write, log-prob ' .. i) end
  t.eq(m:set_dtype('fp32'), 'fp32')
  t.eq(moonrl.model.resolve_dtype('auto'), moonrl.model.bf16_products() and 'bf16' or 'fp32')
  -- auto keeps narrow models in fp32 (bf16 products do not pay below BF16_MIN_HIDDEN)
  t.eq(m:set_dtype('auto'), 'fp32', 'a narrow model stays fp32 under auto')
  t.eq(moonrl.model.resolve_dtype('auto', { hidden_size = 512 }), moonrl.model.bf16_products() and 'bf16' or 'fp32')
  t.eq(moonrl.model.resolve_dtype('auto', { hidden_size = 256 }), 'fp32')
  t.eq(moonrl.model.resolve_dtype('fp16'), nil)
  t.raises(function() m:set_dtype('fp16') end, "model dtype must be one of fp32, bf16, auto (got 'fp16')")
end)

t.test('forward_top: the k most likely tokens of every position, against each token\'s log-prob', function()
  local m = moonrl.model.new({ model_type = 'llama', vocab_size = 40, hidden_size = 32, intermediate_size = 64,
    num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 64,
    initializer_range = 0.5 }, { seed = 9 })
  local seq = { 3, 17, 5, 22, 9, 1, 30 }
  for _, temp in ipairs({ 1.0, 0.7 }) do
    local k = 5
    local lp, ids, lps, ranks = m:forward_top(moonrl.model.batch({ seq }), k, temp)
    -- every token's log-prob at every position: the vocabulary as targets, one forward each
    local all = {}
    for v = 0, 39 do
      local targets = {}
      for p = 1, #seq do targets[p] = v end
      all[v] = m:forward(moonrl.model.batch({ seq }, { targets = { targets } }), { temperature = temp })
    end
    local plain = m:forward(moonrl.model.batch({ seq }), { temperature = temp })
    for p = 0, #seq - 2 do
      t.near(lp[p], plain[p], 1e-6, 'the targets\' log-probs as forward gives them')
      local order = {}
      for v = 0, 39 do order[#order + 1] = { v, all[v][p] } end
      table.sort(order, function(a, b) return a[2] > b[2] or (a[2] == b[2] and a[1] < b[1]) end)
      for r, o in ipairs(order) do
        if o[1] == seq[p + 2] then t.eq(ranks[p], r, 'the target\'s rank at position ' .. p) end
      end
      for j = 1, k do
        t.eq(ids[p * k + j - 1], order[j][1], string.format('position %d, rank %d: the token', p, j))
        t.near(lps[p * k + j - 1], order[j][2], 1e-5, string.format('position %d, rank %d: its log-prob', p, j))
      end
    end
  end
  t.raises(function() m:forward_top(moonrl.model.batch({ seq }), 21) end, 'k must be in 1..20')
  local _, _, _, r = m:forward_top(moonrl.model.batch({ seq }), 1)
  t.eq(r[#seq - 1], 0, 'no target at the last position: rank 0')
end)

t.done()
