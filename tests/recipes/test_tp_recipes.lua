-- dist.tp: groups of consecutive ranks each holding every layer's tensor-parallel slices of the
-- policy (and of a reference or a critic), data parallel over the groups. Against one process
-- on the same global batch: SFT on 2 ranks (tp=2), on 4 (2 groups of 2) and on 4 with tp=4
-- (the model's 2 K/V heads each held by 2 ranks), DPO, GRPO with a KL
-- reference (the engine generating on the slices, every rank of a group stepping together) and
-- PPO with its critic, each within 1e-5 of one process's final weights (a vocabulary of 16 the
-- ranks split, the embedding and head in slices; 2 groups of 2 on one of 15, both whole); 2
-- groups of 2 under ZeRO-1, ZeRO-2 (a model of one K/V head too) and ZeRO-3 (SFT, GRPO, PPO), and
-- SFT, GRPO and PPO with dist.sequence_parallel; a mixture of experts (each expert's MLP split:
-- SFT on tp=2, on 2 groups of 2 with moe.expert_parallel over the groups and with ZeRO-3, GRPO
-- with routing replay, the load-balancing loss and expert parallelism); a
-- run stopped after a checkpoint and resumed ends with the bits of the run never stopped (each
-- slot's optimizer state in its own file; under ZeRO-1 and 3 a file a shard, resumed by 4 ranks
-- as written and by 2 with plain data parallel); a rank of a group killed in a step and in its checkpoint write, restarted by
-- moonrl launch, ends with the same bits; trainers in tensor parallel (and ZeRO-3) send their
-- slices to a rollout rank, which generates what one trainer's does, and so do trainers in
-- context parallel (and ZeRO-3); the keys and configs tensor parallel cannot take are usage errors
-- naming them. (tests/recipes/meson.build runs it where mpirun is.)
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local fs = require('moonrl.io.fs')
local U = dofile('tests/recipes/util.lua')

local exe = assert(rawget(_G, 'MOONRL_EXE'), 'needs the moonrl executable')

local dir = U.tmpdir('tp_recipes')
local model15, sft_data, pref_data, rl_data = U.ranks_setup(dir)
-- the digits' 15 tokens and one no text has: a vocabulary 2 and 4 divide
local model_dir = U.tiny_model(dir .. '/init16', { layers = 2, vocab_size = 16 })
local SFT = { 'model.dir=' .. model_dir, 'data.path=' .. sft_data, 'train.steps=4', 'train.batch=12', 'train.lr=1e-3',
  'run.threads=1' }
local DPO = { 'model.dir=' .. model_dir, 'data.path=' .. pref_data, 'train.steps=4', 'train.pairs=6', 'train.lr=1e-3',
  'train.micro_batch_tokens=60', 'run.threads=1' }
local RL = { 'model.dir=' .. model_dir, 'data.path=' .. rl_data, 'data.prompt=question', 'data.chat=false',
  'reward=tests/recipes/partial_reward.lua:partial', 'train.lr=1e-3', 'train.micro_batch_tokens=64', 'run.threads=1' }
local GRPO = U.with(RL, { 'grpo.prompts=6', 'grpo.samples=4', 'grpo.max_tokens=4', 'grpo.steps=3', 'grpo.kl_coef=0.1' })
local PPO = U.with(RL, { 'ppo.prompts=6', 'ppo.samples=2', 'ppo.max_tokens=4', 'ppo.steps=2' })

-- a recipe on n ranks (0: one process) into run directory tag; its directory
local function run(n, recipe, words, tag)
  local d = dir .. '/' .. tag
  U.run_ranks(exe, n, recipe, U.with(words, { 'run.dir=' .. d }))
  return d
end

local rel_diff = U.weights_diff

