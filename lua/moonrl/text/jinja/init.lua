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
--
-- The files: runtime.lua (values, limits, operators, the helpers R that the
-- generated code calls), filters.lua (methods, filters, tests, globals),
-- lexer.lua (tags and tokens), compiler.lua (parser, tags, Lua source), and
-- this one (compile, render, the public names).
local rt = require('moonrl.text.jinja.runtime')
local library = require('moonrl.text.jinja.filters')
local lexer = require('moonrl.text.jinja.lexer')
local compiler = require('moonrl.text.jinja.compiler')

local M = {}
local format, floor = string.format, math.floor
local RenderError, CompileError = rt.RenderError, lexer.CompileError
local pystr, scan, alloc, builtin = rt.str, rt.scan, rt.alloc, rt.builtin
local generate, globals = compiler.generate, library.globals

M.none, M.limits, M.RenderError = rt.none, rt.limits, RenderError
M.undefined, M.is_undefined, M.kind, M.str, M.call = rt.undefined, rt.is_undefined, rt.kind, rt.str, rt.call
M.filters, M.tests = library.filters, library.tests

-- the generated code's helpers: the runtime's, and the filters, tests and methods
local R = rt.R
R.filters, R.tests, R.method = library.filters, library.tests, library.method

function M.source(src, name) return generate(src, name or 'template') end

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
    local saved = rt.begin_render(opts and opts.limits)
    local ok2, out = pcall(fn, S)
    rt.end_render(saved)
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
