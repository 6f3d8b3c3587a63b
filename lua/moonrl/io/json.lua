-- moonrl.io.json: JSON decoding and encoding in Lua.
--
--   local json = require('moonrl.io.json')
--   local v = json.decode(text [, source])  -- objects keep their key order
--   local s = json.encode(v [, opts])       -- opts.indent (number), opts.sort_keys
--   json.null                                -- JSON null (also Jinja's none)
--   json.object([kv_list])  -> an ordered object: keys iterate in insertion order
--                              json.object{ 'step', 3, 'loss', 0.5 }
--   json.array([t])         -> marks t as an array (so {} encodes as [])
--   json.keys(t)            -> the keys of an object, in order
--   json.is_object(t), json.is_array(t)
--   json.number(x)          -> the text json.encode writes for a number
--
-- Values: null -> json.null, true/false -> booleans, numbers -> Lua numbers
-- (integers above 2^53 lose precision), strings -> Lua strings (UTF-8),
-- arrays -> tables with the array metatable, objects -> ordered objects.
--
-- Numbers are written the way Python's json.dumps / repr writes floats: an
-- integral value of magnitude below 2^53 as an integer ("3"), any other as
-- the shortest of %.15g, %.16g, %.17g that reads back to the same double,
-- with Python's layout ("0.1", "1e-05", "1e+16", "1.5"). Every double
-- therefore round-trips exactly. NaN and infinities are written as NaN,
-- Infinity, -Infinity (as Python does); decode accepts them too.
--
-- Plain Lua tables (no metatable) are encoded as arrays when t[1] ~= nil or
-- the table is empty, else as objects with their keys sorted.
local M = {}

local byte, char, sub, find, format, concat = string.byte, string.char, string.sub, string.find, string.format, table.concat
local floor, huge = math.floor, math.huge

M.null = setmetatable({}, { __tostring = function() return 'null' end, __name = 'null' })
local null = M.null

local order = setmetatable({}, { __mode = 'k' })   -- object -> list of keys
local ObjectMT = { __name = 'object' }
ObjectMT.__newindex = function(t, k, v)
  local ks = order[t]
  ks[#ks + 1] = k
  rawset(t, k, v)
end
M.ObjectMT = ObjectMT
local ArrayMT = { __name = 'array' }
M.ArrayMT = ArrayMT
local TupleMT = { __name = 'tuple' }  -- an array that Jinja prints as a Python tuple
M.TupleMT = TupleMT

function M.object(kv)
  local t = setmetatable({}, ObjectMT)
  order[t] = {}
  if kv then for i = 1, #kv, 2 do t[kv[i]] = kv[i + 1] end end
  return t
end

function M.array(t) return setmetatable(t or {}, ArrayMT) end
function M.is_object(t)
  if type(t) ~= 'table' then return false end
  local mt = getmetatable(t)
  if mt == ObjectMT then return true end
  return mt == nil and t[1] == nil and next(t) ~= nil
end
function M.is_array(t)
  if type(t) ~= 'table' then return false end
  local mt = getmetatable(t)
  if mt == ArrayMT or mt == TupleMT then return true end
  return mt == nil and (t[1] ~= nil or next(t) == nil)
end

-- The keys of an object in order (insertion order for ordered objects,
-- sorted for plain tables). Keys deleted since are left out.
function M.keys(t)
  local ks = order[t]
  if ks then
    local out, n = {}, 0
    for i = 1, #ks do
      local k = ks[i]
      if rawget(t, k) ~= nil then n = n + 1; out[n] = k end
    end
    if n ~= #ks then order[t] = { unpack(out) } end
    return out
  end
  local out = {}
  for k in pairs(t) do out[#out + 1] = k end
  table.sort(out, function(a, b)
    if type(a) == type(b) then return a < b end
    return type(a) == 'number'
  end)
  return out
end

---------------------------------------------------------------- decoding

local escapes = { ['"'] = '"', ['\\'] = '\\', ['/'] = '/', b = '\b', f = '\f', n = '\n', r = '\r', t = '\t' }

local function utf8_char(c)
  if c < 0x80 then return char(c)
  elseif c < 0x800 then return char(0xC0 + floor(c / 64), 0x80 + c % 64)
  elseif c < 0x10000 then return char(0xE0 + floor(c / 4096), 0x80 + floor(c / 64) % 64, 0x80 + c % 64)
  else return char(0xF0 + floor(c / 262144), 0x80 + floor(c / 4096) % 64, 0x80 + floor(c / 64) % 64, 0x80 + c % 64) end
end
M.utf8_char = utf8_char

local function decode(text, source)
  local pos = 1
  local function fail(msg, at)
    at = at or pos
    local line, col = 1, 1
    local last = 1
    for nl in text:sub(1, at - 1):gmatch('()\n') do line = line + 1; last = nl + 1 end
    col = at - last + 1
    error(format('%s:%d:%d: %s', source or 'json', line, col, msg), 0)
  end
  -- byte loops rather than patterns: LuaJIT compiles these
  local function skip()
    local c = byte(text, pos)
    while c == 32 or c == 10 or c == 13 or c == 9 do
      pos = pos + 1
      c = byte(text, pos)
    end
  end
  local value
  local function str()
    local start = pos + 1
    local parts, np = nil, 0
    local i = start
    while true do
      local j = i
      local c = byte(text, j)
      while c and c ~= 34 and c ~= 92 and c >= 32 do
        j = j + 1
        c = byte(text, j)
      end
      if not c then fail('unterminated string', start - 1) end
      if c == 34 then   -- "
        pos = j + 1
        if not parts then return sub(text, start, j - 1) end
        np = np + 1; parts[np] = sub(text, i, j - 1)
        return concat(parts)
      elseif c == 92 then  -- backslash
        parts = parts or {}
        np = np + 1; parts[np] = sub(text, i, j - 1)
        local e = sub(text, j + 1, j + 1)
        if e == 'u' then
          local h = sub(text, j + 2, j + 5)
          if not h:match('^%x%x%x%x$') then fail('bad \\u escape', j) end
          local cp = tonumber(h, 16)
          i = j + 6
          if cp >= 0xD800 and cp <= 0xDBFF and sub(text, i, i + 1) == '\\u' then
            local lo = tonumber(sub(text, i + 2, i + 5), 16)
            if lo and lo >= 0xDC00 and lo <= 0xDFFF then
              cp = 0x10000 + (cp - 0xD800) * 1024 + (lo - 0xDC00)
              i = i + 6
            end
          end
          np = np + 1; parts[np] = utf8_char(cp)
        else
          local r = escapes[e]
          if not r then fail("bad escape '\\" .. e .. "'", j) end
          np = np + 1; parts[np] = r
          i = j + 2
        end
      else
        fail('control character in string', j)
      end
    end
  end
  function value()
    skip()
    local c = byte(text, pos)
    if c == 123 then -- {
      local obj = M.object()
      pos = pos + 1
      skip()
      if byte(text, pos) == 125 then pos = pos + 1; return obj end
      while true do
        skip()
        if byte(text, pos) ~= 34 then fail('expected a string key') end
        local k = str()
        skip()
        if byte(text, pos) ~= 58 then fail("expected ':'") end
        pos = pos + 1
        local v = value()
        if rawget(obj, k) == nil then obj[k] = v else rawset(obj, k, v) end
        skip()
        c = byte(text, pos)
        if c == 44 then pos = pos + 1
        elseif c == 125 then pos = pos + 1; return obj
        else fail("expected ',' or '}'") end
      end
    elseif c == 91 then -- [
      local arr, n = setmetatable({}, ArrayMT), 0
      pos = pos + 1
      skip()
      if byte(text, pos) == 93 then pos = pos + 1; return arr end
      while true do
        n = n + 1; arr[n] = value()
        skip()
        c = byte(text, pos)
        if c == 44 then pos = pos + 1
        elseif c == 93 then pos = pos + 1; return arr
        else fail("expected ',' or ']'") end
      end
    elseif c == 34 then
      return str()
    elseif c == 116 and sub(text, pos, pos + 3) == 'true' then pos = pos + 4; return true
    elseif c == 102 and sub(text, pos, pos + 4) == 'false' then pos = pos + 5; return false
    elseif c == 110 and sub(text, pos, pos + 3) == 'null' then pos = pos + 4; return null
    elseif c == 78 and sub(text, pos, pos + 2) == 'NaN' then pos = pos + 3; return 0 / 0
    elseif c == 73 and sub(text, pos, pos + 7) == 'Infinity' then pos = pos + 8; return huge
    elseif c == 45 and sub(text, pos, pos + 8) == '-Infinity' then pos = pos + 9; return -huge
    else
      if not c then fail('unexpected end of input') end
      if c ~= 45 and (c < 48 or c > 57) then fail(format("unexpected character '%s'", char(c))) end
      local e = pos + 1
      c = byte(text, e)
      -- digits, '.', 'e', 'E', '+', '-'
      while c and ((c >= 48 and c <= 57) or c == 46 or c == 101 or c == 69 or c == 43 or c == 45) do
        e = e + 1
        c = byte(text, e)
      end
      local n = tonumber(sub(text, pos, e - 1))
      if not n then fail('bad number') end
      pos = e
      return n
    end
  end
  local v = value()
  skip()
  if pos <= #text then fail('trailing characters after the value') end
  return v
end

-- Decode one JSON text. Errors name `source`, the line and the column.
function M.decode(text, source)
  if type(text) ~= 'string' then error('json.decode: expected a string, got ' .. type(text), 2) end
  return decode(text, source)
end

function M.read_file(path)
  local f, err = require('moonrl.io.fs').open(path)
  if not f then error(err, 2) end
  local text = f:read('*a')
  f:close()
  return decode(text, path)
end

---------------------------------------------------------------- encoding

-- Python's repr of a float (shortest text that reads back exactly).
local function number(x)
  if x ~= x then return 'NaN' end
  if x == huge then return 'Infinity' elseif x == -huge then return '-Infinity' end
  if x == floor(x) and x > -2 ^ 53 and x < 2 ^ 53 then return format('%d', x) end
  local s
  for p = 15, 17 do
    s = format('%.' .. p .. 'e', x)
    if tonumber(s) == x then break end
  end
  local sign, d1, frac, exp = s:match('^(-?)(%d)%.?(%d*)e([-+]%d+)$')
  frac = frac:gsub('0+$', '')
  local digits = d1 .. frac
  local e = tonumber(exp)
  if e < -4 or e >= 16 then
    local m = #frac > 0 and (d1 .. '.' .. frac) or d1
    return format('%s%se%s%02d', sign, m, e < 0 and '-' or '+', math.abs(e))
  end
  if e < 0 then return sign .. '0.' .. string.rep('0', -e - 1) .. digits end
  if #digits <= e + 1 then return sign .. digits .. string.rep('0', e + 1 - #digits) .. '.0' end
  return sign .. sub(digits, 1, e + 1) .. '.' .. sub(digits, e + 2)
end
M.number = number

local str_escape = { ['"'] = '\\"', ['\\'] = '\\\\', ['\n'] = '\\n', ['\r'] = '\\r', ['\t'] = '\\t',
  ['\b'] = '\\b', ['\f'] = '\\f' }
for c = 0, 31 do str_escape[char(c)] = str_escape[char(c)] or format('\\u%04x', c) end
local function quote(s)
  if not find(s, '[%z\1-\31"\\]') then return '"' .. s .. '"' end
  return '"' .. s:gsub('[%z\1-\31"\\]', str_escape) .. '"'
end
M.quote = quote

-- opts: indent (number of spaces; nil for one line), sort_keys,
-- item_sep / key_sep (defaults ', ' and ': ', or ',' and ': ' with indent,
-- as Python's json.dumps), tostring (function for values JSON cannot hold;
-- default: an error).
function M.encode(v, opts)
  opts = opts or {}
  local indent = opts.indent
  local item_sep = opts.item_sep or (indent and ',' or ', ')
  local key_sep = opts.key_sep or ': '
  local out, n = {}, 0
  local function put(s) n = n + 1; out[n] = s end
  local function enc(x, level)
    local t = type(x)
    if t == 'string' then put(quote(x))
    elseif t == 'number' then put(number(x))
    elseif t == 'boolean' then put(x and 'true' or 'false')
    elseif x == null then put('null')
    elseif t == 'table' and (M.is_array(x) or M.is_object(x)) then
      local arr = M.is_array(x)
      local ks
      if not arr then
        ks = M.keys(x)
        if opts.sort_keys then ks = { unpack(ks) }; table.sort(ks) end
      end
      local count = arr and #x or #ks
      if count == 0 then put(arr and '[]' or '{}'); return end
      put(arr and '[' or '{')
      local nl = indent and ('\n' .. string.rep(' ', indent * (level + 1)))
      for i = 1, count do
        if i > 1 then put(item_sep) end
        if nl then put(nl) end
        if arr then enc(x[i], level + 1)
        else
          local k = ks[i]
          put(quote(tostring(k))); put(key_sep); enc(x[k], level + 1)
        end
      end
      if indent then put('\n' .. string.rep(' ', indent * level)) end
      put(arr and ']' or '}')
    elseif opts.tostring then
      put(opts.tostring(x))
    else
      error('json.encode: cannot encode a value of type ' .. (getmetatable(x) and getmetatable(x).__name or t), 0)
    end
  end
  enc(v, 0)
  return concat(out)
end

return M
