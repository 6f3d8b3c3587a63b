-- The reward registry and the built-in reward plugins (plugins/rewards/): math answers, format,
-- countdown, combined — with malformed, tricky and hostile inputs.
local t = require('moonrl.testing')
local rewards = require('moonrl.rewards')
local m = require('rewards.math')
local format = require('rewards.format')
local countdown = require('rewards.countdown')

local function math_score(response, answer, fn)
  return (fn or m.reward)({ prompt = 'q', response = response, answer = answer })
end

-- ---------------------------------------------------------------- registry

t.test('registry: built-ins, register, unknown names', function()
  t.eq(rewards.get('math'), m.reward)
  t.eq(rewards.get('countdown'), countdown.reward)
  local fn = function(s) return #s.response end
  rewards.register('length', fn)
  t.eq(rewards.get('length'), fn)
  t.raises(function() rewards.register('length', fn) end, "reward 'length' is already registered")
  rewards.register('length', function() return 0 end, { replace = true })
  t.eq(rewards.get('length')({ response = 'abc' }), 0)
  t.raises(function() rewards.register('', fn) end, 'name must be a non-empty string')
  t.raises(function() rewards.register('x', 42) end, "reward 'x' must be a function, got number")
  local msg = t.raises(function() rewards.get('maht') end, "unknown reward 'maht' (known: ")
  for _, name in ipairs({ 'countdown', 'format', 'gsm8k', 'length', 'math' }) do
    t.truthy(msg:find(name, 1, true), 'lists ' .. name)
  end
end)

t.test('registry: score_batch and combine', function()
  local samples = {
    { response = '<think>x</think><answer>\\boxed{2}</answer>', answer = '2' },
    { response = '\\boxed{3}', answer = '2' },
    { response = '<think>y</think> <answer>2</answer>', answer = '2' },
  }
  local scores, mean = rewards.score_batch('math', samples)
  t.eq(scores[0], 1)
  t.eq(scores[1], 0)
  t.eq(scores[2], 1)   -- the <answer> content when there is no box
  t.near(mean, 2 / 3, 1e-12)
  local both = require('rewards.combined').new({ { reward = 'math', weight = 1 }, { reward = 'format', weight = 0.5 } })
  local total, parts = both(samples[1])
  t.eq(total, 1.5)
  t.eq(parts.math, 1)
  t.eq(parts.format, 1)
  t.eq((both(samples[2])), 0)
  t.raises(function() rewards.combine({ { reward = 'nope' } }) end, "unknown reward 'nope'")
  t.raises(function() rewards.combine({}) end, 'non-empty list')
  rewards.register('broken', function() return 0 / 0 end)
  t.raises(function() rewards.score_batch('broken', samples) end, "reward 'broken' returned nan for sample 1")
  t.raises(function() rewards.score_batch('math', { { response = 7, answer = '1' } }) end,
    "reward 'math' failed on sample 1: reward math: sample.response must be a string, got number")
end)

-- ---------------------------------------------------------------- math: extraction

t.test('math: boxed extraction', function()
  local cases = {
    { 'the answer is \\boxed{42}.', '42' },
    { '\\boxed{\\frac{1}{2}}', '\\frac{1}{2}' },                     -- nested braces
    { '\\boxed{\\sqrt{\\frac{a}{b}} + {c}}', '\\sqrt{\\frac{a}{b}} + {c}' },
    { 'first \\boxed{1}, then \\boxed{2}', '2' },                       -- last box wins
    { 'first \\boxed{1}, then \\boxed{2', '1' },                        -- an unclosed box is not an answer
    { '\\boxed{12', nil },
    { '\\boxed{}', nil },                                               -- empty
    { '\\boxed {7}', '7' },                                             -- space before the brace
    { '$\\boxed 5$', '5' },                                             -- \boxed 5 form
    { '\\fbox{9}', '9' },
    { '\\boxedfoo{3}', nil },                                           -- another macro
    { '\\boxed{a}}}} \\boxed{{b}', 'a' },                               -- stray braces, last one unclosed
    { '}{}{ \\boxed{x} }}', 'x' },
    { '\\boxed{\\boxed{5}}', '5' },
    { 'no answer here', nil },
    { '#### 72', '72' },                                                -- GSM8K
    { 'work\n#### 1,234\nmore text', '1,234' },
    { '#### 1\n#### 2', '2' },
    { '####', nil },
    { '<answer> 8 </answer>', '8' },
    { '\\boxed{3} #### 4', '3' },                                       -- a box beats ####
  }
  for _, c in ipairs(cases) do t.eq(m.extract(c[1]), c[2], c[1]) end
end)

