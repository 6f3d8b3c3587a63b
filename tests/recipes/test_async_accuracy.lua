-- The default task (2-digit addition) under one_step_off and async with max_staleness=2 reaches
-- at least 90% of the sync run's held-out accuracy gain with the same number of samples (the
-- defaults: async.correction=auto, tis; async.decoupled=auto, AReaL's decoupled PPO in async
-- mode), and no sample is staler than the bound.
local t = require('moonrl.testing')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')
local proc = require('moonrl.io.proc')
local U = dofile('tests/recipes/util.lua')

local exe = assert(rawget(_G, 'MOONRL_EXE'))
local dir = U.tmpdir('async_acc')

local function run(name, ...)
  local d = dir .. '/' .. name
  local argv = { exe, 'run.dir=' .. d, 'quiet=true', ... }
  local r = proc.run(argv, { timeout = 600 })
  if not r.ok then io.stderr:write(r.stdout, r.stderr) end
  assert(r.ok, name .. ' failed')
  local acc
  for line in io.lines(d .. '/events.jsonl') do
    local e = json.decode(line)
    if e.event == 'heldout_accuracy' then acc = e end
  end
  local worst = 0
  for line in io.lines(d .. '/metrics.jsonl') do
    local m = json.decode(line)
    if m['async/max_staleness_seen'] and m['async/max_staleness_seen'] > worst then worst = m['async/max_staleness_seen'] end
  end
  print(string.format('  %-13s held-out %.1f%% -> %.1f%%, staleness at most %d', name, 100 * acc.before, 100 * acc.after, worst))
  return acc.after - acc.before, worst
end

t.test('one_step_off and async (max_staleness=2) keep 90% of the sync gain', function()
  local sync = run('sync')
  local off, off_worst = run('one_step_off', 'async.mode=one_step_off')
  local async, async_worst = run('async', 'async.mode=async', 'async.max_staleness=2')
  t.truthy(sync > 0.5, 'sync learns')
  t.truthy(off >= 0.9 * sync, string.format('one_step_off: gain %.3f >= 0.9 x %.3f', off, sync))
  t.truthy(async >= 0.9 * sync, string.format('async: gain %.3f >= 0.9 x %.3f', async, sync))
  t.eq(off_worst, 1, 'one_step_off: samples one version old')
  t.eq(async_worst, 2, 'async: at most two versions old')
end)

fs.remove(dir)
t.done()
