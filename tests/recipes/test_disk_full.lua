-- A full disk and a read-only run directory, on a small tmpfs (needs root to mount it; skipped
-- otherwise): a checkpoint or metrics write that fails is an error naming the path, the
-- previous checkpoint stays intact, run.checkpoint_errors=warn goes on, and a run that cannot
-- save its model never exits 0.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local proc = require('moonrl.io.proc')
local fs = require('moonrl.io.fs')
local U = dofile('tests/recipes/util.lua')
local K = dofile('tests/recipes/killer.lua')
local ckpt = require('moonrl.train.checkpoint')

local dir = U.tmpdir('diskfull')
local mnt = dir .. '/mnt'
fs.mkdirs(mnt)
local m = proc.run({ 'mount', '-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', mnt }, { timeout = 30 })
if not m.ok then
  print('skipped: cannot mount a tmpfs here (' .. m.stderr:gsub('\n', ' ') .. ')')
  fs.remove(dir)
  os.exit(77)
end
local function umount() proc.run({ 'umount', '-l', mnt }, { timeout = 30 }) end

local ok, err = pcall(function()
  local WORDS, model_dir = U.grpo_setup(dir, 40, { 'grpo.steps=6', 'run.checkpoint_every=1' })
  local function words(run_dir, extra) return U.words(WORDS, run_dir, extra) end
  local function show(r) return string.format('status %s\n%s%s', tostring(r.exit_status), r.stdout, r.stderr) end
  local ref = dir .. '/ref'
  local r = K.run('recipes/grpo.lua', words(ref))
  assert(r.ok, show(r))
  local size = 0
  local names = ckpt.list(ref .. '/checkpoints')
  for _, f in pairs(require('moonrl.io.json').read_file(ref .. '/checkpoints/' .. names[1] .. '/manifest.json').files) do
    size = size + f.bytes
  end
  -- leave room for the run's first files and a bit more than one checkpoint
  local function fill(leave)
    fs.remove(mnt .. '/filler')
    local free = fs.free_bytes(mnt)
    fs.write(mnt .. '/filler', string.rep('x', math.max(free - leave, 0)))
  end

  t.test('a checkpoint that does not fit: an error naming the path, the previous checkpoint intact; resume later', function()
    local d = mnt .. '/stop'
    fill(math.floor(1.6 * size) + 60000)
    r = K.run('recipes/grpo.lua', words(d))
    if os.getenv('SHOW') then print(r.stderr) end
    t.eq(r.exit_status, 1, show(r))
    t.truthy(r.stderr:find('No space left on device', 1, true), r.stderr)
    t.truthy(r.stderr:find(d .. '/checkpoints/', 1, true), 'names the path: ' .. r.stderr)
    t.truthy(r.stderr:find('previous checkpoints are intact', 1, true), r.stderr)
    local good = ckpt.latest(d .. '/checkpoints')
    t.truthy(good ~= nil and ckpt.verify(good), 'the previous checkpoint verifies')
    t.truthy(not fs.exists(d .. '/checkpoints/.tmp-step-000002') and not fs.exists(d .. '/checkpoints/.tmp-step-000003'),
      'the partial write was removed')
    fs.remove(mnt .. '/filler')
    local r2 = K.run('recipes/grpo.lua', words(d))
    t.truthy(r2.ok, show(r2))
    t.truthy(fs.read(d .. '/model/model.safetensors') == fs.read(ref .. '/model/model.safetensors'),
      'after space came back, the resumed run ends as the uninterrupted one')
    fs.remove(d)
  end)

  t.test('run.checkpoint_errors=warn goes on; a model that cannot be saved is an error, never exit 0', function()
    local d = mnt .. '/warn'
    -- the first checkpoint fits, then not even the model does (32768: room for what the run
    -- writes besides its checkpoints, in tmpfs pages: the heartbeat file status/rank-0.json and
    -- its replacement, manifest.json, metrics.jsonl's lines with their memory/ keys)
    fill(size + 45000 + 32768)
    r = K.run('recipes/grpo.lua', words(d, { 'run.checkpoint_errors=warn' }))
    if os.getenv('SHOW') then print(r.stderr) end
    t.eq(r.exit_status, 1, show(r))
    t.truthy(r.stderr:find('going on (run.checkpoint_errors=warn)', 1, true), r.stderr)
    t.truthy(r.stderr:find('cannot save the policy to ' .. d .. '/model', 1, true) or
      r.stderr:find('No space left on device', 1, true), r.stderr)
    -- whatever of the model directory exists is whole: every file written atomically
    for _, name in ipairs({ 'tokenizer.json', 'tokenizer_config.json' }) do
      local got = fs.read(d .. '/model/' .. name)
      t.truthy(got == nil or got == fs.read(model_dir .. '/' .. name), name .. ' absent or complete')
    end
    fs.remove(d)
  end)

  t.test('no room for metrics.jsonl: an error naming it', function()
    local d = mnt .. '/metrics'
    fill(40000)
    r = K.run('recipes/grpo.lua', words(d, { 'run.checkpoint_every=0', 'run.checkpoint_minutes=0' }))
    t.eq(r.exit_status, 1, show(r))
    t.truthy(r.stderr:find('No space left on device', 1, true), r.stderr)
    fs.remove(d)
  end)

  t.test('a read-only run directory: a clear error at the start', function()
    fs.remove(mnt .. '/filler')
    local ro = proc.run({ 'mount', '-o', 'remount,ro', mnt }, { timeout = 30 })
    t.truthy(ro.ok, ro.stderr)
    r = K.run('recipes/grpo.lua', words(mnt .. '/ro'))
    t.eq(r.exit_status, 2, show(r))
    t.truthy(r.stderr:find('cannot create run directory ' .. mnt .. '/ro', 1, true) and
      r.stderr:find('Read-only file system', 1, true), r.stderr)
  end)
end)
umount()
fs.remove(dir)
if not ok then error(err, 0) end
t.done()
