-- moonrl.engine from Lua: generate's results, agreement with the trainer's
-- forward through moonrl.engine.mismatch, zero copy across an AdamW step,
-- stop ids / EOS / max tokens, stop strings with a tokenizer, errors;
-- swap_params in flight (from on_text), run_async / wait / running; a followed weight store's
-- versions recorded per token; top_logprobs against the trainer's log-probs.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local ffi = require('ffi')
local tiny = dofile('tests/lib/models.lua')

local fixture = 'tests/tok/fixtures/qwen2_split' -- tests run from the source root
local tok = moonrl.tokenizer.load(fixture)

local function new_model(seed)
  return moonrl.model.new({ model_type = 'qwen2', vocab_size = tok.vocab_size, hidden_size = 64,
    intermediate_size = 96, num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2,
    max_position_embeddings = 256, initializer_range = 0.1 }, { seed = seed or 1 })
end

local model = new_model()
local engine = moonrl.engine.new(model, { kv_cache_bytes = 2 ^ 21, block_size = 16, max_batch_tokens = 64,
  max_seqs = 16, seed = 7 })

local prompts = { { 5, 9, 14, 200, 31 }, { 7 }, { 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112,
  113, 114, 115, 116, 117, 118, 119 } }

-- the trainer's log-probs of each sample's tokens after its prompt
local function trainer_logprobs(results, temperature)
  local seqs, spans = {}, {}
  for i, list in ipairs(results) do
    for _, s in ipairs(list) do
      local seq = {}
      for _, x in ipairs(prompts[i]) do seq[#seq + 1] = x end
      for _, x in ipairs(s.ids) do seq[#seq + 1] = x end
      seqs[#seqs + 1] = seq
      spans[#spans + 1] = { #prompts[i], #s.ids }
    end
  end
  local b = moonrl.model.batch(seqs)
  local lp = model:forward(b, { temperature = temperature })
  local out = {}
  for k, sp in ipairs(spans) do
    local first = b:range(k)
    for j = 1, sp[2] do out[#out + 1] = lp[first + sp[1] - 1 + j - 1] end
  end
  return out
end

local function flat_logprobs(results)
  local out = {}
  for _, list in ipairs(results) do
    for _, s in ipairs(list) do for _, x in ipairs(s.logprobs) do out[#out + 1] = x end end
  end
  return out
end

local function requests(n)
  local r = {}
  for i, p in ipairs(prompts) do r[i] = { prompt_ids = p, n = n } end
  return r
end

t.test('results and agreement with the trainer (sampled, temperature 0.8; greedy)', function()
  for _, temp in ipairs({ 0.8, 0 }) do
    local res = engine:generate(requests(3), { temperature = temp, top_k = 50, max_tokens = 12, eos_ids = {} })
    t.eq(#res, 3)
    for _, list in ipairs(res) do
      t.eq(#list, 3)
      for _, s in ipairs(list) do
        t.eq(#s.ids, 12)
        t.eq(#s.logprobs, 12)
        t.eq(s.finish_reason, 'length')
        t.eq(s.text, nil, 'no text without a tokenizer')
      end
    end
    local m = moonrl.engine.mismatch(flat_logprobs(res), trainer_logprobs(res, temp > 0 and temp or 1))
    t.truthy(m.max_abs < 1e-5, 'max |engine - trainer| = ' .. m.max_abs)
    t.truthy(m.token_mult_prob_error >= 1 and m.token_mult_prob_error < 1 + 1e-5)
    t.eq(m.n, 3 * 3 * 12)
  end
end)

t.test('top_logprobs: the k most likely tokens, best first, as the trainer\'s log-probs of each', function()
  local m = tiny.model('llama', { vocab_size = 19, num_hidden_layers = 1, initializer_range = 0.4 }, { seed = 5 })
  local e = moonrl.engine.new(m, { kv_cache_bytes = 2 ^ 20, block_size = 4, max_batch_tokens = 32, seed = 3 })
  for _, temp in ipairs({ 0.7, 0 }) do
    local res = e:generate({ { prompt_ids = { 1, 5, 6 }, n = 2 }, { prompt_ids = { 9 } } },
      { temperature = temp, max_tokens = 5, top_logprobs = 19, eos_ids = {} })
    for _, list in ipairs(res) do
      for _, s in ipairs(list) do
        t.eq(#s.top_logprobs, #s.ids)
        for k, row in ipairs(s.top_logprobs) do
          t.eq(#row, 19, 'the whole vocabulary asked for')
          local mass, seen = 0, false
          for i, a in ipairs(row) do
            mass = mass + math.exp(a[2])
            if i > 1 then t.truthy(a[2] <= row[i - 1][2], 'best first') end
            if a[1] == s.ids[k] then
              seen = true
              t.near(a[2], s.logprobs[k], 1e-5, 'the sampled token\'s entry is its logprob')
            end
          end
          t.truthy(seen, 'the sampled token is among them')
          t.near(mass, 1, 1e-4, 'the whole vocabulary: probabilities sum to 1')
          if temp == 0 then t.eq(row[1][1], s.ids[k], 'greedy: the first is the chosen token') end
        end
      end
    end
    -- the trainer: the log-prob of each of the first 3 alternatives at every position
    local s = res[1][2]
    local seqs, targets = {}, {}
    for k = 1, #s.ids do
      for i = 1, 3 do
        local q, tg = { 1, 5, 6 }, {}
        for j = 1, k - 1 do q[#q + 1] = s.ids[j] end
        for j = 1, #q do tg[j] = -1 end
        tg[#q] = s.top_logprobs[k][i][1]
        seqs[#seqs + 1], targets[#targets + 1] = q, tg
      end
    end
    local b = moonrl.model.batch(seqs, { targets = targets })
    local lp = m:forward(b, { temperature = temp > 0 and temp or 1 })
    for n = 1, #seqs do
      local _, last = b:range(n)
      local k, i = math.floor((n - 1) / 3) + 1, (n - 1) % 3 + 1
      t.near(lp[last - 1], s.top_logprobs[k][i][2], 1e-5, string.format('position %d, alternative %d', k, i))
    end
  end
  t.raises(function() e:generate({ { prompt_ids = { 1 } } }, { top_logprobs = 21 }) end, 'top_logprobs = 21')
  local few = e:generate({ { prompt_ids = { 1 } } }, { max_tokens = 2, top_logprobs = 2 })[1][1]
  t.eq(#few.top_logprobs[1], 2)
  t.eq(e:generate({ { prompt_ids = { 1 } } }, { max_tokens = 2 })[1][1].top_logprobs, nil, 'none asked: none kept')
end)

t.test('same seed and step: same samples; another step: others', function()
  local a = engine:generate(requests(2), { temperature = 1.0, max_tokens = 8, eos_ids = {}, step = 4 })
  local b = engine:generate(requests(2), { temperature = 1.0, max_tokens = 8, eos_ids = {}, step = 4 })
  local c = engine:generate(requests(2), { temperature = 1.0, max_tokens = 8, eos_ids = {}, step = 5 })
  local same, differ = true, false
  for i = 1, 3 do
    for j = 1, 2 do
      same = same and table.concat(a[i][j].ids, ',') == table.concat(b[i][j].ids, ',')
      differ = differ or table.concat(a[i][j].ids, ',') ~= table.concat(c[i][j].ids, ',')
    end
  end
  t.truthy(same and differ)
end)

t.test('zero copy: an AdamW step changes the next generation, no reload', function()
  local m2 = new_model(3)
  local e2 = moonrl.engine.new(m2, { kv_cache_bytes = 2 ^ 21 })
  local before = e2:generate({ { prompt_ids = prompts[1] } }, { temperature = 0, max_tokens = 10, eos_ids = {} })
  local p, n = m2:params()
  local g = m2:grads()
  for i = 0, n - 1 do g[i] = math.sin(i) end
  local opt = moonrl.optim.adamw({ params = p, grads = g, n = n, lr = 0.05 })
  opt:step()
  local after = e2:generate({ { prompt_ids = prompts[1] } }, { temperature = 0, max_tokens = 10, eos_ids = {} })
  t.truthy(math.abs(before[1][1].logprobs[1] - after[1][1].logprobs[1]) > 1e-4, 'the weights changed')
  local b = moonrl.model.batch({ (function()
    local s = {}
    for _, x in ipairs(prompts[1]) do s[#s + 1] = x end
    for _, x in ipairs(after[1][1].ids) do s[#s + 1] = x end
    return s
  end)() })
  local lp = m2:forward(b)
  local tr = {}
  for j = 1, 10 do tr[j] = lp[#prompts[1] - 1 + j - 1] end
  t.truthy(moonrl.engine.mismatch(after[1][1].logprobs, tr).max_abs < 1e-5, 'the new weights, as the trainer sees them')
end)

t.test('weight panels (the default) give what reading the weights in place gives', function()
  local m3 = new_model(4)
  local packed = moonrl.engine.new(m3, { kv_cache_bytes = 2 ^ 21, max_batch_tokens = 64, max_seqs = 16, seed = 3 })
  local inplace = moonrl.engine.new(m3, { kv_cache_bytes = 2 ^ 21, max_batch_tokens = 64, max_seqs = 16, seed = 3,
    pack_weights = false })
  for round = 1, 2 do
    for _, temp in ipairs({ 0, 0.9 }) do
      local a = packed:generate(requests(3), { temperature = temp, max_tokens = 12, eos_ids = {}, step = round })
      local b = inplace:generate(requests(3), { temperature = temp, max_tokens = 12, eos_ids = {}, step = round })
      local same, worst = true, 0
      for i, list in ipairs(a) do
        for j, s in ipairs(list) do
          for k, id in ipairs(s.ids) do
            if b[i][j].ids[k] ~= id then same = false end
            worst = math.max(worst, math.abs(s.logprobs[k] - b[i][j].logprobs[k]))
          end
        end
      end
      t.truthy(same, 'the same tokens (round ' .. round .. ', temperature ' .. temp .. ')')
      t.truthy(worst < 1e-5, 'log-probs agree: max |diff| ' .. worst)
    end
    -- between rounds the weights move: the next round's panels are packed from the new ones
    local p, n = m3:params()
    for i = 0, n - 1, 7 do p[i] = p[i] * 1.05 end
  end
  t.raises(function() moonrl.engine.new(m3, { pack_weights = 'yes' }) end, 'pack_weights must be true or false')
end)

t.test('stop ids, EOS, max tokens', function()
  local full = engine:generate({ { prompt_ids = prompts[1] } }, { temperature = 0.7, max_tokens = 16, eos_ids = {} })[1][1]
  local stop = full.ids[5]
  local first = 1
  while full.ids[first] ~= stop do first = first + 1 end
  local s = engine:generate({ { prompt_ids = prompts[1] } }, { temperature = 0.7, max_tokens = 16, eos_ids = { stop } })[1][1]
  t.eq(#s.ids, first)
  t.eq(s.finish_reason, 'stop')
  s = engine:generate({ { prompt_ids = prompts[1] } }, { temperature = 0.7, max_tokens = 16, eos_ids = {}, stop_ids = { stop } })[1][1]
  t.eq(#s.ids, first)
  t.eq(s.ids[first], stop, 'the stop token is kept')
  s = engine:generate({ { prompt_ids = prompts[1] } }, { temperature = 0.7, max_tokens = 3, eos_ids = {} })[1][1]
  t.eq(#s.ids, 3)
  t.eq(s.finish_reason, 'length')
end)

t.test('text prompts, text and stop strings through the streaming decoder', function()
  local opts = { temperature = 0, max_tokens = 24, eos_ids = {}, tokenizer = tok }
  local full = engine:generate({ { prompt = 'Hello world' } }, opts)[1][1]
  t.eq(full.text, tok:decode(full.ids, { skip_special = true }))
  t.truthy(#full.text >= 6, 'some text: ' .. full.text)
  local stop = full.text:sub(4, 5)
  local pieces = {}
  opts.stop = { stop }
  opts.on_text = function(i, j, piece) pieces[#pieces + 1] = piece end
  local s = engine:generate({ { prompt = 'Hello world' } }, opts)[1][1]
  local cut = full.text:find(stop, 1, true)
  t.eq(s.text, full.text:sub(1, cut - 1), 'cut before the stop string')
  t.eq(table.concat(pieces), s.text, 'the streamed pieces make the text')
  t.eq(s.finish_reason, 'stop')
  t.truthy(#s.ids < #full.ids, 'the sample stopped early')
  for k = 1, #s.ids do t.eq(s.ids[k], full.ids[k]) end
end)

t.test('stats and errors', function()
  local st = engine:stats()
  t.truthy(st.steps > 0 and st.generated_tokens > 0 and st.decode_tokens > 0 and st.prefill_tokens > 0)
  t.truthy(st.forks > 0, 'groups were forked')
  t.eq(st.kv_blocks_used, 0)
  t.truthy(st.kv_blocks_total > 0 and st.kv_block_size == 16)
  t.raises(function() engine:generate({ { prompt_ids = { 1, tok.vocab_size } } }) end, 'vocabulary')
  t.raises(function() engine:generate({ { prompt_ids = { 1 } } }, { top_p = 0 }) end, 'top_p')
  t.raises(function() engine:generate({ { prompt = 'x' } }) end, 'tokenizer')
  t.raises(function() engine:generate({ { prompt_ids = { 1 } } }, { stop = { 'x' } }) end, 'tokenizer')
  t.raises(function() moonrl.engine.new(model, { block_size = 0 }) end, 'block_size')
  -- the engine still works after the errors
  local r = engine:generate({ { prompt_ids = { 3, 4 } } }, { max_tokens = 2, eos_ids = {} })
  t.eq(#r[1][1].ids, 2)
end)

t.test('swap_params in flight: a copy, the old buffer then poisoned, gives the same samples', function()
  local m4 = new_model(5)
  local e4 = moonrl.engine.new(m4, { kv_cache_bytes = 2 ^ 21, max_batch_tokens = 64, max_seqs = 16, seed = 2 })
  local p, n = m4:params()
  local copy = ffi.new('float[?]', n)
  ffi.copy(copy, p, n * 4)
  local opts = { temperature = 0.9, max_tokens = 12, eos_ids = {}, tokenizer = tok, on_text = function() end }
  local ref = e4:generate(requests(2), opts)
  local swapped = false
  opts.on_text = function() -- between steps, samples unfinished
    if swapped then return end
    swapped = true
    e4:swap_params(copy, n)
    for i = 0, n - 1 do p[i] = 0 / 0 end
  end
  local got = e4:generate(requests(2), opts)
  t.truthy(swapped, 'swapped mid-generation')
  for i, list in ipairs(ref) do
    for j, s in ipairs(list) do
      t.eq(table.concat(got[i][j].ids, ','), table.concat(s.ids, ','))
      for k, lp in ipairs(s.logprobs) do t.eq(got[i][j].logprobs[k], lp) end
    end
  end
  t.raises(function() e4:swap_params(copy, n - 1) end, 'swap_params: buffer of')
  ffi.copy(p, copy, n * 4)
  e4:swap_params(nil)
  local back = e4:generate(requests(2), { temperature = 0.9, max_tokens = 12, eos_ids = {} })
  t.eq(table.concat(back[1][1].ids, ','), table.concat(ref[1][1].ids, ','))
  -- run_async / wait / running (nothing queued: the run ends at once)
  e4:run_async(1)
  t.truthy(e4:running())
  t.raises(function() e4:generate(requests(1)) end, 'engine busy')
  e4:wait()
  t.truthy(not e4:running())
  t.raises(function() e4:wait() end, 'no background run')
  t.raises(function() e4:run_async(0) end, 'threads must be an integer >= 1')
end)

t.test('following a weight store: each token records its version, a version published between steps is taken', function()
  local m5 = new_model(6)
  local e5 = moonrl.engine.new(m5, { kv_cache_bytes = 2 ^ 21, max_batch_tokens = 64, max_seqs = 16, seed = 3 })
  local p, n = m5:params()
  local h = ffi.new('mrl_weight_store *[1]')
  moonrl.check(moonrl.C.mrl_weight_store_create(nil, n, 1, h))
  local store = ffi.gc(h[0], moonrl.C.mrl_weight_store_free)
  local opts = { temperature = 0.9, max_tokens = 12, eos_ids = {}, tokenizer = tok, on_text = function() end }
  local ref = e5:generate(requests(2), opts)
  t.eq(ref[1][1].version, nil, 'no versions without a store')
  moonrl.check(moonrl.C.mrl_weight_store_publish(store, p, 10, 0))
  e5:use_weights({ store = store, reader = 0, min_version = 10, follow = true })
  local calls, counts = 0, nil
  opts.on_text = function() -- between steps: after the third, version 11 (the same weights)
    calls = calls + 1
    if calls == 3 and not counts then
      counts = {}
      for i, list in ipairs(ref) do
        counts[i] = {}
        for j in ipairs(list) do
          local toks = ffi.new('const int32_t *[1]')
          local nt = ffi.new('int[1]')
          moonrl.check(moonrl.C.mrl_engine_get_output(e5.handle, i - 1, j - 1, toks, nil, nt, nil))
          counts[i][j] = nt[0]
        end
      end
      moonrl.check(moonrl.C.mrl_weight_store_publish(store, p, 11, 0))
    end
  end
  local got = e5:generate(requests(2), opts)
  t.truthy(counts, 'published mid-generation')
  local switched = 0
  for i, list in ipairs(ref) do
    for j, s in ipairs(list) do
      local g = got[i][j]
      t.eq(table.concat(g.ids, ','), table.concat(s.ids, ','), 'the same weights: the same samples')
      for k, lp in ipairs(s.logprobs) do t.eq(g.logprobs[k], lp) end
      t.eq(g.version, counts[i][j] > 0 and 10 or 11, 'the first token\'s version')
      if counts[i][j] > 0 and counts[i][j] < #g.ids then
        switched = switched + 1
        t.eq(#g.version_switches, 1, 'one switch')
        t.eq(g.version_switches[1][1], counts[i][j] + 1, 'from the first token sampled after the publish')
        t.eq(g.version_switches[1][2], 11)
      else
        t.eq(g.version_switches, nil, 'no switch')
      end
    end
  end
  t.truthy(switched > 0, 'some samples switched')
  t.eq(tonumber(moonrl.C.mrl_engine_version(e5.handle)), 11)
  -- finish mode: a store read, not followed; the model's own buffer again after use_weights(nil)
  moonrl.check(moonrl.C.mrl_weight_store_publish(store, p, 12, 0))
  e5:use_weights({ store = store, reader = 0, min_version = 12 })
  local fixed = e5:generate(requests(1), { temperature = 0.9, max_tokens = 6, eos_ids = {} })
  t.eq(fixed[1][1].version, 12)
  e5:use_weights(nil)
  t.eq(e5:generate(requests(1), { temperature = 0.9, max_tokens = 6, eos_ids = {} })[1][1].version, nil)
  local h2 = ffi.new('mrl_weight_store *[1]')
  moonrl.check(moonrl.C.mrl_weight_store_create(nil, n - 1, 1, h2))
  local small = ffi.gc(h2[0], moonrl.C.mrl_weight_store_free)
  t.raises(function() e5:use_weights({ store = small, reader = 0, follow = true }) end, 'a store of')
  t.raises(function() e5:use_weights({ store = store, reader = 1, follow = true }) end, 'reader 1 of a store')
  e5:use_weights(nil)
end)

t.test('a stream: coroutines\' requests share one engine, each resumed when its own are done', function()
  local opts = { temperature = 0, max_tokens = 12, step = 4 }
  local reqs = { { prompt_ids = prompts[1], n = 2 }, { prompt_ids = prompts[2] }, { prompt_ids = prompts[3] } }
  local want = engine:generate(reqs, opts)
  local st = engine:stream(1)
  local co1 = coroutine.create(function() return engine:generate({ reqs[1], reqs[2] }, opts) end)
  local co2 = coroutine.create(function()
    return engine:generate({ { prompt_ids = prompts[3], prompt_index = 2 } }, opts)
  end)
  local _, job1 = coroutine.resume(co1)
  local _, job2 = coroutine.resume(co2) -- queued beside co1's, no reset
  t.truthy(type(job1) == 'table' and type(job2) == 'table', 'each yields its job')
  local got, steps = {}, 0
  while coroutine.status(co1) ~= 'dead' or coroutine.status(co2) ~= 'dead' do
    for k, co in ipairs({ co1, co2 }) do
      local job = k == 1 and job1 or job2
      if coroutine.status(co) ~= 'dead' and st:done(job) then
        local ok, res = coroutine.resume(co)
        t.truthy(ok, tostring(res))
        got[k] = res
        st:background() -- the other's requests go on on the engine's thread meanwhile
      end
    end
    st:step()
    steps = steps + 1
    t.truthy(steps < 500, 'the stream finishes')
  end
  st:close()
  t.eq(engine.streaming, nil, 'closed: generate is a plain call again')
  for j = 1, 2 do t.eq(table.concat(got[1][1][j].ids, ','), table.concat(want[1][j].ids, ','), 'request 1 sample ' .. j) end
  t.eq(table.concat(got[1][2][1].ids, ','), table.concat(want[2][1].ids, ','), 'request 2')
  t.eq(table.concat(got[2][1][1].ids, ','), table.concat(want[3][1].ids, ','), 'the other coroutine\'s request')
  local ok, err = pcall(function()
    engine:stream(1)
    local co = coroutine.create(function() return engine:generate({ reqs[2] }, { stop = { 'x' }, tokenizer = tok }) end)
    local okc, e = coroutine.resume(co)
    engine.streaming:close()
    error(okc and 'no error' or e, 0)
  end)
  t.truthy(not ok and tostring(err):find('not available in a stream', 1, true), 'stop strings: a clear error: ' .. tostring(err))
end)

t.done()
