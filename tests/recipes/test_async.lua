-- Asynchronous RL (moonrl.train.rollout) on a short default example: the one-step-off and bounded-
-- staleness schedules give the same bits in one process and with a rollout rank, never exceed
-- their staleness bound (from the per-sample versions), resume bit-identically after a kill,
-- and a rollout rank that dies or hangs is reported by the trainer and, under the supervisor,
-- the job resumes to the weights of an uninterrupted run; a guard's rollback takes the rollout
-- ranks back with the trainers; weights go through shared memory on one host, an engine thread
-- overlaps generation in one process, and async.partial=continue updates requests in flight.
local t = require('moonrl.testing')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')
local proc = require('moonrl.io.proc')
local U = dofile('tests/recipes/util.lua')

local exe = rawget(_G, 'MOONRL_EXE')
local mpirun = U.which('mpirun')
assert(exe and mpirun, 'needs the moonrl executable and mpirun')

local dir = U.tmpdir('async')
local BASE = { 'sft.steps=100', 'grpo.steps=6', 'grpo.prompts=8', 'heldout=20', 'quiet=true', 'run.threads=1',
  'run.checkpoint_every=1' }
local SFT = 100 -- global step = SFT + the GRPO step

local function words(run_dir, ...)
  local w = { 'run.dir=' .. run_dir }
  for _, x in ipairs(BASE) do w[#w + 1] = x end
  for _, x in ipairs({ ... }) do w[#w + 1] = x end
  return w
end

-- The default example in one process (ranks = 0) or under mpirun with one rollout rank.
local function run(ranks, w, opts)
  opts = opts or {}
  local argv = U.rank_argv(ranks, exe, opts)
  for _, x in ipairs(w) do argv[#argv + 1] = x end
  local r = proc.run(argv, { timeout = opts.timeout or 180 })
  if not r.ok and not opts.expect_fail then
    io.stderr:write(r.stdout, r.stderr)
    -- the cause in the message too: a test log may keep only stdout
    error(string.format('the default example failed (exit %s%s): %s', tostring(r.exit_status),
      r.timed_out and ', timed out' or '', (r.stderr or ''):sub(-1500)), 2)
  end
  return r
end

local function model_bytes(d) return fs.read(d .. '/model/model.safetensors') end
local events = U.events

-- Run d killed by `fault` (an expected failure), then the same command again (a resume): d's
-- final weights.
local function killed_then_resumed(ranks, d, fault, ...)
  local r = run(ranks, words(d, ...), { env = { fault }, expect_fail = true })
  t.truthy(not r.ok, d .. ': the fault killed the run')
  run(ranks, words(d, ...))
  return model_bytes(d)
end
local function metrics(d)
  local out = {}
  for line in io.lines(d .. '/metrics.jsonl') do out[#out + 1] = json.decode(line) end
  return out
end

t.test('one_step_off: the same bits in one process and with a rollout rank; staleness exactly 1', function()
  run(0, words(dir .. '/off1', 'async.mode=one_step_off'))
  run(2, words(dir .. '/off2', 'async.mode=one_step_off', 'dist.rollout_ranks=1'))
  t.truthy(model_bytes(dir .. '/off1') == model_bytes(dir .. '/off2'), 'same final weights')
  local m = metrics(dir .. '/off2')
  local grpo = 0
  for _, r in ipairs(m) do
    if r['async/staleness/1'] then
      grpo = grpo + 1
      t.eq(r['async/max_staleness_seen'], 1, 'one version behind')
      t.eq(r['async/dropped_stale'], 0, 'none dropped')
    end
  end
  t.eq(grpo, 5, 'every GRPO step but the first (version 0 then) trained on samples one version old')
  -- one timeline of the job: the trainer's track and the rollout rank's, merged at the end
  local tr = json.decode(fs.read(dir .. '/off2/trace.json'))
  local by_pid = {}
  for _, e in ipairs(tr.traceEvents) do
    if e.ph == 'B' then by_pid[e.pid] = by_pid[e.pid] or {}; by_pid[e.pid][e.name] = true end
  end
  t.truthy(by_pid[0] and by_pid[0].train, 'rank 0 (the trainer) trains in trace.json')
  t.truthy(by_pid[1] and by_pid[1].generate, 'rank 1 (the rollout rank) generates in the same trace.json')
  t.truthy(not fs.exists(dir .. '/off2/trace-rank-1.json'), 'no per-rank file left at a clean end')
end)

t.test('async, max_staleness=2: the bound holds, and is reached', function()
  run(2, words(dir .. '/async', 'async.mode=async', 'async.max_staleness=2', 'dist.rollout_ranks=1'))
  local seen = {}
  for _, r in ipairs(metrics(dir .. '/async')) do
    local mx = r['async/max_staleness_seen']
    if mx then
      t.truthy(mx <= 2, 'staleness within the bound: ' .. mx)
      seen[mx] = true
    end
  end
  t.truthy(seen[2], 'two versions behind once the queue is full')
  -- async.decoupled=auto: AReaL's decoupled loss in async mode (its behaviour weights logged), not in one_step_off
  local behav = 0
  for _, r in ipairs(metrics(dir .. '/async')) do if r['is/behav/ratio_max'] then behav = behav + 1 end end
  t.truthy(behav > 0, 'async mode: the decoupled loss by default')
  for _, r in ipairs(metrics(dir .. '/off2')) do t.truthy(r['is/behav/ratio_max'] == nil, 'one_step_off: tis alone') end
  run(0, words(dir .. '/async1', 'async.mode=async', 'async.max_staleness=2'))
  t.truthy(model_bytes(dir .. '/async') == model_bytes(dir .. '/async1'), 'the same bits in one process')
end)

t.test('one_step_off resumes bit-identically after a kill (one process, and with a rollout rank)', function()
  local d = dir .. '/off_killed'
  t.truthy(killed_then_resumed(0, d, 'MOONRL_FAULT=kill:step=' .. (SFT + 4) .. ':phase=train', 'async.mode=one_step_off')
    == model_bytes(dir .. '/off1'), 'resumed: the weights of the uninterrupted run')
  t.eq(#metrics(d), 6, 'each GRPO step logged once')
  t.truthy(killed_then_resumed(2, dir .. '/off_killed2', 'MOONRL_FAULT=kill:step=' .. (SFT + 3) .. ':phase=train:rank=0',
    'async.mode=one_step_off', 'dist.rollout_ranks=1') == model_bytes(dir .. '/off1'),
    'the trainer killed in step 3, resumed with a rollout rank: the same weights')
end)

t.test('a rollout rank that hangs is reported by the trainer within dist.timeout', function()
  local t0 = require('moonrl').now()
  local r = run(2, words(dir .. '/hang', 'async.mode=one_step_off', 'dist.rollout_ranks=1', 'dist.timeout=3'),
    { env = { 'MOONRL_FAULT=hang:step=' .. (SFT + 3) .. ':phase=generate:rank=1' }, expect_fail = true, timeout = 90 })
  local text = r.stdout .. r.stderr
  t.truthy(not r.ok, 'the job failed')
  t.truthy(require('moonrl').now() - t0 < 60, 'within a minute')
  t.truthy(text:find('rank 1: no answer') ~= nil, 'the trainer names rank 1')
  if not text:find('rank 1: no answer') then io.stderr:write(text) end
end)

t.test('a rollout rank killed under moonrl launch --restarts: the job resumes to the same weights', function()
  local d = dir .. '/rollout_killed'
  local argv = { '/usr/bin/env', 'PATH=' .. os.getenv('PATH'), 'MOONRL_THREADS=1',
    'MOONRL_FAULT=kill:step=' .. (SFT + 3) .. ':phase=generate:rank=1:attempt=0',
    exe, 'launch', '-n', '2', '--restarts', '2', '--backoff', '0.1', '--mpirun', '--mca btl vader,self' }
  for _, x in ipairs(words(d, 'async.mode=one_step_off', 'dist.rollout_ranks=1', 'dist.timeout=20')) do argv[#argv + 1] = x end
  local r = proc.run(argv, { timeout = 240 })
  if not r.ok then io.stderr:write(r.stdout, r.stderr) end
  t.truthy(r.ok, 'the supervised job finished')
  t.truthy(r.stderr:find('restarting') ~= nil, 'after a restart')
  t.truthy(model_bytes(d) == model_bytes(dir .. '/off1'), 'the weights of the uninterrupted run')
end)

-- The GRPO recipe on a tiny model (tests/recipes/grpo_sevens.lua), in one process (ranks = 0)
-- or under mpirun; its run directory.
local model_dir, data
local function grpo_run(ranks, d, extra, opts)
  if not model_dir then
    model_dir = U.tiny_model(dir .. '/tiny')
    local recs = {}
    for i, p in ipairs(U.additions(40, 3)) do recs[i] = { question = p.prompt, answer = p.answer } end
    data = U.write_jsonl(dir .. '/rl.jsonl', recs)
  end
  local w = { 'run', 'tests/recipes/grpo_sevens.lua', 'model.dir=' .. model_dir, 'data.path=' .. data,
    'data.prompt=question', 'data.chat=false', 'reward=sevens', 'train.lr=1e-3', 'grpo.steps=5', 'grpo.prompts=6',
    'grpo.samples=4', 'grpo.max_tokens=8', 'run.threads=1', 'async.mode=one_step_off', 'run.dir=' .. dir .. '/' .. d }
  for _, x in ipairs(extra or {}) do w[#w + 1] = x end
  run(ranks, w, opts)
  return dir .. '/' .. d
end

t.test('grpo with rollout ranks: 1 trainer + 1 rollout gives the bits of one process; 2 trainers + 1 rollout agree', function()
  local function grpo(ranks, d, ...) return grpo_run(ranks, d, { ... }) end
  local one = grpo(0, 'grpo1')
  local two = grpo(2, 'grpo11', 'dist.rollout_ranks=1')
  local three = grpo(3, 'grpo21', 'dist.rollout_ranks=1')
  t.truthy(model_bytes(one) == model_bytes(two), '1 trainer + 1 rollout rank: the bits of one process')
  for _, r in ipairs({ 'ppo', 'rlvr' }) do -- their rollouts through the same path
    local function rec(ranks, d, ...)
      run(ranks, { 'run', 'recipes/' .. r .. '.lua', 'model.dir=' .. model_dir, 'data.path=' .. data, 'data.prompt=question',
        'data.chat=false', 'reward=exact', 'train.lr=1e-3', r .. '.steps=3', r .. '.prompts=4', r .. '.max_tokens=6',
        'run.threads=1', 'async.mode=one_step_off', 'run.dir=' .. dir .. '/' .. d, ... })
      return dir .. '/' .. d
    end
    t.truthy(model_bytes(rec(0, r .. '1')) == model_bytes(rec(2, r .. '11', 'dist.rollout_ranks=1')),
      r .. ': 1 trainer + 1 rollout rank, the bits of one process')
  end
  local a, b = metrics(one), metrics(three)
  t.eq(#b, 5, '2 trainers + 1 rollout: every step logged once')
  for i = 1, 2 do
    t.eq(b[i]['reward/mean'], a[i]['reward/mean'], 'the same samples at step ' .. i)
    t.truthy(math.abs(b[i].loss - a[i].loss) <= 1e-4 * math.max(1, math.abs(a[i].loss)), 'the same loss at step ' .. i)
  end
end)

t.test('a guard rollback with a rollout rank: the bits of one process; a replay gives the run without the fault', function()
  local G = { 'grpo.steps=8', 'guard.grad_spike=50', 'guard.action=rollback', 'run.checkpoint_every=2' }
  local spike = { env = { 'MOONRL_FAULT=spike:step=7:factor=1000:times=1' } } -- found at step 7, back to step 6
  local function with(mode, ...)
    local w = {}
    for _, list in ipairs({ G, mode, { ... } }) do
      for _, x in ipairs(list) do w[#w + 1] = x end
    end
    return w
  end
  for _, mode in ipairs({ { 'async.mode=one_step_off' }, { 'async.mode=async', 'async.max_staleness=2' } }) do
    local clean = grpo_run(0, 'rb_clean_' .. mode[1], with(mode))
    for _, skip in ipairs({ 'true', 'false' }) do
      local tag = mode[1] .. '_' .. skip
      local one = grpo_run(0, 'rb1_' .. tag, with(mode, 'guard.skip_batch=' .. skip), spike)
      local two = grpo_run(2, 'rb2_' .. tag, with(mode, 'guard.skip_batch=' .. skip, 'dist.rollout_ranks=1'), spike)
      local ev = events(two, 'rollback')
      t.eq(#ev, 1, tag .. ': one rollback')
      t.eq(ev[1].step, 7, tag .. ': at step 7')
      t.eq(ev[1].to_step, 6, tag .. ': to the checkpoint of step 6')
      t.eq(#metrics(two), 8, tag .. ': each step logged once')
      t.truthy(model_bytes(one) == model_bytes(two), tag .. ': 1 trainer + 1 rollout rank, the bits of one process')
      if skip == 'false' then -- the same batches trained again: the run the fault never hit
        t.truthy(model_bytes(two) == model_bytes(clean), tag .. ': the replay ends where the clean run does')
      else
        t.truthy(model_bytes(two) ~= model_bytes(clean), tag .. ': skipped batches, other weights')
      end
    end
  end
end)

local function shm_files()
  local n = 0
  for _, name in ipairs(fs.list('/dev/shm')) do if name:find('^moonrl%-') then n = n + 1 end end
  return n
end

t.test('shared-memory weights: the bits of the MPI broadcast and of one process; nothing left in /dev/shm', function()
  run(2, words(dir .. '/shm', 'async.mode=one_step_off', 'dist.rollout_ranks=1'))
  run(2, words(dir .. '/shm_mpi', 'async.mode=one_step_off', 'dist.rollout_ranks=1', 'async.weights=mpi'))
  t.eq(events(dir .. '/shm', 'rollout_weights')[1].via, 'shared memory', 'the same host: shared memory')
  t.eq(events(dir .. '/shm_mpi', 'rollout_weights')[1].via, 'mpi', 'async.weights=mpi')
  t.truthy(model_bytes(dir .. '/shm') == model_bytes(dir .. '/off1'), 'shared memory: the bits of one process')
  t.truthy(model_bytes(dir .. '/shm_mpi') == model_bytes(dir .. '/off1'), 'MPI: the bits of one process')
  local published = 0
  for _, r in ipairs(metrics(dir .. '/shm')) do
    if r['async/publish/bytes'] then published = published + 1 end
  end
  t.truthy(published >= 4, 'a version published after each step that has a batch to come: ' .. published)
  t.eq(shm_files(), 0, 'no moonrl store left in /dev/shm')
  -- a rollout rank that cannot open the store (another host; a fault injection): auto falls back
  -- to the broadcast, the bits as ever; async.weights=shm stops, naming the rank
  local far = { env = { 'MOONRL_FAULT=no_shm:rank=1' } }
  run(2, words(dir .. '/shm_far', 'async.mode=one_step_off', 'dist.rollout_ranks=1'), far)
  t.eq(events(dir .. '/shm_far', 'rollout_weights')[1].via, 'mpi', 'a rollout rank without the store: by MPI')
  t.truthy(model_bytes(dir .. '/shm_far') == model_bytes(dir .. '/off1'), 'after the fallback: the bits of one process')
  local r = run(2, words(dir .. '/shm_far2', 'async.mode=one_step_off', 'dist.rollout_ranks=1', 'async.weights=shm'),
    { env = far.env, expect_fail = true })
  t.eq(r.exit_status, 2, 'async.weights=shm and a rollout rank without the store: a usage error')
  t.truthy(r.stderr:find('rollout rank 1 of 1: fault injection', 1, true), r.stderr)
  t.eq(shm_files(), 0, 'no moonrl store left in /dev/shm after either')
end)

t.test('one process, an engine thread: the bits of generating between steps, an evaluation meanwhile too; resumes', function()
  local d = dir .. '/thread'
  run(0, words(d, 'async.mode=one_step_off', 'async.engine_threads=1'))
  t.truthy(model_bytes(d) == model_bytes(dir .. '/off1'), 'the same weights as one_step_off in line')
  t.truthy(fs.read(d .. '/trace.json'):find('generate (background)', 1, true) ~= nil, 'generated on the engine thread')
  -- an evaluation every step: the engine is busy with the next batch when it comes
  run(0, words(dir .. '/thread_eval', 'async.mode=one_step_off', 'async.engine_threads=1', 'grpo.eval_every=1'))
  run(0, words(dir .. '/inline_eval', 'async.mode=one_step_off', 'grpo.eval_every=1'))
  t.truthy(model_bytes(dir .. '/thread_eval') == model_bytes(dir .. '/inline_eval'), 'with evaluations: the same weights')
  local a, b = metrics(dir .. '/thread_eval'), metrics(dir .. '/inline_eval')
  for i = 1, #a do t.eq(a[i].heldout_accuracy, b[i].heldout_accuracy, 'the same held-out accuracy at step ' .. i) end
  -- killed while the engine thread generates the next batch, then resumed
  t.truthy(killed_then_resumed(0, dir .. '/thread_killed', 'MOONRL_FAULT=kill:step=' .. (SFT + 3) .. ':phase=train',
    'async.mode=one_step_off', 'async.engine_threads=1') == model_bytes(dir .. '/off1'), 'resumed: the same weights')
end)

t.test('async.partial=continue: requests in flight take the new weights (a slowed engine), the bound holds', function()
  local function check(d, what)
    local switched = 0
    for _, r in ipairs(metrics(d)) do
      local mx = r['async/max_staleness_seen']
      if mx then
        t.truthy(mx <= 1, what .. ': staleness (of the first token) within the bound: ' .. mx)
        switched = switched + (r['async/switched_samples'] or 0)
      end
    end
    t.truthy(switched > 0, what .. ': samples switched weights mid-generation: ' .. switched)
  end
  run(0, words(dir .. '/cont1', 'async.mode=one_step_off', 'async.engine_threads=1', 'async.partial=continue'),
    { env = { 'MOONRL_FAULT=slow_engine:seconds=0.03' } })
  check(dir .. '/cont1', 'one process, engine thread')
  run(2, words(dir .. '/cont2', 'async.mode=one_step_off', 'dist.rollout_ranks=1', 'async.partial=continue'),
    { env = { 'MOONRL_FAULT=slow_engine:seconds=0.03:rank=1' } })
  check(dir .. '/cont2', 'a rollout rank, shared memory')
  t.eq(shm_files(), 0, 'no moonrl store left in /dev/shm')
end)

t.test('async.stream: one engine for the batches in flight (a slowed engine: they overlap); resume, rollback', function()
  local S = { 'async.mode=async', 'async.max_staleness=2', 'dist.rollout_ranks=1', 'async.partial=continue',
    'async.stream=true', 'grpo.max_tokens=16', 'grpo.steps=6' }
  local slow = { env = { 'MOONRL_FAULT=slow_engine:seconds=0.02:rank=1' } }
  local function check(d, what, ranks_n)
    local overlapped, m = 0, metrics(d)
    t.eq(#m, 6, what .. ': each step logged once')
    for _, r in ipairs(m) do
      local mx = r['async/max_staleness_seen']
      t.truthy(mx and mx <= 2, what .. ': staleness within the bound: ' .. tostring(mx))
      t.eq(r['async/dropped_stale'], 0, what .. ': none dropped')
      if (r['async/batches_in_flight'] or 0) > 0 then overlapped = overlapped + 1 end
    end
    t.truthy(overlapped > 0, what .. ': later batches were in the engine when a batch went to the trainers')
  end
  check(grpo_run(2, 'stream11', S, slow), '1 trainer + 1 rollout rank')
  local S2 = { 'dist.rollout_ranks=2' }
  for i, x in ipairs(S) do if x ~= 'dist.rollout_ranks=1' then S2[#S2 + 1] = x end end
  check(grpo_run(3, 'stream12', S2, { env = { 'MOONRL_FAULT=slow_engine:seconds=0.02:rank=1' } }),
    '1 trainer + 2 rollout ranks')
  -- killed mid-run, resumed: each step once, from the checkpoint's data position
  local k = { env = { 'MOONRL_FAULT=kill:step=4:phase=train:rank=0' }, expect_fail = true }
  local SK = { 'run.checkpoint_every=1', unpack(S) }
  local killed = grpo_run(2, 'stream_killed', SK, k)
  grpo_run(2, 'stream_killed', SK)
  t.eq(#metrics(killed), 6, 'killed and resumed: each step logged once')
  t.eq(#events(killed, 'resume'), 1, 'resumed once')
  -- a guard's rollback: the rollout rank drops its batches in flight and goes on from the checkpoint
  local RB = { 'guard.grad_spike=50', 'guard.action=rollback', 'run.checkpoint_every=2' }
  for _, x in ipairs(S) do RB[#RB + 1] = x end
  RB[#RB + 1] = 'grpo.steps=8'
  local rb = grpo_run(2, 'stream_rb', RB, { env = { 'MOONRL_FAULT=spike:step=7:factor=1000:times=1' } })
  local ev = events(rb, 'rollback')
  t.eq(#ev, 1, 'one rollback')
  t.eq(ev[1] and ev[1].to_step, 6, 'to the checkpoint of step 6')
  t.eq(#metrics(rb), 8, 'rolled back: each step logged once')
  t.eq(shm_files(), 0, 'no moonrl store left in /dev/shm')
end)

t.test('async.stream_unit=group: a batch is the first groups to finish; resumed with the groups in flight', function()
  local S = { 'async.mode=async', 'async.max_staleness=2', 'dist.rollout_ranks=1', 'async.partial=continue',
    'async.stream=true', 'async.stream_unit=group', 'grpo.max_tokens=16', 'grpo.steps=6', 'run.checkpoint_every=1' }
  local d = grpo_run(2, 'groups', S, { env = { 'MOONRL_FAULT=slow_engine:seconds=0.02:rank=1' } })
  local m = metrics(d)
  t.eq(#m, 6, 'each step logged once')
  local inflight, kept = 0, 0
  for _, r in ipairs(m) do
    inflight = math.max(inflight, r['async/groups_in_flight'] or 0)
    local n = 0
    for k, v in pairs(r) do if k:match('^async/staleness/') then n = n + v end end
    t.eq(n, 6 * 4, 'step ' .. r.step .. ': six groups of four samples')
    kept = kept + n - r['async/dropped_stale']
  end
  t.truthy(inflight >= 6, 'groups of later batches were in the engine: ' .. inflight)
  t.truthy(kept > 0, 'trained on')
  local state = json.decode(fs.read(d .. '/checkpoints/step-000006/state.json'))
  t.truthy(state.extra and state.extra.stream_inflight, 'the checkpoint keeps the groups drawn but in no batch')
  -- killed mid-run, resumed: each step once; the rollout rank draws the checkpoint's groups in flight first
  local killed = grpo_run(2, 'groups_killed', S, { env = { 'MOONRL_FAULT=kill:step=4:phase=train:rank=0' },
    expect_fail = true })
  grpo_run(2, 'groups_killed', S)
  t.eq(#metrics(killed), 6, 'killed and resumed: each step logged once')
  t.eq(#events(killed, 'resume'), 1, 'resumed once')
  -- the default example draws its own prompts (S:rollout_count)
  run(2, words(dir .. '/groups_default', 'async.mode=async', 'async.max_staleness=1', 'dist.rollout_ranks=1',
    'async.partial=continue', 'async.stream=true', 'async.stream_unit=group'))
  t.eq(#metrics(dir .. '/groups_default') - 0, 6, 'the default example: each GRPO step logged')
end)

t.test('bad dist and async keys are usage errors naming the key, before any run directory exists', function()
  for _, case in ipairs({ { 'dist.zero=4', 'dist.zero' }, { 'dist.bucket_mb=0', 'dist.bucket_mb' },
    { 'dist.timeout=-1', 'dist.timeout' }, { 'async.mode=later', 'async.mode' }, { 'async.correction=foo', 'async.correction' },
    { 'dist.rollout_ranks=1', 'dist.rollout_ranks' }, { 'async.partial=later', 'async.partial' },
    { 'async.weights=nfs', 'async.weights' }, { 'async.engine_threads=-1', 'async.engine_threads' },
    { 'async.engine_threads=1', 'async.engine_threads' }, -- sync mode: nothing to overlap
    { 'async.partial=continue', 'async.partial=continue' }, { 'async.stream=true', 'async.stream' },
    { 'async.stream_unit=groups', 'async.stream_unit' }, { 'dist.gpu_transport=pcie', 'dist.gpu_transport' },
    { 'async.decoupled=maybe', 'async.decoupled' } }) do
    local d = dir .. '/bad'
    local r = proc.run({ exe, 'run.dir=' .. d, 'sft.steps=1', 'grpo.steps=1', 'quiet=true', case[1] }, { timeout = 60 })
    t.eq(r.exit_status, 2, case[1] .. ': a usage error')
    t.truthy(r.stderr:find(case[2], 1, true) ~= nil, case[1] .. ': the message names ' .. case[2] .. ': ' .. r.stderr)
    t.truthy(not fs.exists(d .. '/metrics.jsonl'), case[1] .. ': no run started')
  end
end)

fs.remove(dir)
t.done()
