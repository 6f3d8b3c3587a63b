-- Memory accounting (moonrl.train.run, moonrl/mem.h): every step's metrics hold the bytes moonrl's
-- allocations keep per category (parameters, gradients, optimizer state, activations, KV cache),
-- the step's peak and the resident set's, and each phase's peaks; the step line shows the
-- resident peak. An allocation larger than the memory available is a clear error naming what
-- asked for how much, not the kernel's OOM killer, and so is one past run.memory_budget_mb.
local t = require('moonrl.testing')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')
local proc = require('moonrl.io.proc')
local U = dofile('tests/recipes/util.lua')

local exe = assert(rawget(_G, 'MOONRL_EXE'), 'needs the moonrl executable')
local dir = U.tmpdir('memory')

t.test('per step and per phase: the categories, the peaks, the step line', function()
  local d = dir .. '/default'
  local r = proc.run({ exe, 'run.dir=' .. d, 'sft.steps=20', 'grpo.steps=2', 'grpo.prompts=4', 'heldout=5' },
    { timeout = 300 })
  t.truthy(r.ok, r.stderr)
  t.truthy(r.stdout:find('| mem %d+ MB |') ~= nil, 'the step line shows the resident peak: ' .. r.stdout:sub(1, 300))
  local cfg = json.decode(fs.read(d .. '/config.json'))
  local last
  for line in io.lines(d .. '/metrics.jsonl') do last = json.decode(line) end
  local MB = 2 ^ 20
  -- the default example's model (fp32 parameters), AdamW's two moments, the engine's KV cache
  local st = fs.stat(d .. '/model/model.safetensors')
  t.truthy(last['memory/params_mb'] > 0 and last['memory/params_mb'] * MB >= 0.9 * st.size,
    'parameters: about the model file: ' .. last['memory/params_mb'])
  t.near(last['memory/optim_mb'], 2 * last['memory/params_mb'], 0.05 * last['memory/optim_mb'] + 0.01,
    'AdamW holds two moments per parameter')
  t.near(last['memory/kv_cache_mb'], 64, 1, "the engine's 64 MiB KV cache")
  t.truthy(last['memory/activations_mb'] >= 0 and last['memory/grads_mb'] > 0, 'activations and gradients')
  local held = 0
  for _, c in ipairs({ 'params', 'grads', 'optim', 'activations', 'kv_cache', 'other' }) do
    held = held + last['memory/' .. c .. '_mb']
  end
  t.truthy(last['memory/peak_mb'] >= held - 1e-6, 'the step peak is at least what is held at its end')
  t.truthy(last['memory/rss_peak_mb'] >= last['memory/peak_mb'], 'the resident peak covers the accounted one')
  for _, ph in ipairs({ 'generate', 'train' }) do
    t.truthy(last['memory/phase/' .. ph .. '/peak_mb'] and last['memory/phase/' .. ph .. '/rss_peak_mb'],
      'phase ' .. ph .. ': its peaks')
  end
  t.truthy(cfg ~= nil, 'a run directory')
end)

t.test('an allocation larger than the memory available: a clear error, exit 2, no traceback', function()
  local base = U.grpo_setup(dir, 4)
  -- a KV cache under the machine's physical memory (the engine's own check) but over what is
  -- available now (the page cache and other processes hold the rest)
  local info = fs.read('/proc/meminfo')
  local total = tonumber(info:match('MemTotal:%s*(%d+)')) / 1024
  local avail = tonumber(info:match('MemAvailable:%s*(%d+)')) / 1024
  if total - avail < 1024 then
    io.stdout:write('(skipped: less than 1 GiB of this machine is in use, nothing fits between)\n')
    return
  end
  local mb = math.floor((total + avail) / 2)
  local argv = { exe, 'run', 'recipes/grpo.lua', 'grpo.steps=1', 'engine.kv_cache_mb=' .. mb }
  for _, w in ipairs(U.words(base, dir .. '/huge')) do argv[#argv + 1] = w end
  local r = proc.run(argv, { timeout = 120 })
  t.eq(r.exit_status, 2, 'a usage error (of engine.kv_cache_mb)')
  t.truthy(r.stderr:find('kv_cache asks for', 1, true) and r.stderr:find('GiB of memory available', 1, true),
    'names what asked for how much: ' .. r.stderr)
  t.truthy(not r.stderr:find('traceback', 1, true), 'no traceback: ' .. r.stderr)
end)

t.test('run.memory_budget_mb: too small, one line naming it; enough, the run ends well', function()
  -- 1,971,200 parameters: 7.5 MiB of weights, as much for the gradients, twice for AdamW
  local words = U.sft_setup(dir .. '/budget', 30, { layers = 2, hidden_size = 256, intermediate_size = 1024 })
  local function argv(run_dir, mb)
    return U.with({ exe, 'run', 'recipes/sft.lua', 'run.dir=' .. run_dir, 'train.steps=2', 'train.batch=4',
      'run.memory_budget_mb=' .. mb }, words)
  end
  -- enough: the run ends well, and what it held stayed under the budget
  local ok = dir .. '/budget_ok'
  local r = proc.run(argv(ok, 64), { timeout = 120 })
  t.truthy(r.ok, r.stdout .. r.stderr)
  local last
  for line in io.lines(ok .. '/metrics.jsonl') do last = json.decode(line) end
  t.near(last['memory/params_mb'], 7.52, 0.01, 'the weights')
  t.truthy(last['memory/peak_mb'] > 30 and last['memory/peak_mb'] <= 64, 'held under the budget: ' .. last['memory/peak_mb'])
  -- too small for the weights: refused as the model loads, before the run directory exists
  local small = U.expect_usage(t, argv(dir .. '/budget_small', 4), 'past run.memory_budget_mb (4.0 MiB)',
    dir .. '/budget_small')
  t.truthy(small.stderr:find('params asks for 7.5 MiB', 1, true), small.stderr)
  -- enough for the weights and gradients, not for AdamW's moments: refused when the recipe makes
  -- its optimizer, the same one line and exit status, no traceback
  local later = proc.run(argv(dir .. '/budget_later', 20), { timeout = 120 })
  t.eq(later.exit_status, 2, later.stderr)
  t.truthy(later.stderr:find('optim asks for 15.0 MiB', 1, true) and
    later.stderr:find('past run.memory_budget_mb (20.0 MiB)', 1, true), later.stderr)
  t.eq(select(2, later.stderr:gsub('\n', '')), 1, 'one line: ' .. later.stderr)
end)

fs.remove(dir)
t.done()
