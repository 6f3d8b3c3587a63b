-- Data parallel over ranks (mpirun, one thread a rank, --oversubscribe): the same recipe and
-- global batch on 1, 2 and 3 ranks gives the same metrics and weights up to summation order;
-- a given number of ranks is bit-identical run to run, ZeRO-1 equals plain data parallel, a
-- checkpoint of 2 ranks resumes on 3 (and ZeRO-1's, written a shard file a rank, on 3 and on 1;
-- an old one of a single optimizer file too), a hung rank fails the job after dist.timeout naming it,
-- and a killed rank under `moonrl launch --restarts` ends with the weights of a clean run.
local t = require('moonrl.testing')
local fs = require('moonrl.io.fs')
local ffi = require('ffi')
local json = require('moonrl.io.json')
local proc = require('moonrl.io.proc')
local U = dofile('tests/recipes/util.lua')

local exe = rawget(_G, 'MOONRL_EXE')
local mpirun = U.which('mpirun')
assert(exe and mpirun, 'needs the moonrl executable and mpirun')

local dir = U.tmpdir('ranks')
local model_dir, sft_data, pref_data, rl_data = U.ranks_setup(dir)

-- Run a recipe on n ranks (n = 0: one plain process, no mpirun); returns the proc result.
local function run(n, recipe, words, opts)
  opts = opts or {}
  opts.timeout = opts.timeout or 120
  return U.run_ranks(exe, n, recipe, words, opts)
end

local function weights(run_dir) return U.weights(run_dir .. '/model/model.safetensors') end

local rel_diff = U.rel_diff

