-- A run whose model is larger than run.max_shard_gb saves it as transformers' save_pretrained
-- does past max_shard_size: RUN_DIR/model and each checkpoint's policy are
-- model-0000K-of-0000N.safetensors shards with model.safetensors.index.json, no model.safetensors;
-- a checkpoint's manifest lists every shard and the index and verifies each (a shard changed
-- after the write is refused, named); and a run resumed from such a checkpoint ends with the
-- same shards, byte for byte, as the run never interrupted; a resume may change the limit.
local t = require('moonrl.testing')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')
local proc = require('moonrl.io.proc')
local ckpt = require('moonrl.train.checkpoint')
local U = dofile('tests/recipes/util.lua')

local exe = assert(rawget(_G, 'MOONRL_EXE'), 'needs the moonrl executable')
local dir = U.tmpdir('save_shards')
local words = U.sft_setup(dir, 40)

-- 4 steps, a checkpoint after each; fault: a MOONRL_FAULT for the run (it is then killed); extra:
-- more words.
local function sft(run_dir, fault, extra)
  local argv = { 'env', 'MOONRL_FAULT=' .. (fault or ''), exe, 'run', 'recipes/sft.lua' }
  -- 20,000 bytes a file: the tiny model's in several shards
  for _, w in ipairs(U.words(words, run_dir, U.with({ 'run.max_shard_gb=2e-5', 'train.batch=4', 'train.steps=4',
    'run.checkpoint_every=1', 'run.keep_checkpoints=0' }, extra))) do
    argv[#argv + 1] = w
  end
  local r = proc.run(argv, { timeout = 120 })
  assert(r.ok == (fault == nil), r.stderr)
  return r
end

-- The shard files of model directory d (sorted) and their N, checked against its index.
local function shards(d)
  local names, n = {}, nil
  for _, f in ipairs(fs.list(d)) do
    local of = f:match('^model%-%d%d%d%d%d%-of%-(%d%d%d%d%d)%.safetensors$')
    if of then
      names[#names + 1] = f
      t.truthy(n == nil or n == tonumber(of), d .. ': shards of one count: ' .. f)
      n = tonumber(of)
    end
  end
  table.sort(names)
  t.eq(#names, n or 0, d .. ': every shard of 1..N')
  t.truthy(not fs.exists(d .. '/model.safetensors'), d .. ': no model.safetensors beside the shards')
  local index = json.read_file(d .. '/model.safetensors.index.json')
  local used = {}
  for _, file in pairs(index.weight_map) do used[file] = true end
  for _, f in ipairs(names) do t.truthy(used[f], d .. ': the index names ' .. f) end
  return names, n
end

local ref = dir .. '/ref'
sft(ref)

t.test('RUN_DIR/model: shards with Hugging Face names and an index, loadable', function()
  local names, n = shards(ref .. '/model')
  t.truthy(n and n >= 3, 'at least 3 shards, got ' .. tostring(n))
  local m = require('moonrl.model').load(ref .. '/model')
  t.truthy(m.n_params > 0, 'loads')
end)

local part = dir .. '/part'
sft(part, 'kill:step=3:phase=step') -- killed as step 3 begins: step-000002 is the newest
local CK = part .. '/checkpoints/step-000002'

t.test('a checkpoint: its policy in shards, each and the index in the manifest and verified', function()
  local names = shards(CK)
  local files = json.read_file(CK .. '/manifest.json').files
  names[#names + 1] = 'model.safetensors.index.json'
  for _, f in ipairs(names) do t.truthy(files[f] ~= nil, 'the manifest lists ' .. f) end
  t.truthy(ckpt.verify(CK), 'verifies')
  local copy = dir .. '/changed'
  assert(proc.run({ 'cp', '-a', CK, copy }).ok)
  local victim = copy .. '/' .. names[2]
  local bytes = fs.read(victim)
  local at = #bytes - 5
  fs.write(victim, bytes:sub(1, at - 1) .. string.char((bytes:byte(at) + 1) % 256) .. bytes:sub(at + 1))
  local ok, why = ckpt.verify(copy)
  t.truthy(not ok and why:find(names[2], 1, true) and why:find('corrupt', 1, true), 'a changed shard refused: ' .. tostring(why))
end)

t.test('resumed from the sharded checkpoint: the shards of the run never interrupted', function()
  local r = sft(part)
  t.truthy(r.stdout:find('resuming from .-step%-000002 %(step 2%)'), r.stdout)
  local names = shards(part .. '/model')
  local want = shards(ref .. '/model')
  t.eq(#names, #want, 'as many shards')
  for i, f in ipairs(want) do
    t.truthy(names[i] == f and fs.read(part .. '/model/' .. f) == fs.read(ref .. '/model/' .. f), f .. ': byte for byte')
  end
end)

t.test('a resume may change run.max_shard_gb: the default 5 GB, one model.safetensors, the shards gone', function()
  local r = sft(part, nil, { 'train.steps=5', 'run.max_shard_gb=5' })
  t.truthy(r.stdout:find('resuming from .-step%-000004 %(step 4%)'), r.stdout)
  for _, d in ipairs({ part .. '/checkpoints/step-000005', part .. '/model' }) do
    t.truthy(fs.exists(d .. '/model.safetensors') and not fs.exists(d .. '/model.safetensors.index.json'), d .. ': one file')
    for _, f in ipairs(fs.list(d)) do t.truthy(not f:find('^model%-%d'), d .. ': no shard left, ' .. f) end
  end
end)

fs.remove(dir)
t.done()
