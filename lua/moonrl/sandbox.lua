-- moonrl.sandbox: run an untrusted program (model-written code, its tests) contained: fresh
-- namespaces, the host's runtime read-only, a private /tmp, no network, no capabilities, a
-- seccomp filter, and limits on time, CPU, memory, processes, files and output (moonrl/sandbox.h;
-- docs/sandbox.md says what it protects against and what not).
--
--   local sandbox = require('moonrl.sandbox')
--   local r = sandbox.run({ 'python3', 'main.py' }, {
--     files = { ['main.py'] = src, ['tests.py'] = { data = tests, read_only = true } },  -- /tmp, /box
--     stdin = '1 2\n', limits = { wall_s = 5, memory_mb = 256 }, network = 'none' })
--   r.ok, r.exited, r.status, r.signal, r.limit, r.stdout, r.stderr, r.wall_s, r.cpu_s, r.peak_memory_bytes
--   local rs = sandbox.run_batch({ { argv, opts }, ... }, { concurrency = 8 })  -- on threads, in order
--   local b = sandbox.start_batch(runs); ...; b:done(); local rs = b:wait()     -- the caller goes on meanwhile
--   local pool = sandbox.pool('python')    -- a warm interpreter: sandbox.run(argv, { pool = pool, ... })
--   local s = sandbox.session(argv, opts)  -- a run to talk to: s:send(data), s:recv(delim), s:close()
--   sandbox.probe()  -- { namespaces, seccomp, cgroup, detail }: what this machine gives it
--
-- limits (each optional; the defaults are the C ones): wall_s (10), cpu_s (wall_s), memory_mb
-- (512), procs (64), files (256 open), file_mb (64), tmpfs_mb (64: /tmp's size), output_kb (1024,
-- each of stdout and stderr; past it the run is killed). A result's limit names the one that
-- ended or constrained the run: 'none', 'wall', 'cpu', 'memory', 'procs', 'output', 'file', 'disk'.
local ffi = require('ffi')
local moonrl = require('moonrl')
local C = moonrl.C

local M = {}

local LIMITS = { wall_s = 1, cpu_s = 1, memory_mb = 2 ^ 20, procs = 1, files = 1, file_mb = 2 ^ 20, tmpfs_mb = 2 ^ 20,
  output_kb = 2 ^ 10 }
local FIELD = { wall_s = 'wall_s', cpu_s = 'cpu_s', memory_mb = 'memory_bytes', procs = 'procs', files = 'files',
  file_mb = 'file_bytes', tmpfs_mb = 'tmpfs_bytes', output_kb = 'output_bytes' }
local NETWORK = { none = 0, loopback = 1 }

