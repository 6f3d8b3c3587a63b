-- dist.pp: the policy's layers split into stages (ranks), micro-batches under 1F1B, the loss on
-- the last stage. Against one process on the same global batch: SFT with pp 2 and 4 (1, 2 and 8
-- micro-batches a step, a tied head and an untied one), an uneven split (dist.pp_layers), 2
-- pipelines of 2 (data parallel over them, ZeRO-1, and ZeRO-2 with an untied head, also with
-- pipelines of different micro-batch counts), pp 2 x tp 2 (and sequence parallel),
-- pp 2 x cp 2, DPO; each within 1e-5 of
-- one process's final weights, and the steps' loss and gradient norm too; trainers in stages (and
-- pp 2 x tp 2) sending their tensors to a rollout rank: GRPO with a reference and PPO with its
-- critic, the tokens, steps and weights of one trainer; weight sync between layouts (ZeRO-3
-- trainers to rollout ranks in tensor parallel 2, pp2 x tp2 to tp4): the tokens and weights of
-- one trainer, each rollout rank sent its slices only, a version checksum that catches a wrong
-- element; delta publication in bf16: the bits of whole versions, fewer bytes, a wrong element
-- healed by a whole version; the bubble reported each
-- step; a given mesh bit-identical run to run, across a stop and resume (each stage's optimizer
-- state in its own file) and across a stage killed and restarted; the keys and configs pipeline
-- parallel cannot take are usage errors naming them; a mixture of experts (SFT, also with expert
-- parallelism over 2 pipelines, GRPO with routing replay, the load-balancing loss and a rollout
-- rank; DeepSeek-V3's, SFT) against one process; a pipeline without rollout ranks generating on
-- its engine's slices over its ranks (GRPO on pp2 and pp2 x tp2, SFT evaluated by generation, a
-- resume) against one process; ZeRO-3 over 2 pipelines of 2 stages
-- (SFT, GRPO on the pipelines' engines, a resume) against one process. A checkpoint resumes into another mesh (each
-- optimizer file says which slices of which tensors it holds). (tests/recipes/meson.build runs it where mpirun is.)
local t = require('moonrl.testing')
local fs = require('moonrl.io.fs')
local U = dofile('tests/recipes/util.lua')

local exe = assert(rawget(_G, 'MOONRL_EXE'), 'needs the moonrl executable')

local dir = U.tmpdir('pp_recipes')
local _, sft_data, pref_data, rl_data = U.ranks_setup(dir)
local tied = U.tiny_model(dir .. '/init4', { layers = 4, vocab_size = 16 })
local untied = U.tiny_model(dir .. '/init4u', { layers = 4, vocab_size = 16, tie = false })
local SFT = { 'model.dir=' .. tied, 'data.path=' .. sft_data, 'train.steps=3', 'train.batch=12', 'train.lr=1e-3',
  'run.threads=1' }
-- GRPO (and PPO) with one rollout rank, the trainers' layout added; R_BASE without the learning rate
local R_BASE = { 'model.dir=' .. tied, 'data.path=' .. rl_data, 'data.prompt=question', 'data.chat=false',
  'reward=tests/recipes/partial_reward.lua:partial', 'train.micro_batch_tokens=64', 'run.threads=1',
  'async.mode=one_step_off', 'dist.rollout_ranks=1' }
local RL = U.with(R_BASE, { 'train.lr=1e-3' })
local GRPO = U.with(RL, { 'grpo.prompts=6', 'grpo.samples=4', 'grpo.max_tokens=4', 'grpo.steps=3', 'grpo.kl_coef=0.1' })
local DPO = { 'model.dir=' .. tied, 'data.path=' .. pref_data, 'train.steps=3', 'train.pairs=6', 'train.lr=1e-3',
  'train.micro_batch_tokens=60', 'run.threads=1' }

local function run(n, recipe, words, tag)
  local d = dir .. '/' .. tag
  U.run_ranks(exe, n, recipe, U.with(words, { 'run.dir=' .. d }))
  return d
