-- LoRA in the recipes (model.lora.*) on the tiny random model: GRPO trains only the adapters (the
-- base bit for bit as loaded), the engine generates with them unmerged (its log-probs are the
-- trainer's), the run's model is a PEFT directory that loads back (and continues training from
-- model.lora.dir), the merged save equals the adapted model, engine.lora_merged generates from a
-- merged copy; SFT (with dropout) and DPO train adapters too, a mixture of experts every expert's;
-- what LoRA does not do yet is a usage error naming the key.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local ffi = require('ffi')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')
local U = dofile('tests/recipes/util.lua')

local dir = U.tmpdir('lora')
local model_dir, sft_data, pref_data, data = U.ranks_setup(dir)

local RL = { 'model.dir=' .. model_dir, 'data.path=' .. data, 'data.prompt=question', 'data.chat=false',
  'reward=tests/recipes/partial_reward.lua:partial', 'train.micro_batch_tokens=64', 'run.threads=1',
  'grpo.prompts=4', 'grpo.samples=4', 'grpo.max_tokens=4' }
local function with(extra) return U.with(RL, extra) end

-- the log-probs of a few sequences under model m
local SEQS = { { 1, 5, 9, 2, 3 }, { 4, 7, 7, 1 } }
local function logprobs(m)
  local lp = m:forward(moonrl.model.batch(SEQS))
  local out = {}
  for i = 0, 8 do out[#out + 1] = lp[i] end
  return out
end

local grpo -- (the first test's run: the later ones start from its adapters)
t.test('grpo with LoRA: adapters trained, base frozen, engine = trainer, a PEFT directory saved', function()
  local out = U.run_recipe('recipes/grpo.lua', with({ 'grpo.steps=4', 'model.lora.rank=4', 'model.lora.alpha=8',
    'grpo.kl_coef=0.01', 'model.lora.save_merged=true', 'run.dir=' .. dir .. '/grpo' }))
  grpo = out
  local recs_out = U.records(out.dir)
  t.eq(#recs_out, 4)
  local moved = 0
  for _, r in ipairs(recs_out) do
    -- the engine generates with the adapters unmerged; the trainer's first forward reads the same weights
    t.truthy(r['mismatch/max_abs'] < 1e-4, 'engine vs trainer log-probs: max |diff| ' .. r['mismatch/max_abs'])
    moved = moved + (r.grad_norm > 0 and 1 or 0)
  end
  t.truthy(moved > 0, 'the adapters got gradients')
  local e = U.event(out.dir, 'lora')
  t.eq(e.rank, 4)
  t.near(e.lr, 1e-5, 1e-12, 'train.lr not given: 10x the recipe\'s full-parameter default (1e-6)')
  t.truthy(e.trainable < e.params, 'the trainable share is the adapters\'')
  -- the base is the loaded model's, bit for bit; the policy differs from it by the adapters
  local base = moonrl.model.load(model_dir)
  local pp, n = out.model:param_buffer()
  local bp = base:param_buffer()
  t.eq(ffi.string(pp, 4 * n), ffi.string(bp, 4 * n), 'the base weights are unchanged')
  local want = logprobs(out.model)
  local differ = 0
  for i, v in ipairs(logprobs(base)) do differ = math.max(differ, math.abs(v - want[i])) end
  t.truthy(differ > 1e-4, 'the adapters changed the model')
  -- the saved PEFT directory over the base is the trained policy
  local m = out.dir .. '/model'
  t.truthy(fs.exists(m .. '/adapter_model.safetensors') and fs.exists(m .. '/adapter_config.json'), 'PEFT files')
  local cfg = json.read_file(m .. '/adapter_config.json')
  t.eq(cfg.r, 4)
  t.eq(cfg.lora_alpha, 8)
  t.eq(cfg.peft_type, 'LORA')
  base:load_lora(m)
  for i, v in ipairs(logprobs(base)) do t.near(v, want[i], 1e-6, 'the saved adapters give the trained log-probs') end
  -- and merged into a whole model (model.lora.save_merged), within fp32 rounding of the unmerged
  local merged = moonrl.model.load(out.dir .. '/model_merged')
  for i, v in ipairs(logprobs(merged)) do t.near(v, want[i], 1e-5, 'merged = unmerged') end
  -- checkpoints hold the adapters, their optimizer state and the base's identity
  local ck = require('moonrl.train.checkpoint').latest(out.dir .. '/checkpoints')
  t.truthy(fs.exists(ck .. '/adapter_model.safetensors') and not fs.exists(ck .. '/model.safetensors'), 'adapters only')
  local id = json.read_file(ck .. '/lora_base.json')
  t.eq(id.path, model_dir)
  t.truthy(id.files['model.safetensors'] ~= nil, 'the base weights\' checksum')
  local st = require('moonrl.io.safetensors').open(ck .. '/optimizer.safetensors')
  t.eq(st:info('policy.exp_avg').numel, out.model:lora().n, 'the optimizer state is the adapters\'')
  -- the KL reference is the policy's base (its adapters off), no copy: at step 1 the policy is the
  -- base (B = 0), so the KL is 0 exactly, and after updates it is not
  local r = U.records(out.dir)
  t.eq(r[1].kl, 0, 'the KL against the base at step 1')
  t.truthy(r[#r].kl > 0, 'and a KL once the adapters moved: ' .. r[#r].kl)
  t.truthy(U.event(out.dir, 'reference').what:find('no copy', 1, true), 'the reference is the policy\'s base, no copy')
end)

t.test('engine.lora_merged: rollouts from a merged copy, made again after each update', function()
  local out = U.run_recipe('recipes/grpo.lua', with({ 'grpo.steps=3', 'model.lora.rank=4', 'model.lora.alpha=8',
    'train.lr=1e-2', 'engine.lora_merged=true', 'run.dir=' .. dir .. '/merged' }))
  local r = U.records(out.dir)
  t.truthy(r[1].grad_norm > 0, 'the adapters move')
  for i = 1, 3 do
    -- the engine reads W + s BA (merged after each update), the trainer W and the adapters apart
    t.truthy(r[i]['mismatch/max_abs'] < 1e-4, 'merged engine vs unmerged trainer: ' .. r[i]['mismatch/max_abs'])
    t.truthy(r[i]['memory/engine_copy_mb'] > 0, 'the merged copy is the engine\'s')
  end
  local ok, err = pcall(U.run_recipe, 'recipes/grpo.lua', with({ 'grpo.steps=1', 'model.lora.rank=4',
    'engine.lora_merged=true', 'engine.launch=auto', 'run.dir=' .. dir .. '/merged_bad' }))
  t.truthy(not ok and moonrl.error_text(err):find('engine.lora_merged', 1, true), moonrl.error_text(err))
end)

t.test('model.lora.dir continues from a saved adapter; a PEFT directory moonrl cannot compute is an error naming why', function()
  local out = U.run_recipe('recipes/grpo.lua', with({ 'grpo.steps=1', 'model.lora.dir=' .. grpo.dir .. '/model',
    'train.lr=0', 'run.dir=' .. dir .. '/grpo2' }))
  local a, b = logprobs(out.model), logprobs(grpo.model)
  for i = 1, #a do t.near(a[i], b[i], 1e-6, 'the adapters read back (lr 0: unchanged)') end
  t.eq(out.model:lora().rank, 4)
  -- hostile directories: a config that does not match the tensors, settings computed otherwise, not JSON
  local function bad_dir(tag, edit_config, text)
    local d = dir .. '/bad_' .. tag
    fs.mkdirs(d)
    fs.copy(grpo.dir .. '/model/adapter_model.safetensors', d .. '/adapter_model.safetensors')
    local c = json.read_file(grpo.dir .. '/model/adapter_config.json')
    if edit_config then edit_config(c) end
    fs.write(d .. '/adapter_config.json', text or json.encode(c))
    return d
  end
  for _, case in ipairs({
    { bad_dir('rank', function(c) c.r = 8 end), 'has shape [4, ' },
    { bad_dir('dora', function(c) c.use_dora = true end), 'use_dora' },
    { bad_dir('targets', function(c) c.target_modules = { 'q_proj', 'lm_head' } end), 'target_modules' },
    { bad_dir('json', nil, '{"r": 4,'), 'not JSON' },
  }) do
    local m = dofile('tests/lib/models.lua').model('digits', { num_hidden_layers = 2 }, { seed = 1 })
    local ok, err = pcall(m.load_lora, m, case[1])
    t.truthy(not ok and tostring(err):find(case[2], 1, true), case[1] .. ': ' .. tostring(err))
  end
end)

t.test('model.lora.dropout: sft with dropout trains, the masks the training forwards\' only; saved as lora_dropout', function()
  local out = U.run_recipe('recipes/sft.lua', { 'model.dir=' .. model_dir, 'data.path=' .. sft_data, 'train.steps=6',
    'train.batch=8', 'train.lr=1e-2', 'model.lora.rank=4', 'model.lora.dropout=0.2', 'run.threads=1',
    'run.dir=' .. dir .. '/sft_dropout' })
  local r = U.records(out.dir)
  t.truthy(r[#r].loss < r[1].loss, string.format('the loss falls with dropout: %.4f -> %.4f', r[1].loss, r[#r].loss))
  t.eq(json.read_file(out.dir .. '/model/adapter_config.json').lora_dropout, 0.2)
  -- a forward outside training: no dropout (the same log-probs twice)
  local a, b = logprobs(out.model), logprobs(out.model)
  for i = 1, #a do t.eq(a[i], b[i]) end
  local ok, err = pcall(U.run_recipe, 'recipes/sft.lua', { 'model.dir=' .. model_dir, 'data.path=' .. sft_data,
    'model.lora.rank=4', 'model.lora.dropout=1', 'run.dir=' .. dir .. '/bad_dropout' })
  t.truthy(not ok and moonrl.error_text(err):find('model.lora.dropout', 1, true), moonrl.error_text(err))
end)

t.test('sft and dpo train adapters', function()
  local out = U.run_recipe('recipes/sft.lua', { 'model.dir=' .. model_dir, 'data.path=' .. sft_data,
    'train.steps=6', 'train.batch=8', 'train.lr=1e-2', 'model.lora.rank=2', 'model.lora.targets=q_proj,v_proj',
    'run.threads=1', 'run.dir=' .. dir .. '/sft' })
  local r = U.records(out.dir)
  t.truthy(r[#r].loss < r[1].loss, string.format('SFT loss falls: %.4f -> %.4f', r[1].loss, r[#r].loss))
  t.eq(table.concat(out.model:lora().targets, ','), 'q_proj,v_proj')
  t.eq(#out.model:lora_views(), 2 * 2 * out.model.config.num_hidden_layers, 'A and B of q and v in each layer')
  local d = U.run_recipe('recipes/dpo.lua', { 'model.dir=' .. model_dir, 'data.path=' .. pref_data,
    'train.steps=4', 'train.pairs=4', 'train.lr=1e-2', 'model.lora.rank=2', 'run.threads=1', 'run.dir=' .. dir .. '/dpo' })
  local dr = U.records(d.dir)
  t.truthy(dr[#dr].loss < dr[1].loss, string.format('DPO loss falls: %.4f -> %.4f', dr[1].loss, dr[#dr].loss))
end)

t.test('a mixture of experts: every expert\'s adapters train, the engine\'s log-probs are the trainer\'s', function()
  dofile('tests/lib/models.lua').save(dir .. '/moe', 'qwen3_moe', nil, { seed = 4 })
  local out = U.run_recipe('recipes/grpo.lua', U.with(RL, { 'model.dir=' .. dir .. '/moe', 'grpo.steps=3',
    'model.lora.rank=4', 'moe.routing_replay=true', 'train.lr=1e-2', 'run.dir=' .. dir .. '/moe_run' }))
  local moved = 0
  for _, r in ipairs(U.records(out.dir)) do
    t.truthy(r['mismatch/max_abs'] < 1e-4, 'engine vs trainer: ' .. r['mismatch/max_abs'])
    moved = moved + (r.grad_norm > 0 and 1 or 0)
  end
  t.truthy(moved > 0, 'the adapters got gradients')
  local experts = 0
  for _, v in ipairs(out.model:lora_views()) do experts = experts + (v.name:find('.mlp.experts.', 1, true) and 1 or 0) end
  local c = out.model.config
  t.eq(experts, 2 * 3 * c.num_experts * out.model:num_moe_layers(), 'A and B of each expert\'s three projections')
end)

t.test('model.dtype=bf16: the frozen base stored in bf16 alone computes as the base kept in fp32 too', function()
  local tiny = dofile('tests/lib/models.lua')
  local function adapted(freeze)
    local m = tiny.model('digits', { hidden_size = 128, intermediate_size = 256 }, { seed = 3 })
    m:set_dtype('bf16')
    m:set_lora({ rank = 4, alpha = 8, seed = 1 })
    local p, n = m:lora_buffer()
    for i = 0, n - 1 do p[i] = 0.1 * math.sin(i) end
    m:trained()
    return m, freeze and m:freeze_base_bf16() or 0
  end
  local kept, frozen, freed = adapted(false), adapted(true)
  local matrices = 0
  for _, v in ipairs(kept:views()) do matrices = matrices + (v.name:match('_proj%.weight$') and v.numel or 0) end
  t.truthy(freed >= 0.7 * 4 * matrices and freed <= 4 * matrices, string.format('the fp32 matrices freed: %d of ' ..
    '%d bytes (whole pages)', freed, 4 * matrices))
  local b = moonrl.model.batch(SEQS)
  local la = logprobs(kept)
  for i, v in ipairs(logprobs(frozen)) do t.eq(v, la[i], 'log-prob ' .. i .. ', bit for bit') end
  local dl = ffi.new('float[9]', -1)
  kept:forward(b)
  kept:backward(dl)
  frozen:forward(b)
  frozen:backward(dl)
  local ga, n = kept:lora_grads()
  local gb = frozen:lora_grads()
  t.eq(ffi.string(gb, 4 * n), ffi.string(ga, 4 * n), 'the adapters\' gradients, bit for bit')
  -- reading the parameters: the matrices are their bf16 copies widened
  local pa, pb = kept:read_params(), frozen:read_params()
  local far = 0
  for i = 0, kept.n_params - 1 do far = math.max(far, math.abs(pa[i] - pb[i]) / math.max(math.abs(pa[i]), 1e-3)) end
  t.truthy(far <= 2 ^ -8, 'read_params: within bf16 rounding of the fp32 base (' .. far .. ')')
  t.raises(function() frozen:params() end, 'stored in bf16', 'params() of a bf16-stored base')
  t.raises(function() frozen:set_dtype('fp32') end, 'its dtype stays bf16', 'back to fp32')
  -- the engine over it (its bf16 panels packed from the copies): the kept base's tokens and log-probs
  local outs = {}
  for i, m in ipairs({ kept, frozen }) do
    outs[i] = moonrl.engine.new(m, { kv_cache_bytes = 2 ^ 22, max_batch_tokens = 128, max_seqs = 8, seed = 1 }):generate(
      { { prompt_ids = { 1, 2, 3 }, n = 2 } }, { temperature = 1, max_tokens = 6, seed = 2 })
  end
  for j = 1, 2 do
    t.eq(table.concat(outs[2][1][j].ids, ' '), table.concat(outs[1][1][j].ids, ' '), 'sample ' .. j .. ' tokens')
    t.eq(table.concat(outs[2][1][j].logprobs, ' '), table.concat(outs[1][1][j].logprobs, ' '), 'sample ' .. j .. ' log-probs')
  end
  -- a run in bf16 freezes its base so, and trains
  local out = U.run_recipe('recipes/grpo.lua', with({ 'grpo.steps=2', 'model.lora.rank=4', 'model.dtype=bf16',
    'train.lr=1e-2', 'model.lora.save_merged=true', 'run.dir=' .. dir .. '/bf16' }))
  t.eq(U.event(out.dir, 'lora').base_bf16, true, 'the lora event says the base is stored in bf16')
  t.truthy(out.model:base_bf16(), 'the policy\'s base is stored in bf16')
  t.truthy(fs.exists(out.dir .. '/model_merged/model.safetensors'), 'the merged save reads the copies')
end)

t.test('what LoRA does not do yet, and bad keys, are usage errors naming the key', function()
  for _, c in ipairs({
    { { 'model.lora.rank=4', 'dist.zero=2' }, 'dist.zero=2' },
    { { 'model.lora.rank=4', 'model.lora.targets=q_proj,lm_head' }, "model.lora.targets: 'lm_head'" },
    { { 'model.lora.rank=4', 'async.engine_threads=1', 'async.mode=one_step_off' }, 'async.engine_threads' },
    { { 'model.lora.dir=' .. dir .. '/none' }, 'model.lora.dir=' },
  }) do
    local ok, err = pcall(U.run_recipe, 'recipes/grpo.lua', with(U.with(c[1], { 'grpo.steps=1',
      'run.dir=' .. dir .. '/bad' })))
    t.truthy(not ok, table.concat(c[1], ' ') .. ' is refused')
    t.truthy(tostring(moonrl.error_text(err)):find(c[2], 1, true), 'names ' .. c[2] .. ': ' .. moonrl.error_text(err))
  end
end)

fs.remove(dir)
