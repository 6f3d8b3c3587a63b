-- Rewards under reward.timeout (moonrl.rewards over moonrl.io.workers): the samples are scored side
-- by side in forked workers, each killed when late, so a batch of rewards that hang costs one
-- timeout, not one a sample; values and failures come back as the trainer would see them in
-- process; a subprocess a late reward started ends with it; a stop ends the wait.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local rewards = require('moonrl.rewards')
local proc = require('moonrl.io.proc')

local function samples(n)
  local out = {}
  for i = 1, n do out[i] = { prompt = tostring(i), response = 'r' .. i } end
  return out
end

t.test('16 samples whose reward blocks past reward.timeout cost one timeout, not 16', function()
  rewards.register('sleeps', function() moonrl.sleep(3); return 1 end, { replace = true })
  local t0 = moonrl.now()
  local scores, _, failures = rewards.score_batch('sleeps', samples(16), nil, { on_error = 'zero', timeout = 0.5 })
  local took = moonrl.now() - t0
  t.truthy(took < 2.5, string.format('16 late samples took %.2f s under a 0.5 s timeout', took))
  t.eq(#failures, 16)
  t.truthy(failures[16].message:find("reward 'sleeps' failed on sample 16: no result within 0.5 s (reward.timeout)", 1,
    true), failures[16].message)
  t.eq(scores[15], 0)
  -- (fewer workers than samples: rounds of them)
  t0 = moonrl.now()
  rewards.score_batch('sleeps', samples(4), nil, { on_error = 'zero', timeout = 0.3, workers = 2 })
  took = moonrl.now() - t0
  t.truthy(took >= 0.55 and took < 2.5, string.format('4 late samples, 2 at once: %.2f s', took))
end)

t.test('values and failures as in process: numbers exactly, errors, non-numbers, a Lua loop, a subprocess', function()
  local pid_file = os.tmpname()
  rewards.register('mixed', function(s)
    local i = tonumber(s.prompt)
    if i == 1 then error('verifier broke') end
    if i == 2 then return 'yes' end
    if i == 3 then return 0 / 0 end
    if i == 4 then while true do end end
    if i == 5 then return tonumber(proc.run({ 'sh', '-c', 'echo 42' }).stdout) end
    if i == 6 then proc.run({ 'sh', '-c', 'echo $$ > ' .. pid_file .. '; exec sleep 100' }) end
    if i == 7 then return false end
    return i / 3
  end, { replace = true })
  local t0 = moonrl.now()
  local scores, _, failures = rewards.score_batch('mixed', samples(12), nil, { on_error = 'zero', timeout = 1 })
  t.truthy(moonrl.now() - t0 < 3, 'the loop and the subprocess were cut off')
  local msg = {}
  for _, f in ipairs(failures) do msg[f.index] = f.message end
  t.truthy(msg[1]:find('verifier broke', 1, true), msg[1])
  t.truthy(msg[2]:find('returned yes for sample 2', 1, true), msg[2])
  t.truthy(msg[3]:find('returned nan', 1, true), msg[3])
  t.truthy(msg[4]:find('no result within 1 s (reward.timeout)', 1, true), msg[4])
  t.truthy(msg[6]:find('no result within 1 s', 1, true), msg[6])
  t.truthy(msg[7]:find('returned false', 1, true), msg[7])
  t.eq(scores[4], 42, 'a subprocess in a worker')
  for i = 8, 12 do t.eq(scores[i - 1], i / 3, 'exact') end
  -- the subprocess of the late reward ended with its worker
  local f = assert(io.open(pid_file))
  local pid = f:read('*n')
  f:close()
  os.remove(pid_file)
  -- (its process group was sent SIGKILL; the signal's delivery is not instant: up to 5 s)
  local state
  for _ = 1, 100 do
    local stat = io.open('/proc/' .. pid .. '/stat')
    state = stat and stat:read('*a'):match('^%d+ %b() (%a)')
    if stat then stat:close() end
    if state == nil or state == 'Z' then break end
    moonrl.sleep(0.05)
  end
  t.truthy(state == nil or state == 'Z', 'the sleep a late reward started is gone: ' .. tostring(state))
end)

t.test('a reward registered in_process runs in the trainer (its state stays), a forked one does not share it', function()
  local calls = 0
  rewards.register('counts_here', function() calls = calls + 1; return calls end, { replace = true, in_process = true })
  rewards.score_batch('counts_here', samples(3), nil, { timeout = 1 })
  t.eq(calls, 3)
  rewards.register('counts_there', function() calls = calls + 1; return calls end, { replace = true })
  local scores = rewards.score_batch('counts_there', samples(3), nil, { timeout = 1 })
  t.eq(calls, 3, 'a worker has its own copy of the state')
  t.eq(scores[0], 4)
  rewards.score_batch('counts_there', samples(3), nil, { timeout = 0 })
  t.eq(calls, 6, 'no time limit: in process')
end)

t.test('a stop requested while workers run ends the wait', function()
  rewards.register('sleeps_long', function() moonrl.sleep(20); return 1 end, { replace = true })
  moonrl.check(moonrl.C.mrl_deadline_set(0.3))
  local t0 = moonrl.now()
  local ok, err = pcall(rewards.score_batch, 'sleeps_long', samples(2), nil, { on_error = 'zero', timeout = 10 })
  local took = moonrl.now() - t0
  moonrl.C.mrl_clear_stop()
  t.eq(ok, false)
  t.truthy(took < 3, string.format('the stop ended the wait after %.2f s', took))
  t.truthy(tostring(err.reason or err):find('deadline', 1, true), tostring(err.reason or err))
end)

t.test('workers.map: a worker whose heap grew ends after its reply and another takes over; one that dies fails its call', function()
  local workers = require('moonrl.io.workers')
  local keep = workers.HEAP_BYTES
  workers.HEAP_BYTES = 2 ^ 20
  local hold = {}
  local ok, results = pcall(workers.map, 8, function(i)
    hold[i] = string.rep(string.char(64 + i), 2 ^ 20) -- (kept: only the worker's own heap grows)
    return #hold[i] + i
  end, { timeout = 5, workers = 2 })
  workers.HEAP_BYTES = keep
  t.truthy(ok, tostring(results))
  for i = 1, 8 do t.eq(results[i].value, 2 ^ 20 + i) end
  local ffi = require('ffi')
  pcall(ffi.cdef, 'void _exit(int status);')
  results = workers.map(3, function(i) if i == 2 then ffi.C._exit(3) end return i end, { timeout = 5 })
  t.eq(results[1].value, 1); t.eq(results[3].value, 3)
  t.eq(results[2].ok, false); t.truthy(results[2].message:find('ended without a result', 1, true), results[2].message)
end)

t.test("the trainer's run.memory_budget_mb does not bind its reward workers", function()
  local ffi = require('ffi')
  local C = moonrl.C
  local st = ffi.new('mrl_mem_stats')
  C.mrl_mem_get_stats(st)
  -- the trainer has 1 MiB left; its rewards' workers allocate 4 MiB each, in processes of their own
  moonrl.check(C.mrl_mem_set_budget(st.total + 2 ^ 20, 'run.memory_budget_mb'))
  rewards.register('allocates', function()
    local p = C.mrl_mem_alloc(4 * 2 ^ 20, C.MRL_MEM_OTHER)
    if p == nil then error(moonrl.last_error and moonrl.last_error() or 'refused') end
    C.mrl_mem_free(p)
    return 1
  end, { replace = true })
  local scores, _, failures = rewards.score_batch('allocates', samples(2), nil, { on_error = 'zero', timeout = 5 })
  moonrl.check(C.mrl_mem_set_budget(0, nil))
  t.eq(#failures, 0, failures[1] and tostring(failures[1].message or failures[1]) or '')
  t.eq(scores[0], 1); t.eq(scores[1], 1) -- (a float array from 0)
end)

t.done()