t.test('sft (2 ranks, 2 groups of 2, and 4 ranks sharing the 2 K/V heads; ZeRO-1, 2, 3; sequence parallel), dpo, grpo with a reference, ppo with its critic: one process\'s weights within 1e-5', function()
  local function on(model, words)
    local out = {}
    for i, w in ipairs(words) do out[i] = w:find('^model%.dir=') and 'model.dir=' .. model or w end
    return out
  end
  local SFT15 = on(model15, SFT)
  -- one K/V head, which both ranks of a group hold, under ZeRO-2: its gradients summed in each shard
  local SFT_KV1 = on(U.tiny_model(dir .. '/init_kv1', { layers = 2, vocab_size = 16, kv_heads = 1 }),
    U.with(SFT, { 'dist.zero=2' }))
  for _, case in ipairs({ { 'recipes/sft.lua', SFT, 'sft', 2 }, { 'recipes/sft.lua', SFT15, 'sft15', 4 },
    { 'recipes/sft.lua', SFT, 'sft', 4, 4 }, { 'recipes/sft.lua', U.with(SFT, { 'dist.zero=1' }), 'sft', 4, 2, 'zero1' },
    { 'recipes/sft.lua', U.with(SFT, { 'dist.zero=2' }), 'sft', 4, 2, 'zero2' },
    { 'recipes/sft.lua', SFT_KV1, 'sft_kv1', 4, 2, 'zero2' },
    { 'recipes/sft.lua', U.with(SFT, { 'dist.zero=3' }), 'sft', 4, 2, 'zero3' },
    { 'recipes/grpo.lua', U.with(GRPO, { 'dist.zero=3' }), 'grpo', 4, 2, 'zero3' },
    { 'recipes/ppo.lua', U.with(PPO, { 'dist.zero=3' }), 'ppo', 4, 2, 'zero3' },
    { 'recipes/dpo.lua', DPO, 'dpo', 2 }, { 'recipes/grpo.lua', GRPO, 'grpo', 2 }, { 'recipes/ppo.lua', PPO, 'ppo', 2 },
    -- (after the cases whose runs are the baselines: one process takes no dist.sequence_parallel)
    { 'recipes/sft.lua', U.with(SFT, { 'dist.sequence_parallel=true' }), 'sft', 2, 2, 'sp' },
    { 'recipes/grpo.lua', U.with(GRPO, { 'dist.sequence_parallel=true' }), 'grpo', 2, 2, 'sp' },
    { 'recipes/ppo.lua', U.with(PPO, { 'dist.sequence_parallel=true' }), 'ppo', 2, 2, 'sp' } }) do
    local one = dir .. '/one_' .. case[3]
    if not fs.exists(one .. '/model') then run(0, case[1], case[2], 'one_' .. case[3]) end
    local K = case[5] or 2
    local tp = run(case[4], case[1], U.with(case[2], { 'dist.tp=' .. K }),
      string.format('tp_%s_%d_%d%s', case[3], case[4], K, case[6] or ''))
    local d = rel_diff(tp .. '/model', one .. '/model')
    print(string.format('  %s on %d ranks, dist.tp=%d%s: %.3g from one process', case[3], case[4], K,
      case[6] and ', ' .. case[6] or '', d))
    t.truthy(d <= 1e-5, case[3] .. ': the weights of one process')
    if case[3] == 'ppo' then t.truthy(rel_diff(tp .. '/critic', one .. '/critic') <= 1e-5, 'ppo: the critic too') end
    if case[3] == 'grpo' then -- the same samples: the engine on the slices draws what the whole model's draws
      local a, b = U.records(tp), U.records(one)
      for s = 1, #b do t.eq(a[s].tokens, b[s].tokens, 'grpo step ' .. s .. ': the same tokens') end
    end
  end
end)

