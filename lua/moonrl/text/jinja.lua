-- moonrl.text.jinja: the subset of Jinja2 that Hugging Face chat templates use,
-- compiled to Lua. The template is parsed once, turned into Lua source and
-- load()ed; rendering runs that function.
--
--   local jinja = require('moonrl.text.jinja')
--   local render = jinja.compile(source [, name])  -- cached by source text
--   local text = render(vars [, opts])             -- vars: the template's variables
--   jinja.source(source)                           -- the generated Lua (for debugging)
--
-- Environment as Hugging Face sets it: trim_blocks and lstrip_blocks on,
-- loop controls (break/continue) on, {% generation %} accepted (rendered as
-- its body), globals raise_exception(msg), strftime_now(fmt) (opts.now, in
-- seconds since the epoch, fixes the clock), namespace(), range(), dict(),
-- and tojson as transformers defines it: json.dumps(x, ensure_ascii=False,
-- indent=..., separators=..., sort_keys=...).
--
-- Values: strings, numbers, booleans, jinja.none (= json.null), lists and
-- dicts (tables; see moonrl.io.json for ordered objects and arrays). A missing
-- variable, key or attribute is undefined: it renders as '', is false, is
-- an empty iterable, and is an error when used further (attribute of it,
-- arithmetic). none renders 'None', booleans 'True'/'False', lists and dicts
-- as Python's repr. Numbers print as Python ints when integral, floats
-- otherwise (a float that holds an integral value, 2.0, prints as 2).
--
-- Supported: {{ }}, {% %}, {# #}, '-' and '+' whitespace control; if/elif/
-- else, for (else, filter 'if', tuple targets, loop.index/index0/revindex/
-- revindex0/first/last/length/previtem/nextitem), set (names, tuples,
-- namespace attributes, block set), macro (positional and keyword args,
-- defaults), break/continue, generation. Expressions: literals (strings,
-- numbers, true/false/none, lists, tuples, dicts), and/or/not, in/not in,
-- comparisons (chained), + - * / // % ** ~, unary -, if-else, attribute,
-- subscript and slices ([a:b:c]), calls, filters, tests. Anything else is an
-- error naming the construct and its template line.
--
-- Limits. A chat template is untrusted input (it comes with a downloaded
-- tokenizer_config.json), so one render is bounded; going past a bound is a
-- normal error naming it ("chat template: rendering exceeded 5000000 steps
-- (limits.steps)"), never a hang or an out-of-memory:
--
--   range   100000    items in one range() (the bound of Jinja's sandbox)
--   steps   5000000   work items: loop iterations, macro calls, and the
--                     items that range(), list literals, + on lists,
--                     slices, filters and methods make or visit
--   string  16 MiB    bytes of any one string built (~, + and * on strings,
--                     join, replace, indent, tojson, ...), the rendered
--                     text included
--   text    256 MiB   bytes of text built or searched in all, over the render
--   depth   100       macro calls nested in one another (recursion)
--
-- range(a, b, 0) is an error, as in Python. To raise a limit for a template
-- that needs it: render(vars, { limits = { steps = 2e7 } }) for one render,
-- or jinja.limits.steps = 2e7 for every render after (moonrl.chat's
-- render functions use those defaults).
local json = require('moonrl.io.json')

local M = {}
local none = json.null
M.none = none
local ObjectMT, ArrayMT, TupleMT = json.ObjectMT, json.ArrayMT, json.TupleMT
local format, concat, byte, sub, find = string.format, table.concat, string.byte, string.sub, string.find
local floor = math.floor

---------------------------------------------------------------- runtime values

local UndefMT = { __name = 'undefined' }
local function undef(name) return setmetatable({ name = name }, UndefMT) end
local function is_undef(v) return getmetatable(v) == UndefMT end
M.is_undefined = is_undef
M.undefined = undef

local NamespaceMT = { __name = 'namespace' }
local LoopMT = { __name = 'loop' }
local MacroMT = { __name = 'macro' }
local BuiltinMT = { __name = 'builtin' }   -- a global function: { fn = f }

local RenderError = {}
RenderError.__tostring = function(e) return e.message end
M.RenderError = RenderError

local function fail(msg) error(setmetatable({ message = msg }, RenderError), 0) end

---------------------------------------------------------------- limits (see the top of the file)

local limits = { range = 100000, steps = 5000000, string = 16 * 1024 * 1024, text = 256 * 1024 * 1024, depth = 100 }
M.limits = limits

-- the bounds of the render in progress and what it has used so far
local max_range, max_steps, max_string, max_text, max_depth =
  limits.range, limits.steps, limits.string, limits.text, limits.depth
local steps, text_used, depth = 0, 0, 0

local function show(n)   -- a count in an error message
  if n ~= n or n == math.huge or n == -math.huge then return tostring(n) end
  return format('%.0f', n)
end
local function over(name, msg) fail(format('chat template: %s (limits.%s)', msg, name)) end
local function too_many_steps() over('steps', format('rendering exceeded %s steps', show(max_steps))) end

-- n more items of work
local function work(n)
  if n > 0 then
    steps = steps + n
    if steps > max_steps then too_many_steps() end
  end
end
-- n more bytes of text searched or copied
local function scan(n)
  if n > 0 then
    text_used = text_used + n
    if text_used > max_text then over('text', format('rendering handled more than %s bytes of text', show(max_text))) end
  end
end
-- a string of n bytes is about to be built
local function alloc(n)
  if not (n <= max_string) then over('string', format('a string of %s bytes exceeds the limit of %s', show(n), show(max_string))) end
  scan(n)
end

local function kind(v)
  local t = type(v)
  if t ~= 'table' then return t end
  local mt = getmetatable(v)
  if mt == nil then
    if v[1] ~= nil or next(v) == nil then return 'list' end
    return 'dict'
  end
  if mt == ArrayMT or mt == TupleMT then return 'list' end
  if mt == ObjectMT then return 'dict' end
  if v == none then return 'none' end
  if mt == UndefMT then return 'undefined' end
  if mt == NamespaceMT then return 'namespace' end
  if mt == LoopMT then return 'loop' end
  if mt == MacroMT or mt == BuiltinMT then return 'callable' end
  return 'dict'
end
M.kind = kind

local function is_ascii(s) scan(#s); return not find(s, '[\128-\255]') end

-- code points of a UTF-8 string as substrings
local function chars(s)
  scan(8 * #s)   -- a table entry per character: weighs more than a search
  local out, n = {}, 0
  for c in s:gmatch('[%z\1-\127\192-\255][\128-\191]*') do n = n + 1; out[n] = c end
  return out
end

-- length in code points: the bytes that do not continue a UTF-8 sequence
local function slen(s)
  if is_ascii(s) then return #s end
  scan(#s)
  local _, cont = s:gsub('[\128-\191]', '')
  return #s - cont
end

local function truthy(v)
  if v == nil or v == false or v == none or v == 0 or v == '' then return false end
  if type(v) == 'table' then
    local k = kind(v)
    if k == 'undefined' then return false end
    if k == 'list' or k == 'dict' then return next(v) ~= nil end
  end
  return true
end

-- escapes in Python's repr of a str, by quote: [char] = escape
local repr_escapes = {}
for _, q in ipairs({ "'", '"' }) do
  local t = { ['\\'] = '\\\\', ['\n'] = '\\n', ['\t'] = '\\t', ['\r'] = '\\r', [q] = '\\' .. q }
  for c = 0, 31 do t[string.char(c)] = t[string.char(c)] or format('\\x%02x', c) end
  t['\127'] = '\\x7f'
  repr_escapes[q] = t
end

local pystr
local function pyrepr(v)
  if type(v) == 'string' then
    local q = "'"
    scan(#v)
    if find(v, "'", 1, true) and not find(v, '"', 1, true) then q = '"' end
    local body = v:gsub('[\\%c' .. q .. ']', repr_escapes[q])
    alloc(#body + 2)
    return q .. body .. q
  end
  return pystr(v)
end

-- concat(parts, sep) once its length is known to be within the limits
local function join_parts(parts, sep, open, close)
  local n = #parts
  local total = (n > 1 and (n - 1) * #sep or 0) + #(open or '') + #(close or '')
  for i = 1, n do total = total + #parts[i] end
  alloc(total)
  local s = concat(parts, sep)
  if open then s = open .. s .. close end
  return s
end

function pystr(v)
  local t = type(v)
  if t == 'string' then return v end
  if t == 'number' then
    if v == floor(v) and v > -2 ^ 53 and v < 2 ^ 53 then return format('%d', v) end   -- what json.number writes
    return (json.number(v):gsub('^NaN$', 'nan'):gsub('Infinity', 'inf'))
  end
  if t == 'boolean' then return v and 'True' or 'False' end
  if v == nil then return '' end
  local k = kind(v)
  if k == 'none' then return 'None' end
  if k == 'undefined' then return '' end
  if k == 'list' then
    work(#v)
    local parts = {}
    for i = 1, #v do parts[i] = pyrepr(v[i]) end
    if getmetatable(v) == TupleMT then return join_parts(parts, ', ', '(', #v == 1 and ',)' or ')') end
    return join_parts(parts, ', ', '[', ']')
  end
  if k == 'dict' then
    local parts = {}
    local keys = json.keys(v)
    work(#keys)
    for i, key in ipairs(keys) do parts[i] = join_parts({ pyrepr(key), pyrepr(v[key]) }, ': ') end
    return join_parts(parts, ', ', '{', '}')
  end
  if k == 'namespace' then return '<Namespace>' end
  return '<' .. k .. '>'
end
M.str = pystr

local function typename(v)
  local k = kind(v)
  return ({ string = 'str', number = 'int', boolean = 'bool', none = 'NoneType', undefined = 'Undefined' })[k] or k
end

local function need_defined(v, what)
  if is_undef(v) then fail(format("'%s' is undefined", v.name)) end
  return v
end

local function eq(a, b)
  if a == b then return true end
  local ta, tb = type(a), type(b)
  if ta ~= 'table' or tb ~= 'table' then return false end
  local ka, kb = kind(a), kind(b)
  if ka ~= kb then return false end
  if ka == 'list' then
    if #a ~= #b then return false end
    work(#a)
    for i = 1, #a do if not eq(a[i], b[i]) then return false end end
    return true
  elseif ka == 'dict' then
    local ks = json.keys(a)
    if #ks ~= #json.keys(b) then return false end
    work(#ks)
    for _, k in ipairs(ks) do
      local bv = b[k]
      if bv == nil or not eq(a[k], bv) then return false end
    end
    return true
  elseif ka == 'undefined' then
    return true
  end
  return false
end

local function list(t) return setmetatable(t, ArrayMT) end

-- items to iterate over (a list of values; dicts give their keys)
local function iterate(v)
  local k = kind(v)
  if k == 'list' then return v end
  if k == 'dict' then local ks = json.keys(v); work(#ks); return ks end
  if k == 'string' then return chars(v) end
  if k == 'undefined' then return {} end
  if k == 'namespace' then fail("'Namespace' object is not iterable") end
  fail(format("'%s' object is not iterable", typename(v)))
end

local function norm_index(i, n)
  if i < 0 then i = i + n end
  return i
end

local function getitem(obj, key)
  local k = kind(obj)
  if k == 'list' or k == 'string' then
    if type(key) ~= 'number' then return undef(tostring(key)) end
    local items = k == 'list' and obj or (is_ascii(obj) and nil or chars(obj))
    local n = k == 'list' and #obj or (items and #items or #obj)
    local i = norm_index(key, n)
    if i < 0 or i >= n then return undef('index ' .. key) end
    if k == 'list' then return obj[i + 1] end
    if items then return items[i + 1] end
    return sub(obj, i + 1, i + 1)
  elseif k == 'dict' or k == 'namespace' or k == 'loop' then
    local v = obj[key]
    if v == nil then return undef(tostring(key)) end
    return v
  elseif k == 'undefined' then
    fail(format("'%s' is undefined", obj.name))
  end
  return undef(tostring(key))
end

local function slice(obj, a, b, step)
  local k = kind(obj)
  local items
  if k == 'list' then items = obj
  elseif k == 'string' then items = is_ascii(obj) and nil or chars(obj)
  else fail(format("cannot slice a value of type '%s'", typename(obj))) end
  local n = items and #items or #obj
  step = (step == nil or step == none) and 1 or step
  if step == 0 then fail('slice step cannot be zero') end
  local function clamp(i, def, lo, hi)
    if i == nil or i == none then return def end
    if i < 0 then i = i + n end
    if i < lo then return lo end
    if i > hi then return hi end
    return i
  end
  local out, m = {}, 0
  local s, e, last
  if step > 0 then
    s, e = clamp(a, 0, 0, n), clamp(b, n, 0, n)
    last = e - 1
    if k == 'string' and step == 1 then   -- a substring
      if s >= e then return '' end
      if not items then alloc(e - s); return sub(obj, s + 1, e) end
      alloc(#obj)
      return concat(items, '', s + 1, e)
    end
  else
    s, e = clamp(a, n - 1, -1, n - 1), clamp(b, -1, -1, n - 1)
    if b ~= nil and b ~= none and b < 0 and b + n < 0 then e = -1 end
    last = e + 1
  end
  if k == 'list' then work(math.max(0, floor((last - s) / step) + 1)) else scan(#obj) end
  for i = s, last, step do m = m + 1; out[m] = items and items[i + 1] or sub(obj, i + 1, i + 1) end
  if k == 'string' then return concat(out) end
  return list(out)
end

---------------------------------------------------------------- methods

local ws = ' \t\n\r\f\v'
-- the characters of a strip() argument, as the inside of a Lua pattern set
local function char_set(chs)
  if chs == nil or chs == none then return ws end
  return (chs:gsub('[%^%]%-%%%[]', '%%%0'):gsub('%z', '%%z'))
end
local function strip(s, chs, left, right)
  local set = char_set(chs)
  if set == '' then return s end
  scan(#s)
  local i, j = 1, #s
  if left then i = find(s, '[^' .. set .. ']') or #s + 1 end
  if right and i <= j then j = (s:match('^.*[^' .. set .. ']()') or 1) - 1 end
  return sub(s, i, j)
end

-- a plain search for `needle` in `hay`: memchr then memcmp at each candidate,
-- which costs up to #needle per byte on a repetitive text
local function search_cost(hay, needle)
  local m = type(needle) == 'string' and #needle or 1
  scan(#hay * math.max(1, math.ceil(m / 32)))
end

local function split(s, sep, maxsplit)
  maxsplit = (maxsplit == nil or maxsplit == none) and -1 or maxsplit
  local out, n = {}, 0
  if sep == nil or sep == none then
    scan(#s)
    for w in s:gmatch('[^ \t\n\r\f\v]+') do work(1); n = n + 1; out[n] = w end
    return list(out)
  end
  if sep == '' then fail('empty separator') end
  search_cost(s, sep)
  local pos = 1
  while maxsplit ~= 0 do
    local i, j = find(s, sep, pos, true)
    if not i then break end
    work(1)
    n = n + 1; out[n] = sub(s, pos, i - 1)
    pos = j + 1
    maxsplit = maxsplit - 1
  end
  out[n + 1] = sub(s, pos)
  return list(out)
end

local function replace(s, old, new, count)
  count = (count == nil or count == none) and -1 or count
  old, new = pystr(old), pystr(new)
  if old == '' then fail('replace with an empty pattern is not supported') end
  -- count the occurrences first: the result must be known to fit before it is built
  search_cost(s, old)
  local found, pos = 0, 1
  while found ~= count do
    local i, j = find(s, old, pos, true)
    if not i then break end
    found = found + 1
    pos = j + 1
  end
  if found == 0 then return s end
  alloc(#s + found * (#new - #old))
  search_cost(s, old)
  local pattern = old:gsub('[^%w%z]', '%%%0'):gsub('%z', '%%z')
  return (s:gsub(pattern, (new:gsub('%%', '%%%%')), found))
end

local function affix_test(s, x, fn)
  if kind(x) == 'list' then
    work(#x)
    for _, p in ipairs(x) do if fn(s, p) then return true end end
    return false
  end
  return fn(s, x)
end
local function starts(s, p) scan(#p); return sub(s, 1, #p) == p end
local function ends(s, p) scan(#p); return p == '' or sub(s, -#p) == p end

local function capitalize(s) alloc(#s); return s:sub(1, 1):upper() .. s:sub(2):lower() end
local upper_of = {}
for c = byte('a'), byte('z') do upper_of[string.char(c)] = string.char(c):upper() end
-- a letter after a non-letter (or at the start) is upper case, the rest lower
local function title(s)
  alloc(#s)
  return (s:lower():gsub('%f[%a]%a', upper_of))
end

local function join_items(items, sep)
  items = iterate(items)
  work(#items)
  local parts = {}
  for i, v in ipairs(items) do parts[i] = pystr(v) end
  return join_parts(parts, sep)
end

local string_methods = {
  strip = function(s, c) return strip(s, c, true, true) end,
  lstrip = function(s, c) return strip(s, c, true, false) end,
  rstrip = function(s, c) return strip(s, c, false, true) end,
  split = split,
  startswith = function(s, p) return affix_test(s, p, starts) end,
  endswith = function(s, p) return affix_test(s, p, ends) end,
  lower = function(s) alloc(#s); return s:lower() end,
  upper = function(s) alloc(#s); return s:upper() end,
  replace = replace,
  title = title,
  capitalize = capitalize,
  find = function(s, x)
    search_cost(s, x)
    local i = find(s, x, 1, true)
    return i and (is_ascii(s) and i - 1 or slen(sub(s, 1, i - 1))) or -1
  end,
  count = function(s, x)
    search_cost(s, x)
    local n, pos = 0, 1
    while true do
      local i, j = find(s, x, pos, true)
      if not i then return n end
      n = n + 1; pos = math.max(j + 1, i + 1)
    end
  end,
  join = function(s, items) return join_items(items, s) end,
  isdigit = function(s) scan(#s); return s ~= '' and not find(s, '%D') end,
  splitlines = function(s)
    alloc(#s + 1)
    local out = {}
    for line in (s .. '\n'):gmatch('(.-)\r?\n') do work(1); out[#out + 1] = line end
    if s == '' or sub(s, -1) == '\n' then out[#out] = nil end
    return list(out)
  end,
}

local dict_methods = {
  items = function(d)
    local out = {}
    local keys = json.keys(d)
    work(#keys)
    for i, k in ipairs(keys) do out[i] = setmetatable({ k, d[k] }, TupleMT) end
    return list(out)
  end,
  keys = function(d) local keys = json.keys(d); work(#keys); return list(keys) end,
  values = function(d)
    local out = {}
    local keys = json.keys(d)
    work(#keys)
    for i, k in ipairs(keys) do out[i] = d[k] end
    return list(out)
  end,
  get = function(d, k, default)
    local v = d[k]
    if v == nil then if default == nil then return none end return default end
    return v
  end,
}

local list_methods = {
  index = function(l, x)
    work(#l)
    for i = 1, #l do if eq(l[i], x) then return i - 1 end end
    fail('value is not in list')
  end,
  count = function(l, x)
    work(#l)
    local n = 0
    for i = 1, #l do if eq(l[i], x) then n = n + 1 end end
    return n
  end,
}

local function method(obj, name, ...)
  local k = kind(obj)
  local f
  if k == 'string' then f = string_methods[name]
  elseif k == 'dict' then
    f = dict_methods[name]
    if not f then
      local v = obj[name]
      if v ~= nil then return M.call(v, { ... }, nil) end
    end
  elseif k == 'list' then f = list_methods[name]
  elseif k == 'undefined' then fail(format("'%s' is undefined", obj.name))
  elseif k == 'namespace' or k == 'loop' then
    local v = obj[name]
    if v ~= nil then return M.call(v, { ... }, nil) end
  end
  if not f then fail(format("'%s' object has no method '%s'", typename(obj), name)) end
  return f(obj, ...)
end

---------------------------------------------------------------- operators

local function num(v, op)
  if type(v) == 'number' then return v end
  if type(v) == 'boolean' then return v and 1 or 0 end
  if is_undef(v) then fail(format("'%s' is undefined", v.name)) end
  fail(format("unsupported operand type(s) for %s: '%s'", op, typename(v)))
end

local function add(a, b)
  local ta, tb = type(a), type(b)
  if ta == 'string' and tb == 'string' then alloc(#a + #b); return a .. b end
  if ta == 'number' and tb == 'number' then return a + b end
  need_defined(a); need_defined(b)
  local ka, kb = kind(a), kind(b)
  if ka == 'list' and kb == 'list' then
    work(#a + #b)
    local out = {}
    for i = 1, #a do out[i] = a[i] end
    for i = 1, #b do out[#a + i] = b[i] end
    return list(out)
  end
  if (ta == 'number' or ta == 'boolean') and (tb == 'number' or tb == 'boolean') then return num(a, '+') + num(b, '+') end
  fail(format("unsupported operand type(s) for +: '%s' and '%s'", typename(a), typename(b)))
end

local function arith(op, a, b)
  if op == '*' then
    if type(b) == 'string' and type(a) == 'number' then a, b = b, a end
    if type(a) == 'string' and type(b) == 'number' then
      local n = floor(b)
      if not (n > 0) or a == '' then return '' end
      alloc(#a * n)
      return string.rep(a, n)
    end
  end
  if op == '%' and type(a) == 'string' then fail("the '%' string formatting operator is not supported") end
  local x, y = num(a, op), num(b, op)
  if op == '-' then return x - y
  elseif op == '*' then return x * y
  elseif op == '/' then
    if y == 0 then fail('division by zero') end
    return x / y
  elseif op == '//' then
    if y == 0 then fail('integer division by zero') end
    return floor(x / y)
  elseif op == '%' then
    if y == 0 then fail('modulo by zero') end
    return x % y
  elseif op == '**' then return x ^ y end
end

local function compare(op, a, b)
  local ta, tb = type(a), type(b)
  if ta == 'boolean' then a = a and 1 or 0; ta = 'number' end
  if tb == 'boolean' then b = b and 1 or 0; tb = 'number' end
  if ta ~= tb or (ta ~= 'number' and ta ~= 'string') then
    need_defined(a); need_defined(b)
    fail(format("'%s' not supported between instances of '%s' and '%s'", op, typename(a), typename(b)))
  end
  if ta == 'string' then scan(math.min(#a, #b)) end
  if op == '<' then return a < b elseif op == '<=' then return a <= b
  elseif op == '>' then return a > b else return a >= b end
end

local function contains(container, item)
  local k = kind(container)
  if k == 'string' then
    if type(item) ~= 'string' then fail("'in <string>' requires string as left operand") end
    search_cost(container, item)
    return find(container, item, 1, true) ~= nil
  elseif k == 'list' then
    work(#container)
    for i = 1, #container do if eq(container[i], item) then return true end end
    return false
  elseif k == 'dict' or k == 'namespace' then
    return type(item) ~= 'table' and container[item] ~= nil
  elseif k == 'undefined' then
    return false
  end
  fail(format("argument of type '%s' is not iterable", typename(container)))
end

local function attr(obj, name)
  if type(obj) == 'table' then
    local k = kind(obj)
    if k == 'undefined' then fail(format("'%s' is undefined", obj.name)) end
    if k == 'dict' or k == 'namespace' or k == 'loop' then
      local v = obj[name]
      if v ~= nil then return v end
    end
  end
  return undef(name)
end

---------------------------------------------------------------- filters and tests

local function tojson(x, kw)
  kw = kw or {}
  local indent = kw.indent
  if indent == none then indent = nil end
  local opts = { indent = indent, sort_keys = truthy(kw.sort_keys) }
  local seps = kw.separators
  if seps and seps ~= none then opts.item_sep, opts.key_sep = seps[1], seps[2] end
  if kw.ensure_ascii ~= nil and truthy(kw.ensure_ascii) then fail('tojson(ensure_ascii=True) is not supported') end
  opts.tostring = function(v)
    if is_undef(v) then fail('Object of type Undefined is not JSON serializable') end
    fail(format('Object of type %s is not JSON serializable', typename(v)))
  end
  -- json.encode builds the whole text at once: first make sure it fits,
  -- from a lower bound of its length (every node, string, separator, indent)
  local pad = type(indent) == 'number' and math.max(0, floor(indent)) or 0
  local item = #pystr(opts.item_sep or (indent and ',' or ', '))
  local key = #pystr(opts.key_sep or ': ')
  local total = 0
  local function size(v, level)
    work(1)
    local t = type(v)
    if t == 'string' then scan(#v); total = total + #v + 2
    elseif t ~= 'table' or v == none then total = total + 1
    elseif json.is_array(v) or json.is_object(v) then
      local arr = json.is_array(v)
      local ks = not arr and json.keys(v)
      local n = arr and #v or #ks
      total = total + 2
      if n > 0 then
        total = total + (n - 1) * item
        if indent then total = total + n * (1 + pad * (level + 1)) + 1 + pad * level end
        if not arr then total = total + n * (key + 2) end
      end
      if total > max_string then
        over('string', format('tojson text of more than %s bytes exceeds the limit of %s', show(total), show(max_string)))
      end
      for i = 1, n do
        if arr then size(v[i], level + 1) else scan(#tostring(ks[i])); total = total + #tostring(ks[i]); size(v[ks[i]], level + 1) end
      end
    end
    if total > max_string then
      over('string', format('tojson text of more than %s bytes exceeds the limit of %s', show(total), show(max_string)))
    end
  end
  size(x, 0)
  local out = json.encode(x, opts)
  alloc(#out)
  return out
end

local function attribute_of(v, path)
  for part in tostring(path):gmatch('[^.]+') do
    local n = tonumber(part)
    if n and kind(v) == 'list' then v = getitem(v, n) else v = attr(v, part) end
  end
  return v
end

local tests, filters = {}, {}

local function apply_test(name, v, args)
  local t = tests[name]
  if not t then fail(format("no test named '%s'", name)) end
  return t(v, unpack(args or {}))
end

tests.defined = function(v) return not is_undef(v) end
tests.undefined = function(v) return is_undef(v) end
tests.none = function(v) return v == none end
tests.string = function(v) return type(v) == 'string' end
tests.number = function(v) return type(v) == 'number' end
tests.integer = function(v) return type(v) == 'number' and v == floor(v) end
tests.float = function(v) return type(v) == 'number' and v ~= floor(v) end
tests.boolean = function(v) return type(v) == 'boolean' end
tests['true'] = function(v) return v == true end
tests['false'] = function(v) return v == false end
tests.mapping = function(v) return kind(v) == 'dict' end
tests.sequence = function(v) local k = kind(v); return k == 'list' or k == 'string' or k == 'dict' end
tests.iterable = function(v) local k = kind(v); return k == 'list' or k == 'string' or k == 'dict' or k == 'undefined' end
tests.callable = function(v) return kind(v) == 'callable' end
tests.odd = function(v) return num(v, 'odd') % 2 == 1 end
tests.even = function(v) return num(v, 'even') % 2 == 0 end
tests.divisibleby = function(v, n) return num(v, 'divisibleby') % n == 0 end
tests.lower = function(v) return type(v) == 'string' and v:lower() == v end
tests.upper = function(v) return type(v) == 'string' and v:upper() == v end
tests.equalto = eq
tests.eq = eq
tests['=='] = eq
tests.ne = function(a, b) return not eq(a, b) end
tests['!='] = tests.ne
tests.sameas = function(a, b) return a == b end
tests.lt = function(a, b) return compare('<', a, b) end
tests['<'] = tests.lt
tests.le = function(a, b) return compare('<=', a, b) end
tests['<='] = tests.le
tests.gt = function(a, b) return compare('>', a, b) end
tests['>'] = tests.gt
tests.ge = function(a, b) return compare('>=', a, b) end
tests['>='] = tests.ge
tests['in'] = function(a, b) return contains(b, a) end

-- tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False), as transformers defines it
filters.tojson = function(x, kw, ensure_ascii, indent, separators, sort_keys)
  kw = kw or {}
  if ensure_ascii ~= nil then kw.ensure_ascii = ensure_ascii end
  if indent ~= nil then kw.indent = indent end
  if separators ~= nil then kw.separators = separators end
  if sort_keys ~= nil then kw.sort_keys = sort_keys end
  return tojson(x, kw)
end
filters.trim = function(s, kw, chs) return strip(pystr(s), chs, true, true) end
filters.length = function(v)
  if type(v) == 'string' then return slen(v) end
  local k = kind(v)
  if k == 'list' then return #v end
  if k == 'dict' then return #json.keys(v) end
  if k == 'undefined' then return 0 end
  fail(format("object of type '%s' has no len()", typename(v)))
end
filters.count = filters.length
filters.string = function(v) return pystr(v) end
filters.list = function(v)
  local out = {}
  local items = iterate(v)
  work(#items)
  for i, x in ipairs(items) do out[i] = x end
  return list(out)
end
filters.join = function(v, kw, sep, attribute)
  sep = sep or (kw and kw.d) or ''
  attribute = attribute or (kw and kw.attribute)
  local items = iterate(v)
  work(#items)
  local parts = {}
  for i, x in ipairs(items) do
    if attribute then x = attribute_of(x, attribute) end
    parts[i] = pystr(x)
  end
  return join_parts(parts, pystr(sep))
end
filters.first = function(v)
  local items = iterate(v)
  if #items == 0 then return undef('first') end
  return items[1]
end
filters.last = function(v)
  local items = iterate(v)
  if #items == 0 then return undef('last') end
  return items[#items]
end
filters.default = function(v, kw, default, boolean)
  default = default or (kw and kw.default_value) or ''
  boolean = boolean or (kw and kw.boolean)
  if is_undef(v) or (boolean and not truthy(v)) then return default end
  return v
end
filters.d = filters.default
filters.upper = function(s) return string_methods.upper(pystr(s)) end
filters.lower = function(s) return string_methods.lower(pystr(s)) end
filters.capitalize = function(s) return capitalize(pystr(s)) end
filters.title = function(s) return title(pystr(s)) end
filters.replace = function(s, kw, old, new, count) return replace(pystr(s), old, new, count) end
filters.indent = function(s, kw, width, first, blank)
  kw = kw or {}
  width = width or kw.width or 4
  first = first or kw.first
  blank = blank or kw.blank
  if type(width) ~= 'string' then alloc(num(width, 'indent')) end
  local pad = type(width) == 'string' and width or string.rep(' ', width)
  s = pystr(s)
  alloc(#s + 1)
  local lines = {}
  for line in (s .. '\n'):gmatch('(.-)\n') do work(1); lines[#lines + 1] = line end
  local trailing = sub(s, -1) == '\n'
  if trailing then lines[#lines] = nil end
  alloc(#s + #lines * #pad + 1)   -- the most the indented text can take
  for i = 2, #lines do
    if truthy(blank) or not lines[i]:match('^[ \t\r\f\v]*$') then lines[i] = pad .. lines[i] end
  end
  local out = concat(lines, '\n')
  if trailing then out = out .. '\n' end
  if truthy(first) then out = pad .. out end
  return out
end
filters.items = function(v)
  if is_undef(v) then return list({}) end
  if kind(v) ~= 'dict' then fail("items filter: expected a mapping, got '" .. typename(v) .. "'") end
  return dict_methods.items(v)
end
filters.safe = function(v) return v end
filters.abs = function(v) return math.abs(num(v, 'abs')) end
filters.int = function(v)
  if type(v) == 'string' then return tonumber(v) and floor(tonumber(v)) or 0 end
  if type(v) == 'number' then return v >= 0 and floor(v) or -floor(-v) end
  return 0
end
filters.float = function(v) return tonumber(v) or 0 end
filters.reverse = function(v)
  if type(v) == 'string' then return slice(v, nil, nil, -1) end
  return slice(filters.list(v), nil, nil, -1)
end
filters.unique = function(v)
  local out = {}
  for _, x in ipairs(iterate(v)) do
    local seen = false
    work(#out + 1)
    for i = 1, #out do if eq(out[i], x) then seen = true; break end end
    if not seen then out[#out + 1] = x end
  end
  return list(out)
end
filters.sum = function(v)
  local s = 0
  local items = iterate(v)
  work(#items)
  for _, x in ipairs(items) do s = s + num(x, 'sum') end
  return s
end
filters.map = function(v, kw, name, ...)
  local out = {}
  local attribute = kw and kw.attribute
  local extra = { ... }
  local items = iterate(v)
  work(#items)
  for i, x in ipairs(items) do
    if attribute then
      local y = attribute_of(x, attribute)
      if is_undef(y) and kw.default ~= nil then y = kw.default end
      out[i] = y
    else
      local f = filters[name]
      if not f then fail(format("no filter named '%s'", tostring(name))) end
      out[i] = f(x, nil, unpack(extra))
    end
  end
  return list(out)
end
local function select_by(v, want, get, testname, args)
  local out = {}
  local items = iterate(v)
  work(#items)
  for _, x in ipairs(items) do
    local y = get(x)
    local ok
    if testname == nil then ok = truthy(y) else ok = apply_test(testname, y, args) end
    if ok == want then out[#out + 1] = x end
  end
  return list(out)
end
filters.select = function(v, kw, testname, ...) return select_by(v, true, function(x) return x end, testname, { ... }) end
filters.reject = function(v, kw, testname, ...) return select_by(v, false, function(x) return x end, testname, { ... }) end
filters.selectattr = function(v, kw, a, testname, ...)
  return select_by(v, true, function(x) return attribute_of(x, a) end, testname, { ... })
end
filters.rejectattr = function(v, kw, a, testname, ...)
  return select_by(v, false, function(x) return attribute_of(x, a) end, testname, { ... })
end
filters.wordcount = function(s)
  s = pystr(s)
  scan(#s)
  local n = 0
  for _ in s:gmatch('%S+') do n = n + 1 end
  return n
end
filters.center = function(s, kw, width)
  s = pystr(s); width = width or 80
  local pad = num(width, 'center') - slen(s)
  if pad <= 0 then return s end
  alloc(#s + pad)
  local left = floor(pad / 2) + ((pad % 2 == 1 and width % 2 == 1) and 1 or 0)
  return string.rep(' ', left) .. s .. string.rep(' ', pad - left)
end

M.filters, M.tests = filters, tests

---------------------------------------------------------------- calls

local function call(f, args, kw)
  local mt = getmetatable(f)
  if mt == BuiltinMT then return f.fn(args, kw) end
  if mt == MacroMT then return f.fn(args, kw) end
  if is_undef(f) then fail(format("'%s' is undefined", f.name)) end
  fail(format("'%s' object is not callable", typename(f)))
end
M.call = call

local function builtin(fn) return setmetatable({ fn = fn }, BuiltinMT) end

local globals = {
  raise_exception = builtin(function(args) fail(pystr(args[1])) end),
  namespace = builtin(function(args, kw)
    local ns = setmetatable({}, NamespaceMT)
    if args[1] and kind(args[1]) == 'dict' then
      local keys = json.keys(args[1])
      work(#keys)
      for _, k in ipairs(keys) do ns[k] = args[1][k] end
    end
    if kw then for k, v in pairs(kw) do ns[k] = v end end
    return ns
  end),
  range = builtin(function(args)
    if #args == 0 then fail('range expected at least 1 argument, got 0') end
    if #args > 3 then fail(format('range expected at most 3 arguments, got %d', #args)) end
    for i = 1, #args do
      local v = args[i]
      if type(v) == 'boolean' then args[i] = v and 1 or 0
      elseif type(v) ~= 'number' or v ~= floor(v) then
        if is_undef(v) then fail(format("'%s' is undefined", v.name)) end
        fail(format("'%s' object cannot be interpreted as an integer", type(v) == 'number' and 'float' or typename(v)))
      end
    end
    local a, b, step = args[1], args[2], args[3] or 1
    if b == nil then a, b = 0, a end
    if step == 0 then fail('range() arg 3 must not be zero') end
    local n = step > 0 and math.ceil((b - a) / step) or math.ceil((a - b) / -step)
    if n < 0 then n = 0 end
    if not (n <= max_range) then over('range', format('range of %s items exceeds the limit of %s', show(n), show(max_range))) end
    work(n)
    local out = {}
    for i = 1, n do out[i] = a + (i - 1) * step end
    return list(out)
  end),
  dict = builtin(function(args, kw)
    local d = json.object()
    if kw then
      local ks = {}
      for k in pairs(kw) do ks[#ks + 1] = k end
      table.sort(ks)
      for _, k in ipairs(ks) do d[k] = kw[k] end
    end
    return d
  end),
}

---------------------------------------------------------------- lexer

local CompileError = {}
CompileError.__tostring = function(e) return e.message end

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
      toks[#toks + 1] = { t = 'num', v = tonumber((w:gsub('_', ''))) }
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

---------------------------------------------------------------- parser + code generation

-- An expression compiles to a Lua expression string that evaluates to a
-- Jinja value. Helpers live in the table R, upvalue of the generated code.

local function new_parser(toks, cerr)
  local P = { toks = toks, i = 1 }
  function P.peek(k) return toks[P.i + (k or 0)] end
  function P.next() local t = toks[P.i]; P.i = P.i + 1; return t end
  function P.is(t, v) local tk = toks[P.i]; return tk.t == t and (v == nil or tk.v == v) end
  function P.accept(t, v) if P.is(t, v) then return P.next() end end
  function P.expect(t, v)
    local tk = toks[P.i]
    if tk.t ~= t or (v ~= nil and tk.v ~= v) then
      cerr(format("expected '%s', found %s", v or t, tk.t == 'eof' and 'end of tag' or ("'" .. tostring(tk.v) .. "'")))
    end
    P.i = P.i + 1
    return tk
  end
  function P.name_is(v) return P.is('name', v) end
  return P
end

local function q(s) return format('%q', s):gsub('\n', 'n'):gsub('\\\r', '\\r') end
-- %q writes a newline as backslash + newline; keep the generated code on one line
q = function(s)
  return '"' .. s:gsub('[%c"\\]', function(c)
    return format('\\%03d', byte(c))
  end) .. '"'
end

local Compiler = {}
Compiler.__index = Compiler

function Compiler:expr(P) return self:ifexpr(P) end

-- Expressions used as conditions compile to plain Lua booleans where they
-- can (and/or/not, comparisons, tests), so that an 'if' needs no closures.
function Compiler:truth(code) return self.conds[code] or ('R.T(' .. code .. ')') end
function Compiler:boolean(code) self.conds[code] = code; return code end

-- code that is safe to evaluate eagerly (no error, no side effect)
local function simple_value(code)
  return code == 'true' or code == 'false' or code == 'R.none' or code:match('^"[^"]*"$') ~= nil
    or tonumber(code) ~= nil or code:match('^R%.var%(S%["[%w_]+"%], "[%w_]+"%)$') ~= nil
end

function Compiler:ifexpr(P)
  local a = self:orexpr(P)
  while P.name_is('if') do
    P.next()
    local cond = self:orexpr(P)
    local b = 'R.undef("else")'
    if P.accept('name', 'else') then b = self:ifexpr(P) end
    if simple_value(a) and simple_value(b) then
      a = format('R.pick(%s, %s, %s)', self:truth(cond), a, b)
    else
      a = format('R.ifx(%s, function() return %s end, function() return %s end)', self:truth(cond), a, b)
    end
  end
  return a
end

-- 'or' / 'and' return one of their operands, as Python does; the right
-- operand is evaluated only when needed
local function logic(word, helper, operand)
  return function(self, P)
    local a = self[operand](self, P)
    while P.accept('name', word) do
      local b = self[operand](self, P)
      local value = format('R.%s(%s, function() return %s end)', helper, a, b)
      self.conds[value] = format('(%s %s %s)', self:truth(a), word, self:truth(b))
      a = value
    end
    return a
  end
end
Compiler.orexpr = logic('or', 'OR', 'andexpr')
Compiler.andexpr = logic('and', 'AND', 'notexpr')

function Compiler:notexpr(P)
  if P.name_is('not') then
    P.next()
    return self:boolean(format('(not %s)', self:truth(self:notexpr(P))))
  end
  return self:compare(P)
end

local cmp_ops = { ['=='] = true, ['!='] = true, ['<'] = true, ['>'] = true, ['<='] = true, ['>='] = true }

function Compiler:compare(P)
  local a = self:math1(P)
  local parts = {}
  while true do
    local op
    if P.is('op') and cmp_ops[P.peek().v] then op = P.next().v
    elseif P.name_is('in') then P.next(); op = 'in'
    elseif P.name_is('not') and P.peek(1).t == 'name' and P.peek(1).v == 'in' then P.next(); P.next(); op = 'notin'
    else break end
    parts[#parts + 1] = { op, self:math1(P) }
  end
  if #parts == 0 then return a end
  -- chained comparisons: a < b < c == (a < b) and (b < c); operands are
  -- evaluated more than once here, which is fine for side-effect-free templates
  local conds = {}
  local left = a
  for _, p in ipairs(parts) do
    local op, right = p[1], p[2]
    local c
    if op == '==' then c = format('R.eq(%s, %s)', left, right)
    elseif op == '!=' then c = format('(not R.eq(%s, %s))', left, right)
    elseif op == 'in' then c = format('R.contains(%s, %s)', right, left)
    elseif op == 'notin' then c = format('(not R.contains(%s, %s))', right, left)
    else c = format('R.cmp(%q, %s, %s)', op, left, right) end
    conds[#conds + 1] = c
    left = right
  end
  return self:boolean('(' .. concat(conds, ' and ') .. ')')
end

function Compiler:math1(P)
  local a = self:concat(P)
  while P.is('op', '+') or P.is('op', '-') do
    local op = P.next().v
    local b = self:concat(P)
    if op == '+' then a = format('R.add(%s, %s)', a, b) else a = format('R.arith("-", %s, %s)', a, b) end
  end
  return a
end

function Compiler:concat(P)
  local a = self:math2(P)
  local parts = nil
  while P.accept('op', '~') do
    parts = parts or { a }
    parts[#parts + 1] = self:math2(P)
  end
  if parts then return 'R.cat(' .. concat(parts, ', ') .. ')' end
  return a
end

function Compiler:math2(P)
  local a = self:pow(P)
  while P.is('op', '*') or P.is('op', '/') or P.is('op', '//') or P.is('op', '%') do
    local op = P.next().v
    a = format('R.arith(%q, %s, %s)', op, a, self:pow(P))
  end
  return a
end

function Compiler:pow(P)
  local a = self:unary(P)
  while P.accept('op', '**') do a = format('R.arith("**", %s, %s)', a, self:unary(P)) end
  return a
end

function Compiler:unary(P, with_filter)
  local node
  if P.accept('op', '-') then
    node = format('R.arith("-", 0, %s)', self:unary(P, false))
  elseif P.accept('op', '+') then
    node = self:unary(P, false)
  else
    node = self:primary(P)
  end
  node = self:postfix(P, node)
  if with_filter ~= false then node = self:filter_expr(P, node) end
  return node
end

-- call arguments: returns Lua code for the positional list and the keyword table
function Compiler:call_args(P)
  P.expect('op', '(')
  local pos, kw = {}, {}
  while not P.is('op', ')') do
    if #pos + #kw > 0 then P.expect('op', ',') end
    if P.is('op', ')') then break end
    if P.is('name') and P.peek(1).t == 'op' and P.peek(1).v == '=' then
      local k = P.next().v
      P.next()
      kw[#kw + 1] = format('[%q] = %s', k, self:expr(P))
    elseif P.is('op', '*') then
      self:cerr('*args in calls')
    else
      if #kw > 0 then self:cerr('a positional argument after a keyword argument') end
      pos[#pos + 1] = self:expr(P)
    end
  end
  P.expect('op', ')')
  return pos, kw
end

function Compiler:primary(P)
  local tk = P.next()
  if tk.t == 'str' then
    local s = tk.v
    while P.is('str') do s = s .. P.next().v end  -- adjacent literals concatenate
    return q(s)
  elseif tk.t == 'num' then
    return format('%.17g', tk.v)
  elseif tk.t == 'name' then
    local v = tk.v
    if v == 'true' or v == 'True' then return 'true' end
    if v == 'false' or v == 'False' then return 'false' end
    if v == 'none' or v == 'None' then return 'R.none' end
    if v == 'loop' then self.uses_loop = true end
    return format('R.var(S[%q], %q)', v, v)
  elseif tk.t == 'op' and tk.v == '(' then
    if P.accept('op', ')') then return 'R.tuple({})' end
    local e = self:expr(P)
    if P.is('op', ',') then
      local items = { e }
      while P.accept('op', ',') do
        if P.is('op', ')') then break end
        items[#items + 1] = self:expr(P)
      end
      P.expect('op', ')')
      return 'R.tuple({' .. concat(items, ', ') .. '})'
    end
    P.expect('op', ')')
    return e
  elseif tk.t == 'op' and tk.v == '[' then
    local items = {}
    while not P.is('op', ']') do
      if #items > 0 then P.expect('op', ',') end
      if P.is('op', ']') then break end
      items[#items + 1] = self:expr(P)
    end
    P.expect('op', ']')
    return 'R.list({' .. concat(items, ', ') .. '})'
  elseif tk.t == 'op' and tk.v == '{' then
    local items = {}
    while not P.is('op', '}') do
      if #items > 0 then P.expect('op', ',') end
      if P.is('op', '}') then break end
      local k = self:expr(P)
      P.expect('op', ':')
      items[#items + 1] = k
      items[#items + 1] = self:expr(P)
    end
    P.expect('op', '}')
    return 'R.object({' .. concat(items, ', ') .. '})'
  end
  self:cerr(format("unexpected %s", tk.t == 'eof' and 'end of tag' or ("'" .. tostring(tk.v) .. "'")))
end

function Compiler:postfix(P, node)
  while true do
    if P.is('op', '.') then
      P.next()
      local name = P.expect('name').v
      if P.is('op', '(') then
        local pos, kw = self:call_args(P)
        if #kw > 0 then self:cerr("keyword arguments in a method call ('." .. name .. "')") end
        local args = #pos > 0 and (', ' .. concat(pos, ', ')) or ''
        node = format('R.method(%s, %q%s)', node, name, args)
      else
        node = format('R.attr(%s, %q)', node, name)
      end
    elseif P.is('op', '[') then
      P.next()
      local parts, cur, colons = {}, nil, 0
      while not P.is('op', ']') do
        if P.accept('op', ':') then
          parts[colons + 1] = cur or 'nil'
          cur = nil
          colons = colons + 1
        else
          cur = self:expr(P)
        end
      end
      P.expect('op', ']')
      if colons == 0 then
        if not cur then self:cerr('empty subscript') end
        node = format('R.getitem(%s, %s)', node, cur)
      else
        parts[colons + 1] = cur or 'nil'
        node = format('R.slice(%s, %s, %s, %s)', node, parts[1], parts[2], parts[3] or 'nil')
      end
    elseif P.is('op', '(') then
      local pos, kw = self:call_args(P)
      node = format('R.call(%s, {%s}, {%s})', node, concat(pos, ', '), concat(kw, ', '))
    else
      return node
    end
  end
end

local test_arg_stop = { ['else'] = true, ['or'] = true, ['and'] = true, ['if'] = true, ['in'] = true, ['is'] = true, ['not'] = true }

function Compiler:filter_expr(P, node)
  while true do
    if P.accept('op', '|') then
      local name = P.expect('name').v
      while P.accept('op', '.') do name = name .. '.' .. P.expect('name').v end
      if not filters[name] then self:cerr(format("unsupported filter '%s'", name)) end
      local pos, kw = {}, {}
      if P.is('op', '(') then pos, kw = self:call_args(P) end
      local args = #pos > 0 and (', ' .. concat(pos, ', ')) or ''
      node = format('R.filters[%q](%s, %s%s)', name, node, #kw > 0 and ('{' .. concat(kw, ', ') .. '}') or 'nil', args)
    elseif P.name_is('is') then
      P.next()
      local negate = P.accept('name', 'not') ~= nil
      local tk = P.next()
      local name
      if tk.t == 'name' then name = tk.v
      elseif tk.t == 'op' and cmp_ops[tk.v] then name = tk.v
      else self:cerr('expected a test name after is') end
      if not tests[name] then self:cerr(format("unsupported test '%s'", name)) end
      local args = {}
      if P.is('op', '(') then
        local kw
        args, kw = self:call_args(P)
        if #kw > 0 then self:cerr('keyword arguments to a test') end
      elseif (P.is('str') or P.is('num') or (P.is('name') and not test_arg_stop[P.peek().v])
          or P.is('op', '[') or P.is('op', '{')) then
        args = { self:postfix(P, self:primary(P)) }
      end
      local a = #args > 0 and (', ' .. concat(args, ', ')) or ''
      node = format('%sR.tests[%q](%s%s)', negate and 'not ' or '', name, node, a)
      if negate then node = '(' .. node .. ')' end
      self:boolean(node)
    elseif P.is('op', '(') then
      local pos, kw = self:call_args(P)
      node = format('R.call(%s, {%s}, {%s})', node, concat(pos, ', '), concat(kw, ', '))
    else
      return node
    end
  end
end

-- statement-level code emission

function Compiler:emit(s) local c = self.code; c[#c + 1] = string.rep('  ', self.depth) .. s end

function Compiler:tmp(prefix) self.ntmp = self.ntmp + 1; return (prefix or 't') .. self.ntmp end

-- assignment targets: name, ns.attr, or a tuple of names
function Compiler:parse_target(P)
  local names = {}
  repeat
    local n = P.expect('name').v
    if P.accept('op', '.') then
      local a = P.expect('name').v
      names[#names + 1] = { ns = n, attr = a }
    else
      names[#names + 1] = { name = n }
    end
  until not P.accept('op', ',')
  return names
end

function Compiler:assign(targets, value_code)
  if #targets == 1 then
    local t = targets[1]
    if t.ns then
      self:emit(format('R.setattr(R.var(S[%q], %q), %q, %s)', t.ns, t.ns, t.attr, value_code))
    else
      self:emit(format('rawset(S, %q, %s)', t.name, value_code))
    end
    return
  end
  local v = self:tmp('u')
  self:emit(format('local %s = R.unpack_n(%s, %d)', v, value_code, #targets))
  for i, t in ipairs(targets) do
    if t.ns then self:cerr('namespace attributes in a tuple assignment') end
    self:emit(format('rawset(S, %q, %s[%d])', t.name, v, i))
  end
end

local end_tags = {
  ['if'] = { elif = true, ['else'] = true, endif = true },
  ['for'] = { ['else'] = true, endfor = true },
}

function Compiler:cerr(msg)
  error(setmetatable({ message = format('%s:%d: %s', self.name, self.line or 0, msg) }, CompileError), 0)
end

-- compile pieces until one of the block names in `stop` is met; returns it
function Compiler:body(stop)
  while true do
    local p = self.pieces[self.pi]
    if not p then
      if stop then
        local want = {}
        for k in pairs(stop) do want[#want + 1] = "'" .. k .. "'" end
        table.sort(want)
        self:cerr('unexpected end of template, expected ' .. concat(want, ' or '))
      end
      return nil
    end
    self.pi = self.pi + 1
    if p.kind == 'text' then
      self:emit(format('n = n + 1; o[n] = %s; ob = ob + %d; if ob > R.max_string then R.too_long(ob) end', q(p.text), #p.text))
    else
      self.line = p.line
      local toks = tokenize(p.text, p.line, function(m) self:cerr(m) end)
      local P = new_parser(toks, function(m) self:cerr(m) end)
      if p.kind == 'var' then
        self:emit(format('LN = %d', p.line))
        local e = self:expr(P)
        P.expect('eof')
        self:emit(format('n = n + 1; o[n], ob = R.out(%s, ob)', e))
      else
        local kw = P.expect('name').v
        if stop and stop[kw] then return kw, P end
        self:statement(kw, P)
      end
    end
  end
end

function Compiler:block(stop)
  self.depth = self.depth + 1
  local kw, P = self:body(stop)
  self.depth = self.depth - 1
  return kw, P
end

function Compiler:statement(kw, P)
  self:emit(format('LN = %d', self.line))
  if kw == 'if' then
    local c = self:expr(P); P.expect('eof')
    self:emit(format('if %s then', self:truth(c)))
    while true do
      local k, P2 = self:block(end_tags['if'])
      if k == 'elif' then
        local c2 = self:expr(P2); P2.expect('eof')
        self:emit(format('elseif %s then', self:truth(c2)))
      elseif k == 'else' then
        P2.expect('eof')
        self:emit('else')
        local k2, P3 = self:block({ endif = true })
        P3.expect('eof')
        break
      else
        P2.expect('eof')
        break
      end
    end
    self:emit('end')
  elseif kw == 'for' then
    local targets = self:parse_target(P)
    for _, t in ipairs(targets) do if t.ns then self:cerr('a namespace attribute as a loop variable') end end
    P.expect('name', 'in')
    local iter = self:orexpr(P)  -- 'if' here is the loop filter, not a conditional expression
    local filter
    if P.accept('name', 'if') then filter = P end
    local filter_code
    if filter then filter_code = self:expr(P) end
    if P.accept('name', 'recursive') then self:cerr("recursive for loops ('recursive')") end
    P.expect('eof')
    local items, nitems, it, parent = self:tmp('items'), self:tmp('n'), self:tmp('i'), self:tmp('S')
    local label = self:tmp('continue')
    self:emit('do')
    self:emit(format('local %s = R.iterate(%s)', items, iter))
    self:emit(format('local %s = S', parent))
    if filter_code then
      -- the loop filter sees the loop variables; build the filtered list first
      local src, k = self:tmp('src'), self:tmp('k')
      self:emit(format('local %s = %s; %s = {}', src, items, items))
      self:emit(format('for %s = 1, #%s do', k, src))
      self:emit(format('  R.tick(); local S = setmetatable({}, {__index = %s})', parent))
      self:depth_assign(targets, format('%s[%s]', src, k))
      self:emit(format('  if %s then %s[#%s + 1] = %s[%s] end', self:truth(filter_code), items, items, src, k))
      self:emit('end')
    end
    self:emit(format('local %s = #%s', nitems, items))
    local mt = self:tmp('mt')
    self:emit(format('local %s = {__index = %s}', mt, parent))
    self:emit(format('for %s = 1, %s do', it, nitems))
    self.depth = self.depth + 1
    self:emit(format('R.tick(); local S = setmetatable({}, %s)', mt))
    -- the loop object is made only when the body mentions 'loop'
    local loop_line = #self.code + 1
    self:emit(format('rawset(S, "loop", R.loop(%s, %s, %s))', items, it, nitems))
    local saved_uses = self.uses_loop
    self.uses_loop = false
    self:assign(targets, format('%s[%s]', items, it))
    self.loop_depth = (self.loop_depth or 0) + 1
    local saved_label = self.loop_label
    self.loop_label = label
    self:emit('do')
    local k, P2 = self:block(end_tags['for'])
    self:emit('end')
    self:emit('::' .. label .. '::')
    if not self.uses_loop then self.code[loop_line] = '' end
    self.uses_loop = saved_uses or self.uses_loop
    self.loop_label = saved_label
    self.loop_depth = self.loop_depth - 1
    self.depth = self.depth - 1
    self:emit('end')
    P2.expect('eof')
    if k == 'else' then
      self:emit(format('if %s == 0 then', nitems))
      local k2, P3 = self:block({ endfor = true })
      P3.expect('eof')
      self:emit('end')
    end
    self:emit('end')
  elseif kw == 'set' then
    local targets = self:parse_target(P)
    if P.accept('op', '=') then
      local e = self:expr(P)
      P.expect('eof')
      self:assign(targets, e)
    else
      local filters_src = nil
      if P.is('op', '|') then self:cerr('filters on a block set') end
      P.expect('eof')
      -- block set: capture the body's output
      self:emit('do')
      self.depth = self.depth + 1
      self:emit('local o, n, ob = {}, 0, 0')
      local k, P2 = self:block({ endset = true })
      P2.expect('eof')
      self:emit('R.captured = R.join(o, n, ob)')
      self.depth = self.depth - 1
      self:emit('end')
      self:assign(targets, 'R.captured')
    end
  elseif kw == 'macro' then
    local name = P.expect('name').v
    P.expect('op', '(')
    local params, defaults = {}, {}
    while not P.is('op', ')') do
      if #params > 0 then P.expect('op', ',') end
      local pn = P.expect('name').v
      params[#params + 1] = pn
      if P.accept('op', '=') then defaults[#params] = self:expr(P) end
    end
    P.expect('op', ')')
    P.expect('eof')
    local plist, dlist = {}, {}
    for i, pn in ipairs(params) do
      plist[i] = format('%q', pn)
      dlist[i] = defaults[i] and format('[%d] = function(S) return %s end', i, defaults[i]) or nil
    end
    local dl = {}
    for i = 1, #params do if dlist[i] then dl[#dl + 1] = dlist[i] end end
    self:emit(format('rawset(S, %q, R.macro(%q, {%s}, {%s}, S, function(S)', name, name, concat(plist, ', '), concat(dl, ', ')))
    self.depth = self.depth + 1
    self:emit('local o, n, ob = {}, 0, 0')
    local saved = self.loop_depth
    self.loop_depth = 0
    local k, P2 = self:block({ endmacro = true })
    self.loop_depth = saved
    P2.expect('eof')
    self:emit('return R.join(o, n, ob)')
    self.depth = self.depth - 1
    self:emit('end))')
  elseif kw == 'break' or kw == 'continue' then
    P.expect('eof')
    if (self.loop_depth or 0) == 0 then self:cerr(format("'%s' outside a for loop", kw)) end
    if kw == 'break' then self:emit('do break end') else self:emit('goto ' .. self.loop_label) end
  elseif kw == 'generation' then
    P.expect('eof')
    self:emit('do')
    local k, P2 = self:block({ endgeneration = true })
    P2.expect('eof')
    self:emit('end')
  elseif kw == 'raw' then
    self:cerr("'raw' blocks")
  else
    self:cerr(format("unsupported tag '%s'", kw))
  end
end

function Compiler:depth_assign(targets, value_code)
  self.depth = self.depth + 1
  self:assign(targets, value_code)
  self.depth = self.depth - 1
end

local function generate(src, name)
  local pieces = lex(src, name)
  local c = setmetatable({ pieces = pieces, pi = 1, code = {}, depth = 1, ntmp = 0, name = name, conds = {} }, Compiler)
  c:emit('local o, n, ob = {}, 0, 0')   -- the output: its pieces, their count, their bytes
  c:body(nil)
  c:emit('return R.join(o, n, ob)')
  local head = 'local R = ...\nlocal LN = 0\nlocal function line() return LN end\nreturn function(S)\n'
  -- 'break' inside the do-block of a loop body: Lua's break leaves the
  -- innermost loop, which is the for loop itself.
  return head .. concat(c.code, '\n') .. '\nend, line\n'
end

---------------------------------------------------------------- runtime table given to the generated code

local R = {
  none = none, T = truthy, str = pystr, eq = eq, cmp = compare, contains = contains, add = add, arith = arith,
  attr = attr, getitem = getitem, slice = slice, method = method, call = call, filters = filters, tests = tests,
  iterate = iterate, undef = undef,
}
function R.var(v, name) if v == nil then return undef(name) end return v end
function R.list(t) work(#t); return setmetatable(t, ArrayMT) end
function R.tuple(t) work(#t); return setmetatable(t, TupleMT) end
function R.object(kv) work(#kv / 2); return json.object(kv) end
-- one more loop iteration
function R.tick()
  steps = steps + 1
  if steps > max_steps then too_many_steps() end
end
-- a ~ b ~ ...
function R.cat(...)
  local n = select('#', ...)
  local parts, total = { ... }, 0
  for i = 1, n do
    local s = pystr(parts[i])
    parts[i] = s
    total = total + #s
  end
  alloc(total)
  return concat(parts, '', 1, n)
end
-- output buffers (of the template, a macro, a block set): o[1..n], of `bytes` bytes
R.max_string = max_string
function R.too_long(bytes)
  over('string', format('rendered text of %s bytes exceeds the limit of %s', show(bytes), show(max_string)))
end
function R.out(v, bytes)
  local s = pystr(v)
  bytes = bytes + #s
  if bytes > max_string then R.too_long(bytes) end
  return s, bytes
end
function R.join(o, n, bytes)
  scan(bytes)
  return concat(o, '', 1, n)
end
function R.ifx(c, a, b) if c then return a() end return b() end
function R.pick(c, a, b) if c then return a end return b end
function R.OR(a, b) if truthy(a) then return a end return b() end
function R.AND(a, b) if not truthy(a) then return a end return b() end
function R.setattr(ns, k, v)
  if getmetatable(ns) ~= NamespaceMT then fail(format("cannot assign attribute '%s' on a non-namespace object", k)) end
  rawset(ns, k, v)
end
function R.unpack_n(v, n)
  local items = iterate(v)
  if #items ~= n then fail(format('cannot unpack %d values into %d names', #items, n)) end
  return items
end
function R.loop(items, i, n)
  return setmetatable({ index = i, index0 = i - 1, first = i == 1, last = i == n, length = n,
    revindex = n - i + 1, revindex0 = n - i, [LoopMT] = items }, LoopMT)
end
LoopMT.__index = function(l, k)
  local items, i = rawget(l, LoopMT), rawget(l, 'index')
  if k == 'previtem' then if i > 1 then return items[i - 1] end return undef('previtem') end
  if k == 'nextitem' then if i < #items then return items[i + 1] end return undef('nextitem') end
end
function R.macro(name, params, defaults, defscope, body)
  local scope_mt = { __index = defscope }
  return setmetatable({ name = name, fn = function(args, kw)
    work(1)
    if depth >= max_depth then
      over('depth', format("macro calls nested deeper than %s (in '%s')", show(max_depth), name))
    end
    local S = setmetatable({}, scope_mt)
    for i, pn in ipairs(params) do
      local v = args[i]
      if v == nil and kw then v = kw[pn] end
      if v == nil and defaults[i] then v = defaults[i](S) end
      if v == nil then v = undef(pn) end
      rawset(S, pn, v)
    end
    if #args > #params then fail(format("macro '%s' takes not more than %d argument(s)", name, #params)) end
    depth = depth + 1
    local out = body(S)
    depth = depth - 1
    return out
  end }, MacroMT)
end

---------------------------------------------------------------- public

function M.source(src, name) return generate(src, name or 'template') end

-- Set the limits and counters for one render (opts.limits over M.limits);
-- returns those of a render in progress, for end_render to put back.
local function begin_render(over_limits)
  local saved = { max_range, max_steps, max_string, max_text, max_depth, steps, text_used, depth }
  local function get(k)
    local v = over_limits and over_limits[k]
    if v == nil then v = limits[k] end
    if type(v) ~= 'number' or v ~= v then error(format('jinja: limits.%s must be a number', k), 3) end
    return v
  end
  max_range, max_steps, max_string, max_text, max_depth = get('range'), get('steps'), get('string'), get('text'), get('depth')
  R.max_string = max_string
  steps, text_used, depth = 0, 0, 0
  return saved
end
local function end_render(saved)
  max_range, max_steps, max_string, max_text, max_depth, steps, text_used, depth = unpack(saved, 1, 8)
  R.max_string = max_string
end

local cache = setmetatable({}, { __mode = 'k' })   -- source -> name -> render

-- Compile a template; returns render(vars, opts) -> string.
function M.compile(src, name)
  name = name or 'template'
  local by_name = cache[src]
  if by_name and by_name[name] then return by_name[name] end
  local ok, code = pcall(generate, src, name)
  if not ok then
    if getmetatable(code) == CompileError then error(code.message, 0) end
    error(code, 0)
  end
  local chunk, err = load(code, '=' .. name)
  if not chunk then error('internal error compiling ' .. name .. ': ' .. err, 2) end
  local fn, line = chunk(R)
  local now   -- the clock strftime_now reads during one render (nil: the system clock)
  local g = {}
  for k, v in pairs(globals) do g[k] = v end
  g.strftime_now = builtin(function(args)
    local fmt = pystr(args[1])
    scan(16 * #fmt)   -- a conversion can write some 30 bytes for its 2
    local out = now and os.date('!' .. fmt, floor(now)) or os.date(fmt)   -- a fixed clock reads as UTC
    alloc(#out)
    return out
  end)
  local gmt = { __index = g }
  local function render(vars, opts)
    local saved_now = now
    now = opts and opts.now
    local ctx = setmetatable({}, gmt)
    for k, v in pairs(vars or {}) do ctx[k] = v end
    local S = setmetatable({}, { __index = ctx })
    local saved = begin_render(opts and opts.limits)
    local ok2, out = pcall(fn, S)
    end_render(saved)
    now = saved_now
    if not ok2 then
      if getmetatable(out) == RenderError then error(format('%s:%d: %s', name, line(), out.message), 2) end
      error(format('%s:%d: %s', name, line(), tostring(out)), 2)
    end
    return out
  end
  cache[src] = cache[src] or {}
  cache[src][name] = render
  return render
end

return M
