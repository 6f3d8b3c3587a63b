-- `moonrl run --restarts N RECIPE ...`: run the recipe in a child process and restart it from
-- its latest checkpoint when it dies or hangs, as torchrun's elastic agent does for its
-- workers.
--
--   * The child runs `moonrl run RECIPE ... run.dir=DIR` (the supervisor picks DIR when the
--     command line does not), and every restart adds run.resume=auto.
--   * Restarted: an exit by a signal (a crash, SIGKILL, the OOM killer) and any non-zero status
--     but 2 (a usage error: the same command would fail again), 3 (the guards gave up), and the
--     clean stops 124 / 130 / 143. After N restarts the last status is returned.
--   * A hang: no heartbeat (the child beats at every phase of its loop) for run.hang_seconds
--     (0: no watchdog); before its first heartbeat, ten times that and at least 60 s (start-up). The supervisor asks the child for its stacks (SIGUSR1), writes what it
--     knows to RUN_DIR/hang-<attempt>.txt (the step and phase in progress, the last heartbeats,
--     the stacks), sends SIGTERM, then SIGKILL after `--kill-grace` seconds, and restarts it.
--   * Backoff between restarts: `--backoff` seconds (default 1), doubled each time, at most 60.
--   * SIGINT / SIGTERM to the supervisor reach the child once (it stops at its next safe point
--     with a checkpoint); a second one is forwarded too; the supervisor then returns the
--     child's status without restarting it.
--   * Each start, exit and restart, with its cause, is a line of RUN_DIR/events.jsonl.
local ffi = require('ffi')
local moonrl = require('moonrl')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')
local C = moonrl.C
pcall(ffi.cdef, 'int kill(int pid, int sig);')

local M = {}

local NO_RESTART = { [0] = 'finished', [2] = 'usage error', [3] = 'guards gave up', [124] = 'deadline',
  [130] = 'SIGINT', [143] = 'SIGTERM' }
local SIGNALS = { [1] = 'SIGHUP', [2] = 'SIGINT', [6] = 'SIGABRT', [7] = 'SIGBUS', [9] = 'SIGKILL', [11] = 'SIGSEGV',
  [15] = 'SIGTERM' }

local function describe(status)
  if status < 0 then return 'killed by ' .. (SIGNALS[-status] or ('signal ' .. -status)) end
  return 'exit status ' .. status
end

local function append_event(dir, kind, fields)
  local record = json.object({ 'event', kind, 'time', os.time(), 'pid', tonumber(C.mrl_process_id()), 'by', 'supervisor' })
  local keys = {}
  for k in pairs(fields) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do record[k] = fields[k] end
  local f = io.open(dir .. '/events.jsonl', 'a')
  if f then
    f:write(json.encode(record), '\n')
    f:close()
  end
end

local function say(fmt, ...) io.stderr:write('moonrl supervisor: ', string.format(fmt, ...), '\n') end

-- The value of key=... among the words, the last one winning (as the config merge does).
local function word_value(words, key)
  local v
  for _, w in ipairs(words) do
    local k, val = w:match('^([%w_%.%-]+)=(.*)$')
    if k == key then v = val end
  end
  return v
end

