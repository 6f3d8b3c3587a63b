-- moonrl.text.jinja.lexer: a template's text cut into pieces (text, {{ }}
-- and {% %}), with Jinja's whitespace control applied, and the tokens of the
-- expression inside a tag. Errors are CompileError objects whose message
-- names the template and line.
local json = require('moonrl.io.json')

local M = {}
local format, concat, sub, find = string.format, table.concat, string.sub, string.find

local CompileError = {}
CompileError.__tostring = function(e) return e.message end


-- A numeral's value as Python reads it: LuaJIT's tonumber gives nil where the exponent has more
-- digits than an int holds (21e7483648), which Python reads as inf (and 0 for a tiny one).
local function numeral(w)
  local v = tonumber(w)
  if v then return v end
  local m, e = w:match('^(.-)[eE]([-+]?%d+)$')
  m = tonumber(m)
  if m == 0 then return 0 end
  return e:sub(1, 1) == '-' and 0 or m * math.huge
end
local function line_of(src, pos)
  local n = 1
  for _ in sub(src, 1, pos - 1):gmatch('\n') do n = n + 1 end
  return n
end

-- Split the template into text and tags, applying whitespace control as
-- Jinja does with trim_blocks and lstrip_blocks.
local function lex(src, name)
  local pieces = {}
  local pos = 1
  local n = #src
  local strip_next = false  -- a '-' closed the previous tag
  local line_at, line_no = 1, 1   -- the line number at position line_at (they only move forward)
  local function line_to(at)
    if at < line_at then return line_of(src, at) end
    for _ in sub(src, line_at, at - 1):gmatch('\n') do line_no = line_no + 1 end
    line_at = at
    return line_no
  end
  local function cerr(msg, at)
    error(setmetatable({ message = format('%s:%d: %s', name, line_of(src, at), msg) }, CompileError), 0)
  end
  while pos <= n do
    local s = find(src, '{[{%%#]', pos)
    local text = sub(src, pos, (s or n + 1) - 1)
    if strip_next then text = text:gsub('^%s+', ''); strip_next = false end
    if not s then
      if text ~= '' then pieces[#pieces + 1] = { kind = 'text', text = text } end
      break
    end
    local open = sub(src, s + 1, s + 1)
    local modifier = sub(src, s + 2, s + 2)
    if modifier == '-' then
      text = sub(text, 1, (text:match('^.*%S()') or 1) - 1)   -- (a '%s+$' pattern is quadratic)
    elseif (open == '%' or open == '#') and modifier ~= '+' then
      -- lstrip_blocks: spaces and tabs between the line start and the tag
      local last_nl = text:match('.*()\n')
      local tail = last_nl and sub(text, last_nl + 1) or text
      local at_line_start = last_nl ~= nil or pos == 1 or sub(src, pos - 1, pos - 1) == '\n'
      if at_line_start and tail:match('^[ \t]*$') then text = sub(text, 1, #text - #tail) end
    end
    if text ~= '' then pieces[#pieces + 1] = { kind = 'text', text = text } end
    local body_start = s + 2 + ((modifier == '-' or modifier == '+') and 1 or 0)
    local line = line_to(s)
    local e, close_end
    if open == '#' then
      local i = find(src, '#}', body_start, true)
      if not i then cerr('unclosed comment', s) end
      e, close_end = i, i + 1
    else
      -- scan to the closing delimiter, skipping string literals
      local closer = open == '{' and '}}' or '%}'
      local i = body_start
      while true do
        local j = find(src, "['\"%%}]", i)
        if not j then cerr('unclosed tag', s) end
        local c = sub(src, j, j)
        if c == '"' or c == "'" then
          local k = j + 1
          while true do
            local q = find(src, '[\\' .. c .. ']', k)
            if not q then cerr('unterminated string', j) end
            if sub(src, q, q) == '\\' then k = q + 2 else k = q + 1; break end
          end
          i = k
        elseif sub(src, j, j + 1) == closer then
          e, close_end = j, j + 1
          break
        else
          i = j + 1
        end
      end
    end
    local body_end = e - 1
    local trim_after = false
    if sub(src, body_end, body_end) == '-' and body_end >= body_start then
      body_end = body_end - 1
      strip_next = true
    elseif sub(src, body_end, body_end) == '+' and body_end >= body_start and open ~= '{' then
      body_end = body_end - 1
    elseif open ~= '{' then
      trim_after = true
    end
    pos = close_end + 1
    if trim_after and sub(src, pos, pos) == '\n' then pos = pos + 1 end
    if trim_after and sub(src, pos, pos + 1) == '\r\n' then pos = pos + 2 end
    if open ~= '#' then
      pieces[#pieces + 1] = { kind = open == '{' and 'var' or 'block', text = sub(src, body_start, body_end),
        line = line, pos = body_start }
    end
  end
  return pieces
end

---------------------------------------------------------------- expression tokens

local function tokenize(text, line, cerr)
  local toks = {}
  local i, n = 1, #text
  local ops3 = { ['//'] = true, ['**'] = true, ['=='] = true, ['!='] = true, ['<='] = true, ['>='] = true }
  while i <= n do
    local c = sub(text, i, i)
    if c:match('%s') then
      i = i + 1
    elseif c:match('[%a_]') then
      local w = text:match('^[%w_]+', i)
      toks[#toks + 1] = { t = 'name', v = w }
      i = i + #w
    elseif c:match('%d') then
      local w = text:match('^%d[%d_]*%.?%d*[eE][-+]?%d+', i) or text:match('^%d[%d_]*%.%d+', i)
        or text:match('^%d[%d_]*', i)
      toks[#toks + 1] = { t = 'num', v = numeral((w:gsub('_', ''))) }
      i = i + #w
    elseif c == '"' or c == "'" then
      local parts = {}
      local j = i + 1
      while true do
        local ch = sub(text, j, j)
        if ch == '' then cerr('unterminated string') end
        if ch == c then break end
        if ch == '\\' then
          local e = sub(text, j + 1, j + 1)
          local map = { n = '\n', t = '\t', r = '\r', ['\\'] = '\\', ["'"] = "'", ['"'] = '"', ['0'] = '\0',
            b = '\b', f = '\f', v = '\v', a = '\a', ['\n'] = '' }
          if map[e] then parts[#parts + 1] = map[e]; j = j + 2
          elseif e == 'u' or e == 'x' or e == 'U' then
            local len = e == 'x' and 2 or (e == 'u' and 4 or 8)
            local h = sub(text, j + 2, j + 1 + len)
            local cp = tonumber(h, 16)
            if not cp or #h ~= len then cerr('bad \\' .. e .. ' escape in string') end
            parts[#parts + 1] = json.utf8_char(cp)
            j = j + 2 + len
          else
            parts[#parts + 1] = '\\' .. e; j = j + 2
          end
        else
          local k = find(text, '[\\' .. c .. ']', j) or n + 1
          parts[#parts + 1] = sub(text, j, k - 1)
          j = k
        end
      end
      toks[#toks + 1] = { t = 'str', v = concat(parts) }
      i = j + 1
    else
      local two = sub(text, i, i + 1)
      if ops3[two] then
        toks[#toks + 1] = { t = 'op', v = two }; i = i + 2
      elseif c:match('[-+*/%%~<>=|.,:()%[%]{}]') then
        toks[#toks + 1] = { t = 'op', v = c }; i = i + 1
      else
        cerr(format("unexpected character '%s'", c))
      end
    end
  end
  toks[#toks + 1] = { t = 'eof' }
  return toks
end

M.CompileError, M.lex, M.tokenize = CompileError, lex, tokenize

return M
