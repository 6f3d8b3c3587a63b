-- The run manifest (moonrl.train.manifest): every run directory holds manifest.json (the build, the
-- command, the resolved config and seeds, the inputs' and code's checksums, the machine), and
-- `moonrl run --from DIR` makes the run again, bit for bit, after checking its inputs are
-- unchanged: a changed or missing input, a corrupt manifest, another rank count are usage errors
-- naming what is wrong.
local t = require('moonrl.testing')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')
local proc = require('moonrl.io.proc')
local U = dofile('tests/recipes/util.lua')

local exe = assert(rawget(_G, 'MOONRL_EXE'), 'needs the moonrl executable')
local dir = U.tmpdir('manifest')

local function moonrl_run(args, expect_fail)
  local argv = { exe }
  for _, a in ipairs(args) do argv[#argv + 1] = a end
  local r = proc.run(argv, { timeout = 300 })
  if not r.ok and not expect_fail then
    io.stderr:write(r.stdout, r.stderr)
    error('moonrl ' .. table.concat(args, ' ') .. ' failed', 2)
  end
  return r
end
local function manifest(d) return json.decode(fs.read(d .. '/manifest.json')) end
local function weights(d) return fs.read(d .. '/model/model.safetensors') end

t.test('the default example: a manifest, and --from makes the same weights', function()
  local d = dir .. '/default'
  moonrl_run({ 'run.dir=' .. d, 'sft.steps=30', 'grpo.steps=2', 'grpo.prompts=4', 'heldout=5', 'quiet=true' })
  local m = manifest(d)
  t.eq(m.format, 1, 'format')
  t.truthy(m.moonrl.version and m.moonrl.git, 'the build')
  t.eq(m.command.recipe.embedded, 'default', 'the embedded default example')
  t.eq(m.command.words[2], 'sft.steps=30', 'the words given')
  t.eq(m.command.world_size, 1, 'one rank')
  t.eq(m.config.sft.steps, 30, 'the resolved config')
  t.truthy(m.seeds['run.seed'] ~= nil, 'the seeds')
  t.truthy(m.machine.kernels and m.machine.cpu and m.machine.threads, 'the machine')
  local r = moonrl_run({ 'run', '--from', d })
  t.truthy(fs.exists(d .. '-rerun/manifest.json'), 'into DIR-rerun')
  t.truthy(weights(d) == weights(d .. '-rerun'), 'bit-identical weights')
  moonrl_run({ 'run', '--from', d, 'run.dir=' .. dir .. '/other' })
  t.truthy(weights(d) == weights(dir .. '/other'), 'run.dir chooses where')
end)

t.test('a recipe on a model and data: their checksums; a changed input stops --from, naming it', function()
  local base, model, data = U.grpo_setup(dir, 12)
  local d = dir .. '/grpo'
  local words = { 'run', 'recipes/grpo.lua', 'grpo.steps=2' }
  for _, w in ipairs(U.words(base, d)) do words[#words + 1] = w end
  moonrl_run(words)
  local m = manifest(d)
  t.truthy(m.command.recipe.path:find('recipes/grpo.lua', 1, true) and #m.command.recipe.crc32c == 8, 'the recipe and its crc')
  t.eq(m.command.recipe.copy, 'recipe.lua', 'a copy of it in the run directory')
  t.eq(fs.read(d .. '/recipe.lua'), fs.read('recipes/grpo.lua'), 'the copy')
  local mf = m.inputs.model.files['model.safetensors']
  t.truthy(mf and mf.bytes > 0 and #mf.crc32c == 8, 'the model files: bytes and crc32c')
  t.truthy(m.inputs['data.train'] and m.inputs['data.train'].files['train.jsonl'], 'the data file')
  local code = false
  for _, c in ipairs(m.code) do if c.path:find('rewards/exact.lua', 1, true) then code = true end end
  t.truthy(code, 'the reward plugin source')
  moonrl_run({ 'run', '--from', d })
  t.truthy(weights(d) == weights(d .. '-rerun'), 'bit-identical weights')
  -- the data changed: refused, naming the file
  local f = assert(io.open(data, 'a'))
  f:write('{"prompt": "1+1=", "answer": "2"}\n')
  f:close()
  local r = moonrl_run({ 'run', '--from', d, 'run.dir=' .. dir .. '/no' }, true)
  t.eq(r.exit_status, 2, 'a usage error')
  t.truthy(r.stderr:find(data, 1, true) and r.stderr:find('changed', 1, true), 'names the changed file: ' .. r.stderr)
  t.truthy(not fs.exists(dir .. '/no'), 'nothing run')
  os.remove(model .. '/config.json')
  r = moonrl_run({ 'run', '--from', d, 'run.dir=' .. dir .. '/no' }, true)
  t.truthy(r.stderr:find('config.json: missing', 1, true), 'names the missing file: ' .. r.stderr)
end)

t.test('--require files are part of the code: recorded, replayed by --from, a change refused', function()
  local base = U.grpo_setup(dir .. '/req', 12)
  local reward = dir .. '/my_reward.lua'
  fs.write(reward, fs.read('tests/recipes/partial_reward.lua'))
  local d = dir .. '/req/run'
  local words = { 'run', 'recipes/grpo.lua', '--require', reward, 'grpo.steps=2' }
  for _, w in ipairs(U.words(base, d)) do words[#words + 1] = (w:match('^reward=') and 'reward=partial' or w) end
  moonrl_run(words)
  local m = manifest(d)
  t.eq(m.command.requires[1], reward, 'the --require file')
  local code = false
  for _, c in ipairs(m.code) do if c.path == reward and #c.crc32c == 8 then code = true end end
  t.truthy(code, 'with its checksum among the code')
  -- the file is outside the run directory: --from runs it only when the command line names it
  local r = moonrl_run({ 'run', '--from', d }, true)
  t.eq(r.exit_status, 2, 'an unnamed --require file outside the directory')
  t.truthy(r.stderr:find('the run loaded --require ' .. reward .. ', outside ' .. d, 1, true), r.stderr)
  t.truthy(not fs.exists(d .. '-rerun'), 'nothing run')
  moonrl_run({ 'run', '--from', d, '--require', reward })
  t.truthy(weights(d) == weights(d .. '-rerun'), 'replayed with the file: the same weights')
  fs.write(reward, fs.read(reward) .. '\n-- changed\n')
  r = moonrl_run({ 'run', '--from', d, '--require', reward, 'run.dir=' .. dir .. '/req/no' }, true)
  t.eq(r.exit_status, 2, 'a changed --require file: a usage error')
  t.truthy(r.stderr:find(reward, 1, true) and r.stderr:find('changed', 1, true), r.stderr)
end)

-- What --from trusts (docs/runs.md): the run directory's files and moonrl's installation. A
-- manifest naming code elsewhere (a shared run directory's, edited) once ran that code.
t.test('--from runs the directory\'s copy of the recipe; code outside it only when named again', function()
  local base = U.grpo_setup(dir .. '/trust', 12)
  local d = dir .. '/trust/run'
  local words = { 'run', 'recipes/grpo.lua', 'grpo.steps=2' }
  for _, w in ipairs(U.words(base, d)) do words[#words + 1] = w end
  moonrl_run(words)
  -- a recipe elsewhere, that leaves a mark when it runs
  local evil, mark = dir .. '/trust/evil.lua', dir .. '/trust/ran'
  fs.write(evil, string.format('io.open(%q, "w"):close()\n', mark))
  local function forged(edit)
    local m = manifest(d)
    edit(m)
    fs.write(d .. '/manifest.json', json.encode(m))
  end
  local saved = fs.read(d .. '/manifest.json')
  local function refused(args, want)
    local r = moonrl_run(args, true)
    t.eq(r.exit_status, 2, want .. ': ' .. r.stderr)
    t.truthy(r.stderr:find(want, 1, true), want .. ': ' .. r.stderr)
    t.truthy(not fs.exists(mark), 'the file outside did not run')
    t.truthy(not fs.exists(d .. '-rerun'), 'nothing run')
  end
  local crc = string.format('%08x', (fs.crc32c_file(evil)))
  -- the manifest names another recipe file, with its checksum, and no copy
  forged(function(m) m.command.recipe = json.object({ 'path', evil, 'crc32c', crc }) end)
  refused({ 'run', '--from', d }, 'names the recipe ' .. evil .. ', and ' .. d .. ' holds no copy of it')
  -- ... or says its copy is that file, through a link
  forged(function(m) m.command.recipe.copy = 'recipe.lua' end)
  local copy = fs.read(d .. '/recipe.lua')
  os.remove(d .. '/recipe.lua')
  assert(proc.run({ 'ln', '-s', evil, d .. '/recipe.lua' }).ok)
  refused({ 'run', '--from', d }, 'holds no copy of it')
  os.remove(d .. '/recipe.lua')
  fs.write(d .. '/recipe.lua', copy)
  fs.write(d .. '/manifest.json', saved)
  -- a reward=FILE.lua:NAME word of a file outside: only when given again
  forged(function(m) m.command.words[#m.command.words + 1] = 'reward=' .. evil .. ':x' end)
  refused({ 'run', '--from', d }, 'the word reward=' .. evil .. ':x loads ' .. evil .. ', outside ' .. d)
  fs.write(d .. '/manifest.json', saved)
  -- the copy edited: refused as a changed recipe
  fs.write(d .. '/recipe.lua', copy .. '\n-- edited\n')
  refused({ 'run', '--from', d }, 'recipe ' .. d .. '/recipe.lua: changed')
  -- a recipe named on the command line runs, when it is the one the run ran
  moonrl_run({ 'run', '--from', d, 'recipes/grpo.lua' })
  t.truthy(weights(d) == weights(d .. '-rerun'), 'the named recipe: the same weights')
  local r = moonrl_run({ 'run', '--from', d, evil, 'run.dir=' .. dir .. '/trust/no' }, true)
  t.eq(r.exit_status, 2)
  t.truthy(r.stderr:find('recipe ' .. evil .. ': changed', 1, true), 'another file named: refused, ' .. r.stderr)
  t.truthy(not fs.exists(mark), 'and not run')
end)

t.test('bad manifests and another rank count: one-line usage errors', function()
  local d = dir .. '/bad'
  fs.mkdirs(d)
  local r = moonrl_run({ 'run', '--from', d }, true)
  t.eq(r.exit_status, 2, 'no manifest')
  t.truthy(r.stderr:find('no manifest.json', 1, true), r.stderr)
  fs.write(d .. '/manifest.json', '{"format": 1, "command": ')
  r = moonrl_run({ 'run', '--from', d }, true)
  t.eq(r.exit_status, 2, 'corrupt manifest')
  t.truthy(r.stderr:find(d .. '/manifest.json', 1, true), 'names the file: ' .. r.stderr)
  local m = manifest(dir .. '/default')
  m.command.world_size = 3
  fs.write(d .. '/manifest.json', json.encode(m))
  r = moonrl_run({ 'run', '--from', d }, true)
  t.eq(r.exit_status, 2, 'another rank count')
  t.truthy(r.stderr:find('mpirun -n 3', 1, true), 'says how: ' .. r.stderr)
  r = moonrl_run({ 'run', '--from' }, true)
  t.eq(r.exit_status, 2, '--from without a directory')
end)

-- run.threads=auto (the default example's default): one of the candidates, in the manifest and the
-- events; --from runs on the recorded count (forged here to the other candidate: it is read back,
-- not measured again); a resumed run keeps its checkpoint's count.
t.test('run.threads=auto: a candidate chosen, recorded, reused by --from and by a resume', function()
  local moonrl = require('moonrl')
  local n = tonumber(moonrl.C.mrl_parallel_threads()) -- what the child process has too (cores, or MOONRL_THREADS)
  local d = dir .. '/threads'
  local SHORT = { 'sft.steps=20', 'grpo.steps=2', 'grpo.prompts=4', 'heldout=5', 'quiet=true' }
  local function with(...)
    local w = {}
    for _, x in ipairs({ ... }) do w[#w + 1] = x end
    for _, x in ipairs(SHORT) do w[#w + 1] = x end
    return w
  end
  local function threads_events(run_dir)
    local out = {}
    for l in io.lines(run_dir .. '/events.jsonl') do
      local e = json.decode(l)
      if e.event == 'threads' then out[#out + 1] = e end
    end
    return out
  end
  moonrl_run(with('run.dir=' .. d))
  local m = manifest(d)
  t.eq(m.config.run.threads, 'auto', 'the default example measures')
  local chosen = m.threads.chosen
  t.truthy(chosen == 1 or chosen == n, 'one of 1 and ' .. n .. ': ' .. tostring(chosen))
  t.eq(m.machine.threads, chosen, 'the run ran on it')
  if n > 1 then
    t.eq(m.threads.by, 'measured')
    t.truthy(m.threads.seconds['1'] > 0 and m.threads.seconds[tostring(n)] > 0, 'both timed')
    t.eq(chosen, m.threads.seconds['1'] < m.threads.seconds[tostring(n)] and 1 or n, 'the faster one')
  end
  local ev = threads_events(d)
  t.eq(#ev, 1, 'one threads event')
  t.eq(ev[1].chosen, chosen)
  -- --from: the recorded count, as a word of the new run (the other candidate, forged)
  local other = (chosen == 1 and n > 1) and n or 1
  m.threads.chosen = other
  fs.write(d .. '/manifest.json', json.encode(m))
  moonrl_run({ 'run', '--from', d, 'run.dir=' .. d .. '-from' })
  local m2 = manifest(d .. '-from')
  t.eq(m2.config.run.threads, other, 'run.threads of the re-run')
  t.eq(m2.machine.threads, other, 'the re-run ran on it')
  t.eq(#threads_events(d .. '-from'), 0, 'not measured again')
  if other == chosen then t.truthy(weights(d) == weights(d .. '-from'), 'bit-identical weights') end
  moonrl_run({ 'run', '--from', d, 'run.threads=1', 'run.dir=' .. d .. '-from1' })
  t.eq(manifest(d .. '-from1').config.run.threads, 1, 'a run.threads word given to --from wins')
  -- a resume: the count of the checkpoint (run.threads=auto again, not measured)
  local e = dir .. '/threads_resume'
  local r = proc.run({ 'env', 'MOONRL_FAULT=kill:step=15:phase=train', exe, 'run.dir=' .. e, 'run.checkpoint_every=10',
    unpack(SHORT) }, { timeout = 300 })
  t.truthy(not r.ok, 'killed at step 15')
  moonrl_run(with('run.dir=' .. e, 'run.checkpoint_every=10'))
  ev = threads_events(e)
  t.eq(#ev, 2, 'a threads event per start')
  t.eq(ev[2].by, 'checkpoint', 'the resumed run took the checkpoint\'s count')
  t.eq(ev[2].chosen, ev[1].chosen, 'the same count')
  t.eq(manifest(e).threads.chosen, ev[1].chosen)
end)

t.test('run.threads: a word other than auto is a usage error that says what it takes', function()
  local r = moonrl_run({ 'run.threads=fast', 'run.dir=' .. dir .. '/bad_threads' }, true)
  t.eq(r.exit_status, 2)
  t.truthy(r.stderr:find("config key 'run.threads' expects an integer or auto, got 'fast'", 1, true), r.stderr)
  t.truthy(not fs.exists(dir .. '/bad_threads'), 'no run directory')
end)

fs.remove(dir)
t.done()
