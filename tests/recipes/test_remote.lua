-- Rollouts on servers in other processes (engine.launch / engine.urls: moonrl.train.remote): GRPO
-- through two `moonrl serve` processes gives the bits of one process (their samples drawn from the
-- trainer engine's own random streams, the weights pushed through vLLM's control protocol every
-- step), every sample of the version the schedule says; one_step_off overlaps the next batch with
-- training on them; a server killed mid-run is started again and synced, one of engine.urls that
-- is down is left out, and a trainer killed again and again resumes on new servers, each with the
-- same result; bad engine keys are usage errors naming them.
local t = require('moonrl.testing')
local fs = require('moonrl.io.fs')
local proc = require('moonrl.io.proc')
local U = dofile('tests/recipes/util.lua')

local exe = rawget(_G, 'MOONRL_EXE')
assert(exe, 'needs the moonrl executable')
local dir = U.tmpdir('remote')
local model_dir = U.tiny_model(dir .. '/tiny')
local recs = {}
for i, p in ipairs(U.additions(40, 3)) do recs[i] = { question = p.prompt, answer = p.answer } end
local data = U.write_jsonl(dir .. '/rl.jsonl', recs)
local SERVE = exe .. ' serve --model {model} --port {port} --served-model-name {name}'

local function grpo(d, ...)
  local w = { 'model.dir=' .. model_dir, 'data.path=' .. data, 'data.prompt=question', 'data.chat=false',
    'reward=sevens', 'train.lr=1e-3', 'grpo.steps=5', 'grpo.prompts=6', 'grpo.samples=4', 'grpo.max_tokens=8',
    'run.threads=1', 'run.dir=' .. dir .. '/' .. d, ... }
  U.run_ranks(exe, 0, 'tests/recipes/grpo_sevens.lua', w, { timeout = 120 })
  return dir .. '/' .. d
end
local function bytes(d) return fs.read(d .. '/model/model.safetensors') end
local events = U.events

local EVAL = { 'eval.every=2', 'eval.data=' .. data, 'eval.prompts=4' }

t.test('grpo through two moonrl serve processes: the bits of one process, every sample of its version', function()
  local here = grpo('local', unpack(EVAL))
  local there = grpo('remote', 'engine.launch=auto', 'engine.servers=2', unpack(EVAL))
  t.truthy(bytes(here) == bytes(there), 'the final weights equal byte for byte')
  local a, b = U.records(here), U.records(there)
  t.truthy(a[1]['reward/std'] > 0 and a[1].grad_norm > 0, 'the rewards differ: the weights move')
  for i = 1, 5 do
    t.eq(b[i]['reward/mean'], a[i]['reward/mean'], 'the same samples at step ' .. i)
    t.eq(b[i]['async/staleness/0'], 24, 'every sample of version step - 1 at step ' .. i)
    t.truthy(b[i]['mismatch/max_abs'] < 1e-5, 'the servers\' log-probs are the trainer\'s: ' .. b[i]['mismatch/max_abs'])
    t.eq(b[i]['engine/servers_up'], 2)
  end
  t.eq(b[2]['eval/accuracy'], a[2]['eval/accuracy'], 'the held-out evaluation through the servers too')
  local function sum(recs, key)
    local n = 0
    for _, r in ipairs(recs) do n = n + (r[key] or 0) end
    return n
  end
  t.truthy(sum(b, 'engine/syncs') >= 5 and sum(b, 'engine/sync_bytes') > 0, 'a sync a step at least')
  t.eq(sum(b, 'engine/requests'), 30 + 2 * 4, 'a request a prompt (6 a step, 4 a held-out evaluation)')
  t.eq(sum(b, 'engine/server1/requests') + sum(b, 'engine/server2/requests'), 38, 'by server')
  t.truthy(b[3]['engine/server1/requests'] > 0 and b[3]['engine/server2/requests'] > 0, 'both servers take requests')
  t.eq(sum(b, 'engine/failures'), 0)
  for i = 1, 5 do -- (the servers' own figures: time to first token, queue; the sync's share of the step)
    t.truthy(b[i]['engine/ttft'] > 0 and b[i]['engine/ttft'] < b[i]['time/step'], 'a time to first token: ' .. b[i]['engine/ttft'])
    t.truthy(b[i]['engine/server1/ttft'] > 0 and b[i]['engine/server2/ttft'] > 0, 'by server')
    t.truthy(b[i]['engine/queue_peak'] >= 0 and b[i]['engine/server1/running_peak'] >= 0, 'the queue')
    t.truthy(b[i]['engine/sync_share'] > 0 and b[i]['engine/sync_share'] < 1, 'the sync share: ' .. b[i]['engine/sync_share'])
  end
  t.truthy(fs.exists(there .. '/engine/server-1.log') and fs.exists(there .. '/engine/server-2.log'), 'the servers\' logs')
  local pid = events(there, 'engine')[1].pid
  for _, name in ipairs(fs.list('/dev/shm')) do
    t.truthy(not name:find('moonrl-sync-' .. pid .. '-', 1, true), 'nothing of the run left in /dev/shm: ' .. name)
  end
end)

