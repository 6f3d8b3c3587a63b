-- moonrl.tasks: prompt sets built in code, used instead of a JSONL file (`data.task=addition`)
-- by every recipe (SFT trains on the answers, DPO prefers them to the rejected ones); their
-- held-out split is what `eval.every` measures by default.
--
--   local tasks = require('moonrl.tasks')
--   tasks.register('parity', function(o)           -- o = { seed = run.seed, cfg = the config }
--     local train, heldout = {}, {}
--     ...                                           -- records { prompt = '1011', answer = '1' }
--     return { train = train, heldout = heldout }
--   end, 'the parity of a bit string')
--   local t = tasks.load('addition', 1)            -- { train, heldout }, built once per seed
--
-- A record is { prompt = text, answer = text, meta = table|nil }: what a reward reads (and, for
-- preference recipes, rejected = text: an answer worse than answer). The
-- registry is a moonrl.registry (register(name, fn, doc), get, check, names, doc).
-- Built in:
--   addition   the default example's task: every "a+b=" with a, b < 100 (10,000 problems), its
--              200 held out chosen by the seed (examples/default.lua builds its problems with
--              it); the answer is the sum ("85"), judged by the 'exact' reward. Called directly,
--              o.rng (a moonrl.rng generator, e.g. a session's S:rng) shuffles in place of
--              a fresh one from o.seed, and o.heldout (200) sets how many are held out. Each
--              record also has rejected, the answer with the default example's flaw ("85="),
--              for preference recipes (`moonrl run dpo data.task=addition`).
--   code       short Python programs with their tests (below), for reward=code.
--   guess      secret numbers for the number game of env=guess.
local M = require('moonrl.registry').new('task')

M.register('addition', function(o)
  local rng = o.rng or require('moonrl.rng').new(o.seed or 1) -- the default example's draw generator
  local n_heldout = o.heldout or 200
  local problems = {}
  for a = 0, 99 do
    for b = 0, 99 do problems[#problems + 1] = { a = a, b = b } end
  end
  require('moonrl.rng').shuffle(problems, rng)
  local train, heldout = {}, {}
  for i, p in ipairs(problems) do
    local sum = tostring(p.a + p.b)
    local r = { prompt = p.a .. '+' .. p.b .. '=', answer = sum, rejected = sum .. '=' }
    if i <= n_heldout then heldout[#heldout + 1] = r else train[#train + 1] = r end
  end
  return { train = train, heldout = heldout }
end, '2-digit addition "37+48=" -> "85": 10,000 problems, 200 held out (the default example\'s)')

-- code: short programs written for this project, each with its tests (meta.tests: assertions,
-- or standard input and output), judged by the 'code' reward in the sandbox; the answer is a
-- reference solution in a ```python block (what SFT trains on). Eight families of problems with
-- their constants drawn (a linear function, counting a character, clamping, sums of multiples,
-- two integers on stdin, a Fibonacci-like sequence, rotating a string, divisibility): 1,600
-- problems, o.heldout (100) held out.
local function code_problems(rng)
  local function pick(lo, hi) return lo + rng:int(hi - lo + 1) end
  local ask = '\nAnswer with the code in a ```python block.'
  local fenced = function(src) return '```python\n' .. src .. '```' end
  local families = {
    function()
      local a, b = pick(2, 9), pick(-9, 9)
      local tests = {}
      for _, x in ipairs({ 0, 1, 5, -3 }) do tests[#tests + 1] = string.format('assert f(%d) == %d', x, a * x + b) end
      local rhs = string.format('%d * x %s %d', a, b < 0 and '-' or '+', math.abs(b))
      return 'Write a Python function f(x) that returns ' .. rhs .. '.', tests,
        string.format('def f(x):\n    return %s\n', rhs)
    end,
    function()
      local c = string.char(pick(97, 122))
      local words = { 'banana', 'moonrl', 'abracadabra', 'mississippi', 'zz' .. c .. c }
      local tests = {}
      for _, w in ipairs(words) do
        local n = select(2, w:gsub(c, ''))
        tests[#tests + 1] = string.format("assert count_char('%s') == %d", w, n)
      end
      return "Write a Python function count_char(s) that returns how many times the character '" .. c ..
        "' occurs in the string s.", tests, string.format("def count_char(s):\n    return s.count('%s')\n", c)
    end,
    function()
      local lo = pick(-20, 10)
      local hi = lo + pick(1, 30)
      local tests = {}
      for _, x in ipairs({ lo - 5, lo, math.floor((lo + hi) / 2), hi, hi + 7 }) do
        tests[#tests + 1] = string.format('assert clamp(%d) == %d', x, math.max(lo, math.min(hi, x)))
      end
      return string.format('Write a Python function clamp(x) that returns x limited to the range [%d, %d].', lo, hi),
        tests, string.format('def clamp(x):\n    return max(%d, min(%d, x))\n', lo, hi)
    end,
    function()
      local k = pick(2, 9)
      local tests = {}
      for _, n in ipairs({ 0, 1, 10, 37, 100 }) do
        local sum = 0
        for m = k, n - 1, k do sum = sum + m end
        tests[#tests + 1] = string.format('assert sum_multiples(%d) == %d', n, sum)
      end
      return 'Write a Python function sum_multiples(n) that returns the sum of the positive multiples of ' .. k ..
        ' below n.', tests, string.format('def sum_multiples(n):\n    return sum(range(%d, n, %d))\n', k, k)
    end,
    function()
      local ops = { { 'sum', function(a, b) return a + b end, 'a + b' },
        { 'product', function(a, b) return a * b end, 'a * b' }, { 'difference a - b', function(a, b) return a - b end, 'a - b' },
        { 'larger one', function(a, b) return math.max(a, b) end, 'max(a, b)' } }
      local op = ops[pick(1, #ops)]
      local inputs, outputs = {}, {}
      for _ = 1, 4 do
        local a, b = pick(-50, 50), pick(-50, 50)
        inputs[#inputs + 1] = a .. ' ' .. b .. '\n'
        outputs[#outputs + 1] = op[2](a, b) .. '\n'
      end
      return 'Write a Python program that reads two integers a and b from one line of standard input and prints the ' ..
        op[1] .. '.', { inputs = inputs, outputs = outputs },
        'a, b = map(int, input().split())\nprint(' .. op[3] .. ')\n'
    end,
    function()
      local f0, f1 = pick(0, 5), pick(1, 5)
      local seq = { f0, f1 }
      for i = 3, 12 do seq[i] = seq[i - 1] + seq[i - 2] end
      local tests = {}
      for _, n in ipairs({ 0, 1, 5, 11 }) do tests[#tests + 1] = string.format('assert seq(%d) == %d', n, seq[n + 1]) end
      return string.format('Write a Python function seq(n) for the sequence with seq(0) = %d, seq(1) = %d and ' ..
        'seq(n) = seq(n - 1) + seq(n - 2).', f0, f1), tests,
        string.format('def seq(n):\n    a, b = %d, %d\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n', f0, f1)
    end,
    function()
      local k = pick(1, 4)
      local tests = {}
      for _, w in ipairs({ 'abcdef', 'moonrl', 'xy' }) do
        local r = k % #w
        tests[#tests + 1] = string.format("assert rotate('%s') == '%s'", w, w:sub(r + 1) .. w:sub(1, r))
      end
      return 'Write a Python function rotate(s) that returns the string s rotated left by ' .. k ..
        ' characters (modulo its length).', tests,
        string.format('def rotate(s):\n    k = %d %% len(s)\n    return s[k:] + s[:k]\n', k)
    end,
    function()
      local k = pick(2, 13)
      local tests = {}
      for _, n in ipairs({ 0, k, k + 1, 3 * k, 7 * k - 1 }) do
        tests[#tests + 1] = string.format('assert is_divisible(%d) == %s', n, n % k == 0 and 'True' or 'False')
      end
      return 'Write a Python function is_divisible(n) that returns True when n is divisible by ' .. k ..
        ', else False.', tests, string.format('def is_divisible(n):\n    return n %% %d == 0\n', k)
    end,
  }
  local out = {}
  for i = 1, 1600 do
    local prompt, tests, solution = families[(i - 1) % #families + 1]()
    out[i] = { prompt = prompt .. ask, answer = fenced(solution), meta = { tests = tests } }
  end
  return out
end

M.register('code', function(o)
  local rng = o.rng or require('moonrl.rng').new(o.seed or 1)
  local problems = code_problems(rng)
  require('moonrl.rng').shuffle(problems, rng)
  local n_heldout, train, heldout = o.heldout or 100, {}, {}
  for i, p in ipairs(problems) do
    if i <= n_heldout then heldout[#heldout + 1] = p else train[#train + 1] = p end
  end
  return { train = train, heldout = heldout }
end, 'short Python programs with their tests (functions and stdin/stdout), judged by reward=code in the sandbox: ' ..
  '1,600 problems, 100 held out')

-- guess: the number game of env=guess (plugins/envs/guess.lua): each record's answer is a secret
-- in 1..100, its prompt the rules; 2,000 records drawn from the seed, o.heldout (100) held out.
M.register('guess', function(o)
  local rng = o.rng or require('moonrl.rng').new(o.seed or 1)
  local n_heldout = o.heldout or 100
  local train, heldout = {}, {}
  for i = 1, 2000 do
    local r = { prompt = 'Guess my number between 1 and 100. Answer with a number.', answer = tostring(1 + rng:int(100)) }
    if i <= n_heldout then heldout[#heldout + 1] = r else train[#train + 1] = r end
  end
  return { train = train, heldout = heldout }
end, 'a secret number in 1..100 to guess with higher/lower answers (env=guess): 2,000 records, 100 held out')

local cache = {}

-- The task's records { train, heldout }, built once per (name, seed); an unknown name is an error
-- listing the tasks.
function M.load(name, seed)
  local key = tostring(name) .. '\0' .. tostring(seed)
  if not cache[key] then
    local t = M.get(name)({ seed = seed, cfg = require('moonrl.config').current })
    if type(t) ~= 'table' or type(t.train) ~= 'table' or #t.train == 0 then
      error(string.format("task '%s' must return { train = records, heldout = records } with records", name), 2)
    end
    t.heldout = t.heldout or {}
    cache[key] = t
  end
  return cache[key]
end

return M
