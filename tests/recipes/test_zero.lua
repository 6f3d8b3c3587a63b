-- Sharded training state over ranks (mpirun, one thread a rank): ZeRO-2 (dist.zero=2, each rank
-- keeps only its shard of the gradients and of the optimizer state). An update whose backward is
-- one micro-batch a rank gives the bits of plain data parallel (dist.zero=0) on the same world
-- size for SFT, DPO and GRPO; with several micro-batches (each one's sum over the ranks added to
-- the shard, as DeepSpeed and FSDP accumulate) it agrees within 1e-5. No rank makes the whole
-- gradient buffer; a checkpoint resumes on another world size and ZeRO level; a poisoned shard
-- stops the update on every rank.
local t = require('moonrl.testing')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')
local proc = require('moonrl.io.proc')
local U = dofile('tests/recipes/util.lua')

local exe = rawget(_G, 'MOONRL_EXE')
local mpirun = U.which('mpirun')
if not (exe and mpirun) then
  io.stdout:write('(skipped: needs the moonrl executable and mpirun)\n')
  os.exit(77)
end

local dir = U.tmpdir('zero')
local model_dir, sft_data, pref_data, rl_data = U.ranks_setup(dir)

-- Run a recipe on n ranks (0: one process); opts.env: variables for every rank; opts.expect_fail.
local function run(n, recipe, words, opts)
  opts = opts or {}
  opts.timeout = opts.timeout or 180
  return U.run_ranks(exe, n, recipe, words, opts)
end

local function model_bytes(d) return fs.read(d .. '/model/model.safetensors') end

local rel_diff = U.rel_diff
local function weights(d) return U.weights(d .. '/model/model.safetensors') end

local function event(d, name)
  for line in io.lines(d .. '/events.jsonl') do
    local e = json.decode(line)
    if e.event == name then return e end
  end
end

-- one micro-batch a rank (micro_batch_tokens past the local batch) and several (40 tokens)
local BASE = { 'model.dir=' .. model_dir, 'run.threads=1', 'train.lr=1e-3' }
local SFT = U.with(BASE, { 'quiet=true', 'data.path=' .. sft_data, 'train.steps=4', 'train.batch=12' })
local DPO = U.with(BASE, { 'quiet=true', 'data.path=' .. pref_data, 'train.steps=3', 'train.pairs=6' })
local GRPO = U.with(BASE, { 'data.path=' .. rl_data, 'data.prompt=question', 'data.chat=false', 'reward=exact',
  'grpo.prompts=6', 'grpo.samples=4', 'grpo.max_tokens=4', 'grpo.steps=3' })
local ONE, MANY = 'train.micro_batch_tokens=4096', 'train.micro_batch_tokens=40'