end

-- the largest relative difference of the steps' loss and gradient norm
local function steps_diff(a, b)
  local worst = #a == #b and 0 or math.huge
  for i = 1, math.min(#a, #b) do
    for _, k in ipairs({ 'loss', 'grad_norm' }) do
      worst = math.max(worst, math.abs(a[i][k] - b[i][k]) / math.max(math.abs(b[i][k]), 1e-3))
    end
  end
  return worst
end

t.test('sft and dpo in pipeline stages (pp 2 and 4, 1 to 8 micro-batches, tied and untied heads, an uneven split, 2 pipelines, ZeRO-1 and 2, pp2 x tp2 with and without sequence parallel, pp2 x cp2): one process\'s steps and weights', function()
  local cases = {
    { 'recipes/sft.lua', SFT, 'sft', 2, { 'dist.pp=2' } },
    { 'recipes/sft.lua', U.with(SFT, { 'train.micro_batch_tokens=40' }), 'sft_mb', 2, { 'dist.pp=2' } },
    { 'recipes/sft.lua', U.with(SFT, { 'train.micro_batch_tokens=40' }), 'sft_mb', 4, { 'dist.pp=4' } },
    { 'recipes/sft.lua', U.with(SFT, { 'train.micro_batch_tokens=12' }), 'sft_mb8', 4, { 'dist.pp=4' } },
    { 'recipes/sft.lua', U.with(SFT, { 'model.dir=' .. untied, 'train.micro_batch_tokens=40' }), 'sft_untied', 2, { 'dist.pp=2' } },
    { 'recipes/sft.lua', SFT, 'sft', 2, { 'dist.pp=2', 'dist.pp_layers=1,3' }, 'uneven' },
    { 'recipes/sft.lua', SFT, 'sft', 4, { 'dist.pp=2' }, 'dp2' },
    { 'recipes/sft.lua', SFT, 'sft', 4, { 'dist.pp=2', 'dist.zero=1' }, 'zero1' },
    -- (ZeRO-2: an untied head; 5 samples over 2 pipelines, the one with fewer micro-batches passing empty ones)
    { 'recipes/sft.lua', U.with(SFT, { 'model.dir=' .. untied, 'train.micro_batch_tokens=40' }), 'sft_untied', 4,
      { 'dist.pp=2', 'dist.zero=2' }, 'zero2' },
    { 'recipes/sft.lua', U.with(SFT, { 'model.dir=' .. untied, 'train.micro_batch_tokens=40', 'train.batch=5' }),
      'sft_untied5', 4, { 'dist.pp=2', 'dist.zero=2' }, 'zero2' },
    { 'recipes/sft.lua', SFT, 'sft', 4, { 'dist.pp=2', 'dist.tp=2' }, 'tp2' },
    { 'recipes/sft.lua', SFT, 'sft', 4, { 'dist.pp=2', 'dist.tp=2', 'dist.sequence_parallel=true' }, 'tp2sp' },
    { 'recipes/sft.lua', U.with(SFT, { 'train.micro_batch_tokens=40' }), 'sft_mb', 4, { 'dist.pp=2', 'dist.cp=2' }, 'cp2' },
    { 'recipes/dpo.lua', DPO, 'dpo', 2, { 'dist.pp=2' } },
  }
  for _, case in ipairs(cases) do
    local one = dir .. '/one_' .. case[3]
    if not fs.exists(one .. '/model') then run(0, case[1], case[2], 'one_' .. case[3]) end
    local tag = string.format('pp_%s_%d%s', case[3], case[4], case[6] and '_' .. case[6] or '')
    local d = run(case[4], case[1], U.with(case[2], case[5]), tag)
    local w = U.weights_diff(d .. '/model', one .. '/model')
    local a, b = U.records(d), U.records(one)
    local sd = steps_diff(a, b)
    local bubble = a[#a]['pipeline/bubble']
    print(string.format('  %s on %d ranks, %s: weights %.3g, steps %.3g from one process; bubble %s', case[3], case[4],
      table.concat(case[5], ' '), w, sd, tostring(bubble)))
    t.truthy(w <= 1e-5, tag .. ': the weights of one process')
    t.truthy(sd <= 1e-5, tag .. ': the steps of one process')
    t.truthy(bubble and bubble >= 0 and bubble < 1, tag .. ': the bubble reported')
  end
end)

t.test('pipeline-parallel trainers and a rollout rank: each stage sends its tensors, the rollout rank assembles the whole model; grpo with a reference, ppo with its critic, and grpo with pp2 x tp2: the steps and weights of one trainer', function()
  local PPO = U.with(RL, { 'ppo.prompts=6', 'ppo.samples=2', 'ppo.max_tokens=4', 'ppo.steps=2' })
  for _, case in ipairs({ { 'recipes/grpo.lua', GRPO, 'grpo', 3, { 'dist.pp=2' } },
    { 'recipes/ppo.lua', PPO, 'ppo', 3, { 'dist.pp=2' } },
    { 'recipes/grpo.lua', GRPO, 'grpo', 5, { 'dist.pp=2', 'dist.tp=2' }, 'tp2' } }) do
    local one = dir .. '/rr_one_' .. case[3]
    if not fs.exists(one .. '/model') then run(2, case[1], case[2], 'rr_one_' .. case[3]) end -- one trainer, one rollout rank
    local tag = string.format('rr_pp_%s%s', case[3], case[6] and '_' .. case[6] or '')
    local d = run(case[4], case[1], U.with(case[2], case[5]), tag)
    local a, b = U.records(d), U.records(one)
    local bytes = 0
    for i = 1, #b do
      t.eq(a[i].tokens, b[i].tokens, tag .. ' step ' .. i .. ': the same tokens')
      bytes = math.max(bytes, a[i]['async/publish/bytes'] or 0)
    end
    local w, sd = U.weights_diff(d .. '/model', one .. '/model'), steps_diff(a, b)
    print(string.format('  %s: weights %.3g, steps %.3g from one trainer, %d bytes a version', tag, w, sd, bytes))
    t.truthy(w <= 1e-5 and sd <= 1e-5, tag .. ': the steps and weights of one trainer')
    if case[3] == 'grpo' then t.truthy(bytes > 0, tag .. ': bytes a version reported') end
    if case[3] == 'ppo' then t.truthy(U.weights_diff(d .. '/critic', one .. '/critic') <= 1e-5, 'ppo: the critic too') end
  end
end)

-- Without rollout ranks a pipeline generates for itself: the engine runs on tensor-parallel
-- slices over the pipeline's ranks (stages x slices), refreshed from the stages after each update
-- (moonrl.train.reshard): GRPO with a reference on pp2 and pp2 x tp2, and SFT evaluated by
-- generation on pp2: one process's tokens, accuracy, steps and weights.
t.test('generation on a pipeline (no rollout ranks: the engine on slices over its ranks, refreshed from the stages): grpo on pp2 and pp2 x tp2, sft evaluated by generation, a resume: one process\'s tokens, steps and weights', function()
  local LOCAL = { 'model.dir=' .. tied, 'data.path=' .. rl_data, 'data.prompt=question', 'data.chat=false',
    'reward=tests/recipes/partial_reward.lua:partial', 'train.micro_batch_tokens=64', 'run.threads=1', 'train.lr=1e-3',
    'grpo.prompts=6', 'grpo.samples=4', 'grpo.max_tokens=4', 'grpo.steps=3', 'grpo.kl_coef=0.1' }
  local EVAL = U.with(SFT, { 'eval.every=3', 'eval.prompts=6', 'eval.max_tokens=4', 'data.task=addition' })
  for _, case in ipairs({ { 'recipes/grpo.lua', LOCAL, 'gen_grpo', 2, { 'dist.pp=2' } },
    { 'recipes/grpo.lua', LOCAL, 'gen_grpo', 4, { 'dist.pp=2', 'dist.tp=2' }, 'tp2' },
    { 'recipes/sft.lua', EVAL, 'gen_sft_eval', 2, { 'dist.pp=2' } } }) do
    local one = dir .. '/one_' .. case[3]
    if not fs.exists(one .. '/model') then run(0, case[1], case[2], 'one_' .. case[3]) end
    local tag = string.format('pp_%s%s', case[3], case[6] and '_' .. case[6] or '')
    local d = run(case[4], case[1], U.with(case[2], case[5]), tag)
    local a, b = U.records(d), U.records(one)
    for i = 1, #b do
      for _, k in ipairs({ 'tokens', 'eval/accuracy', 'eval/prompts' }) do
        t.eq(a[i][k], b[i][k], tag .. ' step ' .. i .. ': the same ' .. k)
      end
    end
    for i = 1, #b do -- (the engine's log-probs against the trainer's: its slices are the stages' weights)
      local ma, mb = a[i]['mismatch/max_abs'], b[i]['mismatch/max_abs']
      if mb then t.truthy(ma and math.abs(ma - mb) <= 1e-5, tag .. ' step ' .. i .. ': the engine\'s mismatch') end
    end
    local w, sd = U.weights_diff(d .. '/model', one .. '/model'), steps_diff(a, b)
    print(string.format('  %s on %d ranks, %s: weights %.3g, steps %.3g from one process', case[3], case[4],
      table.concat(case[5], ' '), w, sd))
    t.truthy(w <= 1e-5 and sd <= 1e-5, tag .. ': the steps and weights of one process')
  end
  -- stopped after step 2 and resumed: the engine's slices come back from the checkpoint's stages
  local words = U.with(LOCAL, { 'dist.pp=2', 'run.checkpoint_every=1' })
  run(2, 'recipes/grpo.lua', U.with(words, { 'grpo.steps=2' }), 'gen_grpo_part')
  local part = run(2, 'recipes/grpo.lua', U.with(words, { 'run.resume=auto' }), 'gen_grpo_part')
  t.eq(#U.records(part), 3, 'resumed: three steps logged')
  t.eq(U.weights_diff(part .. '/model', dir .. '/pp_gen_grpo/model'), 0, 'resumed: the weights of the run never stopped')
end)

-- ZeRO-3 over pipelines (an untied head): each stage's parameters sharded over the ranks that hold
-- that stage, gathered part by part in its forwards and backwards; the model saved (and resumed)
-- by the stages' shards; the engine of a pipeline generating from its shards (moonrl.train.reshard)
t.test('zero=3 over 2 pipelines of 2 stages: sft (untied and tied heads), grpo generating on the pipelines\' engines, a resume: one process\'s steps and weights', function()
  local USFT = U.with(SFT, { 'model.dir=' .. untied, 'train.micro_batch_tokens=40' })
  local UGRPO = { 'model.dir=' .. untied, 'data.path=' .. rl_data, 'data.prompt=question', 'data.chat=false',
    'reward=tests/recipes/partial_reward.lua:partial', 'train.micro_batch_tokens=64', 'run.threads=1', 'train.lr=1e-3',
    'grpo.prompts=6', 'grpo.samples=4', 'grpo.max_tokens=4', 'grpo.steps=3', 'grpo.kl_coef=0.1' }
  local Z3 = { 'dist.pp=2', 'dist.zero=3' }
  -- (a tied head: its two copies' gradients, each rank holding a shard of them, put together and
  -- summed between the ends: pipeline.sync_tied_shard)
  -- (the one-process runs of the first test where they are the same: sft_untied, sft_mb)
  local TSFT = U.with(SFT, { 'train.micro_batch_tokens=40' })
  for _, case in ipairs({ { 'recipes/sft.lua', USFT, 'sft_untied', Z3 },
    { 'recipes/grpo.lua', UGRPO, 'z3_grpo_untied', Z3 },
    { 'recipes/sft.lua', TSFT, 'sft_mb', Z3, '_tied' } }) do
    local one = dir .. '/one_' .. case[3]
    if not fs.exists(one .. '/model') then run(0, case[1], case[2], 'one_' .. case[3]) end
    local d = run(4, case[1], U.with(case[2], case[4]), 'pp_z3_' .. case[3] .. (case[5] or ''))
    local a, b = U.records(d), U.records(one)
    for i = 1, #b do t.eq(a[i].tokens, b[i].tokens, case[3] .. ' step ' .. i .. ': the same tokens') end
    local w, sd = U.weights_diff(d .. '/model', one .. '/model'), steps_diff(a, b)
    print(string.format('  %s on 4 ranks, pp2 x dp2 %s: weights %.3g, steps %.3g from one process', case[3],
      case[4][2], w, sd))
    t.truthy(w <= 1e-5 and sd <= 1e-5, case[3] .. ': the steps and weights of one process')
    local p = a[#a]['memory/params_shard_mb']
    if case[4] == Z3 then t.truthy(p and p > 0, case[3] .. ': the stage\'s shard in the memory rows') end
  end
  -- GRPO stopped after step 2 and resumed: the stages' shards, their optimizer state and the
  -- engines' slices come back (a constant learning rate: the shorter run's steps are the same)
  local words = U.with(U.with(UGRPO, Z3), { 'run.checkpoint_every=1' })
  run(4, 'recipes/grpo.lua', U.with(words, { 'grpo.steps=2' }), 'z3_part')
  local part = run(4, 'recipes/grpo.lua', U.with(words, { 'run.resume=auto' }), 'z3_part')
  t.eq(#U.records(part), 3, 'zero=3 in stages resumed: three steps logged')
  t.eq(U.weights_diff(part .. '/model', dir .. '/pp_z3_z3_grpo_untied/model'), 0,
    'zero=3 in stages resumed: the weights of the run never stopped')
end)

t.test('a mixture of experts in stages (a dense layer between sparse ones): sft on pp2 (and an uneven split), on 2 pipelines with expert parallelism over them (of different micro-batch counts); grpo with routing replay, the load-balancing loss and a reference, trainers in stages and a rollout rank: one process\'s steps, weights and aux loss, the replay\'s counts over every stage', function()
  local json = require('moonrl.io.json')
  local only = json.array()
  only[1] = 1 -- layer 1 dense: a stage's own numbering of its sparse layers differs from the model's
  local moe = dofile('tests/lib/models.lua').save(dir .. '/moe', 'qwen3_moe', { num_hidden_layers = 3, mlp_only_layers = only },
    { seed = 4 })
  local MSFT = U.with(SFT, { 'model.dir=' .. moe })
  -- (the load-balancing loss: each stage's statistics go on with its rows, the totals come back)
  local MGRPO = U.with(GRPO, { 'model.dir=' .. moe, 'moe.routing_replay=true', 'moe.aux_loss_coef=0.01' })
  for _, case in ipairs({ { 'recipes/sft.lua', MSFT, 'moe_sft', 0, 2, { 'dist.pp=2' } },
    { 'recipes/sft.lua', MSFT, 'moe_sft', 0, 2, { 'dist.pp=2', 'dist.pp_layers=2,1' }, 'uneven' },
    -- (5 samples over 2 pipelines: the one with fewer micro-batches passes empty ones, serving its experts)
    { 'recipes/sft.lua', U.with(MSFT, { 'train.batch=5', 'train.micro_batch_tokens=40' }), 'moe_sft5', 0, 4,
      { 'dist.pp=2', 'moe.expert_parallel=true' }, 'ep' },
    { 'recipes/grpo.lua', MGRPO, 'moe_grpo', 2, 3, { 'dist.pp=2' } },
    -- DeepSeek-V3's (a dense first layer: first_k_dense_replace in a stage's own numbering; MLA, shared experts)
    { 'recipes/sft.lua', U.with(SFT, { 'model.dir=' .. dofile('tests/lib/models.lua').save(dir .. '/dsmoe',
      'deepseek_v3_moe', { vocab_size = 16 }, { seed = 4 }) }), 'ds_sft', 0, 2, { 'dist.pp=2', 'dist.pp_layers=1,2' } } }) do
    local one = dir .. '/one_' .. case[3]
    if not fs.exists(one .. '/model') then run(case[4], case[1], case[2], 'one_' .. case[3]) end
    local tag = string.format('pp_%s%s', case[3], case[7] and '_' .. case[7] or '')
    local d = run(case[5], case[1], U.with(case[2], case[6]), tag)
    local a, b = U.records(d), U.records(one)
    local w, sd = U.weights_diff(d .. '/model', one .. '/model'), steps_diff(a, b)
    print(string.format('  %s on %d ranks, %s: weights %.3g, steps %.3g from one process', case[3], case[5],
      table.concat(case[6], ' '), w, sd))
    t.truthy(w <= 1e-5 and sd <= 1e-5, tag .. ': the steps and weights of one process')
    if case[3] == 'moe_grpo' then
      for i = 1, #b do
        t.eq(a[i].tokens, b[i].tokens, tag .. ' step ' .. i .. ': the same tokens')
        t.truthy(a[i]['moe/replayed'] > 0 and a[i]['moe/replayed'] == b[i]['moe/replayed'] and
          a[i]['moe/routing_mismatch'] == b[i]['moe/routing_mismatch'],
          string.format('%s step %d: the replay over every stage (%s, %s)', tag, i, a[i]['moe/replayed'], b[i]['moe/replayed']))
        local x, y = a[i]['moe/aux_loss'], b[i]['moe/aux_loss']
        t.truthy(y > 0 and math.abs(x - y) <= 1e-6 * y, string.format('%s step %d: the aux loss of every stage\'s layers (%s, %s)',
          tag, i, x, y))
      end
    end
  end
end)

t.test('weight sync between layouts: ZeRO-3 trainers on 2 ranks -> rollout ranks in tensor parallel 2, pp2 x tp2 -> tp4: the tokens and weights of one trainer, each rollout rank sent exactly its slices, every version checked', function()
  local one = dir .. '/rr_one_grpo'
  if not fs.exists(one .. '/model') then run(2, 'recipes/grpo.lua', GRPO, 'rr_one_grpo') end
  local b = U.records(one)
  local whole = 0
  for i = 1, #b do whole = math.max(whole, b[i]['async/publish/bytes'] or 0) end
  for _, case in ipairs({ { 4, { 'dist.zero=3', 'dist.rollout_ranks=2', 'dist.rollout_tp=2' }, 'zero3_to_tp2' },
    { 8, { 'dist.pp=2', 'dist.tp=2', 'dist.rollout_ranks=4', 'dist.rollout_tp=4' }, 'tp2pp2_to_tp4' } }) do
    local d = run(case[1], 'recipes/grpo.lua', U.with(GRPO, case[2]), case[3])
    local a, bytes = U.records(d), 0
    for i = 1, #b do
      t.eq(a[i].tokens, b[i].tokens, case[3] .. ' step ' .. i .. ': the same tokens')
      bytes = math.max(bytes, a[i]['async/publish/bytes'] or 0)
    end
    local w = U.weights_diff(d .. '/model', one .. '/model')
    print(string.format('  %s: weights %.3g from one trainer; %d bytes a version (the whole model: %d)', case[3], w, bytes,
      whole))
    t.truthy(w <= 1e-5 and #a == #b, case[3] .. ': the weights of one trainer')
    -- each rollout rank its slices: the whole model once, but the norms (every slot holds them) and
    -- the shared K/V heads (tp4 over 2 K/V heads: each held by 2 ranks)
    t.truthy(bytes > whole and bytes < 1.5 * whole, case[3] .. ': about the model\'s bytes, not the ranks\' times it')
  end
  local r = U.run_ranks(exe, 3, 'recipes/grpo.lua', U.with(GRPO, { 'dist.rollout_ranks=2', 'dist.rollout_tp=2',
    'run.dir=' .. dir .. '/corrupt' }), { expect_fail = true, env = { 'MOONRL_FAULT=sync_corrupt:rank=2' } })
  t.truthy(not r.ok and (r.stderr .. r.stdout):find('weight sync: rollout rank 2', 1, true), 'a wrong element: ' .. r.stderr)
end)

t.test('delta publication (bf16): the bits of sending every version whole; fewer bytes; a wrong element found and healed by a whole version; zero3 trainers -> rollout ranks in tensor parallel 2 too', function()
  local D = U.with(R_BASE, { 'train.lr=1e-5', 'model.dtype=bf16', 'async.weights_delta=true', 'grpo.prompts=6',
    'grpo.samples=4', 'grpo.max_tokens=4', 'grpo.steps=6', 'grpo.kl_coef=0.1' })
  local whole = run(2, 'recipes/grpo.lua', U.with(D, { 'async.full_sync_every=1' }), 'delta_every1')
  local delta = run(2, 'recipes/grpo.lua', U.with(D, { 'async.full_sync_every=3' }), 'delta_every3')
  local healed = U.run_ranks(exe, 2, 'recipes/grpo.lua', U.with(D, { 'async.full_sync_every=3',
    'run.dir=' .. dir .. '/delta_healed' }), { env = { 'MOONRL_FAULT=sync_corrupt:rank=1:times=1' } })
  local bits = fs.read(whole .. '/model/model.safetensors')
  t.eq(fs.read(delta .. '/model/model.safetensors'), bits, 'deltas: the bits of whole versions')
  t.eq(fs.read(dir .. '/delta_healed/model/model.safetensors'), bits, 'a wrong element healed: the same bits')
  t.truthy(fs.read(dir .. '/delta_healed/events.jsonl'):find('"weight_resync"', 1, true) and
    healed.stderr:find('weight sync: rollout rank 1', 1, true), 'the wrong element found, a whole version sent again')
  local full_bytes, delta_bytes, share = 0, math.huge, nil
  for _, r in ipairs(U.records(delta)) do
    if r['async/publish/full'] == 1 then full_bytes = math.max(full_bytes, r['async/publish/bytes'])
    elseif r['async/publish/changed'] and r['async/publish/changed'] > 0 then
      delta_bytes, share = math.min(delta_bytes, r['async/publish/bytes']), r['async/publish/changed']
    end
  end
  print(string.format('  a whole version in bf16: %d bytes; a delta: %d bytes (%.1f%% of the elements changed)', full_bytes,
    delta_bytes, 100 * (share or 0)))
  t.truthy(full_bytes > 0 and delta_bytes < full_bytes, 'a delta costs less than a whole version')
  local d = run(4, 'recipes/grpo.lua', U.with(D, { 'async.full_sync_every=3', 'dist.zero=3', 'dist.rollout_ranks=2',
    'dist.rollout_tp=2' }), 'delta_zero3_tp2')
  local w = U.weights_diff(d .. '/model', whole .. '/model')
  print(string.format('  zero3 -> rollout tp2 with deltas: %.3g from one trainer\'s', w))
  t.truthy(w <= 1e-4 and #U.records(d) == 6, 'zero3 -> tp2 with deltas: the weights of one trainer')
end)

t.test('a given mesh is bit-identical run to run', function()
  local words = U.with(SFT, { 'dist.pp=2', 'train.micro_batch_tokens=40' })
  local a, b = run(2, 'recipes/sft.lua', words, 'again_a'), run(2, 'recipes/sft.lua', words, 'again_b')
  t.eq(fs.read(a .. '/model/model.safetensors'), fs.read(b .. '/model/model.safetensors'), 'the same bits')
end)

t.test('a checkpoint of 2 stages resumes to the bits of the run never stopped; a stage killed in a step, restarted by moonrl launch, too', function()
  local words = U.with(SFT, { 'dist.pp=2', 'train.micro_batch_tokens=40', 'train.schedule=constant',
    'run.checkpoint_every=1' })
  local straight = U.check_resume(t, function(w, tag) return run(2, 'recipes/sft.lua', w, tag) end, words, 2, 3,
    { 'optimizer.pp-00000-of-00002.safetensors', 'optimizer.pp-00001-of-00002.safetensors' }) -- (each stage's state)
  local d = dir .. '/killed'
  local r = require('moonrl.io.proc').run(U.launch_argv(exe, 2, 'kill:step=2:phase=train:rank=1:attempt=0',
    'recipes/sft.lua', d, U.with(words, { 'dist.timeout=20' })), { timeout = 180 })
  if not r.ok then io.stderr:write(r.stdout, r.stderr) end
  t.truthy(r.ok and (r.stderr or ''):find('restarting') ~= nil, 'killed: finished after a restart')
  t.eq(fs.read(d .. '/model/model.safetensors'), fs.read(straight .. '/model/model.safetensors'),
    'killed: the weights of the run never stopped, bit for bit')
  t.eq(#U.records(d), 3, 'killed: each step logged once')
end)

t.test('resume into a different mesh: tp 2 -> pp 2, pp 2 x tp 2 on 4 ranks -> one process, one process -> pp 2 with ZeRO-1 on 4 ranks: the run never stopped within 1e-5', function()
  local words = U.with(SFT, { 'train.micro_batch_tokens=40', 'train.schedule=constant', 'run.checkpoint_every=1' })
  local straight = run(0, 'recipes/sft.lua', words, 'mesh_straight')
  for i, case in ipairs({ { 2, { 'dist.tp=2' }, 2, { 'dist.pp=2' } }, { 4, { 'dist.pp=2', 'dist.tp=2' }, 0, {} },
    { 0, {}, 4, { 'dist.pp=2', 'dist.zero=1' } } }) do
    local tag = 'mesh_' .. i
    run(case[1], 'recipes/sft.lua', U.with(words, U.with(case[2], { 'train.steps=2' })), tag)
    local d = run(case[3], 'recipes/sft.lua', U.with(words, U.with(case[4], { 'run.resume=auto' })), tag)
    local w, sd = U.weights_diff(d .. '/model', straight .. '/model'), steps_diff(U.records(d), U.records(straight))
    print(string.format('  %s -> %s: weights %.3g, steps %.3g from the run never stopped', table.concat(case[2], ' '),
      table.concat(case[4], ' '), w, sd))
    t.truthy(w <= 1e-5 and sd <= 1e-5, tag .. ': the run never stopped')
  end
end)

t.test('usage errors name the key', function()
  for _, case in ipairs({
    { 2, { 'dist.pp=3' }, 'dist.pp=3 does not divide the 2 ranks' },
    { 2, { 'dist.pp=2', 'dist.pp_layers=2,1' }, 'dist.pp_layers=2,1' },
    { 3, { 'dist.pp=3', 'eval.every=1' }, 'dist.pp=3: the engine generates on slices over the pipeline\'s 3 ranks' },
    { 4, { 'dist.pp=4', 'model.dir=' .. U.tiny_model(dir .. '/init2', { layers = 2, vocab_size = 16 }) },
      'more stages than the model\'s 2 layers' },
  }) do
    local r = U.run_ranks(exe, case[1], 'recipes/sft.lua', U.with(SFT, U.with(case[2], { 'run.dir=' .. dir .. '/bad' })),
      { expect_fail = true })
    t.truthy(not r.ok and (r.stderr .. r.stdout):find(case[3], 1, true), case[3] .. ': ' .. r.stderr)
  end
end)

t.done()