t.test('math: numbers', function()
  local cases = {
    { '1000', 1000 }, { '1,000', 1000 }, { '1,234,567.5', 1234567.5 }, { '-3', -3 }, { '+3', 3 },
    { '−7', -7 }, { '0.5', 0.5 }, { '.5', 0.5 }, { '-.25', -0.25 }, { '5.', 5 }, { '1e3', 1000 },
    { '1/2', 0.5 }, { '-3/4', -0.75 }, { '\\frac{1}{2}', 0.5 }, { '\\dfrac{3}{4}', 0.75 },
    { '\\tfrac{-1}{2}', -0.5 }, { '-\\frac{1}{4}', -0.25 }, { '\\frac12', 0.5 }, { '2\\frac{1}{2}', 2.5 },
    { '$5$', 5 }, { '\\$1,000.50', 1000.5 }, { '50\\%', 50 }, { '50%', 50 }, { '18 eggs', 18 },
    { '5 \\text{ cm}', 5 }, { '\\text{12}', 12 }, { '{{5}}', 5 }, { '90^\\circ', 90 }, { '\\left( 3 \\right)', nil },
    { '1,00', nil }, { '12,34', nil }, { '1000,000', nil }, { '1/0', nil }, { '\\frac{1}{0}', nil },
    { '2x', nil }, { '2 x', nil }, { 'abc', nil }, { '', nil }, { '--3', nil }, { '1.2.3', nil }, { '(1, 2)', nil },
  }
  for _, c in ipairs(cases) do
    local v = m.parse_number(c[1])
    if c[2] == nil then t.eq(v, nil, c[1]) else t.near(v, c[2], 1e-12, c[1]) end
  end
end)

t.test('math: reward compares by value', function()
  local yes = {
    { '\\boxed{1000}', '1,000' }, { '\\boxed{1,000}', '1000' }, { '\\boxed{0.5}', '1/2' },
    { '\\boxed{\\frac{1}{2}}', '0.5' }, { '\\boxed{-\\frac{2}{4}}', '-0.5' }, { '\\boxed{2.50}', '2.5' },
    { '\\boxed{\\$18}', '18' }, { 'so #### 72', '72' }, { '\\boxed{72}', 'Natalia ... <<48/2=24>> 48+24 = 72\n#### 72' },
    { '\\boxed{0.3333333333}', '1/3' }, { '\\boxed{x + 1}', 'x+1' }, { '\\boxed{\\text{(A)}}', '(A)' },
    { '\\boxed{-3}', -3 },   -- a numeric answer field
  }
  for _, c in ipairs(yes) do t.eq(math_score(c[1], c[2]), 1, c[1] .. ' vs ' .. tostring(c[2])) end
  local no = {
    { '\\boxed{-3}', '3' }, { '\\boxed{0.5}', '5' }, { '\\boxed{0.334}', '1/3' }, { '\\boxed{12', '12' },
    { 'the answer is 12', '12' }, { '\\boxed{50\\%}', '0.5' }, { '\\boxed{2x}', '2' }, { '\\boxed{}', '0' },
    { '\\boxed{1}\\boxed{2}', '1' },
  }
  for _, c in ipairs(no) do t.eq(math_score(c[1], c[2]), 0, c[1] .. ' vs ' .. tostring(c[2])) end
  -- percentages as fractions when asked
  local pct = m.new({ percent = true })
  t.eq(math_score('\\boxed{50\\%}', '0.5', pct), 1)
  t.eq(math_score('\\boxed{0.5}', '50%', pct), 1)
  t.eq(math_score('\\boxed{50\\%}', '50', pct), 1)
  -- tolerance and scores
  local loose = m.new({ tolerance = 1e-2, no_answer_score = -1, wrong_score = -0.5 })
  t.eq(math_score('\\boxed{0.334}', '1/3', loose), 1)
  t.eq(math_score('nothing', '1', loose), -1)
  t.eq(math_score('\\boxed{7}', '1', loose), -0.5)
  t.raises(function() math_score('\\boxed{1}', nil) end, 'sample.answer is missing')
end)

