-- moonrl.io.workers: a function called on many inputs side by side in forked workers (child
-- processes holding the caller's state as it was at the fork, core/runtime/worker.c), each call
-- under a time limit and its worker killed when late, whatever the call blocks in (a Lua loop, a
-- C call, a subprocess: those a worker starts stay in its process group and end with it).
--
--   local workers = require('moonrl.io.workers')
--   local results = workers.map(#samples, function(i) return score(samples[i]) end, { workers = 16, timeout = 30 })
--   -- results[i] = { ok = true, value = v } or { ok = false, message = 'no result within 30 s' }
--
-- opts.workers: calls at most at once (default 16); opts.timeout: seconds one call may take (0 or
-- nil: no limit). A call that raises gives ok = false and its message; a late one also
-- timed_out = true. Values come back exactly when they are numbers (NaN and infinities too),
-- strings, booleans or nil; anything else as its tostring. A call runs in a child: what it
-- changes in the Lua state (globals, caches, counters) stays there. A stop requested while calls
-- run (SIGINT, SIGTERM, the deadline) kills the workers and is an error.
--
-- Cost: a fork takes milliseconds (more in a large process), so a map starts one worker, which
-- takes the calls one after another while they are quick; when every worker has been on its call
-- for GROW_AFTER seconds (a tenth of the timeout at most) and calls are waiting, the pool doubles,
-- up to opts.workers. Quick calls cost one fork a map; calls that hang, about one timeout a round
-- of opts.workers.
local ffi = require('ffi')
local moonrl = require('moonrl')
local C = moonrl.C

local M = {}

M.GROW_AFTER = 0.05
-- A worker's Lua heap may grow by this much before it ends (after its reply) and another is
-- forked: its garbage collector is off, so that it copies none of the parent's memory by marking
-- it and runs none of the parent's finalizers (closing the parent's files, freeing its buffers).
M.HEAP_BYTES = 64 * 2 ^ 20

local dbl = ffi.new('double[1]')

-- a call's outcome as bytes: whether the worker goes on ('+') or ends ('.'), a type letter, the
-- value
local function encode(ok, v)
  if not ok then return 'e' .. tostring(v) end
  local t = type(v)
  if t == 'number' then dbl[0] = v; return 'n' .. ffi.string(dbl, 8) end
  if t == 'string' then return 's' .. v end
  if t == 'boolean' then return v and 'T' or 'F' end
  if v == nil then return 'z' end
  return 's' .. tostring(v)
end

local function decode(bytes)
  local tag, rest = bytes:sub(2, 2), bytes:sub(3)
  if tag == 'e' then return { ok = false, message = rest } end
  if tag == 'n' and #rest == 8 then ffi.copy(dbl, rest, 8); return { ok = true, value = dbl[0] } end
  if tag == 's' then return { ok = true, value = rest } end
  if tag == 'T' or tag == 'F' then return { ok = true, value = tag == 'T' } end
  return { ok = true }
end

-- The child's part: answer tasks until the parent closes them or kills it; never returns.
local function serve(self, fn)
  collectgarbage('stop')
  local heap = collectgarbage('count') * 1024
  local ok = pcall(function()
    while true do
      local task = tonumber(C.mrl_worker_next(self))
      if task < 0 then return end
      local bytes = encode(pcall(fn, task + 1))
      local last = collectgarbage('count') * 1024 - heap > M.HEAP_BYTES
      bytes = (last and '.' or '+') .. bytes
      if C.mrl_worker_answer(self, bytes, #bytes) ~= 0 or last then return end
    end
  end)
  C.mrl_worker_exit(ok and 0 or 1)
end

function M.map(n, fn, opts)
  opts = opts or {}
  local limit, width = opts.timeout or 0, opts.workers or 16
  if type(width) ~= 'number' or width < 1 or width ~= math.floor(width) then
    error('workers.map: opts.workers must be a positive integer, got ' .. tostring(width), 2)
  end
  width = math.min(width, n)
  local results = {}
  if n == 0 then return results end
  local grow_after = limit > 0 and math.min(M.GROW_AFTER, limit / 10) or M.GROW_AFTER
  local ws = ffi.new('mrl_worker *[?]', width) -- slot -> worker (NULL: none)
  local task_of, started = {}, {}             -- slot -> its task (0-based) and when it was sent
  local next_task, done = 0, 0

  local function retire(slot)
    if ws[slot] ~= nil then C.mrl_worker_free(ws[slot]) end
    ws[slot], task_of[slot], started[slot] = nil, nil, nil
  end
  local function fork(slot)
    local out, is_child = ffi.new('mrl_worker *[1]'), ffi.new('int[1]')
    moonrl.check(C.mrl_worker_fork(out, is_child), 3)
    if is_child[0] ~= 0 then serve(out[0], fn) end
    ws[slot] = out[0]
  end
  -- the next task to slot's worker (forked when there is none); none left: the worker goes
  local function give(slot)
    if next_task >= n then return retire(slot) end
    if ws[slot] == nil then fork(slot) end
    if C.mrl_worker_send(ws[slot], next_task) ~= 0 then -- (it died idle: another one)
      retire(slot)
      fork(slot)
      moonrl.check(C.mrl_worker_send(ws[slot], next_task), 3)
    end
    task_of[slot], started[slot] = next_task, moonrl.now()
    next_task = next_task + 1
  end
  local function finish(slot, result)
    results[task_of[slot] + 1] = result
    done = done + 1
    task_of[slot], started[slot] = nil, nil
  end

  local ok, err = pcall(function()
    give(0)
    local len, pool = ffi.new('size_t[1]'), 1 -- slots in use: 0 .. pool - 1
    while done < n do
      -- wait for a reply, for the next call to be late, or until the pool may grow: every worker
      -- on a call for grow_after seconds and calls waiting
      local now, wait, busy, newest = moonrl.now(), 60, 0, -math.huge
      for _, t0 in pairs(started) do
        if limit > 0 then wait = math.min(wait, t0 + limit - now) end
        busy, newest = busy + 1, math.max(newest, t0)
      end
      local can_grow = pool < width and next_task < n and busy == pool
      if can_grow then wait = math.min(wait, newest + grow_after - now) end
      local i = C.mrl_worker_wait(ws, pool, math.max(wait, 0))
      if i == -2 then moonrl.check(C.MRL_ERR_STOPPED) end
      if i >= 0 then
        local reply = C.mrl_worker_reply(ws[i], len)
        if reply ~= nil then
          local bytes = ffi.string(reply, len[0])
          finish(i, decode(bytes))
          if bytes:sub(1, 1) == '.' then retire(i) end
        else
          finish(i, { ok = false, message = 'its worker process ended without a result' })
          retire(i)
        end
        give(i)
      else
        now = moonrl.now()
        local late = {}
        for slot, t0 in pairs(started) do
          if limit > 0 and now - t0 >= limit then late[#late + 1] = slot end
        end
        for _, slot in ipairs(late) do
          finish(slot, { ok = false, timed_out = true, message = string.format('no result within %g s', limit) })
          retire(slot)
          give(slot)
        end
        if can_grow and #late == 0 and now - newest >= grow_after then
          -- twice as many workers, all forked before any of them starts work (a worker busy in
          -- a loop would slow the forks)
          local more = {}
          for slot = pool, math.min(width, 2 * pool) - 1 do
            if next_task + #more < n then fork(slot); more[#more + 1] = slot end
          end
          for _, slot in ipairs(more) do give(slot) end
          pool = math.min(width, 2 * pool)
        end
      end
    end
  end)
  for slot = 0, width - 1 do retire(slot) end
  if not ok then error(err, 0) end
  return results
end

return M