local function metrics(run_dir)
  local out = {}
  for line in io.lines(run_dir .. '/metrics.jsonl') do out[#out + 1] = json.decode(line) end
  return out
end

local function bytes(path) return fs.read(path) end

-- A checkpoint's optimizer files (optimizer.safetensors, or one optimizer.rank-R-of-N a rank) and
-- each of their tensors' floats as bytes, the shards joined in rank order: the whole state.
local function optimizer_state(ck)
  local files, out = {}, {}
  for _, f in ipairs(fs.list(ck)) do
    if f:match('^optimizer') then files[#files + 1] = f end
  end
  table.sort(files)
  for _, f in ipairs(files) do
    local st = require('moonrl.io.safetensors').open(ck .. '/' .. f)
    for _, name in ipairs(st:names()) do
      local n = st:info(name).numel
      out[name] = (out[name] or '') .. ffi.string(st:read_f32(name), 4 * n)
    end
  end
  return out, files
end

local function same_state(a, b, what)
  local names = 0
  for name, x in pairs(a) do
    names = names + 1
    t.truthy(x == b[name], what .. ': ' .. name .. ' bit for bit')
  end
  for name in pairs(b) do t.truthy(a[name], what .. ': ' .. name .. ' in both') end
  t.truthy(names >= 2, what .. ': exp_avg and exp_avg_sq')
end

local SFT = { 'model.dir=' .. model_dir, 'data.path=' .. sft_data, 'train.steps=4', 'train.batch=12', 'train.lr=1e-3',
  'train.micro_batch_tokens=40', 'run.threads=1' }
local DPO = { 'model.dir=' .. model_dir, 'data.path=' .. pref_data, 'train.steps=4', 'train.pairs=6', 'train.lr=1e-3',
  'train.micro_batch_tokens=60', 'run.threads=1' }
local GRPO = { 'model.dir=' .. model_dir, 'data.path=' .. rl_data, 'data.prompt=question', 'data.chat=false',
  'reward=exact', 'train.lr=1e-3', 'train.micro_batch_tokens=64', 'grpo.prompts=6', 'grpo.samples=4',
  'grpo.max_tokens=4', 'grpo.steps=3', 'run.threads=1' }
local function with(list, ...)
  local w = {}
  for _, x in ipairs(list) do w[#w + 1] = x end
  for _, x in ipairs({ ... }) do w[#w + 1] = x end
  return w
end

local function close(a, b, tol) return math.abs(a - b) <= tol * math.max(1, math.abs(a)) end

local function same_metrics(ref, got, keys, tol, what, steps)
  for i = 1, steps or #ref do
    for _, k in ipairs(keys) do
      t.truthy(got[i] and ref[i][k] and close(ref[i][k], got[i][k], tol),
        string.format('%s step %d %s: %s vs %s', what, i, k, tostring(ref[i][k]), tostring(got[i] and got[i][k])))
    end
  end
end

t.test('sft and dpo: 1, 2 and 3 ranks agree (weights to 1e-5, metrics); 2 ranks bit-identical twice', function()
  for _, case in ipairs({ { 'recipes/sft.lua', SFT, { 'loss', 'grad_norm', 'tokens' } },
    { 'recipes/dpo.lua', DPO, { 'loss', 'rewards_margin', 'grad_norm', 'tokens' } } }) do
    local recipe, words, keys = case[1], case[2], case[3]
    local name = recipe:match('(%a+)%.lua$')
    run(0, recipe, with(words, 'run.dir=' .. dir .. '/' .. name .. '1'))
    local ref_w, ref_m = weights(dir .. '/' .. name .. '1'), metrics(dir .. '/' .. name .. '1')
    for _, n in ipairs({ 2, 3 }) do
      local d = string.format('%s/%s%d', dir, name, n)
      run(n, recipe, with(words, 'run.dir=' .. d))
      local e = rel_diff(ref_w, weights(d))
      print(string.format('  %s on %d ranks: relative weight difference %.3g', name, n, e))
      t.truthy(e <= 1e-5, name .. ' weights within 1e-5 on ' .. n .. ' ranks')
      same_metrics(ref_m, metrics(d), keys, 1e-4, name .. ' ' .. n .. ' ranks')
      local cfg = json.decode(fs.read(d .. '/config.json'))
      t.eq(cfg.world_size, n, 'config.json records the world size')
      t.eq(#metrics(d), 4, 'each step logged once')
    end
    local again = string.format('%s/%s2b', dir, name)
    run(2, recipe, with(words, 'run.dir=' .. again))
    t.truthy(bytes(again .. '/model/model.safetensors') == bytes(dir .. '/' .. name .. '2/model/model.safetensors'),
      name .. ': 2 ranks give the same bytes twice')
  end
end)

t.test('zero-1 and any bucket size equal plain data parallel bit for bit, over shared memory and TCP', function()
  local d1, d2 = dir .. '/zero', dir .. '/zero_tcp'
  run(2, 'recipes/sft.lua', with(SFT, 'run.dir=' .. d1, 'dist.zero=1'))
  run(2, 'recipes/sft.lua', with(SFT, 'run.dir=' .. d2, 'dist.zero=1'), { btl = 'tcp,self' })
  local d3, d4 = dir .. '/small_buckets', dir .. '/zero_small_buckets'
  run(2, 'recipes/sft.lua', with(SFT, 'run.dir=' .. d3, 'dist.bucket_mb=0.004'))
  run(2, 'recipes/sft.lua', with(SFT, 'run.dir=' .. d4, 'dist.bucket_mb=0.004', 'dist.zero=1'))
  local plain = bytes(dir .. '/sft2/model/model.safetensors')
  t.truthy(bytes(d3 .. '/model/model.safetensors') == plain, 'many small buckets started during the backward: the same bits')
  t.truthy(bytes(d4 .. '/model/model.safetensors') == plain, 'and with zero=1')
  t.truthy(bytes(d1 .. '/model/model.safetensors') == plain, 'zero=1 weights equal plain data parallel')
  t.truthy(bytes(d2 .. '/model/model.safetensors') == plain, 'over TCP too')
  local ckpt = fs.list(d1 .. '/checkpoints')
  t.truthy(#ckpt > 0, 'a checkpoint')
  local ev
  for line in io.lines(d1 .. '/events.jsonl') do
    local e = json.decode(line)
    if e.event == 'data_parallel' then ev = e end
  end
  t.truthy(ev and ev.state_bytes_per_rank * 2 >= ev.state_bytes and ev.state_bytes_per_rank * 2 <= ev.state_bytes + 8,
    'zero=1: each rank holds half of the optimizer state')
  -- each rank wrote its own shard of the state, nothing gathered: two files, no whole one,
  -- which joined are the state of plain data parallel bit for bit
  local zstate, zfiles = optimizer_state(d1 .. '/checkpoints/' .. ckpt[#ckpt])
  t.eq(table.concat(zfiles, ' '), 'optimizer.rank-00000-of-00002.safetensors optimizer.rank-00001-of-00002.safetensors',
    'zero=1: one optimizer shard file a rank')
  local pstate, pfiles = optimizer_state(dir .. '/sft2/checkpoints/' .. ckpt[#ckpt])
  t.eq(table.concat(pfiles, ' '), 'optimizer.safetensors', 'plain data parallel: the whole state in one file')
  same_state(pstate, zstate, "zero=1's shards against plain data parallel's state")
end)

t.test('grpo: the first steps agree on 1, 2 and 3 ranks', function()
  run(0, 'recipes/grpo.lua', with(GRPO, 'run.dir=' .. dir .. '/grpo1'))
  local ref = metrics(dir .. '/grpo1')
  for _, n in ipairs({ 2, 3 }) do
    local d = string.format('%s/grpo%d', dir, n)
    run(n, 'recipes/grpo.lua', with(GRPO, 'run.dir=' .. d))
    local m = metrics(d)
    same_metrics(ref, m, { 'reward/mean', 'reward/std', 'response_length/mean', 'tokens' }, 0, 'grpo ' .. n .. ' ranks', 1)
    same_metrics(ref, m, { 'loss', 'grad_norm', 'entropy' }, 1e-4, 'grpo ' .. n .. ' ranks', 1)
  end
  run(2, 'recipes/grpo.lua', with(GRPO, 'run.dir=' .. dir .. '/grpo2b'))
  t.truthy(bytes(dir .. '/grpo2b/model/model.safetensors') == bytes(dir .. '/grpo2/model/model.safetensors'),
    'grpo: 2 ranks give the same bytes twice')
end)

t.test('a checkpoint of 2 ranks resumes on 3', function()
  local d = dir .. '/resume23'
  -- 2 ranks checkpoint every step and die at the start of step 3; 3 ranks finish the run
  local r = run(2, 'recipes/sft.lua', with(SFT, 'run.dir=' .. d, 'run.checkpoint_every=1'),
    { env = { 'MOONRL_FAULT=exit:step=3:phase=step' }, expect_fail = true })
  t.truthy(not r.ok, 'the 2-rank job died at step 3')
  run(3, 'recipes/sft.lua', with(SFT, 'run.dir=' .. d))
  local e = rel_diff(weights(dir .. '/sft1'), weights(d))
  print(string.format('  2 ranks x 2 steps then 3 ranks x 2 steps against 1 process: %.3g', e))
  t.truthy(e <= 1e-5, 'resumed on 3 ranks: the weights of one process')
  t.eq(#metrics(d), 4, 'four steps logged, once each')
end)

t.test('LoRA: sft on 2 ranks within 1e-5 of 1 process, zero=1 the bits of plain data parallel, resumed on 1', function()
  local L = with(SFT, 'model.lora.rank=4', 'train.lr=1e-2')
  local function adapters(d) return U.weights(d .. '/model/adapter_model.safetensors') end
  run(0, 'recipes/sft.lua', with(L, 'run.dir=' .. dir .. '/lora1'))
  run(2, 'recipes/sft.lua', with(L, 'run.dir=' .. dir .. '/lora2'))
  local e = rel_diff(adapters(dir .. '/lora1'), adapters(dir .. '/lora2'))
  print(string.format('  LoRA sft on 2 ranks against 1 process: relative adapter difference %.3g', e))
  t.truthy(e <= 1e-5, 'the adapters\' gradients summed over the ranks')
  run(2, 'recipes/sft.lua', with(L, 'run.dir=' .. dir .. '/lora2z', 'dist.zero=1'))
  t.truthy(bytes(dir .. '/lora2z/model/adapter_model.safetensors') == bytes(dir .. '/lora2/model/adapter_model.safetensors'),
    'zero=1 (the adapters\' state sharded) equals plain data parallel bit for bit')
  local d = dir .. '/lora_resume'
  local r = run(2, 'recipes/sft.lua', with(L, 'run.dir=' .. d, 'run.checkpoint_every=1', 'dist.zero=1'),
    { env = { 'MOONRL_FAULT=exit:step=3:phase=step' }, expect_fail = true })
  t.truthy(not r.ok, 'the 2-rank job died at step 3')
  run(0, 'recipes/sft.lua', with(L, 'run.dir=' .. d))
  e = rel_diff(adapters(dir .. '/lora1'), adapters(d))
  t.truthy(e <= 1e-5, 'a zero=1 LoRA checkpoint of 2 ranks resumed by 1 process: ' .. e)
end)

t.test('LoRA with a rollout rank: each version sends only the adapters; the bits of one process', function()
  local L = with(GRPO, 'model.lora.rank=4', 'async.mode=one_step_off', 'reward=tests/recipes/partial_reward.lua:partial')
  run(0, 'recipes/grpo.lua', with(L, 'run.dir=' .. dir .. '/lora_off1'))
  run(2, 'recipes/grpo.lua', with(L, 'run.dir=' .. dir .. '/lora_off2', 'dist.rollout_ranks=1'))
  local a = bytes(dir .. '/lora_off1/model/adapter_model.safetensors')
  t.truthy(a and a == bytes(dir .. '/lora_off2/model/adapter_model.safetensors'), 'the same adapters, byte for byte')
  local sent, trainable = 0, U.event(dir .. '/lora_off2', 'lora').trainable
  for _, r in ipairs(metrics(dir .. '/lora_off2')) do
    if r['async/publish/bytes'] then
      sent = sent + 1
      t.eq(r['async/publish/bytes'], 4 * trainable, 'a version is the adapters\' floats')
    end
  end
  t.truthy(sent > 0, 'versions published')
end)

-- A checkpoint as moonrl wrote it before the shard files (format version 1): its optimizer
-- state in one optimizer.safetensors, as plain data parallel still writes it, and version 1 in
-- the manifest and state.json (its entry in the manifest updated).
local function as_version1(ck)
  local text, n = fs.read(ck .. '/state.json'):gsub('"format": 2,', '"format": 1,')
  assert(n == 1, 'state.json records the format version 2')
  fs.write(ck .. '/state.json', text)
  local crc, size = fs.crc32c_file(ck .. '/state.json')
  local m = json.decode(fs.read(ck .. '/manifest.json'))
  assert(m.version == 2 and m.files['state.json'] and fs.stat(ck .. '/optimizer.safetensors'))
  m.version = 1
  m.files['state.json'] = json.object({ 'bytes', size, 'crc32c', string.format('%08x', crc) })
  fs.write(ck .. '/manifest.json', json.encode(m, { indent = 1 }) .. '\n')
end

t.test('zero=1: a checkpoint of 2 ranks (a shard file each) resumes on 3 and on 1, one of 3 on 2; one of 1 process and an old one of one file too', function()
  -- 2 ranks checkpoint steps 1 and 2 and die at the start of step 3; the rest resumes
  local function first_half(d, zero, ranks)
    local r = run(ranks or 2, 'recipes/sft.lua', with(SFT, 'run.dir=' .. d, 'run.checkpoint_every=1', 'dist.zero=' .. zero),
      { env = { 'MOONRL_FAULT=exit:step=3:phase=step' }, expect_fail = true })
    t.truthy(not r.ok, 'the first job died at step 3')
  end
  -- plain data parallel's checkpoint, made version 1: on 1 process, and on 3 ranks with zero=1
  -- (each reads its range of the one file)
  local old = dir .. '/old_resume'
  first_half(old, 0)
  as_version1(old .. '/checkpoints/step-000002')
  t.truthy(proc.run({ 'cp', '-a', old, old .. '3' }).ok)
  run(0, 'recipes/sft.lua', with(SFT, 'run.dir=' .. old))
  run(3, 'recipes/sft.lua', with(SFT, 'run.dir=' .. old .. '3', 'dist.zero=1'))
  t.truthy(bytes(old .. '3/model/model.safetensors') == bytes(dir .. '/resume23/model/model.safetensors'),
    'version 1 on 3 ranks with zero=1: the weights of plain data parallel 2 -> 3 bit for bit')
  -- one process's checkpoint (one file) on 2 ranks with zero=1: plain data parallel's bits
  local one = dir .. '/one_resume12'
  local r = run(0, 'recipes/sft.lua', with(SFT, 'run.dir=' .. one, 'run.checkpoint_every=1'),
    { env = { 'MOONRL_FAULT=exit:step=3:phase=step' }, expect_fail = true })
  t.truthy(not r.ok, 'the one process died at step 3')
  t.truthy(proc.run({ 'cp', '-a', one, one .. 'z' }).ok)
  run(2, 'recipes/sft.lua', with(SFT, 'run.dir=' .. one))
  run(2, 'recipes/sft.lua', with(SFT, 'run.dir=' .. one .. 'z', 'dist.zero=1'))
  t.truthy(bytes(one .. 'z/model/model.safetensors') == bytes(one .. '/model/model.safetensors'),
    '1 -> 2 with zero=1: the weights of plain data parallel bit for bit')
  -- ZeRO-1's shards: each rank reads the pieces of the 2 files that overlap its range (3 ranks)
  -- or one process all of them; the same bits as the whole file of plain data parallel gives
  for _, n in ipairs({ 3, 0 }) do
    local d = dir .. '/zero_resume2' .. n
    first_half(d, 1)
    local _, files = optimizer_state(d .. '/checkpoints/step-000002')
    t.eq(#files, 2, 'two shard files')
    run(n, 'recipes/sft.lua', with(SFT, 'run.dir=' .. d, n > 0 and 'dist.zero=1' or 'dist.zero=0'))
    local e = rel_diff(weights(dir .. '/sft1'), weights(d))
    print(string.format('  zero=1: 2 ranks x 2 steps then %d x 2 steps against 1 process: %.3g', math.max(n, 1), e))
    t.truthy(e <= 1e-5, 'resumed on ' .. math.max(n, 1) .. ': the weights of one process')
    t.eq(#metrics(d), 4, 'four steps logged, once each')
    if n == 3 then
      local last = '/checkpoints/step-000004'
      t.truthy(bytes(d .. '/model/model.safetensors') == bytes(dir .. '/resume23/model/model.safetensors'),
        'on 3 ranks: the weights of plain data parallel bit for bit')
      local state, shards = optimizer_state(d .. last)
      t.eq(#shards, 3, 'the last checkpoint: a shard file of each of the 3 ranks')
      same_state(optimizer_state(dir .. '/resume23' .. last), state, "the 3 ranks' shards against plain data parallel")
    else
      t.truthy(bytes(d .. '/model/model.safetensors') == bytes(old .. '/model/model.safetensors'),
        'on 1 process: the weights of plain data parallel 2 -> 1 bit for bit')
    end
  end
  -- the other way, 3 -> 2: the 3 ranks' shards of step 2 go on on 2 ranks (each reads pieces of
  -- two files), as plain data parallel's 3-rank checkpoint does on 2 plain ranks
  local plain32, zero32 = dir .. '/plain_resume32', dir .. '/zero_resume32'
  first_half(plain32, 0, 3)
  first_half(zero32, 1, 3)
  local _, files = optimizer_state(zero32 .. '/checkpoints/step-000002')
  t.eq(#files, 3, 'three shard files')
  run(2, 'recipes/sft.lua', with(SFT, 'run.dir=' .. plain32))
  run(2, 'recipes/sft.lua', with(SFT, 'run.dir=' .. zero32, 'dist.zero=1'))
  t.eq(#metrics(zero32), 4, 'four steps logged, once each')
  t.truthy(bytes(zero32 .. '/model/model.safetensors') == bytes(plain32 .. '/model/model.safetensors'),
    '3 -> 2 with zero=1: the weights of plain data parallel bit for bit')
  -- the manifest covers every shard: one missing or changed and the checkpoint does not verify
  local ckpt = require('moonrl.train.checkpoint')
  local ck = dir .. '/zero_resume23/checkpoints/step-000004'
  t.truthy(ckpt.verify(ck), 'the 3-rank checkpoint verifies')
  local shard = ck .. '/optimizer.rank-00001-of-00003.safetensors'
  local good = fs.read(shard)
  fs.write(shard, good:sub(1, -2) .. string.char((good:byte(-1) + 1) % 256))
  local ok, why = ckpt.verify(ck)
  t.truthy(not ok and why:find('optimizer.rank-00001-of-00003.safetensors: checksum', 1, true), tostring(why))
  fs.remove(shard)
  ok, why = ckpt.verify(ck)
  t.truthy(not ok and why:find('optimizer.rank-00001-of-00003.safetensors: missing', 1, true), tostring(why))
  -- a shard set that does not tile the state is refused naming the file, even past the manifest:
  -- the state read whole through a stand-in optimizer, first from a complete set (3 -> 2's
  -- last checkpoint, written by 2 ranks)
  local sd = zero32 .. '/checkpoints/step-000004'
  local safetensors = require('moonrl.io.safetensors')
  local name = safetensors.open(sd .. '/' .. ckpt.shard_file(0, 2)):names()[1]:match('^(.*)%.exp_avg')
  local n = 0
  for r = 0, 1 do n = n + safetensors.open(sd .. '/' .. ckpt.shard_file(r, 2)):info(name .. '.exp_avg').numel end
  local got
  local function load(want)
    local loaded, err = pcall(ckpt.load_optimizer, sd, name, { n = want, load_state = function(_, st) got = st end })
    return loaded, tostring(err)
  end
  t.truthy(load(n) and got.n == n and got.step == 4, 'the two shards read whole: ' .. n .. ' floats, step 4')
  local loaded, err = load(n + 1)
  t.truthy(not loaded and err:find(ckpt.shard_file(0, 2) .. ': ' .. name .. '.total is ' .. n, 1, true), err)
  fs.copy(ck .. '/' .. ckpt.shard_file(0, 3), sd .. '/' .. ckpt.shard_file(0, 3))
  loaded, err = load(n)
  t.truthy(not loaded and err:find('a shard of %d ranks beside shards of %d') ~= nil, err)
  fs.remove(sd .. '/' .. ckpt.shard_file(0, 3))
  fs.remove(sd .. '/' .. ckpt.shard_file(1, 2))
  loaded, err = load(n)
  t.truthy(not loaded and err:find(ckpt.shard_file(1, 2) .. ': missing (the shards are of 2 ranks)', 1, true), err)
end)

t.test('zero=1: a shard write that fails on one rank fails the checkpoint on every rank, at once', function()
  -- rank 1's optimizer shard cannot be written (a --require hook makes the write raise, as a full
  -- disk would): both ranks end within the collective's agreement, not after dist.timeout, the
  -- error names rank 1 and its file, and no checkpoint (no manifest over a missing shard) is left
  local hook = dir .. '/fail_shard_rank1.lua'
  fs.write(hook, [[
if tonumber(os.getenv('OMPI_COMM_WORLD_RANK') or '0') == 1 then
  local W = getmetatable(require('moonrl.io.safetensors').writer())
  local write = W.write
  W.write = function(self, path)
    if path:find('optimizer.rank-', 1, true) then error(path .. ': no space left on device (injected)', 0) end
    return write(self, path)
  end
end
]])
  local d = dir .. '/zero_shard_fails'
  local t0 = require('moonrl').now()
  local r = run(2, 'recipes/sft.lua', with(SFT, '--require', hook, 'run.dir=' .. d, 'run.checkpoint_every=1', 'dist.zero=1',
    'dist.timeout=60'), { expect_fail = true })
  local secs = require('moonrl').now() - t0
  local text = r.stdout .. r.stderr
  t.truthy(not r.ok, 'the job failed')
  t.truthy(secs < 30, string.format('at once, not after dist.timeout (%.1f s)', secs))
  t.truthy(text:find('rank 1: [^\n]*optimizer%.rank%-00001%-of%-00002%.safetensors: no space left on device') ~= nil, text)
  t.eq(#require('moonrl.train.checkpoint').list(d .. '/checkpoints'), 0, 'no checkpoint')
  t.truthy(not fs.exists(d .. '/checkpoints/.tmp-step-000001'), 'the partial one removed')
end)

t.test('a hung rank: the others fail after dist.timeout, naming it', function()
  local t0 = require('moonrl').now()
  local r = run(2, 'recipes/sft.lua', with(SFT, 'run.dir=' .. dir .. '/hang', 'dist.timeout=3'),
    { env = { 'MOONRL_FAULT=hang:step=2:rank=1' }, expect_fail = true, timeout = 90 })
  local secs = require('moonrl').now() - t0
  local text = r.stdout .. r.stderr
  t.truthy(not r.ok, 'the job failed')
  t.truthy(secs < 60, string.format('within a minute (%.1f s)', secs))
  t.truthy(text:find('rank 1') ~= nil, 'the report names rank 1')
  t.truthy(text:find('step 2') ~= nil, 'and the step')
  if not (text:find('rank 1') and text:find('step 2')) then io.stderr:write(text) end
end)

t.test('a killed rank: moonrl launch --restarts ends with the weights of a clean run', function()
  -- killed in a step; and, with zero=1, killed while writing its optimizer shard of step 2's
  -- checkpoint (after 1000 bytes of it): no manifest, so the restart resumes from step 1's
  for _, case in ipairs({ { 'killed', 'kill:step=3:phase=train:rank=1:attempt=0' },
    { 'killed_zero_ckpt', 'kill:checkpoint=2:bytes=1000:rank=1:attempt=0', 'dist.zero=1' } }) do
    local d = dir .. '/' .. case[1]
    local words = with(SFT, 'run.dir=' .. d, 'run.checkpoint_every=1', 'dist.timeout=20', case[3])
    local argv = { exe, 'launch', '-n', '2', '--restarts', '2', '--backoff', '0.1', '--mpirun', '--mca btl vader,self',
      'recipes/sft.lua' }
    for _, w in ipairs(words) do argv[#argv + 1] = w end
    local r = proc.run({ '/usr/bin/env', 'PATH=' .. os.getenv('PATH'), 'MOONRL_FAULT=' .. case[2], 'MOONRL_THREADS=1',
      unpack(argv) }, { timeout = 180 })
    if not r.ok then io.stderr:write(r.stdout, r.stderr) end
    t.truthy(r.ok, case[1] .. ': the supervised job finished')
    t.truthy((r.stderr or ''):find('restarting') ~= nil, case[1] .. ': after a restart')
    t.truthy(bytes(d .. '/model/model.safetensors') == bytes(dir .. '/sft2/model/model.safetensors'),
      case[1] .. ': the same weights as a clean 2-rank run')
    t.eq(#metrics(d), 4, case[1] .. ': each step logged once')
    if case[3] then
      t.truthy(r.stderr:find('checkpoint write after 1000 bytes', 1, true), 'rank 1 was killed in the write')
      local from
      for line in io.lines(d .. '/events.jsonl') do
        local e = json.decode(line)
        if e.event == 'resume' then from = e.checkpoint end
      end
      t.truthy(from and from:find('step%-000001$'), 'resumed from the checkpoint before: ' .. tostring(from))
    end
  end
end)

t.test('moonrl launch: SIGTERM reaches every rank, which stop at the same step with a checkpoint', function()
  local C = require('moonrl').C
  local d = dir .. '/sigterm'
  local argv = { exe, 'launch', '-n', '2', '--mpirun', '--mca btl vader,self', 'recipes/sft.lua' }
  for _, w in ipairs(with(SFT, 'run.dir=' .. d, 'train.steps=100000', 'train.batch=4')) do argv[#argv + 1] = w end
  local cargv = ffi.new('const char *[?]', #argv + 1)
  for i, a in ipairs(argv) do cargv[i - 1] = a end
  local out = ffi.new('mrl_child *[1]')
  require('moonrl').check(C.mrl_child_spawn(cargv, nil, out))
  local child = ffi.gc(out[0], C.mrl_child_free)
  local deadline = require('moonrl').now() + 60
  while require('moonrl').now() < deadline do -- a few steps first
    local m = fs.read(d .. '/metrics.jsonl')
    if m and select(2, m:gsub('\n', '')) >= 3 then break end
    C.mrl_child_poll(child, 0.1)
  end
  C.mrl_child_signal(child, 15)
  local finished = C.mrl_child_poll(child, 60) ~= 0
  t.truthy(finished, 'the launcher ended')
  t.eq(tonumber(C.mrl_child_status(child)), 143, 'with the status of a SIGTERM stop')
  local steps = #metrics(d)
  local names = fs.list(d .. '/checkpoints')
  t.truthy(names[#names] == string.format('step-%06d', steps),
    string.format('a checkpoint of the last step logged (%d): %s', steps, table.concat(names, ' ')))
end)

fs.remove(dir)
t.done()