t.test('math: hostile inputs stay fast and safe', function()
  local many = string.rep('\\boxed{', 20000)            -- 20000 unclosed boxes: one linear pass
  t.eq(m.extract(many), nil)
  t.eq(m.extract(many .. '\\boxed{5}'), '5')
  local deep = string.rep('{', 5000) .. '1' .. string.rep('}', 5000)
  t.eq(m.extract('\\boxed' .. deep), deep:sub(2, -2))
  t.eq(m.clean(deep), '1')
  t.eq(m.clean('{ {5} }'), '5')
  t.eq(m.clean('{1}+{2}'), '{1}+{2}')
  local huge = string.rep('{', 200000) .. '7' .. string.rep('}', 200000)
  t.eq(m.extract('\\boxed' .. huge .. ' '), huge:sub(2, -2))
  t.eq(math_score('\\boxed' .. huge, '7'), 0)                    -- too long to be a number
  t.eq(m.parse_number(string.rep('1 a', 100000)), nil)
  t.eq(math_score('\\boxed{os.exit(1)}', '1'), 0)
  t.eq(math_score('\\boxed{' .. string.rep('9', 400) .. '}', '1'), 0)    -- overflows to inf: not equal
end)

-- ---------------------------------------------------------------- format

t.test('format reward', function()
  local ok = {
    '<think>reasoning</think><answer>42</answer>',
    '<think>\nmulti\nline\n</think>\n\n<answer>\\boxed{1}</answer>\n',
    '  <think>a</think> <answer>b</answer>  ',
  }
  for _, r in ipairs(ok) do t.eq(format.reward({ response = r }), 1, r) end
  local bad = {
    '<answer>42</answer><think>r</think>',                       -- order
    '<think>r</think>',                                           -- missing tag
    '<think>r</think><answer>1</answer><answer>2</answer>',       -- twice
    '<think>r<answer>1</answer></think>',                         -- nested
    '<think>r</think><answer>42',                                 -- unclosed
    '<think></think><answer>42</answer>',                         -- empty
    'hello <think>r</think><answer>1</answer>',                   -- text before
    '<think>r</think><answer>1</answer> bye',                     -- text after
    '</think>r<think><answer>1</answer>',                         -- closed before opened
    '<think>r</think><answer> </answer>',
    '',
  }
  for _, r in ipairs(bad) do t.eq(format.reward({ response = r }), 0, r) end
  -- configurable
  local loose = format.new({ strict = false, tags = { 'answer' }, score = 0.2 })
  t.eq(loose({ response = 'I think <answer>1</answer>. Done' }), 0.2)
  local prefilled = format.new({ prefix = '<think>' })
  t.eq(prefilled({ response = 'reasoning</think><answer>1</answer>' }), 1)
  local ok2, why = format.check('<think>r</think><answer>1</answer> bye')
  t.eq(ok2, false)
  t.eq(why, 'text after the last tag')
end)

-- ---------------------------------------------------------------- countdown

