-- The sampler from Lua through the generated FFI: one call for a batch of
-- rows, seeded streams, both log-probs, errors as Lua errors.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local ffi = require('ffi')
local C = moonrl.C

local V, R = 1000, 4

local function setup()
  local logits = ffi.new('float[?]', R * V)
  for r = 0, R - 1 do
    for i = 0, V - 1 do logits[r * V + i] = math.sin(i * 0.37 + r) * 3 end
  end
  logits[0 * V + 42] = 20 -- row 0: a clear maximum
  local params = ffi.new('mrl_sampling_params[?]', R)
  for r = 0, R - 1 do params[r].temperature = 0.8; params[r].top_p = 1 end
  params[0].temperature = 0        -- greedy
  params[1].top_k = 20
  params[2].top_p = 0.7
  params[3].min_p = 0.1
  local keys, ctr = ffi.new('uint64_t[?]', R), ffi.new('int64_t[?]', R)
  for r = 0, R - 1 do keys[r] = C.mrl_sample_stream_key(1234, 5, r, 0); ctr[r] = 0 end
  return logits, params, keys, ctr
end

local function sample(logits, params, keys, ctr)
  local tok, lp, lpp = ffi.new('int32_t[?]', R), ffi.new('float[?]', R), ffi.new('float[?]', R)
  moonrl.check(C.mrl_sample_rows(logits, R, V, params, keys, ctr, tok, lp, lpp))
  return tok, lp, lpp
end

t.test('greedy, seeded and repeatable', function()
  local logits, params, keys, ctr = setup()
  local tok, lp, lpp = sample(logits, params, keys, ctr)
  t.eq(tok[0], 42, 'greedy takes the maximum')
  t.eq(lpp[0], 0, 'greedy: processed log-prob 0')
  for r = 0, R - 1 do
    t.truthy(tok[r] >= 0 and tok[r] < V, 'token in the vocabulary')
    t.truthy(lp[r] <= 0 and lpp[r] >= lp[r] - 1e-6, 'truncation only raises the processed log-prob')
  end
  local tok2 = sample(logits, params, keys, ctr)
  for r = 0, R - 1 do t.eq(tok2[r], tok[r], 'same key and counter, same token') end
  -- the untruncated log-prob of row 1 (temperature 0.8), computed here
  local m, z = -math.huge, 0
  for i = 0, V - 1 do m = math.max(m, logits[V + i] / 0.8) end
  for i = 0, V - 1 do z = z + math.exp(logits[V + i] / 0.8 - m) end
  t.near(lp[1], logits[V + tok[1]] / 0.8 - m - math.log(z), 1e-4, 'log-prob under softmax(logits / T)')
end)

t.test('bad input is a Lua error with the C message', function()
  local logits, params, keys, ctr = setup()
  params[2].top_p = 0
  t.raises(function() sample(logits, params, keys, ctr) end, 'row 2: sampling params: top_p=0')
  params[2].top_p = 1
  logits[3 * V + 7] = 0 / 0
  t.raises(function() sample(logits, params, keys, ctr) end, 'row 3: sample: the logits row holds a NaN')
end)

t.done()
