-- The recipes with model.device=cuda against the same runs on the CPU, on a tiny random model
-- (one GPU; skipped where none is visible; without a GPU, the emulated one of tests/gpu/emu runs
-- it as the cuda_recipes_emu test, where every host read of device memory fails):
--   * GRPO with a KL reference (a clone on the GPU), PPO with its critic (critic_from on the
--     GPU), SFT with held-out evaluation (the engine on the GPU), DPO: the same tokens sampled,
--     step metrics and final weights within fp32 rounding of the CPU run's;
--   (MOONRL_TEST_LONG=1, which the GPU suite sets, adds the runs marked "long" below)
--   * data parallel over 2 ranks with GPU models (gradients through the host): the 2-rank CPU run;
--     tensor parallel over 2 (the group's sums and gathers over NCCL, also with sequence
--     parallel; through the host with one K/V head both ranks hold, and GRPO itself, long): GRPO
--     with a reference, the 2-rank CPU run; context parallel over 2 (through the host and over
--     NCCL) and pipeline parallel over 2 stages (GRPO, its engine on slices over the stages;
--     SFT, long): the 2-rank CPU runs;
--     ZeRO-1 (the optimizer state sharded over the GPUs) the bits of plain data parallel, and
--     with its shards offloaded to host memory (long) the same weights within rounding; ZeRO-2
--     (the gradients too, reduce-scattered from windows in the GPU's memory) the same, and
--     resumed; ZeRO-3 (the parameters too, in CUDA virtual memory) the same for GRPO with a
--     reference in fp32 (and bf16, long), PPO (long) and SFT (over NCCL; through the host, long), with half the parameters a GPU,
--     offloaded (long), resumed; and in shard groups of 2 over 4 GPUs (hybrid sharding, long);
--   * a GPU run resumed from its checkpoint ends with the weights of the run never stopped
--     (the optimizer state comes back from the host to the GPU);
--   * the step line and metrics.jsonl carry the GPU's memory by category;
--   * dist.offload=optimizer: the optimizer's state in host memory, the weights of the run without it
--     (its pipeline in chunks of 16 KiB: several for the tiny model);
--   * model.device values that cannot run are usage errors naming the key.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local U = dofile('tests/recipes/util.lua')
local C = moonrl.C

if C.mrl_device_cuda_count() == 0 then
  print('no CUDA device visible: skipped')
  os.exit(77)
end

require('moonrl.rewards').register('sevens', function(s) -- earned in part by a random model: every step moves it
  local _, n = s.response:gsub('7', '')
  return n / math.max(#s.response, 1)
end, { replace = true })

local dir = U.tmpdir('cuda_recipes')
local model_dir = U.tiny_model(dir .. '/init', { hidden_size = 32, layers = 2 })
local recs = {}
for i, p in ipairs(U.additions(40, 5)) do recs[i] = { question = p.prompt, answer = p.answer } end
local data = U.write_jsonl(dir .. '/train.jsonl', recs)
local prefs = {}
for i, p in ipairs(U.additions(24, 9)) do prefs[i] = { prompt = p.prompt, chosen = p.answer, rejected = p.answer .. '=' } end
local prefs_path = U.write_jsonl(dir .. '/prefs.jsonl', prefs)

local records = U.records
local exe, mpirun = rawget(_G, 'MOONRL_EXE'), U.which('mpirun')
-- (the emulated GPU runs the suite's share; the rest, which the GPU suite adds, with MOONRL_TEST_LONG=1:
-- hybrid sharding over 4 GPUs, ZeRO-3's bf16, PPO and offloaded runs, ZeRO-1 and 2 offloaded)
local long = os.getenv('MOONRL_TEST_LONG') == '1'

local weights_diff = U.weights_diff

local function run(recipe, words, tag, device)
  local w = { 'run.dir=' .. dir .. '/' .. tag .. '_' .. device, 'model.device=' .. device, 'run.threads=1' }
  for _, x in ipairs(words) do w[#w + 1] = x end
  U.run_recipe(recipe, w)
  return dir .. '/' .. tag .. '_' .. device
end

-- A GPU run directory g against the same run c on the CPU: one record a step, each step's exact
-- metrics (what counts tokens) equal and near ones (the floats) within 1e-4, each(m, s) on each
-- of the GPU's records, and the final weights within 1e-3. Returns both runs' records.
local function agree(g, c, tag, exact, near, each)
  local mc, mg = records(c), records(g)
  t.eq(#mg, #mc, tag .. ': one record per step on both')
  for s = 1, #mc do
    for _, k in ipairs(exact) do t.eq(mg[s][k], mc[s][k], string.format('%s step %d: %s', tag, s, k)) end
    for _, k in ipairs(near) do
      local a, b = mg[s][k], mc[s][k]
      t.truthy(a ~= nil and b ~= nil, tag .. ': metric ' .. k)
      if a and b then t.near(a, b, 1e-4 * math.max(1, math.abs(b)), string.format('%s step %d: %s', tag, s, k)) end
    end
    if each then each(mg[s], s) end
  end
  local d = weights_diff(g .. '/model', c .. '/model')
  print(string.format('%s: final weights, GPU vs CPU: worst ||d|| / ||w|| %.3g', tag, d))
  t.truthy(d <= 1e-3, tag .. ': the final weights agree')
  return mg, mc
end

-- the same run on both, in this process (rl: the engine's log-probs against the trainer's on the
-- GPU, mismatch/max_abs, within fp32 noise)
local function compare(recipe, words, tag, exact, near, rl)
  local c, g = run(recipe, words, tag, 'cpu'), run(recipe, words, tag, 'cuda')
  agree(g, c, tag, exact, near, function(m)
    if rl then t.truthy(m['mismatch/max_abs'] <= 1e-4, tag .. ': engine and trainer agree on the GPU') end
    t.truthy((m['memory/gpu/params_mb'] or 0) > 0 and (m['memory/gpu/optim_mb'] or 0) > 0,
      tag .. ': the GPU memory by category in metrics.jsonl')
  end)
  return c, g
end

t.test('grpo with a KL reference on the GPU: the CPU run, step by step', function()
  compare('tests/recipes/grpo_sevens.lua', { 'model.dir=' .. model_dir, 'data.path=' .. data, 'data.prompt=question',
    'data.chat=false', 'reward=sevens', 'train.lr=1e-2', 'train.micro_batch_tokens=64', 'grpo.steps=2',
    'grpo.prompts=4', 'grpo.samples=4', 'grpo.max_tokens=4', 'grpo.kl_coef=0.1', 'engine.kv_cache_mb=4' }, 'grpo',
    { 'tokens', 'response_length/mean' }, { 'reward/mean', 'loss', 'grad_norm', 'kl', 'entropy' }, true)
end)

t.test('grpo with LoRA adapters on the GPU (the base frozen there, the lora_fwd op): the CPU run', function()
  local words = { 'model.dir=' .. model_dir, 'data.path=' .. data, 'data.prompt=question', 'data.chat=false',
    'reward=sevens', 'train.lr=1e-2', 'train.micro_batch_tokens=64', 'grpo.steps=2', 'grpo.prompts=4',
    'grpo.samples=4', 'grpo.max_tokens=4', 'grpo.kl_coef=0.1', 'engine.kv_cache_mb=4', 'model.lora.rank=4' }
  local c, g = run('tests/recipes/grpo_sevens.lua', words, 'lora', 'cpu'), run('tests/recipes/grpo_sevens.lua', words, 'lora', 'cuda')
  local mc, mg = records(c), records(g)
  t.eq(#mg, #mc)
  for s = 1, #mc do
    t.eq(mg[s].tokens, mc[s].tokens, 'the same tokens at step ' .. s)
    for _, k in ipairs({ 'reward/mean', 'loss', 'grad_norm', 'kl' }) do
      t.near(mg[s][k], mc[s][k], 1e-4 * math.max(1, math.abs(mc[s][k])), string.format('step %d: %s', s, k))
    end
    t.truthy(mg[s]['mismatch/max_abs'] <= 1e-4, 'the engine (adapters read in place on the GPU) and the trainer agree')
  end
  t.truthy(mc[1].grad_norm > 0, 'the adapters move')
  local d = U.rel_diff(U.weights(c .. '/model/adapter_model.safetensors'), U.weights(g .. '/model/adapter_model.safetensors'))
  print(string.format('lora: final adapters, GPU vs CPU: ||d|| / ||w|| %.3g', d))
  t.truthy(d <= 1e-4, 'the final adapters agree')
end)

t.test('ppo with its critic on the GPU', function()
  compare('recipes/ppo.lua', { 'model.dir=' .. model_dir, 'data.path=' .. data, 'data.prompt=question',
    'data.chat=false', 'reward=sevens', 'train.lr=1e-2', 'train.micro_batch_tokens=64', 'ppo.steps=2',
    'ppo.prompts=4', 'ppo.samples=2', 'ppo.max_tokens=4', 'engine.kv_cache_mb=4' }, 'ppo',
    { 'tokens', 'response_length/mean' }, { 'reward/mean', 'loss', 'critic/loss' }, true)
end)

t.test('sft with held-out accuracy (the engine on the GPU) and dpo', function()
  compare('recipes/sft.lua', { 'model.dir=' .. model_dir, 'data.task=addition', 'train.steps=3', 'train.batch=8',
    'train.lr=3e-3', 'eval.every=3', 'eval.prompts=8', 'engine.kv_cache_mb=4' }, 'sft',
    { 'eval/prompts', 'eval/accuracy' }, { 'loss', 'grad_norm' })
  compare('recipes/dpo.lua', { 'model.dir=' .. model_dir, 'data.path=' .. prefs_path, 'train.steps=3', 'train.pairs=4',
    'train.lr=3e-3', 'dpo.beta=0.5', 'train.micro_batch_tokens=80' }, 'dpo', {}, { 'loss' })
end)

t.test('a GPU run resumed from its checkpoint: the weights of the run never stopped', function()
  local words = { 'model.dir=' .. model_dir, 'data.path=' .. data, 'data.prompt=question', 'data.chat=false',
    'reward=sevens', 'train.lr=1e-2', 'train.micro_batch_tokens=64', 'grpo.prompts=4', 'grpo.samples=4',
    'grpo.max_tokens=4', 'engine.kv_cache_mb=4', 'run.checkpoint_every=1' }
  local function with(extra) return U.with(words, extra) end
  local straight = run('tests/recipes/grpo_sevens.lua', with({ 'grpo.steps=2' }), 'straight', 'cuda')
  local part = dir .. '/part_cuda'
  run('tests/recipes/grpo_sevens.lua', with({ 'grpo.steps=1' }), 'part', 'cuda')
  U.run_recipe('tests/recipes/grpo_sevens.lua', with({ 'run.dir=' .. part, 'model.device=cuda', 'run.threads=1',
    'grpo.steps=2', 'run.resume=auto' }))
  t.eq(#records(part), 2, 'resumed at step 2')
  local d = weights_diff(part .. '/model', straight .. '/model')
  print(string.format('resumed vs straight on the GPU: worst ||d|| / ||w|| %.3g', d))
  t.eq(d, 0, 'the same weights, bit for bit')
end)

t.test('dist.offload=optimizer: no optimizer state on the GPU, the weights of the run without it; resumed bit for bit', function()
  local words = { 'model.dir=' .. model_dir, 'data.path=' .. data, 'data.prompt=question', 'data.chat=false',
    'reward=sevens', 'train.lr=1e-2', 'train.micro_batch_tokens=64', 'grpo.prompts=4', 'grpo.samples=4',
    'grpo.max_tokens=4', 'engine.kv_cache_mb=4', 'run.checkpoint_every=1' }
  -- (each run a process of its own: the memory counters are the process's)
  local function sub(tag, extra)
    local d = dir .. '/' .. tag
    local w = U.with(words, U.with({ 'run.dir=' .. d, 'model.device=cuda', 'run.threads=1' }, extra))
    U.run_ranks(exe, 0, 'tests/recipes/grpo_sevens.lua', w, { timeout = 300 })
    return d
  end
  local on_gpu = sub('no_offload', { 'grpo.steps=2' })
  local off = sub('offload', { 'grpo.steps=2', 'dist.offload=optimizer', 'dist.offload_chunk_mb=0.015625' })
  local mo, mg = records(off), records(on_gpu)
  for s = 1, #mo do
    t.truthy(mg[s]['memory/gpu/optim_mb'] > 0, 'step ' .. s .. ': without offload, the state on the GPU')
    t.eq(mo[s]['memory/gpu/optim_mb'], 0, 'step ' .. s .. ': with it, no optimizer state on the GPU')
    t.truthy(mo[s]['memory/optim_mb'] >= mg[s]['memory/gpu/optim_mb'], 'step ' .. s .. ': it is in host memory')
    t.near(mo[s].loss, mg[s].loss, 1e-5 * math.max(1, math.abs(mg[s].loss)), 'step ' .. s .. ': the loss')
  end
  local d = weights_diff(off .. '/model', on_gpu .. '/model')
  print(string.format('optimizer offloaded vs on the GPU: worst ||d|| / ||w|| %.3g', d))
  t.truthy(d <= 1e-5, 'the weights of the run without offload (the CPU kernel against the GPU\'s)')
  -- stopped after step 1 and resumed: the master weights come back with the model
  local part = sub('offload_part', { 'grpo.steps=1', 'dist.offload=optimizer', 'dist.offload_chunk_mb=0.015625' })
  sub('offload_part', { 'grpo.steps=2', 'run.resume=auto', 'dist.offload=optimizer', 'dist.offload_chunk_mb=0.015625' })
  t.eq(#records(part), 2, 'resumed at step 2')
  t.eq(weights_diff(part .. '/model', off .. '/model'), 0, 'resumed with offload: the weights of the run never stopped')
end)

local proc = require('moonrl.io.proc')
-- One run of grpo_sevens (or recipe with the words base) on 2 ranks (or np), each with its GPU (here both cuda:0: the emulated machine, or
-- one real GPU shared; model.device=device; extra: more words): its run directory, nil where
-- there is no mpirun.
local function ranks(device, tag, extra, recipe, base, np)
  if not (exe and mpirun) then return nil end
  local run_dir = dir .. '/dp_' .. tag
  local argv = { mpirun, '-n', tostring(np or 2), '--oversubscribe', '--bind-to', 'none', '--allow-run-as-root', '--mca', 'btl',
    'vader,self' }
  if os.getenv('LD_PRELOAD') then argv[#argv + 1], argv[#argv + 2] = '-x', 'LD_PRELOAD' end
  for _, a in ipairs({ exe, 'run', recipe or 'tests/recipes/grpo_sevens.lua', 'model.dir=' .. model_dir,
    'run.threads=1', 'dist.gpu_transport=host', 'model.device=' .. device, 'run.dir=' .. run_dir }) do
    argv[#argv + 1] = a
  end
  for _, a in ipairs(base or { 'data.path=' .. data, 'data.prompt=question', 'data.chat=false', 'reward=sevens',
    'train.lr=1e-2', 'train.micro_batch_tokens=64', 'grpo.steps=2', 'grpo.prompts=4', 'grpo.samples=4',
    'grpo.max_tokens=4', 'engine.kv_cache_mb=4' }) do
    argv[#argv + 1] = a
  end
  for _, a in ipairs(extra or {}) do argv[#argv + 1] = a end
  local r = proc.run(argv, { timeout = 600 })
  if not r.ok then io.stderr:write(r.stdout, r.stderr) end
  t.truthy(r.ok, '2 ranks on ' .. device)
  return run_dir
end

-- Two ranks, each with its GPU (here both cuda:0: the emulated machine, or one real GPU shared),
-- gradients summed through the host (dist.gpu_transport=host: NCCL wants a GPU a rank): the
-- weights of the same two ranks on the CPU.
t.test('data parallel over 2 ranks on GPUs: the 2-rank CPU run', function()
  if not (exe and mpirun) then return print('  (no mpirun: skipped)') end
  local c, g = ranks('cpu', 'cpu'), ranks('cuda:0', 'gpu')
  local mg = agree(g, c, '2 ranks', { 'tokens' }, { 'loss' })
  local ev = io.open(g .. '/events.jsonl'):read('*a')
  t.truthy(ev:find('"gpu_transport": "host"', 1, true), 'the data-parallel event names the transport')
  -- ZeRO-1 on GPUs: each rank steps its shard of the optimizer state on its GPU (half of it here),
  -- then the parameters are all-gathered: the bits of plain data parallel; with the shards
  -- offloaded (ZeRO-Offload) the state is in host memory, the weights those of the GPU's kernel
  -- within rounding
  local z1 = ranks('cuda:0', 'gpu_zero1', { 'dist.zero=1' })
  t.eq(weights_diff(z1 .. '/model', g .. '/model'), 0, 'zero=1 on GPUs: the weights of zero=0')
  local m1 = records(z1)
  local full, half = mg[#mg]['memory/gpu/optim_mb'], m1[#m1]['memory/gpu/optim_mb']
  t.truthy(full > 0 and half > 0 and math.abs(half - full / 2) <= 0.01 * full,
    string.format('zero=1: the GPU holds half of the optimizer state (%s of %s MiB)', tostring(half), tostring(full)))
  if long then
    local z1o = ranks('cuda:0', 'gpu_zero1_off', { 'dist.zero=1', 'dist.offload=optimizer', 'dist.offload_chunk_mb=0.015625' })
    local m1o = records(z1o)
    t.truthy((m1o[#m1o]['memory/gpu/optim_mb'] or 0) == 0 and (m1o[#m1o]['memory/optim_mb'] or 0) > 0,
      'zero=1 offloaded: the state of the shard in host memory, none on the GPU')
    local d1 = weights_diff(z1o .. '/model', g .. '/model')
    print(string.format('zero=1 offloaded against zero=0 on GPUs: worst ||d|| / ||w|| %.3g', d1))
    t.truthy(d1 <= 1e-6, 'zero=1 offloaded: the weights of zero=0 within rounding')
  end
  -- stopped after step 1 and resumed: each rank's shard of the state comes back onto its GPU
  ranks('cuda:0', 'gpu_zero1_part', { 'dist.zero=1', 'grpo.steps=1', 'run.checkpoint_every=1' })
  local part = ranks('cuda:0', 'gpu_zero1_part', { 'dist.zero=1', 'run.checkpoint_every=1', 'run.resume=auto' })
  t.eq(#records(part), 2, 'zero=1 on GPUs: two steps logged')
  t.truthy(io.open(part .. '/events.jsonl'):read('*a'):match('"event": "resume"[^\n]*step%-000001'),
    'zero=1 on GPUs: resumed from step 1\'s checkpoint')
  t.eq(weights_diff(part .. '/model', z1 .. '/model'), 0, 'zero=1 on GPUs resumed: the weights of the run never stopped')
end)

-- Tensor parallel on GPUs (dist.tp=2): each rank's slices on its GPU, the group's sums and
-- gathers through the host (tp.c), a vocabulary the ranks split (16 ids): GRPO with a KL
-- reference (the engine generating on the slices), the 2-rank CPU run within rounding.
-- The group's sums through the host (dist.gpu_transport=host), and over NCCL where it starts
-- (auto: the emulated GPU's NCCL, tests/gpu/emu/nccl.cpp; two ranks sharing one real GPU fall
-- back to the host, which the run's precision event says).
t.test('tensor parallel over 2 ranks on GPUs (the sums over NCCL; with MOONRL_TEST_LONG=1 also through the host): the 2-rank CPU run', function()
  if not (exe and mpirun) then return print('  (no mpirun: skipped)') end
  local m16 = U.tiny_model(dir .. '/init16', { hidden_size = 32, layers = 2, vocab_size = 16 })
  local kv1 = U.tiny_model(dir .. '/init16kv1', { hidden_size = 32, layers = 2, vocab_size = 16, kv_heads = 1 })
  local emulated = (os.getenv('LD_PRELOAD') or ''):find('moonrl_cuda_emu', 1, true) ~= nil
  -- (the CPU run, which neither the transport nor sequence parallel changes; through the host on
  -- the GPUs, where MOONRL_TEST_LONG=1 asks: GRPO itself and the one-K/V-head case)
  local c = ranks('cpu', 'tp_grpo_cpu', { 'model.dir=' .. m16, 'dist.tp=2', 'grpo.kl_coef=0.1' })
  local cases = { { 'grpo_nccl', nil, nil, { 'grpo.kl_coef=0.1', 'dist.gpu_transport=auto' }, 'nccl' },
    -- sequence parallel: the rows split over the group between the products
    { 'grpo_sp', nil, nil, { 'grpo.kl_coef=0.1', 'dist.gpu_transport=auto', 'dist.sequence_parallel=true' }, 'nccl' } }
  if long then
    table.insert(cases, 1, { 'grpo', nil, nil, { 'grpo.kl_coef=0.1' } })
    -- one K/V head, held by both ranks: its gradients summed over them after the backwards
    cases[#cases + 1] = { 'grpo_kv1', nil, nil, { 'grpo.kl_coef=0.1', 'model.dir=' .. kv1 }, nil, true }
  end
  for _, case in ipairs(cases) do
    local extra = U.with({ 'model.dir=' .. m16, 'dist.tp=2' }, case[4])
    if case[6] then c = ranks('cpu', 'tp_' .. case[1] .. '_cpu', extra, case[2], case[3]) end -- (a model of its own)
    local g = ranks('cuda:0', 'tp_' .. case[1] .. '_gpu', extra, case[2], case[3])
    agree(g, c, 'tensor parallel ' .. case[1] .. ' on 2 ranks', { 'tokens' }, { 'loss' })
    local ev = io.open(g .. '/events.jsonl'):read('*a')
    local via = ev:match('"tp_transport": "(%a+)"')
    print('  the group\'s sums: ' .. tostring(via))
    if not case[5] then t.eq(via, 'host', 'tp ' .. case[1] .. ': dist.gpu_transport=host')
    elseif emulated then t.eq(via, 'nccl', 'tp ' .. case[1] .. ': the emulated GPU\'s NCCL')
    else t.truthy(via == 'nccl' or via == 'host', 'tp ' .. case[1] .. ': a transport') end
  end
end)

-- Context parallel on GPUs (dist.cp=2, Ulysses): each rank's share of the tokens on its GPU, the
-- all-to-alls around attention and the per-token outputs' gather through host memory
-- (dist.gpu_transport=host) and over NCCL where it starts (auto: the emulated GPU's): GRPO with a
-- reference, the 2-rank CPU run's tokens and losses, the weights within rounding.
t.test('context parallel over 2 ranks on GPUs (the exchanges over NCCL; with MOONRL_TEST_LONG=1 also through the host): the 2-rank CPU run', function()
  if not (exe and mpirun) then return print('  (no mpirun: skipped)') end
  local extra = { 'dist.cp=2', 'grpo.kl_coef=0.1' }
  local c = ranks('cpu', 'cp_grpo_cpu', extra)
  local emulated = (os.getenv('LD_PRELOAD') or ''):find('moonrl_cuda_emu', 1, true) ~= nil
  -- (through the host with MOONRL_TEST_LONG=1, which the GPU suite sets: the suite's time)
  for _, via in ipairs(long and { 'host', 'auto' } or { 'auto' }) do
    local g = ranks('cuda:0', 'cp_grpo_gpu_' .. via, U.with(extra, { 'dist.gpu_transport=' .. via }))
    agree(g, c, 'context parallel grpo on 2 ranks (' .. via .. ')', { 'tokens' }, { 'loss' })
    local got = io.open(g .. '/events.jsonl'):read('*a'):match('"cp_transport": "(%a+)"')
    if via == 'host' then t.eq(got, 'host', 'cp: dist.gpu_transport=host')
    elseif emulated then t.eq(got, 'nccl', 'cp: the emulated GPU\'s NCCL')
    else t.truthy(got == 'nccl' or got == 'host', 'cp: a transport') end
  end
end)

-- Pipeline parallel on GPUs (dist.pp=2): each rank's stage on its GPU, the rows and their
-- gradients sent by MPI through host buffers, a tied head's two copies' gradients summed between
-- the pipeline's ends (over NCCL where it starts): GRPO with a reference in micro-batches (1F1B;
-- the engine on slices over the 2 GPUs, refreshed from the stages) and, with MOONRL_TEST_LONG=1,
-- SFT, the 2-rank CPU runs within rounding; the model saved by the stages the CPU's.
t.test('pipeline parallel over 2 ranks on GPUs: the 2-rank CPU runs (grpo in micro-batches, sft long; a tied head)', function()
  if not (exe and mpirun) then return print('  (no mpirun: skipped)') end
  local m4 = U.tiny_model(dir .. '/init_pp', { hidden_size = 32, layers = 4, vocab_size = 16 })
  local sft = { 'data.task=addition', 'train.steps=2', 'train.batch=8', 'train.lr=3e-3', 'train.micro_batch_tokens=40' }
  local cases = { { 'grpo', nil, nil, { 'grpo.kl_coef=0.1' } } } -- (its micro-batches: 1F1B too)
  if long then cases[2] = { 'sft', 'recipes/sft.lua', sft } end
  for _, case in ipairs(cases) do
    local extra = U.with({ 'model.dir=' .. m4, 'dist.pp=2', 'dist.gpu_transport=auto' }, case[4] or {})
    local c = ranks('cpu', 'pp_' .. case[1] .. '_cpu', extra, case[2], case[3])
    local g = ranks('cuda:0', 'pp_' .. case[1] .. '_gpu', extra, case[2], case[3])
    local mg = agree(g, c, 'pipeline parallel ' .. case[1] .. ' on 2 ranks', case[1] == 'grpo' and { 'tokens' } or {},
      { 'loss' })
    t.truthy((mg[#mg]['memory/gpu/params_mb'] or 0) > 0, 'pp ' .. case[1] .. ': the stage on the GPU')
  end
end)

-- ZeRO-2 on GPUs: each backward's ranges written into windows in the GPU's memory and
-- reduce-scattered through the host; a rank keeps half of the gradients and of the optimizer
-- state. With one micro-batch a rank the bits of zero=0 (the same rank-ordered sums); with the
-- shards offloaded, those of the GPU's kernel within rounding; stopped and resumed, the bits of
-- the run never stopped.
t.test('zero=2 over 2 ranks on GPUs: the bits of zero=0, half the gradients and state on each GPU, offloaded, resumed', function()
  if not (exe and mpirun) then return print('  (no mpirun: skipped)') end
  local one = 'train.micro_batch_tokens=4096'
  local plain, z2 = ranks('cuda:0', 'one', { one }), ranks('cuda:0', 'one_zero2', { one, 'dist.zero=2' })
  t.eq(weights_diff(z2 .. '/model', plain .. '/model'), 0, 'zero=2 on GPUs: the weights of zero=0')
  local mp, m2 = records(plain), records(z2)
  for _, key in ipairs({ 'memory/gpu/grads_mb', 'memory/gpu/optim_mb' }) do
    local full, half = mp[#mp][key], m2[#m2][key]
    t.truthy(full > 0 and half > 0 and math.abs(half - full / 2) <= 0.01 * full,
      string.format('zero=2: %s is half that of zero=0 (%s of %s)', key, tostring(half), tostring(full)))
  end
  t.truthy(m2[#m2]['memory/grads_windows_peak_mb'] > 0, 'zero=2: the windows\' peak is reported')
  if long then
    local off = ranks('cuda:0', 'one_zero2_off', { one, 'dist.zero=2', 'dist.offload=optimizer',
      'dist.offload_chunk_mb=0.015625' })
    local d = weights_diff(off .. '/model', plain .. '/model')
    print(string.format('zero=2 offloaded against zero=0 on GPUs: worst ||d|| / ||w|| %.3g', d))
    t.truthy(d <= 1e-6, 'zero=2 offloaded: the weights of zero=0 within rounding')
  end
  ranks('cuda:0', 'one_zero2_part', { one, 'dist.zero=2', 'grpo.steps=1', 'run.checkpoint_every=1' })
  local part = ranks('cuda:0', 'one_zero2_part', { one, 'dist.zero=2', 'run.checkpoint_every=1', 'run.resume=auto' })
  t.eq(#records(part), 2, 'zero=2 on GPUs: two steps logged')
  t.eq(weights_diff(part .. '/model', z2 .. '/model'), 0, 'zero=2 on GPUs resumed: the weights of the run never stopped')
end)

-- ZeRO-3 on GPUs: each rank's shard of the parameters in a region of CUDA virtual memory (the
-- emulated GPU's pages are 4 KiB), each part of the forward and backward gathered into place
-- through the host and given back, the gradients as ZeRO-2's. With one micro-batch a rank the
-- bits of zero=0: GRPO with a KL reference (loaded whole on the GPU) in fp32 and in bf16 (the
-- engine's compute copy made part by part), PPO with its critic (sharded as the policy), SFT
-- (about half the parameters' GPU memory a rank) and offloaded within rounding; a checkpoint
-- written by the 2 sharded GPUs resumes to the weights of the run never stopped.
t.test('zero=3 over 2 ranks on GPUs: the bits of zero=0 for grpo (fp32, bf16, a KL reference), ppo and sft; half the parameters a GPU; resumed', function()
  if not (exe and mpirun) then return print('  (no mpirun: skipped)') end
  local one = 'train.micro_batch_tokens=4096'
  local function same(a, b, what)
    t.eq(weights_diff(a .. '/model', b .. '/model'), 0, what)
  end
  local cases = { { 'fp32', { one, 'grpo.kl_coef=0.1' } } }
  if long then cases[2] = { 'bf16', { one, 'grpo.kl_coef=0.1', 'model.dtype=bf16' } } end
  for _, case in ipairs(cases) do
    local plain = ranks('cuda:0', 'z3ref_' .. case[1], case[2])
    local z3 = ranks('cuda:0', 'z3_' .. case[1], U.with(case[2], { 'dist.zero=3' }))
    same(z3, plain, 'grpo with a KL reference, ' .. case[1] .. ': zero=3 on GPUs gives the weights of zero=0')
    local m3 = records(z3)
    t.truthy(m3[#m3]['memory/params_shard_mb'] > 0 and m3[#m3]['memory/engine_copy_mb'] > 0,
      case[1] .. ': the shard and the engine\'s copy in the memory rows')
    if case[1] == 'fp32' then -- stopped after step 1 and resumed: the shards come back onto the GPUs
      local words = U.with(case[2], { 'dist.zero=3', 'run.checkpoint_every=1' })
      ranks('cuda:0', 'z3_part', U.with(words, { 'grpo.steps=1' }))
      local part = ranks('cuda:0', 'z3_part', U.with(words, { 'run.resume=auto' }))
      t.eq(#records(part), 2, 'zero=3 on GPUs: two steps logged')
      same(part, z3, 'zero=3 on GPUs resumed: the weights of the run never stopped')
    end
  end
  if long then
    local ppo = { 'data.path=' .. data, 'data.prompt=question', 'data.chat=false', 'reward=exact', 'train.lr=1e-2', one,
      'ppo.steps=2', 'ppo.prompts=4', 'ppo.samples=2', 'ppo.max_tokens=4', 'engine.kv_cache_mb=4' }
    same(ranks('cuda:0', 'z3_ppo', { 'dist.zero=3' }, 'recipes/ppo.lua', ppo),
      ranks('cuda:0', 'z3ref_ppo', {}, 'recipes/ppo.lua', ppo), 'ppo with its critic: zero=3 on GPUs gives the weights of zero=0')
  end
  local sft = { 'data.task=addition', 'train.steps=2', 'train.batch=8', 'train.lr=3e-3', one }
  local s0 = ranks('cuda:0', 'z3ref_sft', {}, 'recipes/sft.lua', sft)
  local s3 -- (sft under zero=3: over NCCL, below; through the host where MOONRL_TEST_LONG=1 asks)
  if long then
    s3 = ranks('cuda:0', 'z3_sft', { 'dist.zero=3' }, 'recipes/sft.lua', sft)
    same(s3, s0, 'sft: zero=3 on GPUs gives the weights of zero=0')
  end
  -- over NCCL where it starts (dist.gpu_transport=auto; the emulated GPU's NCCL sums in rank order,
  -- as the host's: the same bits there; a real one's order differs: within rounding)
  local emulated = (os.getenv('LD_PRELOAD') or ''):find('moonrl_cuda_emu', 1, true) ~= nil
  for _, z in ipairs({ '3' }) do -- (its reduce-scatters are ZeRO-2's)
    local n = ranks('cuda:0', 'z' .. z .. '_sft_nccl', { 'dist.zero=' .. z, 'dist.gpu_transport=auto' }, 'recipes/sft.lua', sft)
    local via = io.open(n .. '/events.jsonl'):read('*a'):match('"event": "data_parallel"[^\n]*"gpu_transport": "(%a+)"')
    s3 = s3 or n
    local d = weights_diff(n .. '/model', s0 .. '/model')
    print(string.format('sft zero=%s over %s against zero=0 through the host: worst ||d|| / ||w|| %.3g', z, tostring(via), d))
    if emulated then t.eq(via, 'nccl', 'zero=' .. z .. ': the emulated GPU\'s NCCL') end
    t.truthy(d <= (via == 'nccl' and not emulated and 1e-5 or 0), 'sft: zero=' .. z .. ' over ' .. tostring(via) ..
      ' gives the weights of zero=0')
  end
  local m0, m3 = records(s0), records(s3)
  local p0, p3 = m0[#m0]['memory/gpu/params_mb'], m3[#m3]['memory/gpu/params_mb']
  t.truthy(p3 > 0 and p3 <= 0.6 * p0, string.format('sft: a GPU holds about half the parameters (%s of %s MiB)',
    tostring(p3), tostring(p0)))
  if long then
    local off = ranks('cuda:0', 'z3_sft_off', { 'dist.zero=3', 'dist.offload=optimizer', 'dist.offload_chunk_mb=0.015625' },
      'recipes/sft.lua', sft)
    local d = weights_diff(off .. '/model', s0 .. '/model')
    print(string.format('zero=3 offloaded against zero=0 on GPUs: worst ||d|| / ||w|| %.3g', d))
    t.truthy(d <= 1e-6, 'zero=3 offloaded: the weights of zero=0 within rounding')
  end
end)

-- Hybrid sharding on 4 GPUs in shard groups of 2: the parts gathered and the parameters made
-- whole within each group through the host, the gradients summed over all 4: zero=2 and 3 give
-- the bits of zero=0 on 4 GPUs.
t.test('hybrid sharding over 4 GPUs (dist.shard_group=2): zero=2 and 3 give the bits of zero=0', function()
  if not (exe and mpirun) then return print('  (no mpirun: skipped)') end
  -- (4 ranks of the emulated GPU on the test machine's 2 cores take minutes: on a real GPU, and
  -- where MOONRL_TEST_LONG=1 asks for it; the CPU's hybrid sharding runs in test_zero)
  if not long then return print('  (4 emulated GPUs: MOONRL_TEST_LONG=1 runs it)') end
  local one = 'train.micro_batch_tokens=4096'
  local plain = ranks('cuda:0', 'hsdp_plain', { one }, nil, nil, 4)
  for zero = 2, 3 do
    local h = ranks('cuda:0', 'hsdp_zero' .. zero, { one, 'dist.zero=' .. zero, 'dist.shard_group=2' }, nil, nil, 4)
    t.eq(weights_diff(h .. '/model', plain .. '/model'), 0,
      'zero=' .. zero .. ' in shard groups of 2 on GPUs: the weights of zero=0')
  end
end)

t.test('model.device values that cannot run: usage errors naming the key', function()
  for _, case in ipairs({ { 'tpu', "expected cpu, cuda or cuda:N" }, { 'cuda:7', 'cuda:7 asked' },
    { 'cuda', 'async.engine_threads', { 'async.mode=one_step_off', 'async.engine_threads=1' } } }) do
    local words = { 'model.dir=' .. model_dir, 'data.path=' .. data, 'data.prompt=question', 'reward=sevens',
      'grpo.steps=1' }
    for _, w in ipairs(case[3] or {}) do words[#words + 1] = w end
    local ok, err = pcall(run, 'tests/recipes/grpo_sevens.lua', words, 'bad', case[1])
    local msg = moonrl.error_text(err)
    t.truthy(not ok and msg:find('model.device=' .. case[1], 1, true) and msg:find(case[2], 1, true),
      'model.device=' .. case[1] .. ': ' .. msg)
  end
end)

t.done()