local function hang_report(dir, attempt, child, hang_seconds, stacks_path)
  local lines = { string.format('moonrl supervisor: no heartbeat for %.0f s (run.hang_seconds=%g): attempt %d, pid %d',
    tonumber(C.mrl_child_idle_seconds(child)), hang_seconds, attempt, tonumber(C.mrl_child_pid(child))) }
  local recent = ffi.string(C.mrl_child_recent(child, 32))
  local last = recent:match('([^\n]*)\n$') or '(none)'
  lines[#lines + 1] = 'in progress: ' .. last
  lines[#lines + 1] = ''
  lines[#lines + 1] = 'last heartbeats, oldest first:'
  lines[#lines + 1] = recent
  lines[#lines + 1] = 'stacks (asked with SIGUSR1):'
  lines[#lines + 1] = fs.read(stacks_path) or '(the child wrote none)'
  local path = string.format('%s/hang-%d.txt', dir, attempt)
  pcall(fs.write, path, table.concat(lines, '\n') .. '\n')
  pcall(fs.remove, stacks_path)
  return path, last
end

-- The silence after which a child counts as hung: run.hang_seconds once it has beaten; before its
-- first heartbeat (loading a model, reading a checkpoint, a loaded machine) ten times that, at
-- least 60 s.
local function startup_allowance(child, o)
  if ffi.string(C.mrl_child_recent(child, 1)) ~= '' then return o.hang_seconds end
  return math.max(10 * o.hang_seconds, 60)
end

-- Wait for the child while watching for hangs and the supervisor's own signals. Returns
-- status, cause ('exit', 'hang', 'stopped').
local function watch(child, o)
  local forwarded, hung = 0, false
  while C.mrl_child_poll(child, 0.2) == 0 do
    local got = tonumber(C.mrl_signals_received())
    if got > forwarded then
      -- the child may have had it too (a terminal's Ctrl-C reaches only us; Slurm signals every
      -- process): forward unless the child says it got one
      local sig = tonumber(C.mrl_signal_last())
      C.mrl_child_poll(child, 0.5)
      local recent = ffi.string(C.mrl_child_recent(child, 4))
      if o.launcher then
        -- to mpirun alone, as SIGUSR2: it hands that to every rank (they stop as on SIGTERM at the
        -- same step); a SIGTERM would make it kill them
        ffi.C.kill(tonumber(C.mrl_child_pid(child)), 12)
      elseif not recent:find('signal SIG') or got > 1 then
        C.mrl_child_signal(child, sig)
      end
      forwarded = got
    elseif not hung and forwarded == 0 and o.hang_seconds > 0 and C.mrl_child_idle_seconds(child) > startup_allowance(child, o) then
      hung = true
      C.mrl_child_signal(child, 10) -- SIGUSR1: the stacks
      C.mrl_child_poll(child, 1.0)
      local path, last = hang_report(o.dir, o.attempt, child, o.hang_seconds, o.stacks)
      say('attempt %d hung (no heartbeat for %g s; in progress: %s): report in %s; killing it', o.attempt,
        o.hang_seconds, last, path)
      append_event(o.dir, 'hang', { attempt = o.attempt, report = path, in_progress = last })
      C.mrl_child_signal(child, 15)
      if C.mrl_child_poll(child, o.kill_grace) == 0 then C.mrl_child_signal(child, 9) end
    end
  end
  local status = tonumber(C.mrl_child_status(child))
  if forwarded > 0 then return status, 'stopped' end
  return status, hung and 'hang' or 'exit'
end

-- words: the command line after `run` without the supervisor's own flags; opts: restarts,
-- backoff, kill_grace, recipe (the recipe's path, for the default run directory's name),
-- launcher (argv that starts the ranks, before `moonrl run ...`: moonrl launch), env (more
-- NAME=value for the child), default_example (the words are overrides of the embedded default
-- example: `moonrl [key=value ...]`).
function M.run(words, opts)
  local exe = rawget(_G, 'MOONRL_EXE')
  if not exe then moonrl.usage_error('--restarts: cannot find the moonrl executable (/proc/self/exe)') end
  local dir = word_value(words, 'run.dir')
  if not dir then
    local stem = (opts.recipe or 'run'):match('([^/]+)$'):gsub('%.lua$', '')
    local base = 'runs/' .. stem .. '-' .. os.date('%Y%m%d-%H%M%S')
    fs.mkdirs('runs')
    dir = base
    local n = 1
    while not fs.mkdir(dir) do n = n + 1; dir = base .. '-' .. n end
    words[#words + 1] = 'run.dir=' .. dir
  else
    fs.mkdirs(dir)
  end
  local hang = tonumber(word_value(words, 'run.hang_seconds') or '1800') or 1800
  if opts.launcher then hang = 0 end -- ranks under mpirun cannot reach our heartbeat pipe; dist.timeout watches them
  moonrl.check(C.mrl_signals_install()) -- SIGINT / SIGTERM are only counted, and forwarded to the child
  C.mrl_signals_count_only()
  local backoff = opts.backoff or 1
  local status, cause = 0, 'exit'
  for attempt = 0, opts.restarts do
    local argv = {}
    for _, a in ipairs(opts.launcher or {}) do argv[#argv + 1] = a end -- mpirun -n N ... (moonrl launch)
    argv[#argv + 1] = exe
    if not opts.default_example then argv[#argv + 1] = 'run' end
    for _, w in ipairs(words) do argv[#argv + 1] = w end
    if attempt > 0 then argv[#argv + 1] = 'run.resume=auto' end
    local stacks = string.format('%s/.stacks-%d', dir, attempt)
    local env = { 'MOONRL_ATTEMPT=' .. attempt, 'MOONRL_STACKS_FILE=' .. stacks }
    for _, e in ipairs(opts.env or {}) do env[#env + 1] = e end
    local cargv, cenv = ffi.new('const char *[?]', #argv + 1), ffi.new('const char *[?]', #env + 1)
    for i, a in ipairs(argv) do cargv[i - 1] = a end
    for i, e in ipairs(env) do cenv[i - 1] = e end
    cargv[#argv], cenv[#env] = nil, nil -- argv and env (Lua strings) outlive the spawn
    local out = ffi.new('mrl_child *[1]')
    moonrl.check(C.mrl_child_spawn(cargv, cenv, out))
    local child = ffi.gc(out[0], C.mrl_child_free)
    append_event(dir, 'start', { attempt = attempt, child = tonumber(C.mrl_child_pid(child)) })
    status, cause = watch(child, { dir = dir, attempt = attempt, hang_seconds = hang, stacks = stacks,
      kill_grace = opts.kill_grace or 10, launcher = opts.launcher ~= nil })
    C.mrl_child_free(ffi.gc(child, nil))
    local final = cause == 'stopped' or (cause ~= 'hang' and NO_RESTART[status] ~= nil)
    append_event(dir, 'exit', { attempt = attempt, status = status, cause = cause == 'hang' and 'hang' or describe(status) })
    if final then break end
    if attempt == opts.restarts then
      say('attempt %d ended (%s); no restarts left (--restarts %d)', attempt, cause == 'hang' and 'hang' or describe(status),
        opts.restarts)
      break
    end
    local wait = math.min(backoff * 2 ^ attempt, 60)
    say('attempt %d ended (%s); restarting from the latest checkpoint in %s in %.3g s (%d of %d)', attempt,
      cause == 'hang' and 'hang' or describe(status), dir, wait, attempt + 1, opts.restarts)
    append_event(dir, 'restart', { attempt = attempt + 1, cause = cause == 'hang' and 'hang' or describe(status),
      backoff_seconds = wait })
    local t_end = moonrl.now() + wait
    while moonrl.now() < t_end and tonumber(C.mrl_signals_received()) == 0 do C.mrl_sleep(0.05) end
    if tonumber(C.mrl_signals_received()) > 0 then status = 128 + tonumber(C.mrl_signal_last()) break end
  end
  if status < 0 then return 128 - status end
  if cause == 'hang' then return 124 end
  -- mpirun says 1 when its ranks stopped on the forwarded signal: say what a process would
  if opts.launcher and cause == 'stopped' and status ~= 0 then return 128 + tonumber(C.mrl_signal_last()) end
  return status
end

return M
