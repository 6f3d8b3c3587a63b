-- reward=code (plugins/rewards/code.lua) and data.task=code: known-good and known-bad programs of
-- each format get the expected verdicts (stdin/stdout in Python and C, assertions, HumanEval's
-- check(candidate), a syntax error, a compile error, a loop past its time, no code block, programs
-- that try to fake a pass or change their tests); the same programs get the same verdicts from the
-- driver run outside the sandbox (the sandbox adds no false failure); the bundled task's reference
-- solutions pass and wrong ones fail; GRPO with reward=code on the task runs end to end with the
-- sandbox's metrics in its records. Skipped (77) without namespaces.
local t = require('moonrl.testing')
local rewards = require('moonrl.rewards')
local code = require('rewards.code')
local sandbox = require('moonrl.sandbox')
local json = require('moonrl.io.json')
local fs = require('moonrl.io.fs')
local proc = require('moonrl.io.proc')

if not sandbox.probe().namespaces then
  print('skip: no namespaces here')
  os.exit(77)
end

local IO = { inputs = { '1 2\n', '5 7\n' }, outputs = { '3\n', '12' } }
local ASSERTS = { 'assert f(1) == 2', 'assert f(3) == 6' }
local function py(src) return 'Here it is:\n```python\n' .. src .. '```\nDone.' end

-- { name, response, tests, score, partial score }
local CASES = {
  { 'stdio, right', py('a, b = map(int, input().split())\nprint(a + b)\n'), IO, 1, 1 },
  { 'stdio, wrong on one case', py('a, b = map(int, input().split())\nprint(3)\n'), IO, 0, 0.5 },
  { 'stdio, trailing spaces and blank lines are fine', py('a, b = map(int, input().split())\nprint(a + b, "  ")\nprint()\n'), IO, 1, 1 },
  { 'assert, right', py('def f(x):\n    return 2 * x\n'), ASSERTS, 1, 1 },
  { 'assert, wrong', py('def f(x):\n    return x + 1\n'), ASSERTS, 0, 0.5 },
  { 'humaneval check(candidate)', py('def add(a, b):\n    return a + b\n'),
    { tests = 'def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n', entry_point = 'add' }, 1, 1 },
  { 'the last block is the program', '```python\nprint(0)\n```\nbetter:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```', IO, 1, 1 },
  { 'a block without language is Python', '```\ndef f(x): return 2 * x\n```', ASSERTS, 1, 1 },
  { 'C, right', '```c\n#include <stdio.h>\nint main(void) { int a, b; scanf("%d %d", &a, &b); printf("%d\\n", a + b); return 0; }\n```', IO, 1, 1 },
  { 'C, compile error', '```c\nint main(void) { return x; }\n```', IO, 0, 0 },
  { 'a syntax error', py('def f(x) return x\n'), ASSERTS, 0, 0 },
  { 'a loop past its time', py('while True:\n    pass\n'), IO, 0, 0 },
  { 'no code block', 'the answer is 3', IO, 0, 0 },
  { 'an unsupported language', '```rust\nfn main() {}\n```', IO, 0, 0 },
  { 'exit 0 before answering (stdio)', py('import os\nos._exit(0)\n'), IO, 0, 0 },
  { 'writing the expected output file', py('open("/box/cases.json", "w").write("{}")\n'), IO, 0, 0 },
  { 'killing the driver', py('import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n'), IO, 0, 0 },
  { 'reading the driver through /proc', py('import os\nprint(open("/proc/%d/cmdline" % os.getppid()).read())\n' ..
    'print(os.listdir("/proc/%d/fd" % os.getppid()))\n'), IO, 0, 0 },
}

local function samples_of(cases)
  local s = {}
  for i, c in ipairs(cases) do s[i] = { prompt = c[1], response = c[2], answer = c[3] } end
  return s
end

