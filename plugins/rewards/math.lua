-- Math answers: extract the final answer of a response and compare it with the reference by value.
--
--   local m = require('rewards.math')
--   m.reward{ response = 'so \\boxed{\\frac{1}{2}}', answer = '0.5' }    --> 1
--   local strict = m.new{ tolerance = 1e-9, percent = true, no_answer_score = 0 }
--
-- Extraction (first that finds something): the LAST complete \boxed{...} (or \fbox{...}, or the
-- "\boxed 5" form), braces nested to any depth; else the text after the last GSM8K "####" marker on
-- its line; else the content of the last <answer>...</answer>. An unclosed \boxed{ is not an answer.
-- The reference answer goes through the same extraction when it contains \boxed or "####" (a GSM8K
-- solution), else it is taken whole.
--
-- Numbers (parse_number): optional sign (+, -, −), thousands commas only in groups of three
-- (1,000,000), decimals (.5, 5., 2.50), exponents (1e-3), simple fractions a/b, \frac{a}{b},
-- \dfrac, \tfrac, \frac12, mixed numbers 3\frac{1}{2}, a trailing % (its value is the number:
-- "50%" = 50; with percent = true it also equals 0.5), $ and \$ signs, LaTeX spacing (\, \! \;),
-- \left / \right, \text{...} and \mathrm{...} wrappers, trailing unit words (18 eggs, 5 \text{cm}),
-- ^\circ. Two numbers are equal when |a − b| <= tolerance · max(1, |b|). Answers that are not numbers
-- are compared as strings after the same clean-up with all spaces removed.
local rewards = require('moonrl.rewards')

local M = {}

-- ---------------------------------------------------------------- extraction

-- Position of the matching '}' for every '{' of s (one pass, a stack); unmatched braces get none.
local function brace_matches(s)
  local match, stack = {}, {}
  for i = 1, #s do
    local c = s:byte(i)
    if c == 123 then stack[#stack + 1] = i              -- {
    elseif c == 125 and #stack > 0 then                  -- }
      match[stack[#stack]] = i
      stack[#stack] = nil
    end
  end
  return match
end

local function trim(s) return (s:gsub('^%s+', ''):gsub('%s+$', '')) end

-- Content of the last complete \boxed{...} / \fbox{...} (or "\boxed x"), or nil.
function M.extract_boxed(s)
  local match
  local best, best_pos
  for _, cmd in ipairs({ '\\boxed', '\\fbox' }) do
    local init = 1
    while true do
      local a, b = s:find(cmd, init, true)
      if not a then break end
      init = b + 1
      local nextc = s:sub(b + 1, b + 1)
      if not nextc:match('%a') then                     -- not \boxedfoo
        local j = b + 1
        while s:sub(j, j):match('^[ \t]$') do j = j + 1 end
        local content
        if s:sub(j, j) == '{' then
          match = match or brace_matches(s)
          local close = match[j]
          if close then content = s:sub(j + 1, close - 1) end
        elseif j > b + 1 then                           -- "\boxed 5": up to a space or $
          content = s:match('^[^%s%$]+', j)
        end
        if content and (not best_pos or a > best_pos) then best, best_pos = content, a end
      end
    end
  end
  return best
end

-- The text after the last "####" on its line (GSM8K), or nil.
function M.extract_gsm8k(s)
  local last
  local init = 1
  while true do
    local a, b = s:find('####', init, true)
    if not a then break end
    last, init = b, b + 1
  end
  if not last then return nil end
  local rest = s:sub(last + 1):match('^[#]*([^\n]*)')
  rest = trim(rest)
  return rest ~= '' and rest or nil
end

-- The content of the last <answer>...</answer>, or nil.
function M.extract_tag(s, tag)
  tag = tag or 'answer'
  local open, close = '<' .. tag .. '>', '</' .. tag .. '>'
  local found, init = nil, 1
  while true do
    local a, b = s:find(open, init, true)
    if not a then break end
    local c = s:find(close, b + 1, true)
    if not c then break end
    found, init = s:sub(b + 1, c - 1), c + #close
  end
  return found
end

-- The final answer of a response, or nil.
function M.extract(s)
  local a = M.extract_boxed(s) or M.extract_gsm8k(s) or M.extract_tag(s, 'answer')
  if a then a = trim(a) end
  if a == '' then return nil end
  return a
end

-- ---------------------------------------------------------------- normalisation

-- Remove the LaTeX decoration that does not change a value.
function M.clean(s)
  s = trim(s)
  s = s:gsub('^%$+', ''):gsub('%$+$', '')                -- $...$
  s = s:gsub('^\\%(', ''):gsub('\\%)$', '')              -- \( ... \)
  s = s:gsub('^\\%[', ''):gsub('\\%]$', '')              -- \[ ... \]
  s = s:gsub('\\[dt]frac', '\\frac')
  s = s:gsub('\\left', ''):gsub('\\right', '')
  s = s:gsub('\\[,!;: ]', ''):gsub('~', '')              -- spacing
  s = s:gsub('\\%$', ''):gsub('%$', '')                  -- currency
  s = s:gsub('\\%%', '%%')                               -- \% -> %
  s = s:gsub('%^%s*{?\\circ}?', ''):gsub('°', '')        -- degrees
  s = s:gsub('\226\136\146', '-')                        -- U+2212 minus sign
  s = s:gsub('\\text%s*(%b{})', function(b) return b:sub(2, -2) end)
  s = s:gsub('\\mathrm%s*(%b{})', function(b) return b:sub(2, -2) end)
  s = s:gsub('\\mbox%s*(%b{})', function(b) return b:sub(2, -2) end)
  s = trim(s)
  -- {5} -> 5, { {5} } -> 5 (braces around the whole string only; one pass over s)
  if s:sub(1, 1) == '{' then
    local match = brace_matches(s)
    local i, j = 1, #s
    while s:byte(i) == 123 and match[i] == j do
      i, j = i + 1, j - 1
      while i <= j and s:sub(i, i):match('%s') do i = i + 1 end
      while j >= i and s:sub(j, j):match('%s') do j = j - 1 end
    end
    s = s:sub(i, j)
  end
  return s
end

-- A plain decimal: sign, digits with optional thousands commas, fraction, exponent.
local function parse_decimal(s)
  local sign, body = s:match('^([+-]?)(.+)$')
  if not body or body == '' then return nil end
  local int, frac, exp = body:match('^(%d[%d,]*)%.?(%d*)([eE][+-]?%d+)$')
  if not int then int, frac = body:match('^(%d[%d,]*)%.?(%d*)$') end
  if not int then
    frac, exp = body:match('^%.(%d+)([eE][+-]?%d+)$')
    if not frac then frac = body:match('^%.(%d+)$') end
    if not frac then return nil end
    int = '0'
  end
  if int:find(',', 1, true) then
    -- thousands separators: 1-3 digits, then groups of exactly three
    local head = int:match('^%d%d?%d?')
    local rest = int:sub(#head + 1)
    if rest == '' or rest:gsub(',%d%d%d', '') ~= '' then return nil end
    int = int:gsub(',', '')
  end
  local v = tonumber(int .. (frac ~= '' and ('.' .. frac) or '') .. (exp or ''))
  if not v then return nil end
  return sign == '-' and -v or v
end

-- Longer text is not a number (and the patterns below stay linear in practice).
local MAX_NUMBER_CHARS = 400

-- Value of a cleaned string: decimal, fraction, \frac, mixed number, percent, trailing units.
-- Returns value, is_percent; or nil.
function M.parse_number(s, no_clean)
  if type(s) == 'number' then return s, false end
  if type(s) ~= 'string' or #s > MAX_NUMBER_CHARS then return nil end
  if not no_clean then s = M.clean(s) end
  s = s:gsub('%s+', ' ')
  local percent = false
  if s:sub(-1) == '%' then percent, s = true, trim(s:sub(1, -2)) end
  -- trailing unit words after a space: "18 eggs", "5 cm" (words of two letters or more, so that
  -- "2 x" stays an expression)
  local num, unit = s:match('^(.-%d) (%a[%a ]*)$')
  if num and not num:find('\\', 1, true) and not (' ' .. unit .. ' '):find(' %a ') then
    s = num
  end
  s = s:gsub(' ', '')
  local v = parse_decimal(s)
  if v then return v, percent end
  -- a/b
  local a, b = s:match('^([+-]?[%d%.,]+)/([%d%.,]+)$')
  if a then
    local x, y = parse_decimal(a), parse_decimal(b)
    if x and y and y ~= 0 then return x / y, percent end
    return nil
  end
  -- [sign][whole]\frac{a}{b} or \frac12
  local sign, whole, fa, fb = s:match('^([+-]?)(%d*)\\frac(%b{})(%b{})$')
  if not sign then
    sign, whole, fa, fb = s:match('^([+-]?)(%d*)\\frac(%d)(%d)$')
  else
    fa, fb = fa:sub(2, -2), fb:sub(2, -2)
  end
  if sign then
    local x, y = parse_decimal(fa), parse_decimal(fb)
    if not x or not y or y == 0 then return nil end
    local w = whole ~= '' and tonumber(whole) or 0
    local val = w + (w ~= 0 and math.abs(x / y) or x / y)
    return sign == '-' and -val or val, percent
  end
  return nil
end

-- Equal by value (numbers) or, failing that, by cleaned string.
function M.equal(got, want, opts)
  opts = opts or {}
  local tol = opts.tolerance or 1e-6
  local g, gp = M.parse_number(got)
  local w, wp = M.parse_number(want)
  if g and w then
    local function close(a, b) return math.abs(a - b) <= tol * math.max(1, math.abs(b)) end
    if close(g, w) then return true end
    if opts.percent then
      if gp and close(g / 100, w) then return true end
      if wp and close(g, w / 100) then return true end
    end
    return false
  end
  if g or w then return false end
  local a = M.clean(tostring(got)):gsub('%s+', '')
  local b = M.clean(tostring(want)):gsub('%s+', '')
  return a ~= '' and a == b
end

-- ---------------------------------------------------------------- the reward

-- opts: tolerance (1e-6, relative above 1), percent (false), correct_score (1), wrong_score (0),
-- no_answer_score (0: no answer could be extracted).
function M.new(opts)
  opts = opts or {}
  local correct, wrong = opts.correct_score or 1, opts.wrong_score or 0
  local none = opts.no_answer_score or 0
  return function(sample)
    local response = rewards.response_of(sample, 'reward math')
    local want = sample.answer
    if type(want) == 'string' and (want:find('\\boxed', 1, true) or want:find('####', 1, true)) then
      want = M.extract(want)
    end
    if want == nil then error('reward math: sample.answer is missing or has no final answer', 2) end
    local got = M.extract(response)
    if not got then return none end
    return M.equal(got, want, opts) and correct or wrong
  end
end

M.reward = M.new()
-- loaded (by moonrl.rewards.get through moonrl.registry.plugin, or a require), it registers its built-in rewards
rewards.register('math', M.reward, { builtin = true })
rewards.register('gsm8k', M.reward, { builtin = true })

return M