t.test('countdown: evaluator', function()
  local v, used = countdown.evaluate('(25 - 5) * 3')
  t.eq(v, 60)
  t.eq(table.concat(used, ','), '25,5,3')
  t.near(countdown.evaluate('1 + 2 * 3 - 4 / 2'), 5, 0)             -- precedence
  t.near(countdown.evaluate('8 - 3 - 2'), 3, 0)                     -- left associative
  t.near(countdown.evaluate('8 / 4 / 2'), 1, 0)
  t.near(countdown.evaluate('((((7))))'), 7, 0)
  local bad = {
    { '6 / (3 - 3)', 'division by zero' },
    { '1 / 0', 'division by zero' },
    { '-3 + 5', "unexpected '-'" },
    { '+3', "unexpected '+'" },
    { '2 ** 3', "unexpected '*'" },
    { '2 ^ 3', 'is not allowed' },
    { '(1 + 2', "missing ')'" },
    { '1 + 2)', "unexpected ')' after the expression" },
    { '1 2', "unexpected 'num' after the expression" },
    { '', 'empty expression' },
    { 'os.exit(1)', 'is not allowed' },
    { "__import__('os').system('ls')", 'is not allowed' },
    { '1; os.execute("rm -rf /")', 'is not allowed' },
    { '2 + 3 -- comment', 'is not allowed' },
    { '2 + 3 - - 1', "unexpected '-'" },
    { 'math.huge', 'is not allowed' },
    { '1e5', 'is not allowed' },
    { '0x10', 'is not allowed' },
    { string.rep('(', 150) .. '1' .. string.rep(')', 150), 'longer than 256' },
  }
  for _, c in ipairs(bad) do
    local val, why = countdown.evaluate(c[1])
    t.eq(val, nil, c[1])
    t.truthy(why and why:find(c[2], 1, true), c[1] .. ': ' .. tostring(why))
  end
  local _, why = countdown.evaluate(string.rep('(', 100) .. '1' .. string.rep(')', 100), { max_chars = 1000 })
  t.eq(why, 'nested too deeply')
  t.near(countdown.evaluate('-3 + 5', { unary_minus = true }), 2, 0)
end)

t.test('countdown: reward', function()
  local meta = { numbers = { 3, 5, 25 }, target = 60 }
  local function score(resp, mt, fn) return (fn or countdown.reward)({ response = resp, meta = mt or meta }) end
  t.eq(score('<think>..</think><answer>(25 - 5) * 3</answer>'), 1)
  t.eq(score('<answer>3 * (25 - 5) = 60</answer>'), 1)                  -- "= target" allowed
  t.eq(score('<answer>25 * 3 - 5</answer>'), 0.1)                       -- wrong value: format score
  t.eq(score('<answer>(25 - 5) * 3 * 1</answer>'), 0.1)                 -- a number not given
  t.eq(score('<answer>(25 - 5) * 3 + 5 - 5</answer>'), 0.1)             -- 5 used three times
  t.eq(score('<answer>25 * 3 - 15</answer>', { numbers = { 25, 3, 15, 15 }, target = 60 }), 0.1) -- not all used
  t.eq(score('<answer>60</answer>', { numbers = { 60 }, target = 60 }), 1)
  t.eq(score('<answer>(25 - 5) * 3</answer><answer>1</answer>'), 0.1)   -- last answer counts
  t.eq(score('(25 - 5) * 3'), 0)                                        -- no tag
  t.eq(score('(25 - 5) * 3', nil, countdown.new({ require_tag = false })), 1)
  t.eq(score('<answer>3 / (5 - 5) * 25</answer>'), 0.1)                 -- division by zero
  t.eq(score('<answer>os.exit()</answer>'), 0.1)
  t.eq(score('<answer>1 / 3 * 3</answer>', { numbers = { 1, 3, 3 }, target = 1 }), 1) -- rational arithmetic
  t.eq(score('<answer>(6 / 4) * 2</answer>', { numbers = { '6', '4', '2' }, target = '3' }), 1)
  t.eq(countdown.new({ format_score = 0 })({ response = '<answer>1+1</answer>', meta = meta }), 0)
  t.raises(function() countdown.reward({ response = 'x', meta = {} }) end, 'needs meta.numbers')
end)

t.done()