t.test('known-good and known-bad programs of every format: the expected verdicts, all or nothing and partial', function()
  local samples = samples_of(CASES)
  local scores, _, failures, stats = rewards.score_batch('code', samples)
  t.eq(#failures, 0)
  local partial = code.new({ partial = true })(samples)
  for i, c in ipairs(CASES) do
    t.eq(scores[i - 1], c[4], c[1])
    t.near(partial[i], c[5], 1e-12, c[1] .. ' (partial)')
  end
  print('  ' .. json.encode(stats, { sort_keys = true }))
  t.eq(stats.executions, #CASES - 2) -- (no code block, rust)
  t.eq(stats.no_code, 2)
  t.eq(stats.compile_errors, 2) -- (the C one and the syntax error)
  t.truthy(stats.timeouts >= 1 and stats.sandbox_errors == 0 and stats.seconds > 0, 'timeouts and seconds counted')
end)

-- the driver outside the sandbox (python3 driver.py DIR) on a program and its tests: the verdict
local function unsandboxed(src, lang, tests)
  local dir = os.tmpname()
  os.remove(dir)
  fs.mkdirs(dir)
  fs.copy('plugins/rewards/code_driver.py', dir .. '/driver.py')
  fs.write(dir .. '/' .. (lang == 'c' and 'solution.c' or 'solution.py'), src)
  fs.write(dir .. '/cases.json', json.encode({ mode = tests.mode, cases = tests.cases, timeout_s = 2 }))
  local r = proc.run({ '/usr/bin/python3', dir .. '/driver.py', dir }, { timeout = 60 })
  proc.run({ 'rm', '-rf', dir })
  return json.decode(r.stdout:match('[^\n]+') or 'null')
end

t.test('the sandbox adds no false failure: the good programs\' verdicts are the driver\'s outside it', function()
  for _, c in ipairs(CASES) do
    if c[4] == 1 then
      local src, lang = code.extract(c[2])
      local tests = code.tests_of({ answer = c[3] })
      local outside = unsandboxed(src, lang, tests)
      t.truthy(outside and #outside.passed == #tests.cases, c[1] .. ': the driver ran outside')
      for j = 1, #tests.cases do t.eq(outside.passed[j], true, c[1] .. ' case ' .. j .. ' outside the sandbox') end
    end
  end
end)

t.test('data.task=code: the reference solutions pass in the sandbox, wrong programs fail', function()
  local task = require('moonrl.tasks').load('code', 3)
  t.eq(#task.train, 1500)
  t.eq(#task.heldout, 100)
  local samples = {}
  for i = 1, 24 do samples[i] = { prompt = task.heldout[i].prompt, response = task.heldout[i].answer, meta = task.heldout[i].meta } end
  for i = 25, 32 do samples[i] = { prompt = task.heldout[i].prompt, response = py('print(12345)\n'), meta = task.heldout[i].meta } end
  local scores = rewards.score_batch('code', samples)
  for i = 1, 32 do t.eq(scores[i - 1], i <= 24 and 1 or 0, samples[i].prompt) end
end)

t.test('the sandbox.* keys: read when a batch is scored (partial credit, a sandbox a run); a bad network is a usage error naming it', function()
  local config = require('moonrl.config')
  local saved = config.current
  config.current = { sandbox = { partial = true, pool = false, case_timeout_s = 1, memory_mb = 256 } }
  local ok, scores, stats = pcall(code.reward, samples_of({ CASES[2], CASES[12] }))
  config.current = saved
  t.truthy(ok, tostring(scores))
  t.eq(scores[1], 0.5, 'partial credit from sandbox.partial')
  t.eq(scores[2], 0)
  t.truthy(stats.timeouts >= 1, 'sandbox.case_timeout_s')
  local exe = assert(rawget(_G, 'MOONRL_EXE'), 'needs the moonrl executable')
  local r = proc.run({ exe, 'run', 'grpo', 'model.dir=/nonexistent', 'data.task=code', 'reward=code', 'sandbox.network=host' },
    { timeout = 60 })
  t.eq(r.exit_status, 2)
  t.truthy((r.stderr .. r.stdout):find("config key 'sandbox.network' must be one of none, loopback, got 'host'", 1, true),
    r.stderr)
end)

t.test('bad tests are an error naming them', function()
  t.raises(function() code.tests_of({ answer = 42 }) end, 'the sample has no tests')
  t.raises(function() code.tests_of({ answer = { inputs = { 'a' }, outputs = {} } }) end, 'inputs and outputs of the same length')
  t.raises(function() code.tests_of({ answer = { foo = 1 } }) end, 'tests of an unknown shape')
end)

t.test('grpo with reward=code on data.task=code: end to end, the sandbox\'s numbers in the records', function()
  local exe = assert(rawget(_G, 'MOONRL_EXE'), 'needs the moonrl executable')
  local dir = os.tmpname()
  os.remove(dir)
  fs.mkdirs(dir .. '/tok')
  -- a byte-level tokenizer (any text) and a tiny model over it
  fs.copy('tests/fuzz/corpus/tokenizer/gen-gpt2_bytelevel.json', dir .. '/tok/tokenizer.json')
  fs.write(dir .. '/tok/tokenizer_config.json', json.encode({ tokenizer_class = 'PreTrainedTokenizerFast',
    eos_token = '<|endoftext|>', bos_token = '<|endoftext|>' }))
  local tiny = dofile('tests/lib/models.lua')
  require('moonrl.train.models').save({ dir = dir }, tiny.model('digits', { vocab_size = 1000, max_position_embeddings = 512,
    bos_token_id = 0, eos_token_id = 0 }), dir .. '/tok', dir .. '/model')
  local r = proc.run({ exe, 'run', 'grpo', 'model.dir=' .. dir .. '/model', 'data.task=code', 'reward=code', 'data.chat=false',
    'grpo.prompts=2', 'grpo.samples=2', 'grpo.max_tokens=8', 'grpo.steps=2', 'run.threads=1', 'run.dir=' .. dir .. '/run' },
    { timeout = 300 })
  t.truthy(r.ok, r.stdout .. r.stderr)
  local recs = {}
  for line in (fs.read(dir .. '/run/metrics.jsonl') or ''):gmatch('[^\n]+') do recs[#recs + 1] = json.decode(line) end
  t.eq(#recs, 2)
  t.truthy(recs[1]['reward/code/no_code'] ~= nil and recs[1]['reward/code/seconds'] ~= nil,
    'the reward\'s metrics recorded: ' .. json.encode(recs[1]))
  proc.run({ 'rm', '-rf', dir })
end)

t.done()
