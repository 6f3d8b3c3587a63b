-- moonrl.text.jinja.filters: what templates call by name. The methods of
-- strings, dicts and lists (s.strip(), d.items(), ...), the filters (| tojson,
-- | join, ...), the tests (is defined, is string, ...) and the globals
-- (namespace, range, dict, raise_exception; strftime_now is per template, see
-- moonrl.text.jinja). Each counts the work and text it does against the
-- render's limits (moonrl.text.jinja.runtime).
local json = require('moonrl.io.json')
local rt = require('moonrl.text.jinja.runtime')

local M = {}
local none, TupleMT, NamespaceMT = rt.none, json.TupleMT, rt.NamespaceMT
local format, concat, byte, sub, find = string.format, table.concat, string.byte, string.sub, string.find
local floor = math.floor
local fail, show, over, work, scan, alloc, search_cost = rt.fail, rt.show, rt.over, rt.work, rt.scan, rt.alloc, rt.search_cost
local undef, is_undef, kind, typename, truthy, pystr = rt.undefined, rt.is_undefined, rt.kind, rt.typename, rt.truthy, rt.str
local is_ascii, slen, join_parts, list, eq = rt.is_ascii, rt.slen, rt.join_parts, rt.list, rt.eq
local iterate, getitem, slice, num, compare, contains, attr = rt.iterate, rt.getitem, rt.slice, rt.num, rt.compare, rt.contains, rt.attr
local call, builtin = rt.call, rt.builtin

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
      if v ~= nil then return call(v, { ... }, nil) end
    end
  elseif k == 'list' then f = list_methods[name]
  elseif k == 'undefined' then fail(format("'%s' is undefined", obj.name))
  elseif k == 'namespace' or k == 'loop' then
    local v = obj[name]
    if v ~= nil then return call(v, { ... }, nil) end
  end
  if not f then fail(format("'%s' object has no method '%s'", typename(obj), name)) end
  return f(obj, ...)
end

M.method = method

---------------------------------------------------------------- filters and tests

local function tojson(x, kw)
  kw = kw or {}
  local indent = kw.indent
  if indent == none then indent = nil end
  -- (what json.dumps refuses with a TypeError: an indent that is not an integer, separators that
  -- are not two strings)
  if indent ~= nil and (type(indent) ~= 'number' or indent ~= floor(indent)) then
    fail(format('tojson: indent must be an integer (got %s)', typename(indent)))
  end
  local opts = { indent = indent, sort_keys = truthy(kw.sort_keys) }
  local seps = kw.separators
  if seps and seps ~= none then
    if type(seps) ~= 'table' or type(seps[1]) ~= 'string' or type(seps[2]) ~= 'string' then
      fail(format('tojson: separators must be two strings (got %s)', typename(seps)))
    end
    opts.item_sep, opts.key_sep = seps[1], seps[2]
  end
  if kw.ensure_ascii ~= nil and truthy(kw.ensure_ascii) then fail('tojson(ensure_ascii=True) is not supported') end
  opts.tostring = function(v)
    if is_undef(v) then fail('Object of type Undefined is not JSON serializable') end
    fail(format('Object of type %s is not JSON serializable', typename(v)))
  end
  -- json.encode builds the whole text at once: first make sure it fits,
  -- from a lower bound of its length (every node, string, separator, indent)
  local max_string = rt.max_string()   -- this render's bound
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

---------------------------------------------------------------- globals

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
    rt.check_range(n)
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

M.globals = globals

return M
