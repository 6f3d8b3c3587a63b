-- moonrl.text.jinja.compiler: a template's pieces (moonrl.text.jinja.lexer)
-- parsed and turned into Lua source. An expression becomes a Lua expression
-- over the helpers of R (moonrl.text.jinja.runtime); a tag ({% if %},
-- {% for %}, ...) becomes statements through its handler in `tags`.
--
--   compiler.generate(src, name) -> Lua source: `local R = ...` then
--     `return function(S) ... end, line`, S the variables' scope and line()
--     the template line being rendered (for error messages)
local lexer = require('moonrl.text.jinja.lexer')
local library = require('moonrl.text.jinja.filters')

local M = {}
local format, concat, byte = string.format, table.concat, string.byte
local CompileError, lex, tokenize = lexer.CompileError, lexer.lex, lexer.tokenize
local filters, tests = library.filters, library.tests

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

-- a Lua string literal on one line (%q writes a newline as backslash + newline)
local function q(s)
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

-- node(...): a call of whatever node evaluates to
function Compiler:call(P, node)
  local pos, kw = self:call_args(P)
  return format('R.call(%s, {%s}, {%s})', node, concat(pos, ', '), concat(kw, ', '))
end

function Compiler:primary(P)
  local tk = P.next()
  if tk.t == 'str' then
    local s = tk.v
    while P.is('str') do s = s .. P.next().v end  -- adjacent literals concatenate
    return q(s)
  elseif tk.t == 'num' then
    if tk.v == math.huge then return '(1/0)' end -- (%.17g writes inf, no Lua numeral)
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
      node = self:call(P, node)
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
      node = self:call(P, node)
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

-- The tags: tags[kw](self, P) compiles the statement {% kw ... %}, P the parser
-- positioned after kw; it reads the tag's body up to its end tag itself.
local tags = {}

tags['if'] = function(self, P)
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
      local _, P3 = self:block({ endif = true })
      P3.expect('eof')
      break
    else
      P2.expect('eof')
      break
    end
  end
  self:emit('end')
end

tags['for'] = function(self, P)
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
    local _, P3 = self:block({ endfor = true })
    P3.expect('eof')
    self:emit('end')
  end
  self:emit('end')
end

tags['set'] = function(self, P)
  local targets = self:parse_target(P)
  if P.accept('op', '=') then
    local e = self:expr(P)
    P.expect('eof')
    self:assign(targets, e)
    return
  end
  if P.is('op', '|') then self:cerr('filters on a block set') end
  P.expect('eof')
  -- block set: capture the body's output
  self:emit('do')
  self.depth = self.depth + 1
  self:emit('local o, n, ob = {}, 0, 0')
  local _, P2 = self:block({ endset = true })
  P2.expect('eof')
  self:emit('R.captured = R.join(o, n, ob)')
  self.depth = self.depth - 1
  self:emit('end')
  self:assign(targets, 'R.captured')
end

tags['macro'] = function(self, P)
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
  local plist, dl = {}, {}
  for i, pn in ipairs(params) do
    plist[i] = format('%q', pn)
    if defaults[i] then dl[#dl + 1] = format('[%d] = function(S) return %s end', i, defaults[i]) end
  end
  self:emit(format('rawset(S, %q, R.macro(%q, {%s}, {%s}, S, function(S)', name, name, concat(plist, ', '), concat(dl, ', ')))
  self.depth = self.depth + 1
  self:emit('local o, n, ob = {}, 0, 0')
  local saved = self.loop_depth
  self.loop_depth = 0   -- a loop around the macro's definition is not one its body can break
  local _, P2 = self:block({ endmacro = true })
  self.loop_depth = saved
  P2.expect('eof')
  self:emit('return R.join(o, n, ob)')
  self.depth = self.depth - 1
  self:emit('end))')
end

-- 'break' inside the do-block of a loop body: Lua's break leaves the
-- innermost loop, which is the for loop itself.
local function loop_control(kw)
  return function(self, P)
    P.expect('eof')
    if (self.loop_depth or 0) == 0 then self:cerr(format("'%s' outside a for loop", kw)) end
    if kw == 'break' then self:emit('do break end') else self:emit('goto ' .. self.loop_label) end
  end
end
tags['break'] = loop_control('break')
tags['continue'] = loop_control('continue')

-- {% generation %}: Hugging Face marks the assistant's tokens with it; it renders its body
tags['generation'] = function(self, P)
  P.expect('eof')
  self:emit('do')
  local _, P2 = self:block({ endgeneration = true })
  P2.expect('eof')
  self:emit('end')
end

tags['raw'] = function(self) self:cerr("'raw' blocks") end

function Compiler:statement(kw, P)
  self:emit(format('LN = %d', self.line))
  local handler = tags[kw]
  if not handler then self:cerr(format("unsupported tag '%s'", kw)) end
  handler(self, P)
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
  return head .. concat(c.code, '\n') .. '\nend, line\n'
end
M.generate = generate

return M
