-- Code reward: the program in the response run against the sample's tests in the sandbox
-- (moonrl.sandbox), all the batch's programs at once on the sandbox's threads.
--
--   reward=code                      -- 1 when every test passes, else 0
--   local code = require('rewards.code')
--   code.reward(samples)             -- a batch reward: a list of scores, and the step's metrics
--   local partial = code.new{ partial = true, timeout_s = 4 }   -- the fraction of tests passed
--
-- The program: the last fenced block of the response (```python ... ```, ```c ... ```, or a
-- block without a language: Python); opts.block = 'first' takes the first. A response without
-- one scores 0 (opts.whole = true runs the whole response instead).
--
-- The tests, from sample.meta.tests, sample.meta.input_output, else sample.answer (a table, or a
-- JSON string of one, or Python source):
--   standard input and output (the APPS / CodeContests / TACO input_output shape):
--     { inputs = { '1 2\n', ... }, outputs = { '3\n', ... } }, or a list of { input =, output = }
--     each input is the program's stdin; its stdout must equal the output, line by line, trailing
--     whitespace and blank lines aside.
--   assertions appended to the program (HumanEval / MBPP / LiveCodeBench's functional shape):
--     { 'assert f(1) == 2', ... } or { tests = ..., entry_point = 'f' } or Python source; each
--     entry is a test (a process of its own, after the program), a single source is one test,
--     and with entry_point the source's check(candidate) is called on it (HumanEval).
-- Python is run by the interpreter of the sandbox; C (```c) is compiled there with gcc -O2 and
-- run per case (standard input and output only).
--
-- The runs go to a warm pool (sandbox.pool: one started Python interpreter forks each run), else a
-- sandbox each. Each case runs in its own process, forked by a driver (code_driver.py, read-only in
-- the sandbox) that alone judges it: a case that runs past timeout_s (2) fails, one that exits
-- non-zero fails. A program cannot change its tests (read-only), reach the driver, or leave a
-- process behind. For assert tests the program and the assertions share a process, so a program
-- written to subvert its own process (exiting 0 before the assertions run, patching builtins)
-- is what the sandbox cannot judge: stdin/stdout tests have no such gap.
--
-- The step's metrics (reward/code/...): executions (sandbox runs), cases, cases_passed,
-- pass_rate (samples with every test passed), no_code (samples without a program), timeouts
-- (cases past their time, runs past the sandbox's wall limit), memory_kills, compile_errors,
-- sandbox_errors (runs the sandbox itself failed), seconds (the batch's wall time).
local rewards = require('moonrl.rewards')
local sandbox = require('moonrl.sandbox')
local json = require('moonrl.io.json')
local moonrl = require('moonrl')
local trace = require('moonrl.train.trace')

local M = {}

local driver_source
local function driver()
  driver_source = driver_source or require('moonrl.io.fs').read_beside('code_driver.py')
  return driver_source
end

local PYTHON = { python = true, py = true, python3 = true, [''] = true }

-- The program of a response: its code and language ('python' or 'c'), or nil.
function M.extract(response, opts)
  opts = opts or {}
  local blocks = {}
  for lang, body in response:gmatch('```([%w_+%-]*)[^\n]*\n(.-)```') do blocks[#blocks + 1] = { lang:lower(), body } end
  local b = blocks[opts.block == 'first' and 1 or #blocks]
  if not b then
    if opts.whole then return response, 'python' end
    return nil
  end
  if PYTHON[b[1]] then return b[2], 'python' end
  if b[1] == 'c' then return b[2], 'c' end
  return nil, b[1]
end

local function decode(t)
  if type(t) == 'string' and t:match('^%s*[%[{]') then
    local ok, v = pcall(json.decode, t)
    if ok then return v end
  end
  return t
end

-- The tests of a sample: { mode = 'stdio' | 'assert', cases = {...} }; an error names what is wrong.
function M.tests_of(sample)
  local meta = type(sample.meta) == 'table' and sample.meta or {}
  local t = decode(meta.tests or meta.input_output or sample.answer)
  if type(t) == 'string' then return { mode = 'assert', cases = { t } } end
  if type(t) ~= 'table' then error('reward code: the sample has no tests (meta.tests, meta.input_output or answer)', 0) end
  if t.inputs or t.outputs then
    local ins, outs = t.inputs, t.outputs
    if type(ins) ~= 'table' or type(outs) ~= 'table' or #ins ~= #outs or #ins == 0 then
      error('reward code: input_output needs lists inputs and outputs of the same length', 0)
    end
    local cases = {}
    for i = 1, #ins do
      local a, b = ins[i], outs[i]
      if type(a) == 'table' then a = table.concat(a, '\n') end
      if type(b) == 'table' then b = table.concat(b, '\n') end
      cases[i] = { input = tostring(a), output = tostring(b) }
    end
    return { mode = 'stdio', cases = cases }
  end
  if t.tests then
    local cases = type(t.tests) == 'table' and t.tests or { tostring(t.tests) }
    if t.entry_point then cases = { table.concat(cases, '\n') .. '\n\ncheck(' .. t.entry_point .. ')\n' } end
    return { mode = 'assert', cases = cases }
  end
  if #t > 0 and type(t[1]) == 'table' then
    local cases = {}
    for i, c in ipairs(t) do cases[i] = { input = tostring(c.input or ''), output = tostring(c.output or '') } end
    return { mode = 'stdio', cases = cases }
  end
  if #t > 0 then return { mode = 'assert', cases = t } end
  error('reward code: tests of an unknown shape (inputs/outputs, tests, or a list)', 0)
end

-- The warm pool the runs go to (sandbox.pool: a started interpreter forks each driver), opened at
-- the first batch; where it cannot open (no cgroups) each run is a sandbox of its own, said once.
local pool, pool_tried
local function warm_pool(network)
  if not pool_tried then
    pool_tried = true
    local ok, p = pcall(sandbox.pool, 'python', { network = network })
    if ok then pool = p
    else moonrl.log('warn', 'reward code: no warm pool (%s): a sandbox a run', tostring(p)) end
  end
  return pool
end

-- The options of a run: opts over the run's sandbox section (sections.sandbox_config: sandbox.*),
-- read when a batch is scored.
local function options(opts)
  local c = require('moonrl.config').current
  local sb = type(c) == 'table' and type(c.sandbox) == 'table' and c.sandbox or {}
  local o = { limits = {} }
  for k, v in pairs(opts) do o[k] = v end
  if o.partial == nil then o.partial = sb.partial end
  if o.pool == nil then o.pool = sb.pool end
  o.concurrency = o.concurrency or sb.concurrency
  o.timeout_s = o.timeout_s or sb.case_timeout_s or 2
  o.network = o.network or sb.network
  for _, k in ipairs({ 'memory_mb', 'procs', 'tmpfs_mb', 'output_kb' }) do o.limits[k] = sb[k] end
  if (sb.wall_s or 0) > 0 then o.limits.wall_s = sb.wall_s end
  for k, v in pairs(opts.limits or {}) do o.limits[k] = v end
  return o
end

-- opts: partial (false: all or nothing), block ('last'), whole (false), timeout_s (2, a case),
-- limits (the sandbox's, memory_mb 512 ...), concurrency (runs at once: 0, 2 a CPU), pool (true:
-- the warm pool; false: a sandbox a run), network ('none'); what opts leaves out comes from the
-- run's sandbox.* keys where it has them.
function M.new(given)
  given = given or {}
  return function(samples)
    local opts = options(given)
    local timeout = opts.timeout_s
    local t0 = moonrl.now()
    local stats = { executions = 0, cases = 0, cases_passed = 0, pass_rate = 0, no_code = 0, timeouts = 0,
      memory_kills = 0, compile_errors = 0, sandbox_errors = 0 }
    local scores, runs, which, n_cases = {}, {}, {}, {} -- (n_cases: each run's, for its score)
    for i, s in ipairs(samples) do
      scores[i] = 0
      local src, lang = M.extract(rewards.response_of(s, 'reward code'), opts)
      local tests = M.tests_of(s)
      if not src or (lang == 'c' and tests.mode ~= 'stdio') then
        stats.no_code = stats.no_code + 1
      else
        local limits = { wall_s = #tests.cases * (timeout + 0.5) + (lang == 'c' and 15 or 5) }
        for k, v in pairs(opts.limits) do limits[k] = v end
        local p = opts.pool ~= false and warm_pool(opts.network) or nil
        runs[#runs + 1] = { { 'python3', '/box/driver.py' }, { limits = limits, pool = p, network = not p and opts.network or nil, files = {
          ['driver.py'] = { data = driver(), read_only = true },
          [lang == 'c' and 'solution.c' or 'solution.py'] = { data = src, read_only = true },
          ['cases.json'] = { data = json.encode({ mode = tests.mode, cases = tests.cases, timeout_s = timeout }),
            read_only = true } } } }
        which[#runs], n_cases[#runs] = i, #tests.cases
      end
    end
    trace.begin('sandbox runs') -- (a span of the run's timeline: the batch's programs)
    local results = sandbox.run_batch(runs, { concurrency = opts.concurrency })
    trace.finish('sandbox runs')
    stats.executions = #runs
    for k, r in ipairs(results) do
      local i = which[k]
      local ok, verdict = false, nil
      if r.error then stats.sandbox_errors = stats.sandbox_errors + 1
      else
        if r.limit == 'wall' then stats.timeouts = stats.timeouts + 1 end
        if r.limit == 'memory' then stats.memory_kills = stats.memory_kills + 1 end
        ok, verdict = pcall(json.decode, r.stdout:match('[^\n]+') or '')
      end
      if ok and type(verdict) == 'table' and type(verdict.passed) == 'table' then
        if verdict.compile ~= 'ok' then stats.compile_errors = stats.compile_errors + 1 end
        local n, passed = #verdict.passed, 0
        for j, p in ipairs(verdict.passed) do
          if p then passed = passed + 1 end
          if verdict.reasons[j] == 'timeout' then stats.timeouts = stats.timeouts + 1 end
        end
        local total = math.max(n, n_cases[k])
        stats.cases, stats.cases_passed = stats.cases + total, stats.cases_passed + passed
        scores[i] = opts.partial and passed / total or (passed == total and total > 0 and 1 or 0)
        if passed == total and total > 0 then stats.pass_rate = stats.pass_rate + 1 end
      end
    end
    stats.pass_rate = #samples > 0 and stats.pass_rate / #samples or 0
    stats.seconds = moonrl.now() - t0
    return scores, stats
  end
end

M.reward = M.new()
rewards.register('code', M.reward, { builtin = true, batch = true })

return M
