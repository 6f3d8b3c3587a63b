-- moonrl.text.jinja.runtime: what a compiled template runs on. Values (undefined,
-- namespace, loop, macro), the limits of a render and their counters, Python's
-- str()/repr(), equality, iteration, indexing and slicing, the operators, calls,
-- and R: the table of helpers the generated Lua code calls (moonrl.text.jinja
-- adds the filters, tests and methods of moonrl.text.jinja.filters to it).
--
-- The counters (steps, text, depth) and the bounds of the render in progress
-- are upvalues of this file, not fields of a table: work(), scan() and
-- R.tick() run for nearly every value a template touches.
local json = require('moonrl.io.json')

local M = {}
local none = json.null
M.none = none
local ObjectMT, ArrayMT, TupleMT = json.ObjectMT, json.ArrayMT, json.TupleMT
local format, concat, find, sub = string.format, table.concat, string.find, string.sub
local floor = math.floor

---------------------------------------------------------------- values and errors

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
M.fail = fail
M.NamespaceMT = NamespaceMT

---------------------------------------------------------------- limits (see moonrl.text.jinja)

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

-- a plain search for `needle` in `hay`: memchr then memcmp at each candidate,
-- which costs up to #needle per byte on a repetitive text
local function search_cost(hay, needle)
  local m = type(needle) == 'string' and #needle or 1
  scan(#hay * math.max(1, math.ceil(m / 32)))
end

M.show, M.over, M.work, M.scan, M.alloc, M.search_cost = show, over, work, scan, alloc, search_cost

-- range() of n items: within limits.range
function M.check_range(n)
  if not (n <= max_range) then over('range', format('range of %s items exceeds the limit of %s', show(n), show(max_range))) end
end
-- the longest string this render may build (tojson checks its text against it while sizing it)
function M.max_string() return max_string end

---------------------------------------------------------------- kinds, strings, items

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
    if type(key) ~= 'number' or key ~= floor(key) or key - key ~= 0 then return undef(tostring(key)) end -- (0.5, NaN, inf: no index)
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

-- A slice bound as Python takes one: an integer, a boolean (0 or 1), None; anything else (0.5,
-- 'a') is Python's TypeError, which Jinja's getitem turns into an undefined (false: not a bound).
local function slice_bound(i)
  if i == nil or i == none then return i end
  if type(i) == 'boolean' then return i and 1 or 0 end
  if type(i) == 'number' and i == floor(i) and i - i == 0 then return i end -- (inf is a float too)
  return false
end

local function slice(obj, a, b, step)
  a, b, step = slice_bound(a), slice_bound(b), slice_bound(step)
  if a == false or b == false or step == false then return undef('slice') end
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
  -- (two loops: `items and items[i + 1] or sub(...)` took a false item of a list for a string)
  if items then for i = s, last, step do m = m + 1; out[m] = items[i + 1] end
  else for i = s, last, step do m = m + 1; out[m] = sub(obj, i + 1, i + 1) end end
  if k == 'string' then return concat(out) end
  return list(out)
end

M.is_ascii, M.slen, M.truthy, M.join_parts = is_ascii, slen, truthy, join_parts
M.typename, M.eq, M.list, M.iterate, M.getitem, M.slice = typename, eq, list, iterate, getitem, slice

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

M.num, M.compare, M.contains, M.attr = num, compare, contains, attr

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
M.builtin = builtin

---------------------------------------------------------------- runtime table given to the generated code

-- (R.filters, R.tests and R.method come from moonrl.text.jinja.filters: the
-- entry module sets them, since that module is built on this one)
local R = {
  none = none, T = truthy, str = pystr, eq = eq, cmp = compare, contains = contains, add = add, arith = arith,
  attr = attr, getitem = getitem, slice = slice, call = call, iterate = iterate, undef = undef,
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

M.R = R

---------------------------------------------------------------- one render

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

M.begin_render, M.end_render = begin_render, end_render

return M
