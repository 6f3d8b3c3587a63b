-- Subprocesses with timeouts, run by the event loop (core/runtime/proc.c).
--
--   local r = moonrl.io.proc.run({'python3', 'check.py'}, {stdin = text, timeout = 10})
--   -- r.ok, r.exit_status, r.signal, r.timed_out, r.stdout, r.stderr, r.seconds
--
-- spawn() starts one and returns a handle, so that many can run at once
-- (reward verifiers over a batch); wait() collects it.
local moonrl = require('moonrl')
local ffi = require('ffi')
local C = moonrl.C

local M = {}

local Proc = {}
Proc.__index = Proc

function M.spawn(argv, opts)
  opts = opts or {}
  if type(argv) ~= 'table' or #argv == 0 then error('proc.spawn: argv must be a non-empty list', 2) end
  local cargv = ffi.new('const char *[?]', #argv + 1)
  for i, a in ipairs(argv) do cargv[i - 1] = tostring(a) end
  cargv[#argv] = nil
  local stdin = opts.stdin
  local out = ffi.new('mrl_proc *[1]')
  moonrl.check(C.mrl_proc_spawn(cargv, stdin, stdin and #stdin or 0, opts.timeout or 0,
    opts.max_output or 0, out), 2)
  local handle = ffi.gc(out[0], C.mrl_proc_free)
  return setmetatable({ handle = handle, argv = argv }, Proc)
end

function Proc:done() return C.mrl_proc_done(self.handle) ~= 0 end

function Proc:wait()
  local res = ffi.new('mrl_proc_result')
  moonrl.check(C.mrl_proc_wait(self.handle, res), 2)
  local len = ffi.new('size_t[1]')
  local out = ffi.string(C.mrl_proc_stdout(self.handle, len), len[0])
  local err = ffi.string(C.mrl_proc_stderr(self.handle, len), len[0])
  local r = {
    exited = res.exited ~= 0,
    exit_status = tonumber(res.exit_status),
    signal = tonumber(res.term_signal),
    timed_out = res.timed_out ~= 0,
    seconds = tonumber(res.seconds),
    stdout = out,
    stderr = err,
  }
  r.ok = r.exited and r.exit_status == 0 and not r.timed_out
  C.mrl_proc_free(ffi.gc(self.handle, nil))
  self.handle = nil
  return r
end

-- Kill the child (SIGKILL to its process group) and free it.
function Proc:kill()
  if self.handle then
    C.mrl_proc_free(ffi.gc(self.handle, nil))
    self.handle = nil
  end
end

function M.run(argv, opts) return M.spawn(argv, opts):wait() end

-- Background file write (atomic: temporary file, fsync, rename) on the
-- loop's thread pool; returns a job with :wait().
local Job = {}
Job.__index = Job
function M.write_file_async(path, data)
  local out = ffi.new('mrl_job *[1]')
  moonrl.check(C.mrl_job_write_file(path, data, #data, out), 2)
  return setmetatable({ handle = ffi.gc(out[0], C.mrl_job_free) }, Job)
end
function Job:done() return C.mrl_job_done(self.handle) ~= 0 end
function Job:wait()
  local st = C.mrl_job_wait(self.handle)
  C.mrl_job_free(ffi.gc(self.handle, nil))
  self.handle = nil
  moonrl.check(st, 2)
end

return M