local function strings(list, what)
  local arr = ffi.new('const char *[?]', #list + 1)
  for i, s in ipairs(list) do
    if type(s) ~= 'string' then error(string.format('sandbox: %s[%d] is a %s, not a string', what, i, type(s)), 3) end
    arr[i - 1] = s
  end
  return arr
end

-- The C spec of argv and opts; keep (returned) holds what the spec points into.
local function spec_of(argv, opts)
  opts = opts or {}
  if type(argv) ~= 'table' or #argv == 0 then error('sandbox.run: argv is a list of strings, the program first', 3) end
  local keep = { strings(argv, 'argv') }
  local s = ffi.new('mrl_sandbox_spec')
  s.argv = keep[1]
  for k, v in pairs(opts.limits or {}) do
    if not LIMITS[k] then
      error(string.format("sandbox: unknown limit '%s' (wall_s, cpu_s, memory_mb, procs, files, file_mb, tmpfs_mb, " ..
        "output_kb)", tostring(k)), 3)
    end
    if type(v) ~= 'number' or not (v > 0) then error(string.format('sandbox: limits.%s is %s, not a number > 0', k, tostring(v)), 3) end
    s.limits[FIELD[k]] = v * LIMITS[k]
  end
  if opts.pool then
    if type(opts.pool) ~= 'table' or not opts.pool.handle then error('sandbox: opts.pool is a sandbox.pool(...)', 3) end
    keep[#keep + 1] = opts.pool
    s.pool = opts.pool.handle
  end
  local net = NETWORK[opts.network or (opts.pool and opts.pool.network) or 'none']
  if not net then error(string.format("sandbox: network '%s' (none or loopback)", tostring(opts.network)), 3) end
  s.network = net
  if opts.stdin then
    keep[#keep + 1] = opts.stdin
    s.stdin_data, s.stdin_len = opts.stdin, #opts.stdin
  end
  if opts.env then
    local env = {}
    for k, v in pairs(opts.env) do env[#env + 1] = tostring(k) .. '=' .. tostring(v) end
    table.sort(env)
    keep[#keep + 1] = env
    keep[#keep + 1] = strings(env, 'env')
    s.env = keep[#keep]
  end
  if opts.ro_paths then
    keep[#keep + 1] = strings(opts.ro_paths, 'ro_paths')
    s.ro_paths = keep[#keep]
  end
  if opts.files then
    local names = {}
    for name in pairs(opts.files) do names[#names + 1] = name end
    table.sort(names) -- (the files in a fixed order)
    local arr = ffi.new('mrl_sandbox_file[?]', math.max(#names, 1))
    for i, name in ipairs(names) do
      local f = opts.files[name]
      if type(f) == 'string' then f = { data = f } end
      if type(name) ~= 'string' or type(f) ~= 'table' or type(f.data) ~= 'string' then
        error(string.format("sandbox: files['%s'] is a string, or { data = string, read_only =, executable = }",
          tostring(name)), 3)
      end
      keep[#keep + 1] = name
      keep[#keep + 1] = f.data
      arr[i - 1].name, arr[i - 1].data, arr[i - 1].size = name, f.data, #f.data
      arr[i - 1].read_only, arr[i - 1].executable = f.read_only and 1 or 0, f.executable and 1 or 0
    end
    keep[#keep + 1] = arr
    s.files, s.n_files = arr, #names
  end
  return s, keep
end

-- A run's result as a table (the C result freed).
local function result_of(r)
  local t = { exited = r.exited == 1, limit = ffi.string(C.mrl_sandbox_limit_name(r.limit)),
    stdout = ffi.string(r.out, r.out_len), stderr = ffi.string(r.err, r.err_len),
    stdout_truncated = r.out_truncated == 1, stderr_truncated = r.err_truncated == 1,
    wall_s = r.wall_s, cpu_s = r.cpu_s, peak_memory_bytes = tonumber(r.peak_memory_bytes) }
  if t.exited then t.status = r.status else t.signal = r.status end
  t.ok = t.exited and t.status == 0 and t.limit == 'none'
  C.mrl_sandbox_result_free(r)
  return t
end

-- Runs argv in the sandbox to its end or its first limit; returns the result table. A failure
-- of the sandbox itself (namespaces refused, the program not found) is an error, never a result.
function M.run(argv, opts)
  local s, keep = spec_of(argv, opts)
  local r = ffi.new('mrl_sandbox_result')
  moonrl.check(C.mrl_sandbox_run(s, r), 2)
  local _ = keep -- (alive until here)
  return result_of(r)
end

-- A batch: runs = { { argv, opts }, ... } on threads of the C core, at most opts.concurrency at
-- once (0 or nil: 2 a CPU), started at once; the handle's done() never waits, wait() returns the
-- results in order: each a run's table, or { error = message } where the sandbox itself failed
-- for that run (a program not found).
local Batch = {}
Batch.__index = Batch

function M.start_batch(runs, opts)
  if type(runs) ~= 'table' then error('sandbox.start_batch: runs is a list of { argv, opts }', 2) end
  local n = #runs
  local specs = ffi.new('mrl_sandbox_spec[?]', math.max(n, 1))
  local keep = {}
  for i, r in ipairs(runs) do
    local s, k = spec_of(r[1] or r.argv, r[2] or r.opts)
    specs[i - 1] = s
    keep[i] = k
  end
  local h = ffi.new('mrl_sandbox_batch *[1]')
  moonrl.check(C.mrl_sandbox_batch_start(specs, n, (opts or {}).concurrency or 0, h), 2)
  return setmetatable({ handle = ffi.gc(h[0], C.mrl_sandbox_batch_free), n = n, specs = specs, keep = keep }, Batch)
end

function Batch:done() return C.mrl_sandbox_batch_done(self.handle) ~= 0 end

function Batch:wait()
  if self.results then return self.results end
  local out, r = {}, ffi.new('mrl_sandbox_result')
  for i = 1, self.n do
    if C.mrl_sandbox_batch_take(self.handle, i - 1, r) == 0 then out[i] = result_of(r)
    else out[i] = { error = ffi.string(C.mrl_last_error()), ok = false } end
  end
  C.mrl_sandbox_batch_free(ffi.gc(self.handle, nil))
  self.handle, self.specs, self.keep, self.results = nil, nil, nil, out
  return out
end

-- The same, waited for: the results in order.
function M.run_batch(runs, opts) return M.start_batch(runs, opts):wait() end

-- A warm pool (mrl_sandbox_pool_open): a Python interpreter started once in a sandbox, which
-- forks each run given opts.pool = the pool (`python3 FILE ARGS` or `python3 -c CODE ARGS`); a run
-- costs a fork, not an interpreter's start, and keeps its own namespaces, cgroup, limits and
-- filter. opts: network ('none' or 'loopback', for all its runs), ro_paths. Closed by close() or
-- when collected.
local Pool = {}
Pool.__index = Pool

function M.pool(language, opts)
  opts = opts or {}
  local net = NETWORK[opts.network or 'none']
  if not net then error(string.format("sandbox.pool: network '%s' (none or loopback)", tostring(opts.network)), 2) end
  local ro = opts.ro_paths and strings(opts.ro_paths, 'ro_paths') or nil
  local h = ffi.new('mrl_sandbox_pool *[1]')
  moonrl.check(C.mrl_sandbox_pool_open(language or 'python', net, ro, h), 2)
  return setmetatable({ handle = ffi.gc(h[0], C.mrl_sandbox_pool_close), language = language or 'python',
    network = opts.network or 'none' }, Pool)
end

function Pool:close()
  if self.handle then C.mrl_sandbox_pool_close(ffi.gc(self.handle, nil)) end
  self.handle = nil
end

-- A session: a run the caller talks to while it goes on (mrl_sandbox_session_*: a tool's
-- interpreter across an episode's turns), started as run() starts one (opts as run's, opts.stdin
-- aside), under the same limits (wall_s from its start).
--   local s = sandbox.session({ 'python3', '-i' }, { limits = { wall_s = 600 } })
--   s:send('print(1)\n', 5)          -- waits at most 5 s
--   local text, ended = s:recv('\n', 5)   -- up to and with the delimiter (nil delimiter: what came);
--                                       -- nil, 'timeout' when none came in time
--   local r = s:close(kill)             -- the run's result (run's table: what recv did not take)
local Session = {}
Session.__index = Session
pcall(ffi.cdef, 'void free(void *p);') -- (what _recv allocates)

function M.session(argv, opts)
  local s, keep = spec_of(argv, opts)
  local h = ffi.new('mrl_sandbox_session *[1]')
  moonrl.check(C.mrl_sandbox_session_start(s, h), 2)
  return setmetatable({ handle = h[0], keep = keep }, Session)
end

function Session:send(data, timeout_s)
  if not self.handle then error('sandbox session: closed', 2) end
  moonrl.check(C.mrl_sandbox_session_send(self.handle, data, #data, timeout_s or 10), 2)
end

local recv_out, recv_len, recv_ended = ffi.new('char *[1]'), ffi.new('int64_t[1]'), ffi.new('int[1]')
function Session:recv(delim, timeout_s)
  if not self.handle then error('sandbox session: closed', 2) end
  local st = C.mrl_sandbox_session_recv(self.handle, delim, timeout_s or 10, recv_out, recv_len, recv_ended)
  if st == C.MRL_ERR_TIMEOUT then return nil, 'timeout', recv_ended[0] == 1 end
  moonrl.check(st, 2)
  local text = ffi.string(recv_out[0], recv_len[0])
  ffi.C.free(recv_out[0])
  return text, recv_ended[0] == 1
end

function Session:close(kill)
  if not self.handle then return self.result end
  local r = ffi.new('mrl_sandbox_result')
  local st = C.mrl_sandbox_session_close(self.handle, kill and 1 or 0, r)
  self.handle, self.keep = nil, nil
  moonrl.check(st, 2)
  self.result = result_of(r)
  return self.result
end

-- What this machine gives the sandbox (mrl_sandbox_probe): namespaces and seccomp (booleans),
-- cgroup (2, 1, or 0: rlimits), detail (in words).
function M.probe()
  local c = ffi.new('mrl_sandbox_caps')
  moonrl.check(C.mrl_sandbox_probe(c), 2)
  return { namespaces = c.namespaces == 1, seccomp = c.seccomp == 1, cgroup = c.cgroup, detail = ffi.string(c.detail) }
end

return M