t.test('LoRA through moonrl serve: only the adapters go, as a PEFT directory a version; the bits of one process', function()
  local here = grpo('lora_local', 'model.lora.rank=4')
  local there = grpo('lora_remote', 'model.lora.rank=4', 'engine.launch=auto', 'engine.servers=2')
  local function adapters(d) return fs.read(d .. '/model/adapter_model.safetensors') end
  t.truthy(adapters(here) and adapters(here) == adapters(there), 'the final adapters equal byte for byte')
  local a, b = U.records(here), U.records(there)
  local model_bytes = fs.stat(dir .. '/tiny/model.safetensors').size
  for i = 1, 5 do
    t.eq(b[i]['reward/mean'], a[i]['reward/mean'], 'the same samples at step ' .. i)
    t.truthy(b[i]['mismatch/max_abs'] < 1e-5, 'the servers\' log-probs (base + adapters) are the trainer\'s: ' .. b[i]['mismatch/max_abs'])
    if (b[i]['engine/syncs'] or 0) > 0 then
      local per = b[i]['engine/sync_bytes'] / b[i]['engine/syncs'] * 2 -- (two servers, one file a version)
      t.truthy(per < model_bytes / 2, string.format('a version is the adapters\' file: %d bytes, the model %d', per, model_bytes))
    end
  end
  t.truthy(a[2].grad_norm > 0, 'the adapters move')
end)

t.test('weights by transfer: buckets of the tensors that changed; reload gives the same bits', function()
  local here = fs.exists(dir .. '/local/model/model.safetensors') and dir .. '/local' or grpo('local', unpack(EVAL))
  local small = grpo('buckets', 'engine.launch=auto', 'engine.bucket_mb=0.01', unpack(EVAL))
  local reload = grpo('reload', 'engine.launch=auto', 'engine.weight_sync=reload', unpack(EVAL))
  t.truthy(bytes(small) == bytes(here) and bytes(reload) == bytes(here), 'both give the weights of one process')
  local r = U.records(small)
  local views = #require('moonrl.model').load(model_dir):views()
  t.eq(r[2]['engine/sync_tensors'], views, 'every tensor changed in a step: all sent')
  local log = fs.read(small .. '/engine/server-1.log')
  local n = 0
  for tensors in log:gmatch('weights updated: (%d+) tensors') do n = n + 1; t.eq(tonumber(tensors), views) end
  t.truthy(n >= 5, 'an update a step, by the transfer routes: ' .. n)
  t.truthy(not fs.read(reload .. '/engine/server-1.log'):find('weights updated', 1, true), 'reload: none')
  -- only what changed goes: one tensor changed, one sent; the servers' log-probs are then the
  -- changed model's, exactly for fp32 buckets (also of a bf16 model, whose norms and embeddings
  -- are read in fp32), within bf16's rounding for bf16 buckets (half the bytes)
  local model = require('moonrl.model')
  for _, case in ipairs({ { 'fp32', 'float32', 1e-5 }, { 'bf16', 'float32', 1e-5 }, { 'bf16', 'bfloat16', 0.05 } }) do
    local dtype, sync, tol = unpack(case)
    local policy = model.load(model_dir)
    if dtype == 'bf16' then policy:set_dtype('bf16') end
    local e = require('moonrl.train.remote').new({ backend = 'moonrl', launch = 'auto', servers = 1, model_dir = model_dir,
      policy = policy, launch_timeout = 60, sync_dir = dir, log_dir = dir, bucket_mb = 0.001, sync_dtype = sync })
    dtype = dtype .. ' (' .. sync .. ' buckets)'
    local ok, err = pcall(function()
      local function check(label, what)
        e:sync(label)
        local got = e:generate({ { prompt_ids = { 1, 2, 3, 4 }, n = 1 } }, { temperature = 0, max_tokens = 6 })[1][1]
        local local_e = require('moonrl.engine').new(policy, { max_model_len = 64 })
        local want = local_e:generate({ { prompt_ids = { 1, 2, 3, 4 }, n = 1 } }, { temperature = 0, max_tokens = 6 })[1][1]
        t.eq(table.concat(got.ids, ','), table.concat(want.ids, ','), what .. ': the same tokens')
        for k = 1, #want.ids do
          local d = math.abs(got.logprobs[k] - want.logprobs[k])
          t.truthy(d < tol, string.format('%s: the log-probs within %g: %g', what, tol, d))
        end
        return e:metrics()
      end
      local m = check('1', dtype .. ' first sync')
      t.eq(m.sync_tensors, views, 'the first sync sends every tensor')
      local size = sync == 'bfloat16' and 2 or 4
      t.truthy(m.sync_bytes > size * policy.n_params and m.sync_bytes < size * policy.n_params + 65536, 'its bytes: ' .. m.sync_bytes)
      local p = policy:read_params()
      local v = policy:views()[#policy:views()] -- (the final norm)
      for i = 0, v.numel - 1 do p[v.offset + i] = p[v.offset + i] * 1.5 + 0.25 end
      policy:write_params(p)
      m = check('2', dtype .. ' one tensor changed')
      t.eq(m.sync_tensors, 1, 'only it is sent')
      t.truthy(m.sync_bytes < size * v.numel + 4096, 'its bytes: ' .. m.sync_bytes)
    end)
    e:close()
    if not ok then error(err, 0) end
  end
end)

