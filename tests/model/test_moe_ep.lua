-- Expert parallelism (model.h, mrl_model_set_expert_parallel): tests/model/moe_ep_ranks.lua
-- alone and under mpirun on 2 ranks (shared memory) and 3 (TCP), in fp32, bf16, with
-- activation recompute and with routing replay: each rank's log-probs and the summed gradients
-- equal one process's on the whole batch, a rank's own experts' gradients are whole and the
-- others' zero; a rank with no tokens (an empty batch) still serves its experts. A rank that never arrives fails the others' forward after the timeout with the
-- communicator's report; a dense model refuses the setting. GRPO with moe.expert_parallel on 2
-- ranks (micro-batch counts that differ between the ranks, two epochs, routing replay) ends with
-- the weights of plain data parallel; with a rollout rank, the engine's routing record travels to
-- the trainer and is replayed. Skipped where mpirun is absent.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local proc = require('moonrl.io.proc')
local U = dofile('tests/recipes/util.lua')
local tiny = dofile('tests/lib/models.lua')

local exe = assert(rawget(_G, 'MOONRL_EXE'), 'needs the moonrl executable')
local mpirun = U.which('mpirun')
local WORKER = 'tests/model/moe_ep_ranks.lua'

local function run(n, btl, words)
  local argv = {}
  if n > 0 then
    for _, a in ipairs({ mpirun, '-n', tostring(n), '--oversubscribe', '--bind-to', 'none', '--allow-run-as-root',
      '--mca', 'btl', btl .. ',self' }) do argv[#argv + 1] = a end
  end
  for _, a in ipairs({ exe, 'run', WORKER }) do argv[#argv + 1] = a end
  for _, w in ipairs(words or {}) do argv[#argv + 1] = w end
  return proc.run(argv, { timeout = 120 })
end

local function oks(r)
  local n = 0
  for line in r.stdout:gmatch('[^\n]+') do
    if line:find('^ep ok rank') then
      n = n + 1
      print('  ' .. line)
    end
  end
  return n
end

t.test('one process: expert parallelism over a world of one is the plain model, bit for bit', function()
  local r = run(0)
  t.truthy(r.ok, r.stderr)
  t.eq(oks(r), 1)
  t.truthy(r.stdout:find('log-probs 0, gradients 0', 1, true), r.stdout)
end)

t.test('a dense model refuses expert parallelism', function()
  local m = tiny.model('qwen3')
  t.raises(function() m:set_expert_parallel(require('moonrl.train.dist').world()) end, 'has no sparse layers')
  t.raises(function() m:forward(moonrl.model.empty_batch()) end, 'n_tokens = 0', 'an empty batch without expert parallelism')
  local _, count, on = m:expert_range()
  t.eq(on, false)
  t.eq(count, 0)
end)

if not mpirun then
  print('skipped the mpirun cases: no mpirun')
  t.done()
  return
end

for _, c in ipairs({ { 2, 'vader' }, { 3, 'tcp' } }) do
  for _, words in ipairs({ {}, { 'dtype=bf16' }, { 'recompute=true', 'replay=true' }, { 'idle=true', 'recompute=true' },
    { 'arch=deepseek_v3', 'replay=true' } }) do
    local name = string.format('%d ranks (%s) %s: the single-process log-probs and gradients', c[1], c[2],
      #words > 0 and table.concat(words, ' ') or 'fp32')
    t.test(name, function()
      local r = run(c[1], c[2], words)
      t.truthy(r.ok, r.stdout .. r.stderr)
      t.eq(oks(r), c[1], 'every rank')
    end)
  end
end

-- A tiny qwen3_moe (5 experts: uneven blocks over 2 ranks) saved in Hugging Face format at dir.
local function tiny_moe(dir, seed) tiny.save(dir, 'qwen3_moe', nil, { seed = seed }) end

-- mpirun -n 2 moonrl run WORDS... (shared memory)
local function two_ranks(words)
  local argv = { mpirun, '-n', '2', '--oversubscribe', '--bind-to', 'none', '--allow-run-as-root', '--mca', 'btl',
    'vader,self', exe, 'run' }
  for _, w in ipairs(words) do argv[#argv + 1] = w end
  return argv
end

t.test('grpo with moe.expert_parallel on 2 ranks: the weights and losses of plain data parallel', function()
  local json = require('moonrl.io.json')
  local dir = U.tmpdir('moe_ep_grpo')
  local init = dir .. '/init'
  tiny_moe(init, 3)
  local recs = {}
  for i, p in ipairs(U.additions(40, 6)) do recs[i] = { question = p.prompt, answer = p.answer } end
  local data = U.write_jsonl(dir .. '/train.jsonl', recs)
  local function grpo(name, ep, extra)
    local argv = two_ranks { 'recipes/grpo.lua', 'model.dir=' .. init, 'data.path=' .. data, 'data.prompt=question',
      'data.chat=false', 'reward=exact', 'train.lr=1e-3', 'train.micro_batch_tokens=17', 'grpo.steps=3',
      'grpo.prompts=6', 'grpo.samples=4', 'grpo.max_tokens=5', 'grpo.epochs=2', 'grpo.temperature=1.5',
      'moe.routing_replay=true', 'run.threads=1', 'run.progress=off', 'run.dir=' .. dir .. '/' .. name,
      'moe.expert_parallel=' .. tostring(ep) }
    for _, w in ipairs(extra or {}) do argv[#argv + 1] = w end
    local r = proc.run(argv, { timeout = 300 })
    t.truthy(r.ok, name .. ": " .. r.stdout .. r.stderr)
    local steps = {}
    for l in io.lines(dir .. '/' .. name .. '/metrics.jsonl') do steps[#steps + 1] = json.decode(l) end
    local w = U.weights(dir .. '/' .. name .. '/model/model.safetensors')
    return steps, w
  end
  local dp_steps, dp_w = grpo('dp', false)
  local ep_steps, ep_w = grpo('ep', true)
  t.eq(#ep_steps, 3)
  for i = 1, 3 do
    t.near(ep_steps[i].loss, dp_steps[i].loss, 1e-4, 'loss of step ' .. i)
    t.near(ep_steps[i]['reward/mean'], dp_steps[i]['reward/mean'], 1e-9, 'the same samples at step ' .. i)
  end
  local worst, changed = 0, 0
  for n, a in pairs(dp_w) do
    local b = ep_w[n]
    for i = 0, a.n - 1 do worst = math.max(worst, math.abs(a.buf[i] - b.buf[i])) end
  end
  local w0 = dp_w['model.layers.0.mlp.experts.4.down_proj.weight']
  local b0 = U.weights(init .. '/model.safetensors')['model.layers.0.mlp.experts.4.down_proj.weight'].buf
  for i = 0, w0.n - 1 do if b0[i] ~= w0.buf[i] then changed = changed + 1 end end
  print(string.format('  expert parallel vs data parallel after 3 steps: weights within %.2g; loss %.6f vs %.6f', worst,
    ep_steps[3].loss, dp_steps[3].loss))
  t.truthy(changed > 0, 'the last expert (rank 1\'s) was trained')
  t.truthy(worst < 1e-5, 'weights within 1e-5: ' .. worst)
  -- small gradient buckets reduced while the backward's exchanges run, and ZeRO-1: the same weights
  local _, zw = grpo('ep_buckets', true, { 'dist.bucket_mb=0.004', 'dist.zero=1' })
  local zworst = 0
  for n, a in pairs(dp_w) do
    for i = 0, a.n - 1 do zworst = math.max(zworst, math.abs(a.buf[i] - zw[n].buf[i])) end
  end
  t.truthy(zworst < 1e-5, 'buckets and zero=1 under expert parallelism: weights within 1e-5: ' .. zworst)
  -- routing replay from a rollout rank: its engine's routing record travels with the batch
  local ro = grpo('rollout', false, { 'dist.rollout_ranks=1' })
  for i, r in ipairs(ro) do
    t.truthy(r['moe/replayed'] > 0.5, 'step ' .. i .. ': replayed share ' .. tostring(r['moe/replayed']))
    t.eq(r['moe/routing_mismatch'], 0, 'the trainer runs the experts the rollout rank sampled with')
  end
  os.execute("rm -rf '" .. dir .. "'")
end)

t.test('sft and dpo with moe.expert_parallel on 2 ranks: the weights of plain data parallel; a killed rank', function()
  local dir = U.tmpdir('moe_ep_sup')
  local init = dir .. '/init'
  tiny_moe(init, 4)
  local sft, prefs = {}, {}
  for i, p in ipairs(U.additions(45, 8)) do
    sft[i] = { prompt = p.prompt, response = p.answer .. string.rep('1', i % 4) } -- lengths that differ
    prefs[i] = { prompt = p.prompt, chosen = p.answer, rejected = p.answer .. string.rep('=', 1 + i % 3) }
  end
  local words = {
    sft = { 'data.path=' .. U.write_jsonl(dir .. '/sft.jsonl', sft), 'train.steps=3', 'train.batch=15', 'train.lr=3e-3' },
    dpo = { 'data.path=' .. U.write_jsonl(dir .. '/prefs.jsonl', prefs), 'train.steps=3', 'train.pairs=7',
            'train.lr=3e-3', 'dpo.beta=0.5' },
  }
  for _, recipe in ipairs({ 'sft', 'dpo' }) do
    local function run(name, ep)
      local argv = two_ranks { recipe, 'model.dir=' .. init, 'train.micro_batch_tokens=20', 'run.threads=1',
        'run.progress=off', 'quiet=true', 'run.dir=' .. dir .. '/' .. name, 'moe.expert_parallel=' .. tostring(ep) }
      for _, w in ipairs(words[recipe]) do argv[#argv + 1] = w end
      local r = proc.run(argv, { timeout = 300 })
      t.truthy(r.ok, name .. ': ' .. r.stdout .. r.stderr)
      return U.weights(dir .. '/' .. name .. '/model/model.safetensors')
    end
    local dp, ep = run(recipe .. '_dp', false), run(recipe .. '_ep', true)
    local worst = 0
    for n, a in pairs(dp) do
      for i = 0, a.n - 1 do worst = math.max(worst, math.abs(a.buf[i] - ep[n].buf[i])) end
    end
    print(string.format('  %s: expert parallel vs data parallel after 3 steps: weights within %.2g', recipe, worst))
    t.truthy(worst < 1e-5, recipe .. ': weights within 1e-5: ' .. worst)
  end
  -- a rank killed mid-step (its peer waiting in an exchange): moonrl launch --restarts resumes the
  -- job from its checkpoint, and it ends with the clean run's weights, byte for byte
  local function bytes(path)
    local f = assert(io.open(path, 'rb'))
    local b = f:read('*a')
    f:close()
    return b
  end
  local argv = { '/usr/bin/env', 'PATH=' .. os.getenv('PATH'), 'MOONRL_FAULT=kill:step=2:phase=train:rank=1:attempt=0',
    'MOONRL_THREADS=1', exe, 'launch', '-n', '2', '--restarts', '2', '--backoff', '0.1', '--mpirun', '--mca btl vader,self',
    'sft', 'model.dir=' .. init, 'train.micro_batch_tokens=20', 'run.threads=1', 'run.progress=off', 'quiet=true',
    'run.dir=' .. dir .. '/sft_killed', 'moe.expert_parallel=true', 'run.checkpoint_every=1', 'dist.timeout=20' }
  for _, w in ipairs(words.sft) do argv[#argv + 1] = w end
  local killed = proc.run(argv, { timeout = 300 })
  t.truthy(killed.ok, 'the supervised job finished: ' .. killed.stdout .. killed.stderr)
  t.truthy(killed.stderr:find('restarting', 1, true), 'after a restart')
  t.truthy(bytes(dir .. '/sft_killed/model/model.safetensors') == bytes(dir .. '/sft_ep/model/model.safetensors'),
    'a killed rank under expert parallelism: the clean run\'s weights')
  U.tiny_model(dir .. '/dense')
  local r = proc.run({ exe, 'run', 'sft', 'model.dir=' .. dir .. '/dense', 'data.path=' .. dir .. '/sft.jsonl',
    'moe.expert_parallel=true', 'run.dir=' .. dir .. '/bad' }, { timeout = 60 })
  t.eq(r.exit_status, 2)
  t.truthy(r.stderr:find("config key 'moe.expert_parallel': the model (llama) has no mixture-of-experts layers", 1, true),
    r.stderr)
  t.truthy(not require('moonrl.io.fs').exists(dir .. '/bad'), 'no run directory')
  os.execute("rm -rf '" .. dir .. "'")
end)

t.test('a rank that never runs its forward: the others fail after the timeout, the report names it', function()
  local r = run(2, 'vader', { 'hang=true' })
  local line = r.stdout:match('ep timeout ok rank 0: [^\n]+')
  t.truthy(line, r.stdout .. r.stderr)
  print('  ' .. line)
  t.truthy(line:find('timed out', 1, true), line)
end)

t.done()
