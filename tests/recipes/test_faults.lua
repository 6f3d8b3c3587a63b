-- Runs stopped, crashed, hung and fed bad run directories, as separate processes: SIGTERM,
-- SIGINT and run.max_seconds stop at a safe point with a checkpoint and the model; an error in a
-- step saves the last complete one; a corrupt or incomplete checkpoint is skipped; a changed
-- config is refused; run directories are created exclusively and never through a shell; the
-- supervisor restarts a crashed and a hung run. Each resumed run must end with the weights of a
-- run that was never interrupted.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local proc = require('moonrl.io.proc')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')
local U = dofile('tests/recipes/util.lua')
local K = dofile('tests/recipes/killer.lua')

local dir = U.tmpdir('faults')
local WORDS, model_dir = U.grpo_setup(dir, 40, { 'grpo.kl_coef=0.01' })
local function words(run_dir, extra) return U.words(WORDS, run_dir, extra) end
local function weights(run_dir) return fs.read(run_dir .. '/model/model.safetensors') end
local function events(run_dir, kind)
  local out = {}
  for l in (fs.read(run_dir .. '/events.jsonl') or ''):gmatch('[^\n]+') do
    local e = json.decode(l)
    if e.event == kind then out[#out + 1] = e end
  end
  return out
end
local function show(r) return string.format('status %s signal %s\n%s%s', tostring(r.exit_status), tostring(r.signal), r.stdout, r.stderr) end

-- the reference: 8 steps, never interrupted
local ref = dir .. '/ref'
local r0 = K.run('recipes/grpo.lua', words(ref, { 'grpo.steps=8' }))
assert(r0.ok, show(r0))
local REF = weights(ref)
local REF_METRICS = K.metrics(ref)

t.test('SIGTERM (a pre-emption) and SIGINT: a checkpoint and the model at the next safe point, then resume', function()
  -- during the update the next safe point is the end of the step; during generation the engine
  -- stops at once and the step is given up (nothing of it touched the weights)
  for _, case in ipairs({ { 15, 143, 'SIGTERM', 'train', 3 }, { 2, 130, 'SIGINT', 'generate', 2 } }) do
    local sig, status, name, phase, saved = unpack(case)
    local d = dir .. '/sig' .. sig
    local r = K.run('recipes/grpo.lua', words(d, { 'grpo.steps=8' }),
      { fault = string.format('signal:step=3:phase=%s:sig=%d', phase, sig) })
    t.eq(r.exit_status, status, name .. ' exit status: ' .. show(r))
    t.truthy(r.stderr:find('stopped (' .. name .. ') at a safe point', 1, true), r.stderr)
    local names = require('moonrl.train.checkpoint').list(d .. '/checkpoints')
    t.eq(names[#names], string.format('step-%06d', saved), name .. ': the checkpoint of the last complete step')
    t.truthy(weights(d) ~= nil, 'the model saved')
    t.eq(#events(d, 'stop'), 1, 'a stop event')
    local r2 = K.run('recipes/grpo.lua', words(d, { 'grpo.steps=8' }))
    t.truthy(r2.ok, show(r2))
    t.truthy(r2.stdout:find('resuming from ', 1, true), 'resumed')
    t.truthy(weights(d) == REF, name .. ': final weights equal to the uninterrupted run')
    local m = K.metrics(d)
    t.eq(#m, 8)
    for i = 1, 8 do t.eq(m[i], REF_METRICS[i], 'metrics of step ' .. i) end
  end
end)

t.test('the default example: Ctrl-C in the SFT warm-up stops within a step; both phases resume bit-identically', function()
  -- one thread named: run.threads=auto measures at start-up, and two fresh runs may choose
  -- differently (a resume takes its checkpoint's choice; that is what this test is about)
  local W = { 'examples/default.lua', 'sft.steps=200', 'grpo.steps=4', 'quiet=true', 'heldout=20',
    'run.checkpoint_every=50', 'run.threads=1' }
  local function run(d, fault)
    local w = { 'run.dir=' .. d }
    for i = 2, #W do w[#w + 1] = W[i] end
    return K.run(W[1], w, { fault = fault })
  end
  local clean = dir .. '/default_ref'
  local r = run(clean)
  t.truthy(r.ok, show(r))
  -- SIGINT at step 120 of the warm-up: out within the step, with its checkpoint
  local d = dir .. '/default_sig'
  local t0 = moonrl.now()
  r = run(d, 'signal:step=120:phase=step:sig=2')
  t.eq(r.exit_status, 130, show(r))
  t.truthy(moonrl.now() - t0 < 30, 'stopped at once')
  local names = require('moonrl.train.checkpoint').list(d .. '/checkpoints')
  t.eq(names[#names], 'step-000120', 'the stop checkpoint')
  -- then killed in the GRPO phase (global step 202), resumed from the end of the warm-up
  r = run(d, 'kill:step=202:phase=train')
  t.truthy(r.signal == 9 or r.exit_status == 137, show(r))
  r = run(d)
  t.truthy(r.ok, show(r))
  t.truthy(weights(d) == weights(clean), 'final weights equal to the uninterrupted run')
  t.eq(#K.metrics(d), 4, 'one line per GRPO step')
  for i, line in ipairs(K.metrics(clean)) do t.eq(K.metrics(d)[i], line, 'metrics of GRPO step ' .. i) end
end)

t.test('run.max_seconds: a clean stop (124) with a checkpoint; the resumed run ends as the reference', function()
  local d = dir .. '/deadline'
  local r = K.run('recipes/grpo.lua', words(d, { 'grpo.steps=8', 'run.max_seconds=3' }), { fault = 'sleep:step=2:phase=train:seconds=4' })
  t.eq(r.exit_status, 124, show(r))
  local names = require('moonrl.train.checkpoint').list(d .. '/checkpoints')
  t.eq(names[#names], 'step-000002', 'the checkpoint of the step the deadline passed in')
  t.truthy(weights(d) ~= nil, 'the model saved')
  local r2 = K.run('recipes/grpo.lua', words(d, { 'grpo.steps=8' }))
  t.truthy(r2.ok, show(r2))
  t.truthy(weights(d) == REF, 'final weights equal to the uninterrupted run')
end)

t.test('an error inside a step: the last complete step is checkpointed; the resumed run ends as the reference', function()
  local d = dir .. '/error'
  local r = K.run('recipes/grpo.lua', words(d, { 'grpo.steps=8' }), { fault = 'error:step=5:phase=reward' })
  t.eq(r.exit_status, 1, show(r))
  t.truthy(r.stderr:find('fault injection: error at step 5', 1, true), r.stderr)
  t.truthy(fs.is_dir(d .. '/checkpoints/step-000004'), 'the state before the failed step saved')
  t.eq(#events(d, 'error'), 1)
  local r2 = K.run('recipes/grpo.lua', words(d, { 'grpo.steps=8' }))
  t.truthy(r2.ok, show(r2))
  t.truthy(weights(d) == REF, 'final weights equal to the uninterrupted run')
end)

t.test('corrupt, truncated and incomplete checkpoints are skipped with a line naming the file', function()
  local d = dir .. '/corrupt'
  local r = K.run('recipes/grpo.lua', words(d, { 'grpo.steps=6', 'run.checkpoint_every=1', 'run.keep_checkpoints=0' }))
  t.truthy(r.ok, show(r))
  local c = d .. '/checkpoints/'
  -- step 6: one flipped byte; step 5: cut short; step 4: no manifest (as if the write never ended)
  local p6 = c .. 'step-000006/model.safetensors'
  local bytes = fs.read(p6)
  fs.write(p6, bytes:sub(1, 200) .. string.char((bytes:byte(201) + 1) % 256) .. bytes:sub(202))
  local p5 = c .. 'step-000005/optimizer.safetensors'
  fs.write(p5, fs.read(p5):sub(1, 1000))
  fs.remove(c .. 'step-000004/manifest.json')
  local r2 = K.run('recipes/grpo.lua', words(d, { 'grpo.steps=8' }))
  t.truthy(r2.ok, show(r2))
  t.truthy(r2.stderr:find('step-000006/model.safetensors: checksum', 1, true), r2.stderr)
  t.truthy(r2.stderr:find('step-000005/optimizer.safetensors: 1000 bytes, the manifest says', 1, true), r2.stderr)
  t.truthy(r2.stderr:find('step-000004/manifest.json: missing', 1, true), r2.stderr)
  t.truthy(r2.stdout:find('resuming from ' .. c .. 'step-000003', 1, true), r2.stdout)
  t.truthy(fs.is_dir(c .. 'step-000006.corrupt') and fs.is_dir(c .. 'step-000005.corrupt'), 'set aside, kept')
  t.truthy(weights(d) == REF, 'final weights equal to the uninterrupted run (grpo.steps may change)')
  -- a checkpoint named on the command line that does not verify is a usage error
  local r3 = K.run('recipes/grpo.lua', words(dir .. '/other', { 'grpo.steps=8', 'run.resume=' .. c .. 'step-000006' }))
  t.eq(r3.exit_status, 2, show(r3))
end)

t.test('resuming with a changed config is refused, naming the keys', function()
  local d = dir .. '/changed'
  local r = K.run('recipes/grpo.lua', words(d, { 'grpo.steps=2' }))
  t.truthy(r.ok, show(r))
  local r2 = K.run('recipes/grpo.lua', words(d, { 'grpo.steps=4', 'train.lr=2e-3', 'grpo.samples=2' }))
  t.eq(r2.exit_status, 2, show(r2))
  t.truthy(r2.stderr:find('the config changed: grpo.samples (4 -> 2), train.lr (0.001 -> 0.002)', 1, true), r2.stderr)
  local r3 = K.run('recipes/grpo.lua', words(d, { 'grpo.steps=3', 'run.max_seconds=100', 'run.log_level=warn' }))
  t.truthy(r3.ok, 'free keys may change: ' .. show(r3))
end)

t.test('run directories: exclusive, never through a shell, refused when they hold something else', function()
  -- a run directory whose name is a shell command
  local evil = dir .. '/x$(touch ' .. dir .. '/PWNED)'
  local r = K.run('recipes/grpo.lua', words(evil, { 'grpo.steps=1' }))
  t.truthy(r.ok, show(r))
  t.truthy(fs.is_dir(evil), 'the directory has the name as given')
  t.truthy(not fs.exists(dir .. '/PWNED'), 'no command ran')
  -- not a run
  fs.mkdirs(dir .. '/notrun')
  fs.write(dir .. '/notrun/notes.txt', 'mine')
  r = K.run('recipes/grpo.lua', words(dir .. '/notrun', { 'grpo.steps=1' }))
  t.eq(r.exit_status, 2, show(r))
  t.truthy(r.stderr:find('is not empty and holds no moonrl run', 1, true), r.stderr)
  -- a finished run with resume=never
  r = K.run('recipes/grpo.lua', words(ref, { 'grpo.steps=8', 'run.resume=never' }))
  t.eq(r.exit_status, 2, show(r))
  t.truthy(r.stderr:find('already holds a run', 1, true), r.stderr)
  -- two runs at once in one directory: the second is refused while the first holds it
  local d = dir .. '/busy'
  local first = proc.spawn({ 'env', 'MOONRL_FAULT=hang:step=1:phase=train', rawget(_G, 'MOONRL_EXE'), 'run',
    'recipes/grpo.lua', unpack(words(d, { 'grpo.steps=2' })) }, { timeout = 60 })
  local t0 = moonrl.now()
  while not fs.exists(d .. '/metrics.jsonl') and moonrl.now() - t0 < 30 do moonrl.sleep(0.05) end
  r = K.run('recipes/grpo.lua', words(d, { 'grpo.steps=2' }))
  t.eq(r.exit_status, 2, show(r))
  t.truthy(r.stderr:find('in use by another run (process', 1, true), r.stderr)
  first:kill()
  -- two runs started in the same second without run.dir get two directories
  fs.mkdirs(dir .. '/cwd')
  local procs = {}
  for i = 1, 2 do
    local w = words('unused', { 'grpo.steps=1' })
    table.remove(w, 1)
    procs[i] = proc.spawn({ 'env', '-C', dir .. '/cwd', rawget(_G, 'MOONRL_EXE'), 'run',
      fs.join(moonrl.home, 'recipes/grpo.lua'), unpack(w) }, { timeout = 120 })
  end
  for i = 1, 2 do t.truthy(procs[i]:wait().ok, 'run ' .. i) end
  t.eq(#fs.list(dir .. '/cwd/runs'), 2, 'two run directories')
end)

t.test('supervisor: a crash and a hang are restarted from the latest checkpoint; the result equals the reference', function()
  local d = dir .. '/supervised'
  local w = words(d, { 'grpo.steps=8', 'run.checkpoint_every=1', 'run.hang_seconds=2' })
  local argv = { 'env', 'MOONRL_FAULT=crash:step=3:phase=train:attempt=0;hang:step=6:phase=generate:attempt=1',
    rawget(_G, 'MOONRL_EXE'), 'run', '--restarts', '3', '--backoff', '0.05', '--kill-grace', '1', 'recipes/grpo.lua' }
  for _, x in ipairs(w) do argv[#argv + 1] = x end
  local r = proc.run(argv, { timeout = 120 })
  t.truthy(r.ok, show(r))
  t.truthy(weights(d) == REF, 'final weights equal to the uninterrupted run')
  local restarts = events(d, 'restart')
  t.eq(#restarts, 2, 'two restarts')
  t.eq(restarts[1].cause, 'killed by SIGSEGV')
  t.eq(restarts[2].cause, 'hang')
  local report = fs.read(d .. '/hang-1.txt') or ''
  t.truthy(report:find('in progress: phase generate step 6', 1, true), report)
  t.truthy(report:find('C stack of the main thread', 1, true) and report:find('mrl_fault_hang', 1, true), report)
  local m = K.metrics(d)
  t.eq(#m, 8, 'each step once')
  for i = 1, 8 do t.eq(m[i], REF_METRICS[i], 'metrics of step ' .. i) end
  -- a usage error is not restarted
  local bad = { rawget(_G, 'MOONRL_EXE'), 'run', '--restarts', '3', 'recipes/grpo.lua', 'run.dir=' .. dir .. '/sup2', 'nokey=1' }
  r = proc.run(bad, { timeout = 60 })
  t.eq(r.exit_status, 2, show(r))
  t.eq(#events(dir .. '/sup2', 'restart'), 0, 'no restart after a usage error')
end)

if not os.getenv("KEEP") then fs.remove(dir) end
t.done()