t.test('a checkpoint of 2 tensor-parallel ranks resumes to the bits of the run never stopped', function()
  local words = U.with(SFT, { 'dist.tp=2', 'train.schedule=constant', 'run.checkpoint_every=1' })
  U.check_resume(t, function(w, tag) return run(2, 'recipes/sft.lua', w, tag) end, words, 2, 4,
    { 'optimizer.tp-00000-of-00002.safetensors', 'optimizer.tp-00001-of-00002.safetensors' }) -- (each slot's state)
end)

t.test('a killed rank of a tensor-parallel group: moonrl launch --restarts ends with the bits of the run never stopped', function()
  -- the group's second rank killed in a step; and while it writes its slot's optimizer state into
  -- step 2's checkpoint (after 1000 bytes): no manifest, so the restart resumes from step 1's
  local words = U.with(SFT, { 'dist.tp=2', 'train.schedule=constant', 'run.checkpoint_every=1', 'dist.timeout=20' })
  local straight = dir .. '/straight'
  if not fs.exists(straight .. '/model') then
    run(2, 'recipes/sft.lua', U.with(SFT, { 'dist.tp=2', 'train.schedule=constant', 'run.checkpoint_every=1' }), 'straight')
  end
  for _, case in ipairs({ { 'tp_killed', 'kill:step=3:phase=train:rank=1:attempt=0' },
    { 'tp_killed_ckpt', 'kill:checkpoint=2:bytes=1000:rank=1:attempt=0' } }) do
    local d = dir .. '/' .. case[1]
    local r = require('moonrl.io.proc').run(U.launch_argv(exe, 2, case[2], 'recipes/sft.lua', d, words), { timeout = 180 })
    if not r.ok then io.stderr:write(r.stdout, r.stderr) end
    t.truthy(r.ok and (r.stderr or ''):find('restarting') ~= nil, case[1] .. ': finished after a restart')
    t.eq(fs.read(d .. '/model/model.safetensors'), fs.read(straight .. '/model/model.safetensors'),
      case[1] .. ': the weights of the run never stopped, bit for bit')
    t.eq(#U.records(d), 4, case[1] .. ': each step logged once')
    if case[1] == 'tp_killed_ckpt' then
      t.truthy(r.stderr:find('checkpoint write after 1000 bytes', 1, true), 'rank 1 was killed in the write')
    end
  end
end)

t.test('dist.cp=2 (Ulysses): sft on 2 ranks (and ZeRO-3) and on 2 groups of 2 with ZeRO-1, grpo with ZeRO-3, dpo, grpo with a reference, ppo with its critic: one process\'s weights within 1e-5', function()
  for _, case in ipairs({ { 'recipes/sft.lua', SFT, 'sft', 2 }, { 'recipes/sft.lua', U.with(SFT, { 'dist.zero=1' }), 'sft', 4, 'zero1' },
    { 'recipes/sft.lua', U.with(SFT, { 'dist.zero=3' }), 'sft', 2, 'zero3' }, { 'recipes/grpo.lua', U.with(GRPO, { 'dist.zero=3' }), 'grpo', 2, 'zero3' },
    { 'recipes/dpo.lua', DPO, 'dpo', 2 }, { 'recipes/grpo.lua', GRPO, 'grpo', 2 }, { 'recipes/ppo.lua', PPO, 'ppo', 2 } }) do
    local one = dir .. '/one_' .. case[3]
    if not fs.exists(one .. '/model') then run(0, case[1], case[2], 'one_' .. case[3]) end
    local cp = run(case[4], case[1], U.with(case[2], { 'dist.cp=2' }), string.format('cp_%s_%d%s', case[3], case[4], case[5] or ''))
    local d = rel_diff(cp .. '/model', one .. '/model')
    print(string.format('  %s on %d ranks, dist.cp=2%s: %.3g from one process', case[3], case[4], case[5] and ', ' .. case[5] or '', d))
    t.truthy(d <= 1e-5, case[3] .. ': the weights of one process')
    if case[3] == 'ppo' then t.truthy(rel_diff(cp .. '/critic', one .. '/critic') <= 1e-5, 'ppo: the critic too') end
    if case[3] == 'grpo' then
      local a, b = U.records(cp), U.records(one)
      for s = 1, #b do t.eq(a[s].tokens, b[s].tokens, 'grpo step ' .. s .. ': the same tokens') end
    end
  end
end)

-- (each step's loss and gradient norm within 1e-5 of one process's; the weights within 1e-5, SFT's
-- within 1e-4: Adam moves a weight by about lr whatever its gradient's size, so a gradient near 0,
-- whose sign the ranks' summation order can flip, moves it the other way: layer 0's o_proj here,
-- 2.9e-5 from one process where the metrics agree to 1e-7)
t.test('dist.tp=2 x dist.cp=2 on 4 ranks: sft, grpo with a reference and ppo with its critic: one process\'s steps and weights', function()
  local model4 = U.tiny_model(dir .. '/init_kv4', { layers = 2, vocab_size = 16, kv_heads = 4 })
  local function on4(words)
    local out = {}
    for i, w in ipairs(words) do out[i] = w:find('^model%.dir=') and 'model.dir=' .. model4 or w end
    return out
  end
  for _, case in ipairs({ { 'recipes/sft.lua', SFT, 'sft' }, { 'recipes/grpo.lua', GRPO, 'grpo' }, { 'recipes/ppo.lua', PPO, 'ppo' } }) do
    local words = on4(case[2])
    local one = run(0, case[1], words, 'one4_' .. case[3])
    local mixed = run(4, case[1], U.with(words, { 'dist.tp=2', 'dist.cp=2' }), 'tpcp_' .. case[3])
    local d = rel_diff(mixed .. '/model', one .. '/model')
    local a, b, worst = U.records(mixed), U.records(one), 0
    for i = 1, #b do
      for _, k in ipairs({ 'loss', 'grad_norm' }) do
        worst = math.max(worst, math.abs(a[i][k] - b[i][k]) / math.max(math.abs(b[i][k]), 1e-3))
      end
    end
    print(string.format('  %s on 4 ranks, dist.tp=2 x dist.cp=2: weights %.3g, steps\' loss and gradient norm %.3g from one process',
      case[3], d, worst))
    t.truthy(#a == #b and worst <= 1e-5, case[3] .. ': the steps of one process')
    t.truthy(d <= (case[3] == 'sft' and 1e-4 or 1e-5), case[3] .. ': the weights of one process')
    if case[3] == 'ppo' then t.truthy(rel_diff(mixed .. '/critic', one .. '/critic') <= 1e-5, 'ppo: the critic too') end
    if case[3] == 'sft' then -- moonrl status: each rank's place in the mesh
      local st = require('moonrl.io.proc').run({ exe, 'status', mixed }, { timeout = 60 })
      t.truthy(st.ok and st.stdout:find('0 (tp 0/2 cp 0/2 dp 0/1)', 1, true) and st.stdout:find('3 (tp 1/2 cp 1/2 dp 0/1)', 1, true),
        'status: the ranks\' places: ' .. tostring(st.stdout))
    end
    if case[3] == 'grpo' then
      local a, b = U.records(mixed), U.records(one)
      for s = 1, #b do t.eq(a[s].tokens, b[s].tokens, 'grpo step ' .. s .. ': the same tokens') end
    end
  end
end)

t.test('a mixture of experts under tensor parallel (each expert\'s MLP split, the router whole): sft on tp2, and tp2 x 2 groups with moe.expert_parallel over the groups (and ZeRO-3); grpo likewise with routing replay, the load-balancing loss and a reference: one process\'s steps and weights', function()
  local moe = dir .. '/moe'
  dofile('tests/lib/models.lua').save(moe, 'qwen3_moe', nil, { seed = 4 })
  local MOE = { 'model.dir=' .. moe }
  -- (the load-balancing loss is each data-parallel rank's own batch's, as Megatron's: on one group only)
  local REPLAY = U.with(GRPO, { 'moe.routing_replay=true' })
  for _, case in ipairs({ { 'recipes/sft.lua', SFT, 'sft', 2, {} },
    { 'recipes/sft.lua', SFT, 'sft', 4, { 'moe.expert_parallel=true' } },
    { 'recipes/sft.lua', SFT, 'sft', 4, { 'moe.expert_parallel=true', 'dist.zero=3' } },
    { 'recipes/grpo.lua', U.with(REPLAY, { 'moe.aux_loss_coef=0.01' }), 'grpo_aux', 2, {} },
    { 'recipes/grpo.lua', REPLAY, 'grpo', 4, { 'moe.expert_parallel=true' } } }) do
    local words = U.with(case[2], MOE)
    local one = dir .. '/one_moe_' .. case[3]
    if not fs.exists(one .. '/model') then run(0, case[1], words, 'one_moe_' .. case[3]) end
    local tag = string.format('tp_moe_%s_%d_%d', case[3], case[4], #case[5])
    local d = run(case[4], case[1], U.with(words, U.with({ 'dist.tp=2' }, case[5])), tag)
    local e = rel_diff(d .. '/model', one .. '/model')
    local a, b = U.records(d), U.records(one)
    print(string.format('  %s on %d ranks, dist.tp=2%s: %.3g from one process', case[3], case[4],
      #case[5] > 0 and ', ' .. table.concat(case[5], ', ') or '', e))
    -- (the router's rows of experts no token picked have a gradient of rounding noise: with
    -- norm_topk_prob it is 0 in exact arithmetic, and Adam turns noise into steps of about lr, as in
    -- the tp x cp test below: the weights within 1e-4, every step's loss and gradient norm 3e-6, relative or of 0.01:
    -- the sums of the split products go in another order, a CPU's kernels picking their own blocking; a
    -- gradient norm 1.16e-6 off one process's on a Zen 5 with OpenBLAS's Haswell kernels)
    t.truthy(e <= 1e-4 and #a == #b, tag .. ': the weights of one process')
    for s = 1, #b do
      local function d(x, y) return math.abs(x - y) / math.max(math.abs(y), 0.01) end
      local dl, dg = d(a[s].loss, b[s].loss), d(a[s].grad_norm, b[s].grad_norm)
      t.truthy(dl <= 3e-6 and dg <= 3e-6, string.format('%s step %d: the loss and gradient norm of one process (%.3g, %.3g)', tag, s, dl, dg))
    end
    if case[3]:find('^grpo') then
      t.truthy(math.abs(a[1]['moe/aux_loss'] - b[1]['moe/aux_loss']) <= 1e-5 or case[4] > 2, tag .. ': the aux loss of one process')
      for s = 1, #b do t.eq(a[s].tokens, b[s].tokens, tag .. ' step ' .. s .. ': the same tokens') end
    end
  end
end)

t.test('tensor-parallel trainers and a rollout rank: each trainer sends its slices (or its shard of them), the rollout rank assembles the whole model; the steps and weights of one trainer', function()
  local words = U.with(GRPO, { 'async.mode=one_step_off', 'dist.rollout_ranks=1' })
  local one = run(2, 'recipes/grpo.lua', words, 'rr_one') -- one trainer, one rollout rank
  for _, case in ipairs({ { 3, {}, 'rr_tp' }, { 5, { 'dist.zero=3' }, 'rr_tp_zero3' } }) do
    local d = run(case[1], 'recipes/grpo.lua', U.with(words, U.with({ 'dist.tp=2' }, case[2])), case[3])
    local e = rel_diff(d .. '/model', one .. '/model')
    local a, b = U.records(d), U.records(one)
    local bytes = 0
    for i = 1, #a do
      t.eq(a[i].tokens, b[i].tokens, case[3] .. ' step ' .. i .. ': the same tokens')
      bytes = math.max(bytes, a[i]['async/publish/bytes'] or 0)
    end
    local via
    for line in io.lines(d .. '/events.jsonl') do
      local ev = require('moonrl.io.json').decode(line)
      if ev.event == 'rollout_weights' then via = ev.via end
    end
    print(string.format('  %s: %.3g from one trainer, %d bytes a version', case[3], e, bytes))
    t.truthy(e <= 1e-5 and #a == #b, case[3] .. ': the weights of one trainer')
    t.eq(via, 'trainer shards', case[3] .. ': the trainers\' slices by MPI')
    t.truthy(bytes > 0, case[3] .. ': bytes a version reported')
  end
  local r = U.run_ranks(exe, 3, 'recipes/grpo.lua', U.with(words, { 'dist.tp=2', 'async.weights=shm', 'run.dir=' .. dir .. '/rr_shm' }),
    { expect_fail = true })
  t.truthy(not r.ok and (r.stderr .. r.stdout):find('dist.tp=2 with async.weights=shm', 1, true), 'shm: ' .. r.stderr)
end)

t.test('context-parallel trainers and rollout ranks: their first rank sends the weights (under ZeRO-3 every trainer its shard, into shared memory); the steps and weights of one trainer', function()
  local words = U.with(GRPO, { 'async.mode=one_step_off' })
  for _, case in ipairs({ { 1, {}, 'rr_cp' }, { 2, { 'dist.zero=3' }, 'rr_cp_zero3' } }) do
    local R = { 'dist.rollout_ranks=' .. case[1] }
    local one = dir .. '/rr_one_' .. case[1]
    if not fs.exists(one .. '/model') then run(1 + case[1], 'recipes/grpo.lua', U.with(words, R), 'rr_one_' .. case[1]) end
    local d = run(2 + case[1], 'recipes/grpo.lua', U.with(words, U.with(R, U.with({ 'dist.cp=2' }, case[2]))), case[3])
    local e = rel_diff(d .. '/model', one .. '/model')
    local a, b = U.records(d), U.records(one)
    for i = 1, #b do t.eq(a[i].tokens, b[i].tokens, case[3] .. ' step ' .. i .. ': the same tokens') end
    print(string.format('  %s: %.3g from one trainer', case[3], e))
    t.truthy(e <= 1e-5 and #a == #b, case[3] .. ': the weights of one trainer')
  end
end)

t.test('the asynchronous modes in one process (each batch generated between steps, by the group together) under tensor and context parallel: one process\'s steps and weights', function()
  for _, mode in ipairs({ 'one_step_off', 'async' }) do
    local words = U.with(GRPO, { 'async.mode=' .. mode })
    local one = run(0, 'recipes/grpo.lua', words, 'async_one_' .. mode)
    for _, key in ipairs({ 'dist.tp=2', 'dist.cp=2' }) do
      local tag = 'async_' .. mode .. '_' .. key:sub(6, 7)
      local d = run(2, 'recipes/grpo.lua', U.with(words, { key }), tag)
      local a, b = U.records(d), U.records(one)
      local e = rel_diff(d .. '/model', one .. '/model')
      for i = 1, #b do
        t.eq(a[i].tokens, b[i].tokens, tag .. ' step ' .. i .. ': the same tokens')
        t.truthy(math.abs(a[i].grad_norm - b[i].grad_norm) <= 1e-6 * math.max(b[i].grad_norm, 0.01),
          string.format('%s step %d: the gradient norm of one process (%g, %g)', tag, i, a[i].grad_norm, b[i].grad_norm))
      end
      print(string.format('  %s: %.3g from one process', tag, e))
      t.truthy(e <= 1e-5 and #a == #b, tag .. ': the weights of one process')
    end
  end
end)

t.test('plain data parallel, ppo on 2 ranks with several micro-batches a rank: the critic\'s loop does not start the policy\'s gradient sums early', function()
  local one = dir .. '/one_ppo'
  if not fs.exists(one .. '/model') then run(0, 'recipes/ppo.lua', PPO, 'one_ppo') end
  local d = run(2, 'recipes/ppo.lua', U.with(PPO, { 'train.micro_batch_tokens=16' }), 'dp_ppo_mb16')
  local e = rel_diff(d .. '/model', one .. '/model')
  print(string.format('  ppo on 2 ranks, micro-batches of 16 tokens: %.3g from one process', e))
  t.truthy(e <= 1e-5, 'the weights of one process')
  t.truthy(rel_diff(d .. '/critic', one .. '/critic') <= 1e-5, 'the critic too')
end)

t.test('ZeRO-1 and ZeRO-3 over 2 groups of 2: a file a shard of each slot; resumed to the bits, and by 2 ranks without ZeRO', function()
  for _, zero in ipairs({ 1, 3 }) do
    local tag = 'z' .. zero
    local words = U.with(SFT, { 'dist.tp=2', 'dist.zero=' .. zero, 'train.schedule=constant', 'run.checkpoint_every=1' })
    local straight = run(4, 'recipes/sft.lua', words, tag .. '_straight')
    run(4, 'recipes/sft.lua', U.with(words, { 'train.steps=2' }), tag .. '_part')
    local ckpt = dir .. '/' .. tag .. '_part/checkpoints/step-000002'
    for _, f in ipairs({ 'optimizer.tp-00000-of-00002.rank-00000-of-00002', 'optimizer.tp-00000-of-00002.rank-00001-of-00002',
      'optimizer.tp-00001-of-00002.rank-00000-of-00002', 'optimizer.tp-00001-of-00002.rank-00001-of-00002' }) do
      t.truthy(fs.exists(ckpt .. '/' .. f .. '.safetensors'), tag .. ': ' .. f)
    end
    t.truthy(moonrl.model.load(ckpt).n_params > 0, tag .. ': the checkpoint holds the whole model')
    run(4, 'recipes/sft.lua', U.with(words, { 'train.steps=2' }), tag .. '_two')
    local two = run(2, 'recipes/sft.lua', U.with(words, { 'dist.zero=0', 'run.resume=auto' }), tag .. '_two')
    local part = run(4, 'recipes/sft.lua', U.with(words, { 'run.resume=auto' }), tag .. '_part')
    t.eq(fs.read(part .. '/model/model.safetensors'), fs.read(straight .. '/model/model.safetensors'),
      tag .. ': resumed, the weights of the run never stopped, bit for bit')
    local d = rel_diff(two .. '/model', straight .. '/model')
    print(string.format('  ZeRO-%d, resumed by 2 ranks (tp=2, no ZeRO): %.3g from the run never stopped', zero, d))
    t.truthy(d <= 1e-5, tag .. ': resumed on another mesh: within 1e-5')
  end
end)

t.test('what tensor parallel cannot take: usage errors naming the key', function()
  for _, case in ipairs({ { 2, { 'dist.tp=3' }, 'dist.tp=3 does not divide the 2 ranks' },
    { 3, { 'dist.tp=3' }, 'num_attention_heads (4) is not a multiple of 3' },
    { 2, { 'dist.tp=2', 'async.mode=one_step_off', 'async.engine_threads=1' }, 'dist.tp=2 with async.engine_threads=1' },
    { 3, { 'dist.cp=3' }, 'num_attention_heads (4) is not a multiple of 3' },
    { 3, { 'dist.cp=2', 'dist.tp=2' }, 'dist.tp=2 x dist.cp=2 does not divide the 3 ranks' },
    { 2, { 'dist.sequence_parallel=true' }, 'dist.sequence_parallel splits the tensor-parallel groups' } }) do
    local recipe = case[2][2] and case[2][2]:find('async') and 'recipes/grpo.lua' or 'recipes/sft.lua'
    local words = recipe == 'recipes/grpo.lua' and U.with(GRPO, case[2]) or U.with(SFT, case[2])
    local r = U.run_ranks(exe, case[1], recipe, U.with(words, { 'run.dir=' .. dir .. '/bad' }), { expect_fail = true })
    t.truthy(not r.ok and (r.stderr .. r.stdout):find(case[3], 1, true), case[3] .. ': ' .. r.stderr)
  end
end)

t.done()
