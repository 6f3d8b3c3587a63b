-- moonrl: the Lua side of the C core. This module loads the generated FFI
-- declarations, finds the C library, and offers the few helpers every other
-- module uses (check a status, version info, stopping at safe points).
local ffi = require('ffi')
local cdef = require('moonrl.cdef')

local M = {}

-- Inside the `moonrl` command the library is already linked in (ffi.C);
-- from a plain LuaJIT, load it by name or from MOONRL_LIB.
local function find_library()
  local ok = pcall(function() return ffi.C.mrl_version end)
  if ok then return ffi.C end
  return ffi.load(os.getenv('MOONRL_LIB') or 'moonrl', true)
end

M.C = find_library()
M.ffi_functions = cdef.functions
M.home = rawget(_G, 'MOONRL_HOME')

local C = M.C

-- Error objects raised for user mistakes (bad config, missing file): the
-- command line prints their message alone and exits with status 2.
local UsageError = {}
UsageError.__index = UsageError
UsageError.__tostring = function(e) return e.message end
M.UsageError = UsageError

function M.usage_error(message)
  error(setmetatable({ message = message, usage = true }, UsageError), 0)
end

function M.is_usage_error(e) return getmetatable(e) == UsageError end

-- Errors of the world, not of the program (a full disk, an unwritable directory): the command
-- line prints their message alone, without a traceback, and exits with status 1.
local RunError = {}
RunError.__index = RunError
RunError.__tostring = function(e) return e.message end
function M.run_error(message) error(setmetatable({ message = message }, RunError), 0) end
function M.is_run_error(e) return getmetatable(e) == RunError end

-- The text of an error without the "file.lua:12: " where the library raised it.
function M.error_text(e)
  if type(e) == 'table' and e.message then return e.message end
  return (tostring(e):gsub('^[^%s:]+%.lua:%d+: ', ''))
end

-- Raised at a safe point after SIGINT/SIGTERM or a deadline.
local StopRequest = {}
StopRequest.__index = StopRequest
StopRequest.__tostring = function(e) return 'stopped: ' .. e.reason end
M.StopRequest = StopRequest
function M.is_stop_request(e) return getmetatable(e) == StopRequest end

-- The message of the last C error on this thread.
function M.last_error()
  return ffi.string(C.mrl_last_error())
end

-- Turn a non-zero status into a Lua error that points at the caller's caller
-- (the recipe line that called the wrapper), with the C message.
function M.check(status, level)
  if status ~= 0 then
    local code = tonumber(status)
    if code == 7 and C.mrl_stop_requested() ~= 0 then M.check_stop() end
    error(M.last_error(), (level or 1) + 1)
  end
end

-- A safe point: if a stop was requested, unwind the recipe cleanly.
function M.check_stop()
  local code = C.mrl_stop_requested()
  if code ~= 0 then
    error(setmetatable({ code = code, reason = ffi.string(C.mrl_stop_reason()) }, StopRequest), 0)
  end
end

function M.stop_requested() return C.mrl_stop_requested() ~= 0 end

-- fn(...) for a wait that would never reach a safe point (a read of standard input): while it
-- runs, the first SIGINT / SIGTERM ends the process at once (128 + the signal).
function M.exit_on_signal(fn, ...)
  M.check_stop() -- (one requested before it would not end the wait)
  local was = C.mrl_signals_exit_at_once(1)
  local res = { pcall(fn, ...) }
  C.mrl_signals_exit_at_once(was)
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

-- Functions the command line calls when a recipe ends, fn(ok, err): ok with no error, else
-- the error or stop request that ended it (a session saves what it can and closes its files).
local exit_hooks = {}
function M.on_exit(fn) exit_hooks[#exit_hooks + 1] = fn end
function M.run_exit_hooks(ok, err)
  local hooks = exit_hooks
  exit_hooks = {}
  for i = #hooks, 1, -1 do
    local hok, herr = pcall(hooks[i], ok, err)
    if not hok then io.stderr:write('moonrl: error while ending the run: ', tostring(herr), '\n') end
  end
end

function M.version()
  return {
    version = ffi.string(C.mrl_version()),
    git = ffi.string(C.mrl_git_revision()),
    backends = ffi.string(C.mrl_backends()),
    cpu_features = ffi.string(C.mrl_cpu_features()),
    kernels_built = ffi.string(C.mrl_kernel_isas_built()),
    kernels = ffi.string(C.mrl_kernel_isa()),
    cuda_devices = tonumber(C.mrl_device_cuda_count()),
    cuda_built = C.mrl_device_cuda_built() ~= 0,
    threads = tonumber(C.mrl_parallel_threads()),
  }
end

function M.now() return tonumber(C.mrl_time_now()) end

-- Sleep that ends early (at a safe point) when a stop is requested.
function M.sleep(seconds)
  local st = C.mrl_sleep(seconds)
  if st ~= 0 then M.check_stop(); M.check(st, 2) end
end

local levels = { error = 0, warn = 1, info = 2, debug = 3, trace = 4 }
function M.log(level, fmt, ...)
  local n = levels[level]
  if not n then error('log level must be one of error, warn, info, debug, trace; got ' .. tostring(level), 2) end
  if n <= C.mrl_log_get_level() then
    C.mrl_log_write(n, select('#', ...) > 0 and string.format(fmt, ...) or tostring(fmt))
  end
end

function M.set_log_level(name)
  local n = levels[name]
  if not n then M.usage_error("log level '" .. tostring(name) .. "': expected error, warn, info, debug or trace") end
  C.mrl_log_set_level(n)
end

-- Memory accounting, per category, in bytes.
function M.memory()
  local s = ffi.new('mrl_mem_stats')
  C.mrl_mem_get_stats(s)
  local out = { total = tonumber(s.total), total_peak = tonumber(s.total_peak) }
  for i = 0, 5 do
    local name = ffi.string(C.mrl_mem_category_name(i))
    out[name] = tonumber(s.current[i])
    out[name .. '_peak'] = tonumber(s.peak[i])
  end
  return out
end

-- Submodules load on first use: moonrl.config, moonrl.io.proc, ...
setmetatable(M, {
  __index = function(t, name)
    local ok, mod = pcall(require, 'moonrl.' .. name)
    if not ok then
      if tostring(mod):find("module 'moonrl." .. name .. "' not found", 1, true) then return nil end
      error(mod, 2)
    end
    rawset(t, name, mod)
    return mod
  end,
})

return M
