-- moonrl sandbox: one program run under the sandbox from the shell (moonrl.sandbox), for users
-- checking their limits and for scripts. Standard input (unless a terminal) goes to the program,
-- its stdout and stderr come out as they were (once it has ended), and the exit status is the
-- program's (128 + the signal when killed). A limit that ended or constrained the run is said
-- on stderr; --json writes the whole result record.
local moonrl = require('moonrl')
local sandbox = require('moonrl.sandbox')

local M = {}

local USAGE = [[
usage: moonrl sandbox [options] -- PROGRAM [ARGS...]
  --time S             wall-clock limit in seconds (10)
  --cpu S              CPU time of all its processes (the wall limit)
  --memory MB          memory of all its processes (512)
  --procs N            processes and threads at once (64)
  --files N            open files a process (256)
  --file-size MB       the largest file it may write (64)
  --tmpfs MB           the size of its /tmp, its working directory (64)
  --output KB          each of stdout and stderr; past it the run is killed (1024)
  --network none|loopback   no network, or its own loopback only (none)
  --put PATH           copy a host file into its /tmp (by its base name); repeatable
  --put-ro PATH        the same into /box, read-only; repeatable
  --ro PATH            bind a host path read-only at the same place; repeatable
  --env KEY=VALUE      add to its (otherwise clean) environment; repeatable
  --json FILE          write the result (status, limit, times, memory, output) as JSON
PROGRAM is looked up in /usr/local/bin:/usr/bin:/bin of the sandbox (the host's /usr).]]

local NUM = { ['--time'] = 'wall_s', ['--cpu'] = 'cpu_s', ['--memory'] = 'memory_mb', ['--procs'] = 'procs',
  ['--files'] = 'files', ['--file-size'] = 'file_mb', ['--tmpfs'] = 'tmpfs_mb', ['--output'] = 'output_kb' }

local function read_file(path)
  local f, err = io.open(path, 'rb')
  if not f then moonrl.usage_error('sandbox: ' .. tostring(err)) end
  local s = f:read('*a')
  f:close()
  return s
end

local function parse(args)
  local o = { limits = {}, files = {}, ro = {}, env = {} }
  local i = 1
  while i <= #args do
    local a, v = args[i], args[i + 1]
    local key, inline = a:match('^(%-%-[%w-]+)=(.*)$')
    if key then a, v, i = key, inline, i - 1 end
    local function need()
      if v == nil then moonrl.usage_error(string.format('sandbox: %s needs a value\n%s', a, USAGE)) end
      i = i + 1
      return v
    end
    if a == '--' then
      o.argv = {}
      for j = i + 1, #args do o.argv[#o.argv + 1] = args[j] end
      break
    elseif NUM[a] then
      local n = tonumber(need())
      if not n or n <= 0 then moonrl.usage_error(string.format("sandbox: %s '%s' is not a number > 0", a, tostring(v))) end
      o.limits[NUM[a]] = n
    elseif a == '--network' then
      o.network = need()
      if o.network ~= 'none' and o.network ~= 'loopback' then
        moonrl.usage_error(string.format("sandbox: --network '%s' (none or loopback)", o.network))
      end
    elseif a == '--put' or a == '--put-ro' then
      local path = need()
      local name = path:match('([^/]+)$')
      if not name then moonrl.usage_error(string.format("sandbox: %s '%s' names no file", a, path)) end
      o.files[name] = { data = read_file(path), read_only = a == '--put-ro' }
    elseif a == '--ro' then o.ro[#o.ro + 1] = need()
    elseif a == '--env' then
      local k, val = need():match('^([^=]+)=(.*)$')
      if not k then moonrl.usage_error(string.format("sandbox: --env '%s' is not KEY=VALUE", v)) end
      o.env[k] = val
    elseif a == '--json' then o.json = need()
    elseif a == '--help' or a == '-h' then print(USAGE) return nil
    else moonrl.usage_error(string.format("sandbox: unknown option '%s' (the program goes after --)\n%s", a, USAGE)) end
    i = i + 1
  end
  if not o.argv or #o.argv == 0 then moonrl.usage_error('sandbox: no program (after --)\n' .. USAGE) end
  return o
end

function M.main(args)
  local o = parse(args)
  if not o then return 0 end
  local stdin = nil
  if not require('moonrl.io.progress').isatty(0) then stdin = moonrl.exit_on_signal(io.read, '*a') end
  local ok, r = pcall(sandbox.run, o.argv, { limits = o.limits, network = o.network, files = o.files,
    ro_paths = #o.ro > 0 and o.ro or nil, env = o.env, stdin = stdin })
  if not ok then
    io.stderr:write('moonrl sandbox: ', tostring(r), '\n')
    return 1
  end
  io.stdout:write(r.stdout)
  io.stdout:flush()
  io.stderr:write(r.stderr)
  if r.limit ~= 'none' then
    io.stderr:write(string.format('moonrl sandbox: limit hit: %s (%s; wall %.3f s, cpu %.3f s, peak memory %.1f MiB)\n',
      r.limit, r.exited and 'exit status ' .. r.status or 'killed by signal ' .. r.signal, r.wall_s, r.cpu_s,
      r.peak_memory_bytes / 2 ^ 20))
  end
  if o.json then
    local f, err = io.open(o.json, 'w')
    if not f then
      io.stderr:write('moonrl sandbox: --json: ', tostring(err), '\n')
      return 1
    end
    f:write(require('moonrl.io.json').encode(r, { sort_keys = true }), '\n')
    f:close()
  end
  return r.exited and r.status or 128 + r.signal
end

return M
