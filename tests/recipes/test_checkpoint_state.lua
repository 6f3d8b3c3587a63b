-- A checkpoint edited after it was written (its manifest's checksums made to match) is refused when
-- a run resumes from it, naming the field: state.json and run.json are checked against what moonrl
-- writes (types, ranges) and against the run (the dataset's size, metrics.jsonl), and a manifest's
-- file list may not reach outside its checkpoint. Each of these was once accepted, or ended in an
-- internal Lua error: a step of -5, a data index of 1e9, a metrics length of 0 (the metrics of every
-- step cut away), ../../etc/hostname read as a checkpoint file.
local t = require('moonrl.testing')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')
local proc = require('moonrl.io.proc')
local U = dofile('tests/recipes/util.lua')

local exe = assert(rawget(_G, 'MOONRL_EXE'), 'needs the moonrl executable')
local dir = U.tmpdir('checkpoint_state')
local words = U.grpo_setup(dir, 12)
local CKPT = '/checkpoints/step-000003'

local function grpo(run_dir, extra)
  local argv = { exe, 'run', 'recipes/grpo.lua' }
  for _, w in ipairs(U.words(words, run_dir, extra)) do argv[#argv + 1] = w end
  return argv
end

-- the run every case starts from: 3 steps, a checkpoint at each
local base = dir .. '/base'
local r = proc.run(grpo(base, { 'grpo.steps=3', 'run.checkpoint_every=1', 'run.keep_checkpoints=0' }), { timeout = 120 })
assert(r.ok, r.stderr)

-- A copy of the base run with edit(state, run) applied to its last checkpoint's state.json and
-- run.json (text: the new state.json as it is), and the manifest's sizes and checksums made to match.
local n = 0
local function tampered(edit, text)
  n = n + 1
  local d = dir .. '/case' .. n
  assert(proc.run({ 'cp', '-a', base, d }).ok)
  local c = d .. CKPT
  local state, run = json.read_file(c .. '/state.json'), json.read_file(c .. '/run.json')
  if edit then edit(state, run) end
  fs.write(c .. '/state.json', text or json.encode(state))
  fs.write(c .. '/run.json', json.encode(run))
  local m = json.read_file(c .. '/manifest.json')
  for _, f in ipairs({ 'state.json', 'run.json' }) do
    local crc, size = fs.crc32c_file(c .. '/' .. f)
    m.files[f] = json.object({ 'bytes', size, 'crc32c', string.format('%08x', crc) })
  end
  fs.write(c .. '/manifest.json', json.encode(m))
  return d
end

local function refused(d, want, extra)
  local argv = grpo(d, { 'grpo.steps=4' })
  for _, w in ipairs(extra or {}) do argv[#argv + 1] = w end
  local res = proc.run(argv, { timeout = 120 })
  t.eq(res.exit_status, 2, want .. ': ' .. res.stderr)
  t.truthy(res.stderr:find(want, 1, true), want .. ': ' .. res.stderr)
  t.eq(select(2, res.stderr:gsub('\n', '')), 1, 'one line: ' .. res.stderr)
  t.truthy(not fs.exists(d .. '/checkpoints/step-000004'), 'no step run')
  return res
end

t.test('an untouched checkpoint resumes (the checks refuse nothing moonrl wrote)', function()
  local res = proc.run(grpo(tampered(), { 'grpo.steps=4' }), { timeout = 120 })
  t.truthy(res.ok, res.stderr)
  t.truthy(res.stdout:find('resuming from .-step%-000003 %(step 3%)'), res.stdout)
  local m = U.records(dir .. '/case1')
  t.eq(#m, 4, 'the metrics of steps 1-3 kept, step 4 added')
end)

t.test('state.json: a field of the wrong type or out of range is refused, naming it', function()
  local cases = {
    { function(s) s.step = -5 end, 'state.json: step must be an integer >= 0, got -5' },
    { function(s) s.step = '3' end, 'state.json: step must be an integer >= 0, got "3"' },
    { function(s) s.step = 1.5 end, 'state.json: step must be an integer >= 0, got 1.5' },
    { function(s) s.phase_step = 7 end, 'state.json: phase_step 7 is past step 3' },
    { function(s) s.data = 3 end, 'state.json: data must be an object, got 3' },
    { function(s) s.data.train.index = 'x' end, 'state.json: data.train.index must be an integer >= 0, got "x"' },
    { function(s) s.lr_scale = -1 end, 'state.json: lr_scale must be a number > 0, got -1' },
    { function(s) s.guard = json.object({ 'loss', 'high' }) end, 'state.json: guard.loss must be a list of finite numbers' },
    { function(s) s.phases_done = json.array({ 1 }) end, 'state.json: phases_done must be a list of strings' },
    { function(s) s.memo = json.object({ 'threads', json.object({ 'chosen', 1e9 }) }) end,
      'state.json: memo.threads.chosen must be a thread count, got 1000000000' },
    { function(_, run) run.config = 'x' end, 'run.json: config must be an object, got "x"' },
    { function(_, run) run.recipe = 5 end, 'run.json: recipe must be a string, got 5' },
  }
  for _, c in ipairs(cases) do refused(tampered(c[1]), c[2]) end
  refused(tampered(nil, '[1, 2'), CKPT .. '/state.json')
  refused(tampered(nil, '"a string"'), 'state.json: not a JSON object')
end)

t.test('state.json against the run: a data index past the dataset, a metrics length that cuts the log', function()
  refused(tampered(function(s) s.data.train.index = 1e9 end),
    'state.json: data.train.index 1000000000 is past the end of the dataset (12 records)')
  refused(tampered(function(s) s.data.train.n = 99 end), 'state.json: data.train.n is 99, the dataset has 12 records')
  local d = tampered(function(s) s.metrics_bytes = 0 end)
  local before = fs.read(d .. '/metrics.jsonl')
  refused(d, 'state.json: metrics_bytes 0 keeps 0 lines of ' .. d .. '/metrics.jsonl, the checkpoint was written after 3')
  t.eq(fs.read(d .. '/metrics.jsonl'), before, 'metrics.jsonl untouched')
  refused(tampered(function(s) s.metrics_bytes = 1e9 end), 'state.json: metrics_bytes 1000000000 is past the end of')
end)

t.test('a manifest that lists a file outside its checkpoint is refused', function()
  for _, rel in ipairs({ '../../etc/hostname', '/etc/hostname', 'a/../../x', 'tb/../state.json' }) do
    local d = tampered()
    local c = d .. CKPT
    local m = json.read_file(c .. '/manifest.json')
    m.files[rel] = json.object({ 'bytes', 1, 'crc32c', '00000000' })
    fs.write(c .. '/manifest.json', json.encode(m))
    refused(d, rel, { 'run.resume=' .. c })
  end
  -- through a symbolic link to a directory outside
  local d = tampered()
  local c = d .. CKPT
  assert(proc.run({ 'ln', '-s', '/etc', c .. '/etc' }).ok)
  local m = json.read_file(c .. '/manifest.json')
  m.files['etc/hostname'] = json.object({ 'bytes', 1, 'crc32c', '00000000' })
  fs.write(c .. '/manifest.json', json.encode(m))
  refused(d, 'reaches outside the checkpoint (through ' .. c .. '/etc)', { 'run.resume=' .. c })
  -- run.resume=auto skips it (with a line naming why) and resumes from the one before
  local res = proc.run(grpo(d, { 'grpo.steps=4' }), { timeout = 120 })
  t.truthy(res.ok, res.stderr)
  t.truthy(res.stderr:find('reaches outside the checkpoint', 1, true), res.stderr)
  t.truthy(res.stdout:find('step%-000002 %(step 2%)'), res.stdout)
end)

fs.remove(dir)
t.done()
