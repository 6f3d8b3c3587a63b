-- Countdown / arithmetic verifier: the answer is an expression that uses exactly the given numbers
-- (each once), only + - * / and parentheses, and evaluates to the target.
--
--   local c = require('rewards.countdown')
--   c.reward{ response = '<answer>(25 - 5) * 3</answer>', meta = { numbers = { 3, 5, 25 }, target = 60 } }  --> 1
--   c.evaluate('(25 - 5) * 3')     --> 60, {25, 5, 3}      (or nil, reason)
--
-- The sample gives the numbers as sample.meta.numbers (a list) and the target as sample.meta.target
-- (or sample.answer). The expression is the content of the last <answer>...</answer> (or the whole
-- response when opts.require_tag is false); a trailing "= value" is dropped (the left side counts).
-- The text is parsed by a small recursive-descent parser — it is never given to load(): anything
-- but digits, + - * / ( ) and spaces is rejected, as are division by zero, unary signs (unless
-- opts.unary_minus), nesting deeper than 64 and expressions longer than opts.max_chars (256).
-- Scores: opts.correct_score (1); opts.format_score (0.1, TinyZero) when an expression was given but
-- is invalid or wrong; 0 when there is none. Equality: |value − target| <= 1e-6.
local rewards = require('moonrl.rewards')
local math_reward = require('rewards.math')

local M = {}

local MAX_DEPTH = 64

-- Tokens: numbers (digits, optional decimal part) and single-character operators.
local function tokenize(s)
  local toks, i, n = {}, 1, #s
  while i <= n do
    local c = s:sub(i, i)
    if c:match('%s') then
      i = i + 1
    elseif c:match('%d') then
      local num = s:match('^%d+%.?%d*', i)
      toks[#toks + 1] = { kind = 'num', value = tonumber(num), text = num }
      i = i + #num
    elseif c == '+' or c == '-' or c == '*' or c == '/' or c == '(' or c == ')' then
      toks[#toks + 1] = { kind = c }
      i = i + 1
    else
      return nil, string.format("character %q at position %d is not allowed", c, i)
    end
  end
  return toks
end

-- Evaluate an expression text. Returns value, numbers used (in order); or nil, reason.
function M.evaluate(text, opts)
  opts = opts or {}
  local max_chars = opts.max_chars or 256
  if type(text) ~= 'string' then return nil, 'not a string' end
  if #text > max_chars then return nil, string.format('expression longer than %d characters', max_chars) end
  local toks, err = tokenize(text)
  if not toks then return nil, err end
  if #toks == 0 then return nil, 'empty expression' end
  local pos, used = 1, {}
  local unary = opts.unary_minus == true
  local expr -- forward declaration

  local function fail(msg) error({ reason = msg }, 0) end
  local function peek() return toks[pos] and toks[pos].kind end

  local function factor(depth)
    if depth > MAX_DEPTH then fail('nested too deeply') end
    local tk = toks[pos]
    if not tk then fail('expression ends early') end
    if tk.kind == 'num' then
      pos = pos + 1
      used[#used + 1] = tk.value
      return tk.value
    elseif tk.kind == '(' then
      pos = pos + 1
      local v = expr(depth + 1)
      if peek() ~= ')' then fail("missing ')'") end
      pos = pos + 1
      return v
    elseif tk.kind == '-' and unary then
      pos = pos + 1
      return -factor(depth + 1)
    end
    fail(string.format("unexpected '%s'", tk.kind))
  end

  local function term(depth)
    local v = factor(depth)
    while peek() == '*' or peek() == '/' do
      local op = peek()
      pos = pos + 1
      local r = factor(depth)
      if op == '*' then
        v = v * r
      else
        if r == 0 then fail('division by zero') end
        v = v / r
      end
    end
    return v
  end

  function expr(depth)
    local v = term(depth)
    while peek() == '+' or peek() == '-' do
      local op = peek()
      pos = pos + 1
      local r = term(depth)
      v = op == '+' and v + r or v - r
    end
    return v
  end

  local ok, v = pcall(expr, 0)
  if not ok then
    if type(v) == 'table' then return nil, v.reason end
    error(v, 0)
  end
  if pos <= #toks then return nil, string.format("unexpected '%s' after the expression", toks[pos].kind) end
  if v ~= v or v == math.huge or v == -math.huge then return nil, 'not a finite value' end
  return v, used
end

-- The same multiset of numbers?
local function same_numbers(used, given)
  if #used ~= #given then return false end
  local a, b = {}, {}
  for i, x in ipairs(used) do a[i] = x end
  for i, x in ipairs(given) do b[i] = tonumber(x) end
  table.sort(a)
  table.sort(b)
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end

-- Check a full response: returns score-kind ('correct', 'wrong', 'none') and a reason.
function M.check(response, numbers, target, opts)
  opts = opts or {}
  local text = math_reward.extract_tag(response, 'answer')
  if not text and opts.require_tag == false then text = response end
  if not text or not text:find('%S') then return 'none', 'no <answer>' end
  local eq = text:find('=', 1, true)
  if eq and opts.allow_equals ~= false then text = text:sub(1, eq - 1) end
  local v, used = M.evaluate(text, opts)
  if not v then return 'wrong', used end
  if not same_numbers(used, numbers) then return 'wrong', 'does not use exactly the given numbers' end
  if math.abs(v - target) > 1e-6 then return 'wrong', string.format('evaluates to %.10g, not %.10g', v, target) end
  return 'correct'
end

function M.new(opts)
  opts = opts or {}
  local scores = { correct = opts.correct_score or 1, wrong = opts.format_score or 0.1, none = 0 }
  return function(sample)
    local response = rewards.response_of(sample, 'reward countdown')
    local meta = sample.meta or {}
    local numbers = meta.numbers or meta.nums
    local target = tonumber(meta.target or sample.answer)
    if type(numbers) ~= 'table' or not target then
      error('reward countdown: the sample needs meta.numbers (a list) and meta.target (or answer)', 2)
    end
    return scores[(M.check(response, numbers, target, opts))]
  end
end

M.reward = M.new()
-- loaded (by moonrl.rewards.get through moonrl.registry.plugin, or a require), it registers its built-in reward
rewards.register('countdown', M.reward, { builtin = true })

return M
