-- `moonrl launch -n N [--restarts K] RECIPE [key=value ...]`: N ranks of one data-parallel job
-- on this machine, started with Open MPI's mpirun (as torchrun --nproc-per-node starts its
-- workers). It is `mpirun -n N moonrl run RECIPE ...` with the flags one machine needs:
-- --oversubscribe (more ranks than cores is allowed), --bind-to none (a rank's threads may use
-- any core), --allow-run-as-root when root; each rank gets cores / N threads unless run.threads
-- or MOONRL_THREADS says otherwise. Under the supervisor (moonrl.cli.supervisor) the command
-- forwards SIGINT / SIGTERM to mpirun, returns the job's status (mpirun reports the first rank
-- that failed), and with --restarts K starts the whole job again from its latest checkpoint when
-- a rank dies or the job fails (a hung rank makes the others fail after dist.timeout).
-- --mpirun "ARGS": more words for mpirun (split at spaces), e.g. --mpirun "--mca btl tcp,self".
local ffi = require('ffi')
local moonrl = require('moonrl')
local fs = require('moonrl.io.fs')
pcall(ffi.cdef, 'unsigned int getuid(void);')
pcall(ffi.cdef, 'int kill(int pid, int sig);')

local M = {}

local function eprint(msg) io.stderr:write('moonrl launch: ', msg, '\n') end

-- The program's path through PATH (posix_spawn wants a path).
local function which(name)
  for dir in (os.getenv('PATH') or ''):gmatch('[^:]+') do
    local p = dir .. '/' .. name
    if fs.exists(p) then return p end -- /usr/bin/mpirun is a link (alternatives)
  end
end

-- The words that start n ranks on this machine before the program's own (mpirun with the flags
-- above and extra's words), and the environment they add (each rank's share of the cores); nil
-- and why when mpirun is not there.
function M.mpirun(n, extra)
  local mpirun = which('mpirun')
  if not mpirun then return nil, 'mpirun not found on PATH: install Open MPI (Debian: openmpi-bin libopenmpi-dev)' end
  local launcher = { mpirun, '-n', tostring(n), '--oversubscribe', '--bind-to', 'none' }
  if ffi.C.getuid() == 0 then
    launcher[#launcher + 1] = '--allow-run-as-root'
  end
  for _, w in ipairs(extra or {}) do launcher[#launcher + 1] = w end
  local env = {}
  if not os.getenv('MOONRL_THREADS') then
    local threads = math.max(1, math.floor(tonumber(moonrl.C.mrl_parallel_threads()) / n))
    env[1] = 'MOONRL_THREADS=' .. threads
  end
  return launcher, env
end

-- `moonrl COMMAND args` again on n ranks under mpirun (M.mpirun's flags), waited for: its exit
-- status. (generate and serve --tp N started from one process.) A signal this process gets goes
-- to mpirun: as it came (mpirun then ends the job), or with graceful as SIGUSR2, which mpirun hands
-- to every rank as a stop (signals.c), a second one as it came.
function M.start_self(command, n, args, graceful)
  local C = moonrl.C
  local launcher, env = M.mpirun(n)
  if not launcher then moonrl.usage_error(command .. ': --tp ' .. n .. ': ' .. env) end
  local exe = rawget(_G, 'MOONRL_EXE')
  if not exe then moonrl.usage_error(command .. ': --tp: cannot find the moonrl executable (/proc/self/exe)') end
  local argv = {}
  for _, a in ipairs(launcher) do argv[#argv + 1] = a end
  argv[#argv + 1], argv[#argv + 2] = exe, command
  for _, a in ipairs(args) do argv[#argv + 1] = a end
  local cargv, cenv = ffi.new('const char *[?]', #argv + 1), ffi.new('const char *[?]', #env + 1)
  for i, a in ipairs(argv) do cargv[i - 1] = a end
  for i, e in ipairs(env) do cenv[i - 1] = e end
  cargv[#argv], cenv[#env] = nil, nil
  moonrl.check(C.mrl_signals_install()) -- a Ctrl-C reaches this process alone: handed to mpirun
  C.mrl_signals_count_only()
  local out = ffi.new('mrl_child *[1]')
  moonrl.check(C.mrl_child_spawn(cargv, cenv, out))
  local child = ffi.gc(out[0], C.mrl_child_free)
  local forwarded = 0
  while C.mrl_child_poll(child, 0.2) == 0 do
    local got = tonumber(C.mrl_signals_received())
    if got > forwarded then
      if graceful and forwarded == 0 then ffi.C.kill(tonumber(C.mrl_child_pid(child)), 12)
      else C.mrl_child_signal(child, tonumber(C.mrl_signal_last())) end
      forwarded = got
    end
  end
  local status = tonumber(C.mrl_child_status(child))
  return status >= 0 and status or 128 - status
end

local USAGE = 'usage: moonrl launch -n N [--restarts K] [--backoff S] [--mpirun "ARGS"] [RECIPE] [--require FILE.lua] [key=value ...]'

function M.main(args)
  local n, sup, extra, words = nil, { restarts = 0 }, {}, {}
  local i = 1
  local numbers = { ['-n'] = 'n', ['-np'] = 'n', ['--nproc'] = 'n', ['--restarts'] = 'restarts', ['--backoff'] = 'backoff',
    ['--kill-grace'] = 'kill_grace' }
  while i <= #args do
    local a = args[i]
    local key = numbers[a]
    if key then
      local v = tonumber(args[i + 1])
      if not v or not (v >= 0 and v < math.huge) or ((key == 'n' or key == 'restarts') and v ~= math.floor(v)) or (key == 'n' and v < 1) then
        eprint(string.format('%s expects a %s, got %s', a, key == 'n' and 'whole number >= 1' or 'number >= 0',
          tostring(args[i + 1])))
        return 2
      end
      if key == 'n' then n = v else sup[key] = v end
      i = i + 1
    elseif a == '--mpirun' then
      for w in (args[i + 1] or ''):gmatch('%S+') do extra[#extra + 1] = w end
      i = i + 1
    elseif a == '-h' or a == '--help' then
      print(USAGE)
      return 0
    else
      words[#words + 1] = a
    end
    i = i + 1
  end
  if not n then eprint(USAGE) return 2 end
  -- the recipe: the first word that is not a --require FILE (those go to every rank as they are)
  local first = 1
  while words[first] and (words[first] == '--require' or words[first]:match('^%-%-require=')) do
    first = first + (words[first] == '--require' and 2 or 1)
  end
  if first > 1 and words[first] then table.insert(words, 1, table.remove(words, first)) end
  -- no recipe: the embedded default example, as `moonrl [key=value ...]` runs it
  local default_example = #words == 0 or words[1]:match('^[%w_%.%-]+=') ~= nil or words[1]:match('^%-%-require') ~= nil
  local launcher, env = M.mpirun(n, extra)
  if not launcher then
    eprint(env)
    return 2
  end
  local recipe = default_example and 'default' or words[1]
  local ok, status = pcall(require('moonrl.cli.supervisor').run, words, { restarts = sup.restarts, backoff = sup.backoff,
    kill_grace = sup.kill_grace, recipe = recipe, launcher = launcher, env = env, default_example = default_example })
  if ok then return status end
  if moonrl.is_usage_error(status) then eprint(status.message) return 2 end
  eprint('error: ' .. tostring(status))
  return 1
end

return M
