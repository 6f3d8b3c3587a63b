-- Sharded training state over ranks (mpirun, one thread a rank): ZeRO-2 (dist.zero=2, each rank
-- keeps only its shard of the gradients and of the optimizer state) and ZeRO-3 (dist.zero=3, and
-- of the parameters, each part of the model gathered into place as it computes). An update whose
-- backward is one micro-batch a rank gives the bits of plain data parallel (dist.zero=0) on the
-- same world size for SFT, DPO and GRPO; with several micro-batches (each one's sum over the ranks
-- added to the shard, as DeepSpeed and FSDP accumulate) it agrees within 1e-5. No rank makes the
-- whole gradient buffer, nor (ZeRO-3) holds the whole parameters; a checkpoint resumes on another
-- world size and ZeRO level; a poisoned shard stops the update on every rank; under a memory
-- budget one process cannot meet, 4 ranks with ZeRO-3 train the model.
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
local function weights(d) return U.weights(d .. '/model') end -- (one file or shards with an index)

local event = U.event

-- one micro-batch a rank (micro_batch_tokens past the local batch) and several (40 tokens)
local BASE = { 'model.dir=' .. model_dir, 'run.threads=1', 'train.lr=1e-3' }
local SFT = U.with(BASE, { 'quiet=true', 'data.path=' .. sft_data, 'train.steps=4', 'train.batch=12' })
local DPO = U.with(BASE, { 'quiet=true', 'data.path=' .. pref_data, 'train.steps=3', 'train.pairs=6' })
-- (GRPO with a reward a tiny random model earns in part from its first step: every step moves the weights)
local GRPO_RECIPE = 'tests/recipes/grpo_sevens.lua'
local GRPO = U.with(BASE, { 'data.path=' .. rl_data, 'data.prompt=question', 'data.chat=false', 'reward=sevens',
  'grpo.prompts=6', 'grpo.samples=4', 'grpo.max_tokens=4', 'grpo.steps=3' })
local PPO = U.with(BASE, { 'data.path=' .. rl_data, 'data.prompt=question', 'data.chat=false', 'reward=exact',
  'ppo.prompts=6', 'ppo.samples=2', 'ppo.max_tokens=4', 'ppo.steps=2' })
local ONE, MANY = 'train.micro_batch_tokens=4096', 'train.micro_batch_tokens=40'