t.test('one_step_off on the servers: the next batch generated while this one trains, its version one behind', function()
  local here = grpo('off_local', 'async.mode=one_step_off')
  local there = grpo('off_remote', 'async.mode=one_step_off', 'engine.launch=auto', 'engine.servers=2')
  local a, b = U.records(here), U.records(there)
  for i = 1, 5 do
    t.eq(b[i]['reward/mean'], a[i]['reward/mean'], 'the same samples at step ' .. i)
    if i > 1 then t.eq(b[i]['async/staleness/1'], 24, 'staleness exactly 1 at step ' .. i) end
    t.truthy(math.abs(b[i]['mismatch/max_abs'] - a[i]['mismatch/max_abs']) < 1e-5, 'the engine\'s log-probs at step ' .. i)
    t.truthy(math.abs(b[i].loss - a[i].loss) < 1e-5, 'the loss at step ' .. i)
  end
end)

t.test('a server killed mid-run is started again and synced; one of engine.urls down is left out; the trainer killed', function()
  local wrap = dir .. '/flaky.sh'
  fs.write(wrap, '#!/bin/sh\n# the first server started dies at its 4th generation request\n' ..
    'if mkdir ' .. dir .. '/flaky.mark 2>/dev/null; then export MOONRL_FAULT=serve_kill:requests=3; fi\nexec "$@"\n')
  local ref = grpo('sync_ref')
  local killed = grpo('killed', 'engine.launch=sh ' .. wrap .. ' ' .. SERVE, 'engine.servers=2')
  t.truthy(bytes(killed) == bytes(ref), 'the weights of the run without the fault')
  local ev = events(killed, 'engine_server')
  t.truthy(#ev >= 2 and ev[1].what == 'failed' and ev[2].what == 'restarted', 'the failure and the restart, logged')
  local r = U.records(killed)
  local restarts, retries = 0, 0
  for _, x in ipairs(r) do restarts, retries = restarts + x['engine/restarts'], retries + x['engine/retries'] end
  t.truthy(restarts == 1 and retries >= 1, 'counted: ' .. restarts .. ' restart(s), ' .. retries .. ' retries')
  -- two servers of the test's own; one of them gone before the run
  local function serve()
    local log = os.tmpname()
    local p = proc.spawn({ '/bin/sh', '-c', 'exec ' .. exe .. ' serve --model ' .. model_dir ..
      ' --port 0 2> ' .. log }) -- (served under its path's name: the run reads it off /v1/models)
    local port
    for _ = 1, 600 do
      port = (fs.read(log) or ''):match('listening on http://[^ ]*:(%d+)')
      if port then break end
      require('moonrl').sleep(0.05)
    end
    return p, 'http://127.0.0.1:' .. port
  end
  local p1, u1 = serve()
  local p2, u2 = serve()
  local ok, err = pcall(function()
    local up = grpo('urls', 'engine.urls=' .. u1 .. ',' .. u2)
    t.truthy(bytes(up) == bytes(ref), 'engine.urls: the same weights')
    p2:kill()
    local one = grpo('urls_one_down', 'engine.urls=' .. u1 .. ',' .. u2, 'engine.launch_timeout=2')
    t.truthy(bytes(one) == bytes(ref), 'one server down: the same weights from the other')
    t.eq(events(one, 'engine_server')[1].what, 'down', 'the server down, logged')
  end)
  p1:kill()
  pcall(p2.kill, p2)
  if not ok then error(err, 0) end
  -- the trainer killed again and again (its servers die with it) and resumed on new ones: every
  -- step once, the weights of the run never killed. (In sync mode: one_step_off trains on the
  -- servers' log-probs, whose last bits follow how their batches formed, which timing decides.)
  local K = dofile('tests/recipes/killer.lua')
  local rep = K.campaign({ recipe = 'tests/recipes/grpo_sevens.lua', steps = 5, kills = 3, seed = 31, dir = dir .. '/kills',
    words = { 'model.dir=' .. model_dir, 'data.path=' .. data, 'data.prompt=question', 'data.chat=false',
      'reward=sevens', 'train.lr=1e-3', 'grpo.steps=5', 'grpo.prompts=6', 'grpo.samples=4', 'grpo.max_tokens=8',
      'run.threads=1', 'engine.launch=auto', 'engine.servers=2' } })
  t.truthy(rep.kills >= 3, 'kills: ' .. rep.kills)
  -- the servers of the killed trainers died with them (the parent-death signal): none is left
  require('moonrl').sleep(0.5)
  local left = {}
  for _, pid in ipairs(fs.list('/proc')) do
    local cmd = pid:match('^%d+$') and fs.exists('/proc/' .. pid .. '/cmdline') and (fs.read('/proc/' .. pid .. '/cmdline') or '')
    if cmd and cmd:find('serve', 1, true) and cmd:find(model_dir, 1, true) then left[#left + 1] = pid end
  end
  t.eq(#left, 0, 'servers left by the killed trainers: ' .. table.concat(left, ' '))
  for m, same in pairs(rep.same) do t.truthy(same, m .. '/model.safetensors equal byte for byte') end
  t.eq(#rep.metrics, 5)
end)

t.test("a server's figures read off its Prometheus text, vLLM's too", function()
  local p = require('moonrl.train.remote').prometheus(table.concat({
    '# HELP vllm:num_requests_waiting Number of requests waiting.', '# TYPE vllm:num_requests_waiting gauge',
    'vllm:num_requests_waiting{engine="0",model_name="a b"} 3.0', 'vllm:num_requests_waiting{engine="1",model_name="a b"} 2',
    'vllm:time_to_first_token_seconds_sum{engine="0"} 1.5', 'moonrl_engine_waiting 4', 'garbage', '' }, '\n'))
  t.eq(p['vllm:num_requests_waiting'], 5, 'summed over label sets')
  t.eq(p['vllm:time_to_first_token_seconds_sum'], 1.5)
  t.eq(p['moonrl_engine_waiting'], 4)
  t.eq(p.garbage, nil)
end)

t.test('bad engine keys are usage errors naming the key', function()
  local function fails(...)
    local argv = U.rank_argv(0, exe)
    for _, x in ipairs({ 'run', 'tests/recipes/grpo_sevens.lua', 'model.dir=' .. model_dir, 'data.path=' .. data,
      'data.prompt=question', 'data.chat=false', 'reward=sevens', 'run.dir=' .. dir .. '/bad', ... }) do argv[#argv + 1] = x end
    local r = proc.run(argv, { timeout = 60 })
    t.eq(r.exit_status, 2, 'a usage error: ' .. r.stderr)
    return r.stderr
  end
  t.truthy(fails('engine.backend=sglang', 'engine.launch=auto'):find('engine.backend', 1, true))
  t.truthy(fails('engine.backend=vllm'):find('engine.urls', 1, true))
  t.truthy(fails('engine.launch=' .. exe .. ' serve --model {model}'):find('{port}', 1, true))
  t.truthy(fails('engine.launch=auto', 'engine.urls=http://127.0.0.1:1'):find('one of them', 1, true))
  t.truthy(fails('engine.launch=auto', 'async.mode=one_step_off', 'async.engine_threads=1'):find('async.engine_threads', 1, true))
  t.truthy(fails('engine.launch=auto', 'engine.weight_sync=fast'):find('engine.weight_sync', 1, true))
  t.truthy(fails('engine.backend=vllm', 'engine.urls=http://127.0.0.1:1', 'engine.weight_sync=transfer'):find('NCCL', 1, true))
  t.truthy(fails('engine.launch=auto', 'engine.sync_dtype=int8'):find('engine.sync_dtype', 1, true))
  t.truthy(fails('engine.launch=auto', 'engine.weight_sync=reload', 'engine.sync_dtype=bfloat16'):find('engine.sync_dtype', 1, true))
end)

fs.remove(dir)
t.done()
