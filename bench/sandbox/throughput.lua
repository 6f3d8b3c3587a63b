-- Sandbox throughput: executions a second a core, and each execution's latency (median, p99), of
--   a trivial Python test (`python3 -c 'assert sum(range(10)) == 45'`), and
--   a typical 10-test problem (a stdin/stdout program against 10 cases, through the code
--   reward's driver, plugins/rewards/code_driver.py, which forks a process a case),
-- by moonrl's warm pool (sandbox.pool: a started interpreter forks each run), moonrl's cold runner
-- (a sandbox a run), a plain unsandboxed `python3` subprocess (for the problem: the driver, and
-- the usual harness, a `python3` a case with its output compared), firejail and bubblewrap (Debian's
-- packages; skipped where absent) with comparable isolation (no network, a private /tmp, the
-- runtime read-only; firejail with its memory and process rlimits), all in this one run, `c`
-- at a time (twice the cores by default, for every runner).
--   MOONRL_THREADS=1 build/moonrl run bench/sandbox/throughput.lua [n=300] [c=0: twice the cores] [rounds=3]
-- (the runners take turns, rounds times, n executions in all each; the figures are the sums)
local moonrl = require('moonrl')
local sandbox = require('moonrl.sandbox')
local proc = require('moonrl.io.proc')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')

local cfg = moonrl.config { n = moonrl.config.integer(300, { min = 1 }), c = moonrl.config.integer(0, { min = 0 }),
  rounds = moonrl.config.integer(3, { min = 1 }) }
local N = cfg.n
local cores = 0
for _ in (fs.read('/proc/cpuinfo') or ''):gmatch('\nprocessor') do cores = cores + 1 end
cores = cores + 1
local C = cfg.c > 0 and cfg.c or 2 * cores -- (every runner the same; two a core keep the cores busy)
local PY = '/usr/bin/python3'

-- the 10-test problem: a + b over ten lines of input, its cases and the driver's files
local program = 'import sys\nfor line in sys.stdin:\n    a, b = map(int, line.split())\n    print(a + b)\n'
local cases = {}
for i = 1, 10 do cases[i] = { input = i .. ' ' .. (2 * i) .. '\n', output = (3 * i) .. '\n' } end
local driver = fs.read('plugins/rewards/code_driver.py')
local cases_json = json.encode({ mode = 'stdio', cases = cases, timeout_s = 2 })
local box = (os.getenv('PWD') or '.') .. '/build/sandbox_bench_' .. tostring(os.time()) -- (firejail hides /tmp and /var/tmp)
fs.mkdirs(box)
fs.write(box .. '/driver.py', driver)
fs.write(box .. '/solution.py', program)
fs.write(box .. '/cases.json', cases_json)
for i, c in ipairs(cases) do fs.write(box .. '/in' .. i, c.input); fs.write(box .. '/out' .. i, c.output) end
-- the usual harness without a sandbox: a python3 a case, its output compared
local PER_CASE = string.format('for i in 1 2 3 4 5 6 7 8 9 10; do %s %s/solution.py < %s/in$i | cmp -s - %s/out$i || exit 1; done',
  '/usr/bin/python3', box, box, box)
local TRIVIAL = 'assert sum(range(10)) == 45'

local function percentile(xs, p)
  table.sort(xs)
  return xs[math.max(1, math.ceil(p * #xs))]
end

-- n external commands (argv_of(i)), c at a time; returns seconds, latencies, failures
local function external(argv_of, check)
  local running, lat, bad, next_i = {}, {}, 0, 1
  local t0 = moonrl.now()
  while next_i <= N or #running > 0 do
    while next_i <= N and #running < C do
      running[#running + 1] = { p = proc.spawn(argv_of(next_i), { timeout = 60 }), t = moonrl.now() }
      next_i = next_i + 1
    end
    local k = 1
    while k <= #running do
      local e = running[k]
      if e.p:done() then
        local r = e.p:wait()
        lat[#lat + 1] = moonrl.now() - e.t
        if not check(r) then bad = bad + 1 end
        table.remove(running, k)
      else
        k = k + 1
      end
    end
    moonrl.sleep(0.0005)
  end
  return moonrl.now() - t0, lat, bad
end

-- n runs of moonrl's sandbox (opts.pool: the warm pool), as one batch at c at a time
local function moonrl_runs(argv, opts, check)
  local runs = {}
  for i = 1, N do runs[i] = { argv, opts } end
  local t0 = moonrl.now()
  local rs = sandbox.run_batch(runs, { concurrency = C })
  local secs, lat, bad = moonrl.now() - t0, {}, 0
  for i, r in ipairs(rs) do
    lat[i] = r.wall_s or 0
    if not check(r) then bad = bad + 1 end
  end
  return secs, lat, bad
end

local ok_trivial = function(r) return (r.ok ~= nil and r.ok) or (r.exit_status == 0) end
local ok_problem = function(r)
  local v = (r.stdout or ''):match('[^\n]+')
  local okj, d = pcall(json.decode, v or '')
  if not okj or type(d) ~= 'table' then return false end
  for _, p in ipairs(d.passed) do if not p then return false end end
  return #d.passed == 10
end

local function firejail(cmd)
  return { 'firejail', '--quiet', '--noprofile', '--net=none', '--private', '--rlimit-as=536870912', '--rlimit-nproc=64',
    '--private-tmp', unpack(cmd) }
end
local function bwrap(cmd, bind)
  local a = { 'bwrap', '--ro-bind', '/usr', '/usr', '--symlink', 'usr/lib', '/lib', '--symlink', 'usr/lib64', '/lib64',
    '--symlink', 'usr/bin', '/bin', '--proc', '/proc', '--dev', '/dev', '--tmpfs', '/tmp', '--unshare-all',
    '--die-with-parent' }
  if bind then for _, x in ipairs({ '--ro-bind', box, '/box' }) do a[#a + 1] = x end end
  for _, x in ipairs(cmd) do a[#a + 1] = x end
  return a
end
local function which(name) return proc.run({ 'sh', '-c', 'command -v ' .. name }, { timeout = 10 }).stdout ~= '' end

local pool = sandbox.pool('python')
-- the runners of each workload, in rounds: every runner's share of a round after the other's, so
-- that the shared machine's load drifts over all of them alike
local runners = {}
for _, what in ipairs({ 'trivial test', '10-test problem' }) do
  local problem = what ~= 'trivial test'
  local check = problem and ok_problem or ok_trivial
  local files = { ['driver.py'] = { data = driver, read_only = true }, ['solution.py'] = { data = program, read_only = true },
    ['cases.json'] = { data = cases_json, read_only = true } }
  local argv = problem and { 'python3', '/box/driver.py' } or { 'python3', '-c', TRIVIAL }
  local plain = problem and { PY, box .. '/driver.py', box } or { PY, '-c', TRIVIAL }
  local list = {
    { 'moonrl warm pool', function() return moonrl_runs(argv, { pool = pool, files = problem and files or nil }, check) end },
    { 'moonrl cold', function() return moonrl_runs(argv, { files = problem and files or nil }, check) end },
    { 'python3 (no sandbox)', function() return external(function() return plain end, check) end } }
  if problem then -- (the same without the driver: a python3 a case)
    list[#list + 1] = { 'python3 a case', function() return external(function() return { 'sh', '-c', PER_CASE } end, ok_trivial) end }
  end
  if which('firejail') then
    list[#list + 1] = { 'firejail', function() return external(function() return firejail(plain) end, check) end }
  end
  if which('bwrap') then
    local cmd = problem and { PY, '/box/driver.py', '/box' } or { PY, '-c', TRIVIAL }
    list[#list + 1] = { 'bubblewrap', function() return external(function() return bwrap(cmd, problem) end, check) end }
  end
  runners[#runners + 1] = { what = what, list = list }
end
local ROUNDS = cfg.rounds
local total = N
N = math.max(1, math.floor(total / ROUNDS)) -- (each round's share)
local rows = {}
for _, w in ipairs(runners) do
  local acc = {}
  for round = 1, ROUNDS do
    for k, r in ipairs(w.list) do
      local secs, lat, bad = r[2]()
      local a = acc[k] or { secs = 0, lat = {}, bad = 0, n = 0 }
      a.secs, a.bad, a.n = a.secs + secs, a.bad + bad, a.n + N
      for _, x in ipairs(lat) do a.lat[#a.lat + 1] = x end
      acc[k] = a
      io.stderr:write(string.format('round %d %-16s %-20s %7.1f /s/core\n', round, w.what, r[1], N / secs / C))
    end
  end
  for k, r in ipairs(w.list) do
    local a = acc[k]
    rows[#rows + 1] = { what = w.what, runner = r[1], per_core = a.n / a.secs / C, median = percentile(a.lat, 0.5) * 1e3,
      p99 = percentile(a.lat, 0.99) * 1e3, bad = a.bad }
  end
end
N = total
pool:close()
proc.run({ 'rm', '-rf', box })

local cpu = (fs.read('/proc/cpuinfo') or ''):match('model name%s*:%s*([^\n]+)') or '?'
print(string.format('%s, %d cores, %d executions each, %d at a time', cpu, cores, N, C))
print('| workload | runner | executions/s a core | median ms | p99 ms | against python3 | failed |')
print('|---|---|---|---|---|---|---|')
local base = {}
for _, r in ipairs(rows) do if r.runner == 'python3 (no sandbox)' then base[r.what] = r.per_core end end
for _, r in ipairs(rows) do
  print(string.format('| %s | %s | %.1f | %.1f | %.1f | %.2fx | %d |', r.what, r.runner, r.per_core, r.median, r.p99,
    r.per_core / base[r.what], r.bad))
end
