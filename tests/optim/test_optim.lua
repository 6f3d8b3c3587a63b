-- The Lua optimizer API: adamw object, schedules, bad options.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local ffi = require('ffi')
local optim = moonrl.optim

t.test('adamw step, clip, state and resume', function()
  local n = 1000
  local p, g = ffi.new('float[?]', n), ffi.new('float[?]', n)
  for i = 0, n - 1 do p[i] = math.sin(i); g[i] = math.cos(i) end
  local opt = optim.adamw{ params = p, grads = g, n = n, lr = 0.01, weight_decay = 0.1, no_decay = { { 0, 10 } } }
  local norm = opt:clip_grad_norm(1.0)
  t.near(norm, math.sqrt(500.5), 1e-2, 'pre-clip norm')
  t.near(opt:grad_norm(), 1.0, 1e-5, 'post-clip norm')
  opt:step()
  opt:step(0.001)
  t.eq(opt:steps(), 2)
  local st = opt:state()
  t.eq(st.n, n); t.eq(st.step, 2); t.eq(st.bytes, 8 * n)
  local q = ffi.new('float[?]', n); ffi.copy(q, p, 4 * n)
  local opt2 = optim.adamw{ params = q, grads = g, n = n, lr = 0.01, weight_decay = 0.1, no_decay = { { 0, 10 } } }
  opt2:load_state(st)
  opt:step(); opt2:step()
  for i = 0, n - 1 do if p[i] ~= q[i] then error('resumed run differs at ' .. i) end end
  opt:zero_grad()
  t.eq(g[5], 0)
  t.raises(function() opt:set_no_decay({ { 990, 20 } }) end, 'outside')
  t.raises(function() optim.adamw{ params = p, grads = g, n = n, betas = { 1.5, 0.9 } } end, 'beta1')
end)

t.test('adamw defer: no state until the first use; a shard of a deferred one has only its own', function()
  local C, stats = moonrl.C, ffi.new('mrl_mem_stats')
  local function optim_bytes() C.mrl_mem_get_stats(stats); return tonumber(stats.current[C.MRL_MEM_OPTIM]) end
  local n = 1000
  local p, g = ffi.new('float[?]', n), ffi.new('float[?]', n)
  for i = 0, n - 1 do p[i] = math.sin(i); g[i] = math.cos(i) end
  local q = ffi.new('float[?]', n); ffi.copy(q, p, 4 * n)
  collectgarbage() -- (the optimizers of the test before)
  local before = optim_bytes()
  local opt = optim.adamw{ params = p, grads = g, n = n, lr = 0.01, weight_decay = 0.1, no_decay = { { 0, 10 } },
    defer = true }
  t.eq(optim_bytes(), before, 'deferred: no state')
  t.eq(opt:steps(), 0)
  local shard = opt:shard(600, 400, {})
  t.eq(optim_bytes(), before + 8 * 400, "a shard: its own state alone, the deferred one's still none")
  opt:step() -- the first use creates it, with the no-decay ranges given before
  t.eq(optim_bytes(), before + 8 * 400 + 8 * n, 'the whole state once used')
  t.eq(shard:steps(), 0, 'the shard is an optimizer of its own')
  local eager = optim.adamw{ params = q, grads = g, n = n, lr = 0.01, weight_decay = 0.1, no_decay = { { 0, 10 } } }
  eager:step()
  for i = 0, n - 1 do if p[i] ~= q[i] then error('deferred differs from eager at ' .. i) end end
  t.eq(opt:steps(), 1)
end)

t.test('schedules', function()
  local c = optim.schedule{ kind = 'cosine', warmup = 10, total = 110, lr = 2.0 }
  t.eq(c(0), 0); t.near(c(5), 1.0, 1e-15); t.near(c(10), 2.0, 1e-15); t.near(c(60), 1.0, 1e-12); t.near(c(110), 0, 1e-12)
  local l = optim.schedule{ kind = 'linear', warmup = 0, total = 4, lr = 1.0 }
  t.eq(l(1), 0.75); t.eq(l(9), 0)
  local k = optim.schedule{ kind = 'constant', warmup = 4, lr = 3.0 }
  t.eq(k(2), 1.5); t.eq(k(100), 3.0)
  local m = optim.schedule{ kind = 'cosine', warmup = 0, total = 10, lr = 1.0, min_lr_ratio = 0.1 }
  t.near(m(10), 0.1, 1e-12)
  t.raises(function() optim.schedule{ kind = 'step', lr = 1 } end, "kind must be")
  t.raises(function() optim.schedule{ kind = 'cosine', lr = 1 } end, "total")
end)

t.done()