t.test('zero=2 equals plain data parallel bit for bit (one micro-batch a rank): sft, dpo, grpo, bf16 sft on 2 and 3 ranks', function()
  for _, case in ipairs({ { 'recipes/sft.lua', SFT }, { 'recipes/dpo.lua', DPO }, { 'recipes/grpo.lua', GRPO },
    { 'recipes/sft.lua', U.with(SFT, { 'model.dtype=bf16' }), 'sft_bf16' } }) do
    local recipe, words = case[1], U.with(case[2], { ONE })
    local name = case[3] or recipe:match('(%a+)%.lua$')
    for _, n in ipairs({ 2, 3 }) do
      local plain, z2 = string.format('%s/%s_plain%d', dir, name, n), string.format('%s/%s_zero2_%d', dir, name, n)
      run(n, recipe, U.words(words, plain))
      run(n, recipe, U.words(words, z2, { 'dist.zero=2' }))
      t.truthy(model_bytes(z2) == model_bytes(plain), string.format('%s on %d ranks: zero=2 gives the bits of zero=0', name, n))
      local pm, zm = U.records(plain), U.records(z2)
      t.eq(#zm, #pm, name .. ': each step logged once')
      for i = 1, #pm do t.eq(zm[i].grad_norm, pm[i].grad_norm, string.format('%s step %d grad_norm', name, i)) end
      local ev = event(z2, 'data_parallel')
      t.eq(ev and ev.zero, 2, name .. ': the data_parallel event records zero=2')
    end
  end
end)

t.test('zero=2 with expert parallelism (qwen3_moe, moe.expert_parallel on 2 ranks): the bits of zero=0', function()
  local moe = dir .. '/moe'
  dofile('tests/lib/models.lua').save(moe, 'qwen3_moe', nil, { seed = 4 })
  local words = U.with(SFT, { ONE, 'model.dir=' .. moe, 'train.steps=3', 'moe.expert_parallel=true' })
  local plain, z2 = dir .. '/moe_plain', dir .. '/moe_zero2'
  run(2, 'recipes/sft.lua', U.words(words, plain))
  run(2, 'recipes/sft.lua', U.words(words, z2, { 'dist.zero=2' }))
  t.truthy(model_bytes(z2) == model_bytes(plain), 'expert parallel sft: zero=2 gives the bits of zero=0')
end)

t.test('zero=2 with several micro-batches a rank: within 1e-5 of plain data parallel and of one process', function()
  local words = U.with(SFT, { MANY })
  local one, plain, z2 = dir .. '/many1', dir .. '/many_plain', dir .. '/many_zero2'
  run(0, 'recipes/sft.lua', U.words(words, one))
  run(2, 'recipes/sft.lua', U.words(words, plain))
  run(2, 'recipes/sft.lua', U.words(words, z2, { 'dist.zero=2' }))
  local e_plain, e_one = rel_diff(weights(plain), weights(z2)), rel_diff(weights(one), weights(z2))
  print(string.format('  zero=2, 2 ranks, 40-token micro-batches: relative weight difference %.3g to zero=0, %.3g to 1 process',
    e_plain, e_one))
  t.truthy(e_plain <= 1e-5 and e_one <= 1e-5, 'within 1e-5')
  local pm, zm = U.records(plain), U.records(z2)
  for i = 1, #pm do
    t.truthy(math.abs(pm[i].loss - zm[i].loss) <= 1e-5 * math.abs(pm[i].loss), 'step ' .. i .. ' loss')
  end
end)

t.test('zero=2 on 2 ranks: no whole gradient buffer; the shard, windows and scratch are what a rank holds', function()
  -- 16 layers, so that a layer's window is small against the whole, and 1 MB segments (the
  -- scratch: two segments' pieces from every rank); plain data parallel holds the whole
  -- gradient (4 bytes a parameter) on every rank
  local d0 = dir .. '/mem'
  local big = U.tiny_model(d0 .. '/init', { layers = 16, hidden_size = 192, intermediate_size = 576 })
  local words = U.with(SFT, { ONE, 'model.dir=' .. big, 'train.steps=2', 'dist.bucket_mb=1' })
  local plain, z2 = d0 .. '/plain', d0 .. '/zero2'
  run(2, 'recipes/sft.lua', U.words(words, plain), { env = { 'MALLOC_PERTURB_=0' } })
  run(2, 'recipes/sft.lua', U.words(words, z2, { 'dist.zero=2' }), { env = { 'MALLOC_PERTURB_=0' } })
  local n = event(plain, 'data_parallel').state_bytes / 8
  local whole_mb = 4 * n / 2 ^ 20
  local pm, zm = U.records(plain), U.records(z2)
  for i = 1, #pm do
    local p, z = pm[i]['memory/grads_mb'], zm[i]['memory/grads_mb']
    print(string.format('  step %d rank 0 gradients: plain %.2f MiB, zero=2 %.2f MiB (the whole: %.2f MiB)', i, p, z,
      whole_mb))
    t.truthy(p >= whole_mb - 0.01, 'plain data parallel holds the whole gradient')
    t.truthy(z <= 0.75 * p, string.format('step %d: zero=2 holds its half and the windows: %.2f MiB of %.2f', i, z, p))
    t.truthy(zm[i]['memory/peak_mb'] <= pm[i]['memory/peak_mb'] - whole_mb / 4,
      string.format('step %d: the peak falls with it: %.2f MiB against %.2f', i, zm[i]['memory/peak_mb'],
        pm[i]['memory/peak_mb']))
  end
  t.truthy(model_bytes(z2) == model_bytes(plain), 'and the same bits')
end)

t.test('zero=2 checkpoints: 2 ranks resume on 3 (zero=2), on 2 with zero=1 and on 1 process', function()
  local words = U.with(SFT, { ONE, 'run.checkpoint_every=1' })
  -- plain data parallel's 2 -> 3 is the reference for the bits
  local function first_half(d, zero)
    local r = run(2, 'recipes/sft.lua', U.words(words, d, { 'dist.zero=' .. zero }),
      { env = { 'MOONRL_FAULT=exit:step=3:phase=step' }, expect_fail = true })
    t.truthy(not r.ok, 'the first job died at step 3')
  end
  local plain = dir .. '/ck_plain'
  first_half(plain, 0)
  run(3, 'recipes/sft.lua', U.words(words, plain))
  local cases = { { 3, 'dist.zero=2', 'on 3 ranks with zero=2: plain 2 -> 3 bit for bit' },
    { 2, 'dist.zero=1', 'on 2 ranks with zero=1' }, { 0, 'dist.zero=0', 'on 1 process' } }
  local one = dir .. '/ck_one'
  run(0, 'recipes/sft.lua', U.words(U.with(SFT, { ONE }), one))
  for i, c in ipairs(cases) do
    local d = dir .. '/ck_zero2_' .. i
    first_half(d, 2)
    local files = {}
    for _, f in ipairs(fs.list(d .. '/checkpoints/step-000002')) do
      if f:match('^optimizer') then files[#files + 1] = f end
    end
    t.eq(#files, 2, 'zero=2 writes an optimizer shard file a rank')
    run(c[1], 'recipes/sft.lua', U.words(words, d, { c[2] }))
    t.eq(#U.records(d), 4, 'four steps logged, once each')
    if c[1] == 3 then
      t.truthy(model_bytes(d) == model_bytes(plain), c[3])
    else
      local e = rel_diff(weights(one), weights(d))
      print(string.format('  zero=2 2 ranks x 2 steps, then %s: %.3g to one process', c[3], e))
      t.truthy(e <= 1e-5, c[3] .. ': the weights of one process within 1e-5')
    end
  end
end)

t.test('zero=2: NaN gradients in the shards skip the update on every rank, as plain data parallel does', function()
  local words = U.with(SFT, { ONE })
  local plain, z2 = dir .. '/nan_plain', dir .. '/nan_zero2'
  local env = { 'MOONRL_FAULT=nan:step=2' }
  run(2, 'recipes/sft.lua', U.words(words, plain), { env = env })
  run(2, 'recipes/sft.lua', U.words(words, z2, { 'dist.zero=2' }), { env = env })
  local zm = U.records(z2)
  t.eq(zm[2]['guard/skipped'], 1, 'step 2 skipped')
  t.truthy(model_bytes(z2) == model_bytes(plain), 'the same weights as plain data parallel after the skip')
end)

t.test('zero=2 on one process is that process\'s run; an unknown level is a usage error', function()
  -- one process: nothing to shard, the key is accepted and the run is that of one process
  local one, z = dir .. '/solo', dir .. '/solo_zero2'
  run(0, 'recipes/sft.lua', U.words(U.with(SFT, { ONE }), one))
  run(0, 'recipes/sft.lua', U.words(U.with(SFT, { ONE }), z, { 'dist.zero=2' }))
  t.truthy(model_bytes(z) == model_bytes(one), 'one process: the same run')
  local r = proc.run({ exe, 'run', 'recipes/sft.lua', 'run.dir=' .. dir .. '/bad', 'model.dir=' .. model_dir,
    'data.path=' .. sft_data, 'dist.zero=4', 'quiet=true' },
    { timeout = 60 })
  t.eq(r.exit_status, 2, 'dist.zero=4: a usage error')
  t.truthy(r.stderr:find('dist.zero', 1, true) ~= nil, r.stderr)
end)

fs.remove(dir)
t.done()