local copy_mb = {} -- the engine's copy, by case, zero and world size
t.test('zero=2 and 3 equal plain data parallel bit for bit (one micro-batch a rank): sft, dpo, grpo, grpo with a reference, ppo with its critic, bf16 sft and grpo (the engine\'s bf16 compute copy) on 2 and 3 ranks, sft, dpo and grpo on 4', function()
  for _, case in ipairs({ { 'recipes/sft.lua', SFT }, { 'recipes/dpo.lua', DPO }, { GRPO_RECIPE, GRPO, 'grpo' },
    { 'recipes/ppo.lua', PPO },
    { GRPO_RECIPE, U.with(GRPO, { 'grpo.kl_coef=0.1' }), 'grpo_kl' },
    { 'recipes/sft.lua', U.with(SFT, { 'model.dtype=bf16' }), 'sft_bf16' },
    { GRPO_RECIPE, U.with(GRPO, { 'model.dtype=bf16' }), 'grpo_bf16' } }) do
    local recipe, words = case[1], U.with(case[2], { ONE })
    local name = case[3] or recipe:match('(%a+)%.lua$')
    -- (4 ranks: sft, dpo and grpo)
    for _, n in ipairs((name == 'sft' or name == 'dpo' or name == 'grpo') and { 2, 3, 4 } or { 2, 3 }) do
      local plain = string.format('%s/%s_plain%d', dir, name, n)
      run(n, recipe, U.words(words, plain))
      local pm = U.records(plain)
      for _, zero in ipairs({ 2, 3 }) do
        local z = string.format('%s/%s_zero%d_%d', dir, name, zero, n)
        run(n, recipe, U.words(words, z, { 'dist.zero=' .. zero }))
        t.truthy(model_bytes(z) == model_bytes(plain),
          string.format('%s on %d ranks: zero=%d gives the bits of zero=0', name, n, zero))
        if name == 'ppo' then
          t.truthy(fs.read(z .. '/critic/model.safetensors') == fs.read(plain .. '/critic/model.safetensors'),
            string.format('ppo on %d ranks: zero=%d: the critic too', n, zero))
        end
        local zm = U.records(z)
        t.eq(#zm, #pm, name .. ': each step logged once')
        for i = 1, #pm do
          t.eq(zm[i].grad_norm, pm[i].grad_norm, string.format('%s zero=%d step %d grad_norm', name, zero, i))
        end
        local ev = event(z, 'data_parallel')
        t.eq(ev and ev.zero, zero, name .. ': the data_parallel event records the level')
        copy_mb[name .. zero .. n] = zm[#zm]['memory/engine_copy_mb']
      end
    end
  end
  -- the engine's copy of a sharded policy: whole fp32, or in bf16 its compute copy (other bytes)
  for _, n in ipairs({ 2, 3 }) do
    t.truthy(copy_mb['grpo3' .. n] and copy_mb['grpo_bf163' .. n] and copy_mb['grpo_bf163' .. n] ~= copy_mb['grpo3' .. n],
      'bf16 grpo on ' .. n .. ' ranks: the engine reads its bf16 compute copy')
  end
end)

t.test('zero=2 and 3 with expert parallelism (qwen3_moe, moe.expert_parallel on 2 ranks): the bits of zero=0', function()
  local moe = dir .. '/moe'
  dofile('tests/lib/models.lua').save(moe, 'qwen3_moe', nil, { seed = 4 })
  local words = U.with(SFT, { ONE, 'model.dir=' .. moe, 'train.steps=3', 'moe.expert_parallel=true' })
  local plain = dir .. '/moe_plain'
  run(2, 'recipes/sft.lua', U.words(words, plain))
  for _, zero in ipairs({ 2, 3 }) do
    local z = dir .. '/moe_zero' .. zero
    run(2, 'recipes/sft.lua', U.words(words, z, { 'dist.zero=' .. zero }))
    t.truthy(model_bytes(z) == model_bytes(plain), 'expert parallel sft: zero=' .. zero .. ' gives the bits of zero=0')
  end
  -- bf16 GRPO: the engine's compute copy holds the experts in bf16
  local grpo = U.with(GRPO, { ONE, 'model.dir=' .. moe, 'moe.expert_parallel=true', 'model.dtype=bf16', 'grpo.steps=2' })
  run(2, GRPO_RECIPE, U.words(grpo, dir .. '/moe_grpo_plain'))
  run(2, GRPO_RECIPE, U.words(grpo, dir .. '/moe_grpo_zero3', { 'dist.zero=3' }))
  t.truthy(model_bytes(dir .. '/moe_grpo_plain') and model_bytes(dir .. '/moe_grpo_zero3') == model_bytes(dir .. '/moe_grpo_plain'),
    'expert parallel bf16 grpo: zero=3 gives the bits of zero=0')
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

t.test('zero=2 and 3 with ranks of different micro-batch counts (3 samples over 2 ranks, small micro-batches): the ranks with fewer pass empty ones through the collectives; within 1e-5 of plain data parallel and of one process', function()
  -- (the held-out loss too: its forwards gather the shards under zero=3)
  local words = U.with(SFT, { 'train.batch=3', 'train.micro_batch_tokens=12', 'eval.every=1', 'dist.timeout=30' })
  local one, plain = dir .. '/uneven1', dir .. '/uneven_plain'
  run(0, 'recipes/sft.lua', U.words(words, one))
  run(2, 'recipes/sft.lua', U.words(words, plain))
  for _, zero in ipairs({ 2, 3 }) do
    local d = dir .. '/uneven_zero' .. zero
    run(2, 'recipes/sft.lua', U.words(words, d, { 'dist.zero=' .. zero }))
    local e_plain, e_one = rel_diff(weights(plain), weights(d)), rel_diff(weights(one), weights(d))
    print(string.format('  zero=%d, 2 ranks of 2 and 1 samples, 12-token micro-batches: %.3g to zero=0, %.3g to 1 process',
      zero, e_plain, e_one))
    t.truthy(e_plain <= 1e-5 and e_one <= 1e-5, 'zero=' .. zero .. ': within 1e-5')
    local pm, zm = U.records(plain), U.records(d)
    for i = 1, #pm do
      t.truthy(math.abs(pm[i].eval_loss - zm[i].eval_loss) <= 1e-5 * math.abs(pm[i].eval_loss),
        'zero=' .. zero .. ' step ' .. i .. ': the held-out loss')
    end
  end
end)

t.test('zero=2 on 2 ranks: no whole gradient buffer; the shard, windows and scratch are what a rank holds', function()
  -- 16 layers, so that a layer's window is small against the whole, and 1 MB segments (the
  -- scratch: two segments' pieces from every rank); plain data parallel holds the whole
  -- gradient (4 bytes a parameter) on every rank
  local d0 = dir .. '/mem'
  local big = U.tiny_model(d0 .. '/init', { layers = 16, hidden_size = 192, intermediate_size = 576 })
  local words = U.with(SFT, { ONE, 'model.dir=' .. big, 'train.steps=2', 'dist.bucket_mb=1' })
  local plain, z2, z3 = d0 .. '/plain', d0 .. '/zero2', d0 .. '/zero3'
  run(2, 'recipes/sft.lua', U.words(words, plain), { env = { 'MALLOC_PERTURB_=0' } })
  run(2, 'recipes/sft.lua', U.words(words, z2, { 'dist.zero=2' }), { env = { 'MALLOC_PERTURB_=0' } })
  run(2, 'recipes/sft.lua', U.words(words, z3, { 'dist.zero=3' }), { env = { 'MALLOC_PERTURB_=0' } })
  local n = event(plain, 'data_parallel').state_bytes / 8
  local whole_mb = 4 * n / 2 ^ 20
  local pm, zm, z3m = U.records(plain), U.records(z2), U.records(z3)
  for i = 1, #pm do
    local p, z = pm[i]['memory/grads_mb'], zm[i]['memory/grads_mb']
    print(string.format('  step %d rank 0 gradients: plain %.2f MiB, zero=2 %.2f MiB (the whole: %.2f MiB)', i, p, z,
      whole_mb))
    t.truthy(p >= whole_mb - 0.01, 'plain data parallel holds the whole gradient')
    t.truthy(z <= 0.51 * p, string.format('step %d: zero=2 holds its half after the step: %.2f MiB of %.2f', i, z, p))
    -- during the backward, the windows of a few layers (a layer is 1/16 of the model here)
    local win = zm[i]['memory/grads_windows_peak_mb']
    print(string.format('  step %d zero=2: the windows held at most %.2f MiB at once', i, win))
    t.truthy(win > 0 and win <= 4 * whole_mb / 16, 'a few layers\' windows at once')
    t.truthy(zm[i]['memory/peak_mb'] <= pm[i]['memory/peak_mb'] - whole_mb / 4,
      string.format('step %d: the peak falls with it: %.2f MiB against %.2f', i, zm[i]['memory/peak_mb'],
        pm[i]['memory/peak_mb']))
    -- ZeRO-3: the parameters too (its shard and the parts in flight), so the training state
    local function state(m) return m['memory/params_mb'] + m['memory/grads_mb'] + m['memory/optim_mb'] end
    print(string.format('  step %d rank 0 parameters: plain %.2f MiB, zero=3 %.2f MiB; training state %.2f against %.2f',
      i, pm[i]['memory/params_mb'], z3m[i]['memory/params_mb'], state(z3m[i]), state(pm[i])))
    t.truthy(z3m[i]['memory/params_mb'] <= 0.7 * pm[i]['memory/params_mb'], 'zero=3: the shard and a few layers')
    t.truthy(state(z3m[i]) <= 0.65 * state(pm[i]), string.format('zero=3 on 2 ranks: %.2f MiB of state against %.2f',
      state(z3m[i]), state(pm[i])))
    -- the accounting's parts: the shard, and the most gathered into place at once (a layer is
    -- 1/16 of the model here: the one in use, the next, a tied head's embedding)
    local shard, gathered = z3m[i]['memory/params_shard_mb'], z3m[i]['memory/params_gathered_peak_mb']
    print(string.format('  step %d zero=3 rank 0: shard %.2f MiB, at most %.2f MiB gathered at once', i, shard, gathered))
    t.truthy(math.abs(shard - whole_mb / 2) <= 0.01 and shard <= z3m[i]['memory/params_mb'], 'the shard: half the parameters')
    t.truthy(gathered > 0 and gathered <= 3 * whole_mb / 16 + 0.1, 'a few layers gathered at a time')
  end
  t.truthy(model_bytes(z2) == model_bytes(plain), 'and the same bits')
  t.truthy(model_bytes(z3) == model_bytes(plain), 'zero=3 too')
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

t.test('zero=3 checkpoints: 2 ranks resume on 3, on 1 process and on 2 with zero=0; 4 on 2 and on 1; 1 process resumes on 2 and on 4 with zero=3', function()
  -- (the checkpoints' models in shards of 20 kB with an index: each rank reads its ranges across the files)
  local words = U.with(SFT, { ONE, 'run.checkpoint_every=1', 'run.max_shard_gb=0.00002' })
  local function first_half(n, d, zero)
    local r = run(n, 'recipes/sft.lua', U.words(words, d, { 'dist.zero=' .. zero }),
      { env = { 'MOONRL_FAULT=exit:step=3:phase=step' }, expect_fail = true })
    t.truthy(not r.ok, 'the first job died at step 3')
  end
  local plain = dir .. '/ck_plain' -- (2 -> 3 of plain data parallel, made by the zero=2 test)
  local one = dir .. '/ck_one'
  for i, c in ipairs({ { 3, 'dist.zero=3' }, { 0, 'dist.zero=0' }, { 2, 'dist.zero=0' } }) do
    local d = dir .. '/ck3_' .. i
    first_half(2, d, 3)
    local ck = d .. '/checkpoints/step-000002'
    t.truthy(fs.exists(ck .. '/model.safetensors.index.json') and fs.exists(ck .. '/optimizer.rank-00001-of-00002.safetensors'),
      'zero=3: the whole model (gathered, written by rank 0, in shards with an index) and a shard file a rank')
    t.truthy(require('moonrl.train.checkpoint').verify(ck), 'the checkpoint verifies')
    run(c[1], 'recipes/sft.lua', U.words(words, d, { c[2] }))
    t.eq(#U.records(d), 4, 'four steps logged, once each')
    if c[1] == 3 then
      t.eq(rel_diff(weights(plain), weights(d)), 0, 'on 3 ranks with zero=3: plain 2 -> 3 bit for bit')
    else
      local e = rel_diff(weights(one), weights(d))
      print(string.format('  zero=3 2 ranks x 2 steps, then %s on %d: %.3g to one process', c[2], math.max(c[1], 1), e))
      t.truthy(e <= 1e-5, 'the weights of one process within 1e-5')
    end
  end
  -- one process's checkpoint on 2 and on 4 ranks with zero=3 (each reads its ranges): plain 1 -> n's bits
  for _, n in ipairs({ 2, 4 }) do
    local a, b = dir .. '/ck1' .. n .. '_plain', dir .. '/ck1' .. n .. '_zero3'
    first_half(0, a, 0)
    t.truthy(proc.run({ 'cp', '-a', a, b }).ok)
    run(n, 'recipes/sft.lua', U.words(words, a))
    run(n, 'recipes/sft.lua', U.words(words, b, { 'dist.zero=3' }))
    t.eq(rel_diff(weights(a), weights(b)), 0, '1 -> ' .. n .. ' with zero=3: plain data parallel bit for bit')
  end
  -- 4 ranks' checkpoint (zero=3) on 2 ranks and on 1
  for _, n in ipairs({ 2, 0 }) do
    local d = dir .. '/ck4_' .. n
    first_half(4, d, 3)
    t.truthy(fs.exists(d .. '/checkpoints/step-000002/optimizer.rank-00003-of-00004.safetensors'), '4 shard files')
    run(n, 'recipes/sft.lua', U.words(words, d, { 'dist.zero=' .. (n > 0 and 3 or 0) }))
    local e = rel_diff(weights(one), weights(d))
    print(string.format('  zero=3 4 ranks x 2 steps, then %d: %.3g to one process', math.max(n, 1), e))
    t.truthy(#U.records(d) == 4 and e <= 1e-5, '4 -> ' .. math.max(n, 1) .. ': the weights of one process within 1e-5')
  end
end)

t.test('zero=3: a rank killed in a checkpoint write (its optimizer shard; rank 0 in the model it writes) leaves the one before, and --restarts ends with a clean run', function()
  local clean = dir .. '/kill_clean'
  local words = U.with(SFT, { ONE, 'run.checkpoint_every=1', 'dist.timeout=20', 'dist.zero=3' })
  run(2, 'recipes/sft.lua', U.words(words, clean))
  for _, case in ipairs({ { 'kill_shard', 'kill:checkpoint=2:bytes=1000:rank=1:attempt=0' },
    { 'kill_model', 'kill:checkpoint=2:bytes=1000:rank=0:attempt=0' } }) do
    local d = dir .. '/' .. case[1]
    local argv = { '/usr/bin/env', 'PATH=' .. os.getenv('PATH'), 'MOONRL_FAULT=' .. case[2], 'MOONRL_THREADS=1', exe,
      'launch', '-n', '2', '--restarts', '2', '--backoff', '0.1', '--mpirun', '--mca btl vader,self', 'recipes/sft.lua' }
    for _, w in ipairs(U.words(words, d)) do argv[#argv + 1] = w end
    local r = proc.run(argv, { timeout = 180 })
    if not r.ok then io.stderr:write(r.stdout, r.stderr) end
    t.truthy(r.ok, case[1] .. ': the supervised job finished')
    t.truthy(r.stderr:find('checkpoint write after 1000 bytes', 1, true), case[1] .. ': killed in the write')
    t.truthy(model_bytes(d) == model_bytes(clean), case[1] .. ': the weights of a clean run')
    t.eq(#U.records(d), 4, case[1] .. ': each step logged once')
    local from
    for line in io.lines(d .. '/events.jsonl') do
      local e = json.decode(line)
      if e.event == 'resume' then from = e.checkpoint end
    end
    t.truthy(from and from:find('step%-000001$'), case[1] .. ': resumed from the checkpoint before: ' .. tostring(from))
  end
end)

t.test('zero=3 under a memory budget one process cannot meet: it fails at once naming the budget, 4 ranks train to the end', function()
  local d0 = dir .. '/budget'
  local big = U.tiny_model(d0 .. '/init', { layers = 16, hidden_size = 192, intermediate_size = 576 })
  local words = U.with(SFT, { ONE, 'model.dir=' .. big, 'train.steps=2', 'dist.bucket_mb=1', 'run.memory_budget_mb=80' })
  local r = run(0, 'recipes/sft.lua', U.words(words, d0 .. '/one'), { expect_fail = true })
  t.eq(r.exit_status, 2, 'one process: the budget error')
  t.truthy(r.stderr:find('run.memory_budget_mb', 1, true) ~= nil, r.stderr)
  local d4 = d0 .. '/four'
  run(4, 'recipes/sft.lua', U.words(words, d4, { 'dist.zero=3' }), { timeout = 300 })
  local m = U.records(d4)
  t.eq(#m, 2, '4 ranks with zero=3: both steps')
  print(string.format('  4 ranks, zero=3: rank 0 holds %.1f MiB at its peak (budget 80), the largest rank resident %.1f MiB',
    m[2]['memory/peak_mb'], m[2]['memory/max_rank_peak_mb']))
  t.truthy(m[2]['memory/peak_mb'] <= 80, 'within the budget')
end)

t.test('hybrid sharding (4 ranks, dist.shard_group=2): the bits of zero=0 on 4 ranks for sft and grpo, half the state a rank, its checkpoints resume on 2 and on 4 without groups', function()
  for _, case in ipairs({ { 'recipes/sft.lua', U.with(SFT, { ONE, 'run.checkpoint_every=2' }), 'sft' },
    { GRPO_RECIPE, U.with(GRPO, { ONE }), 'grpo' } }) do
    local plain = dir .. '/hsdp_plain_' .. case[3]
    run(4, case[1], U.words(case[2], plain), { timeout = 300 })
    for _, zero in ipairs({ 2, 3 }) do
      local d = string.format('%s/hsdp%d_%s', dir, zero, case[3])
      run(4, case[1], U.words(case[2], d, { 'dist.zero=' .. zero, 'dist.shard_group=2' }), { timeout = 300 })
      t.truthy(model_bytes(d) == model_bytes(plain),
        string.format('%s: zero=%d in shard groups of 2 gives the bits of zero=0 on 4 ranks', case[3], zero))
    end
  end
  -- a rank of a group of 2 holds half of the optimizer state (zero=3 over all 4: a quarter)
  local h, q = U.records(dir .. '/hsdp3_sft'), nil
  run(4, 'recipes/sft.lua', U.words(U.with(SFT, { ONE }), dir .. '/hsdp_quarter', { 'dist.zero=3' }), { timeout = 300 })
  q = U.records(dir .. '/hsdp_quarter')
  print(string.format('  4 ranks: optimizer state a rank %.3f MiB in groups of 2, %.3f MiB over all 4',
    h[1]['memory/optim_mb'], q[1]['memory/optim_mb']))
  t.truthy(math.abs(h[1]['memory/optim_mb'] - 2 * q[1]['memory/optim_mb']) <= 0.01 * h[1]['memory/optim_mb'],
    'groups of 2: half the state a rank, twice that of sharding over all 4')
  -- the checkpoint of step 2: one optimizer file a shard (2), written by the first group
  local ck = dir .. '/hsdp3_sft/checkpoints/step-000002'
  local files = {}
  for _, f in ipairs(fs.list(ck)) do if f:match('^optimizer') then files[#files + 1] = f end end
  table.sort(files)
  t.eq(table.concat(files, ' '), 'optimizer.rank-00000-of-00002.safetensors optimizer.rank-00001-of-00002.safetensors',
    'one optimizer file a shard')
  for _, c in ipairs({ { 2, { 'dist.zero=3' } }, { 4, { 'dist.zero=3' } } }) do
    local d = dir .. '/hsdp_resume' .. c[1]
    local words = U.with(SFT, { ONE, 'run.checkpoint_every=2' })
    local r = run(4, 'recipes/sft.lua', U.words(words, d, { 'dist.zero=3', 'dist.shard_group=2' }),
      { env = { 'MOONRL_FAULT=exit:step=3:phase=step' }, expect_fail = true, timeout = 300 })
    t.truthy(not r.ok, 'the groups of 2 died at step 3')
    run(c[1], 'recipes/sft.lua', U.words(words, d, c[2]), { timeout = 300 })
    t.eq(#U.records(d), 4, 'resumed: four steps')
    if c[1] == 4 then
      t.truthy(model_bytes(d) == model_bytes(dir .. '/hsdp_plain_sft'), 'groups of 2 -> all 4 sharding: the same bits')
    else
      local e = rel_diff(weights(dir .. '/hsdp_plain_sft'), weights(d))
      print(string.format('  groups of 2 on 4 ranks -> 2 ranks: %.3g to the 4-rank run', e))
      t.truthy(e <= 1e-5, 'on 2 ranks: within 1e-5')
    end
  end
  -- a group size that does not divide the ranks, and groups without ZeRO-2 or 3: usage errors
  for _, case in ipairs({ { { 'dist.zero=3', 'dist.shard_group=3' }, 'does not divide' },
    { { 'dist.zero=1', 'dist.shard_group=2' }, 'dist.zero=2 or 3' } }) do
    local r = run(4, 'recipes/sft.lua', U.words(U.with(SFT, case[1]), dir .. '/hsdp_bad'), { expect_fail = true })
    t.eq(r.exit_status, 2, table.concat(case[1], ' ') .. ': a usage error')
    t.truthy(r.stderr:find('dist.shard_group', 1, true) and r.stderr:find(case[2], 1, true), r.stderr)
  end
end)

t.test('zero=3 with asynchronous rollouts: one_step_off, async and engine threads (the engine\'s whole copy), and rollout ranks getting every trainer\'s shard (in shared memory, by MPI): the bits of zero=0', function()
  for _, case in ipairs({ { 2, { 'async.mode=one_step_off' }, 'off' },
    { 2, { 'async.mode=async', 'async.max_staleness=1' }, 'async' },
    { 2, { 'async.mode=one_step_off', 'async.engine_threads=1' }, 'threads' },
    { 3, { 'async.mode=one_step_off', 'dist.rollout_ranks=1' }, 'rollout', 'shared memory' },
    { 4, { 'async.mode=one_step_off', 'dist.rollout_ranks=1', 'async.weights=shm' }, 'rollout_shm', 'shared memory' },
    { 3, { 'async.mode=async', 'async.max_staleness=1', 'dist.rollout_ranks=1', 'async.weights=mpi' }, 'rollout_async',
      'trainer shards' } }) do
    local words = U.with(GRPO, U.with({ ONE, 'grpo.steps=4' }, case[2]))
    local plain, z3 = dir .. '/async_plain_' .. case[3], dir .. '/async_zero3_' .. case[3]
    run(case[1], GRPO_RECIPE, U.words(words, plain))
    run(case[1], GRPO_RECIPE, U.words(words, z3, { 'dist.zero=3' }))
    t.eq(#U.records(z3), 4, case[3] .. ': every step logged')
    t.truthy(model_bytes(z3) == model_bytes(plain), case[3] .. ': zero=3 gives the bits of zero=0')
    if case[4] then
      local ev = event(z3, 'rollout_weights')
      t.eq(ev and ev.via, case[4], case[3] .. ': how the rollout rank got the trainers\' shards')
    end
  end
  -- a guard's rollback (a spike at step 7, back to step 6's checkpoint): the shards read again and
  -- the engine's copy with them, the replay as zero=0's
  local RB = U.with(GRPO, { ONE, 'grpo.steps=8', 'guard.grad_spike=50', 'guard.action=rollback', 'run.checkpoint_every=2',
    'guard.skip_batch=false' })
  local spike = { env = { 'MOONRL_FAULT=spike:step=7:factor=1000:times=1' } }
  local rb0, rb3 = dir .. '/rb_plain', dir .. '/rb_zero3'
  run(2, GRPO_RECIPE, U.words(RB, rb0), spike)
  run(2, GRPO_RECIPE, U.words(RB, rb3, { 'dist.zero=3' }), spike)
  local ev = event(rb3, 'rollback')
  t.truthy(ev and ev.step == 7 and ev.to_step == 6, 'zero=3: rolled back at step 7 to step 6')
  t.truthy(model_bytes(rb3) == model_bytes(rb0), 'zero=3 after a rollback: the bits of zero=0')
  -- hybrid sharding with a rollout rank (4 trainers in groups of 2: the second group's replicas
  -- send nothing), through shared memory and by MPI: the bits of zero=0
  local hs = U.with(GRPO, { ONE, 'grpo.steps=4', 'grpo.prompts=8', 'async.mode=one_step_off', 'dist.rollout_ranks=1' })
  run(5, GRPO_RECIPE, U.words(hs, dir .. '/async_hsdp_plain'))
  for _, via in ipairs({ 'shm', 'mpi' }) do
    local d = dir .. '/async_hsdp_' .. via
    run(5, GRPO_RECIPE, U.words(hs, d, { 'dist.zero=3', 'dist.shard_group=2', 'async.weights=' .. via }))
    t.truthy(model_bytes(d) == model_bytes(dir .. '/async_hsdp_plain'),
      'hybrid sharding with a rollout rank (' .. via .. '): the bits of zero=0')
  end
  -- a rank that cannot open the store (another host; a fault injection): auto sends the shards by
  -- MPI, the bits as ever; shm stops before the first step, naming the rank and the key
  local far = { env = { 'MOONRL_FAULT=no_shm:rank=1' } }
  local fb = dir .. '/async_zero3_far'
  run(3, GRPO_RECIPE, U.words(U.with(GRPO, { ONE, 'grpo.steps=4', 'async.mode=one_step_off', 'dist.rollout_ranks=1' }),
    fb, { 'dist.zero=3' }), far)
  t.eq((event(fb, 'rollout_weights') or {}).via, 'trainer shards', 'a trainer without the store: the shards by MPI')
  t.truthy(model_bytes(fb) == model_bytes(dir .. '/async_plain_rollout'), 'by MPI after the fallback: the bits of zero=0')
  local r = run(3, GRPO_RECIPE, U.words(U.with(GRPO, { 'dist.zero=3', 'dist.rollout_ranks=1', 'async.mode=one_step_off',
    'async.weights=shm' }), dir .. '/async_far_shm'), { env = far.env, expect_fail = true })
  t.eq(r.exit_status, 2, 'async.weights=shm and a rank without the store: a usage error')
  t.truthy(r.stderr:find('async.weights=shm needs the trainers and every rollout rank on one host', 1, true) and
    r.stderr:find('rank 1 of 3: fault injection', 1, true), r.stderr)
  -- in-flight weight updates on a rollout rank (async.partial=continue: the engine takes up each
  -- version the trainers write into the store while its requests run; timing-dependent bits)
  local pc = dir .. '/async_zero3_partial'
  run(3, GRPO_RECIPE, U.words(U.with(GRPO, { ONE, 'grpo.steps=4', 'async.mode=async', 'async.max_staleness=1',
    'dist.rollout_ranks=1', 'async.partial=continue' }), pc, { 'dist.zero=3' }))
  local pm = U.records(pc)
  t.eq(#pm, 4, 'partial=continue with zero=3: every step logged')
  t.truthy(pm[#pm]['async/switched_samples'] ~= nil, 'partial=continue with zero=3: the switches counted')
  t.eq((event(pc, 'rollout_weights') or {}).via, 'shared memory', 'partial=continue with zero=3: through the store')
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
  -- optimizer offload is for GPU models: on a CPU model, a usage error saying why
  r = proc.run({ exe, 'run', 'recipes/sft.lua', 'run.dir=' .. dir .. '/bad', 'model.dir=' .. model_dir,
    'data.path=' .. sft_data, 'dist.offload=optimizer', 'quiet=true' }, { timeout = 60 })
  t.eq(r.exit_status, 2, 'dist.offload=optimizer on a CPU model: a usage error')
  t.truthy(r.stderr:find('dist.offload=optimizer', 1, true) and r.stderr:find('CPU', 1, true), r.stderr)
end)

fs.remove(dir)
t.done()
