-- The calculator tool: arithmetic over numbers, evaluated by its own parser (nothing of the
-- expression ever reaches Lua's load or a shell): + - * / // % ** (right-associative), unary
-- minus and plus, parentheses, decimals and exponents (1.5e3). Integers stay exact up to 2^53
-- and print without a decimal point; a division by zero, a result that is not finite, a bad
-- token or an expression past 1,000 characters is an error the caller turns into an observation.
--
--   require('tools.calculator').evaluate('1234 * 5678')   --> 7006652
--   tool 'calculator', arguments { expression = '(3 + 4) ** 2' }  --> '49'
local tools = require('moonrl.tools')

local M = {}

local function fail(msg) error({ calc = msg }, 0) end

function M.evaluate(text)
  if type(text) ~= 'string' then fail('the expression must be a string') end
  if #text > 1000 then fail('an expression past 1000 characters') end
  local toks, i = {}, 1
  while i <= #text do
    local c = text:sub(i, i)
    if c:match('%s') then i = i + 1
    else
      local num = text:match('^%d+%.?%d*[eE][%+%-]?%d+', i) or text:match('^%d+%.?%d*', i) or text:match('^%.%d+', i)
      if num then toks[#toks + 1] = { n = tonumber(num) }; i = i + #num
      elseif text:sub(i, i + 1) == '**' or text:sub(i, i + 1) == '//' then toks[#toks + 1] = { op = text:sub(i, i + 1) }; i = i + 2
      elseif c:match('[%+%-%*/%%%(%)%^]') then toks[#toks + 1] = { op = c == '^' and '**' or c }; i = i + 1
      else fail(string.format("unexpected '%s' at %d", c, i)) end
    end
  end
  local pos = 1
  local function peek() return toks[pos] end
  local expr
  local function atom()
    local t = peek()
    if not t then fail('the expression ends too soon') end
    if t.n then pos = pos + 1; return t.n end
    if t.op == '(' then
      pos = pos + 1
      local v = expr()
      if not (peek() and peek().op == ')') then fail("a '(' without its ')'") end
      pos = pos + 1
      return v
    end
    if t.op == '-' or t.op == '+' then
      pos = pos + 1
      local v = M._unary()
      return t.op == '-' and -v or v
    end
    fail(string.format("unexpected '%s'", t.op))
  end
  local function power()
    local base = atom()
    if peek() and peek().op == '**' then
      pos = pos + 1
      return base ^ M._unary() -- (right-associative, binding tighter than a unary minus on its left)
    end
    return base
  end
  M._unary = function()
    local t = peek()
    if t and (t.op == '-' or t.op == '+') then
      pos = pos + 1
      local v = M._unary()
      return t.op == '-' and -v or v
    end
    return power()
  end
  local function term()
    local v = M._unary()
    while peek() and (peek().op == '*' or peek().op == '/' or peek().op == '//' or peek().op == '%') do
      local op = peek().op
      pos = pos + 1
      local r = M._unary()
      if op == '*' then v = v * r
      elseif r == 0 then fail('division by zero')
      elseif op == '/' then v = v / r
      elseif op == '//' then v = math.floor(v / r)
      else v = v - math.floor(v / r) * r end
    end
    return v
  end
  expr = function()
    local v = term()
    while peek() and (peek().op == '+' or peek().op == '-') do
      local op = peek().op
      pos = pos + 1
      local r = term()
      v = op == '+' and v + r or v - r
    end
    return v
  end
  if #toks == 0 then fail('an empty expression') end
  local v = expr()
  if pos <= #toks then fail(string.format("unexpected '%s'", toks[pos].op or tostring(toks[pos].n))) end
  if v ~= v or v == math.huge or v == -math.huge then fail('the result is not a finite number') end
  return v
end

-- the text of a value: an integer without a decimal point, else 15 significant digits
function M.format(v)
  if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return string.format('%d', v) end
  return string.format('%.15g', v)
end

M.tool = {
  description = 'Evaluate an arithmetic expression (+ - * / // % ** and parentheses) and return its value.',
  parameters = { type = 'object', properties = { expression = { type = 'string', description = 'e.g. "1234 * 5678"' } },
    required = { 'expression' } },
  call = function(args)
    local ok, v = pcall(M.evaluate, args.expression)
    if not ok then error(type(v) == 'table' and v.calc or tostring(v), 0) end
    return M.format(v)
  end,
}

tools.register('calculator', M.tool, { doc = 'arithmetic over numbers, by its own parser' })

return M
