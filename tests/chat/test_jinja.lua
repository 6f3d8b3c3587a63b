-- The Jinja subset on its own: error messages, compile-once caching, load(), and the limits on one render.
local t = require('moonrl.testing')
local chat = require('moonrl.chat')
local jinja = require('moonrl.text.jinja')
local json = require('moonrl.io.json')

t.test('unsupported constructs name themselves and their line', function()
  t.raises(function() chat.render('ok\n{% include "x" %}', {}) end, "chat_template:2: unsupported tag 'include'")
  t.raises(function() chat.render('{{ x | nosuch }}', {}) end, "chat_template:1: unsupported filter 'nosuch'")
  t.raises(function() chat.render('\n\n{{ x is nosuch }}', {}) end, "chat_template:3: unsupported test 'nosuch'")
  t.raises(function() chat.render('{% for x in y %}', {}) end, "expected 'else' or 'endfor'")
  t.raises(function() chat.render('{{ (1 }}', {}) end, "chat_template:1: expected ')'")
end)

t.test('runtime errors name the template line', function()
  t.raises(function() chat.render('a\nb\n{{ raise_exception("nope") }}', {}) end, 'chat_template:3: nope')
  t.raises(function() chat.render('{{ x.y.z }}', {}) end, "'x' is undefined")
  t.raises(function() chat.render('{{ x.y.z }}', { x = {} }) end, "'y' is undefined")
  t.raises(function() chat.render('{{ "a" + 1 }}', {}) end, "unsupported operand type(s) for +: 'str' and 'int'")
end)

t.test('values render as Python does', function()
  t.eq(chat.render('{{ a }}|{{ b }}|{{ c }}|{{ d }}|{{ e }}', { a = true, b = json.null, c = 2.5, d = 3, e = json.decode('{"x": [1, "y"]}') }),
    "True|None|2.5|3|{'x': [1, 'y']}")
  t.eq(chat.render('{{ m | tojson }}', { m = json.decode('{"z": 1, "a": "é\\n"}') }), '{"z": 1, "a": "é\\n"}')
end)

t.test('generation blocks render their body; macros; loop controls', function()
  t.eq(chat.render('{% for m in messages %}{% generation %}[{{ m }}]{% endgeneration %}{% endfor %}', { messages = { 'a', 'b' } }), '[a][b]')
  t.eq(chat.render('{% macro f(x, y=2) %}{{ x }}-{{ y }}{% endmacro %}{{ f(1) }} {{ f(1, y=3) }}', {}), '1-2 1-3')
  t.eq(chat.render('{% for i in range(9) %}{% if i is odd %}{% continue %}{% endif %}{% if i > 5 %}{% break %}{% endif %}{{ i }}{% endfor %}', {}), '024')
end)

-- A chat template is untrusted input: every render is bounded (the limits at
-- the top of moonrl/text/jinja/init.lua). Each of these must fail fast with the limit's name.
local function fails_fast(src, want, vars, opts)
  local t0 = os.clock()
  local fn = jinja.compile(src, 'chat_template')
  local msg = t.raises(function() fn(vars or {}, opts) end, want, src)
  local dt = os.clock() - t0
  t.truthy(dt < 1, string.format('%s: took %.3f s', src, dt))
  return msg
end

t.test('range: step 0 and huge ranges are errors', function()
  fails_fast('{% for i in range(0, 10, 0) %}x{% endfor %}', 'chat_template:1: range() arg 3 must not be zero')
  fails_fast('{{ range(10**9) | length }}', 'chat template: range of 1000000000 items exceeds the limit of 100000 (limits.range)')
  fails_fast('{% for i in range(5, -10**9, -1) %}{% endfor %}', 'range of 1000000005 items exceeds the limit of 100000')
  fails_fast('{{ range(1.5) }}', "'float' object cannot be interpreted as an integer")
  t.eq(chat.render('{{ range(4) }} {{ range(2, 10, 3) }} {{ range(10, 0, -3) }} {{ range(3, 1) }} {{ range(100000) | length }}', {}),
    '[0, 1, 2, 3] [2, 5, 8] [10, 7, 4, 1] [] 100000')
end)

t.test('the work of one render is bounded', function()
  -- 10^10 iterations
  fails_fast('{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}',
    'chat template: rendering exceeded 5000000 steps (limits.steps)')
  fails_fast('{% for i in range(100000) %}{% for j in range(100000) if j is odd %}{% endfor %}{% endfor %}',
    'rendering exceeded 5000000 steps')
  -- a list that doubles
  fails_fast('{% set ns = namespace(l=[1]) %}{% for i in range(100) %}{% set ns.l = ns.l + ns.l %}{% endfor %}',
    'rendering exceeded 5000000 steps')
  -- quadratic filters
  fails_fast('{{ range(100000) | unique | length }}', 'rendering exceeded 5000000 steps')
  -- searching a long text over and over
  fails_fast("{% set s = 'a' * 10000000 %}{% for i in range(100000) %}{% if 'b' in s %}{% endif %}{% endfor %}",
    'chat template: rendering handled more than 268435456 bytes of text (limits.text)')
end)

t.test('strings and the rendered text are bounded', function()
  fails_fast("{{ 'a' * 10**9 }}", 'chat template: a string of 1000000000 bytes exceeds the limit of 16777216 (limits.string)')
  fails_fast("{{ 10**9 * 'ab' }}", 'a string of 2000000000 bytes exceeds the limit')
  -- a string that doubles, by ~ and by +
  fails_fast("{% set ns = namespace(s='ab') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    'a string of 33554432 bytes exceeds the limit of 16777216')
  fails_fast("{% set ns = namespace(s='ab') %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    'a string of 33554432 bytes exceeds the limit of 16777216')
  -- output that grows
  fails_fast("{% set s = 'a' * 1000000 %}{% for i in range(100) %}{{ s }}{% endfor %}",
    'chat template: rendered text of 17000000 bytes exceeds the limit of 16777216 (limits.string)')
  fails_fast("{% set s = 'a' * 1000000 %}{% set x %}{% for i in range(100) %}{{ s }}{% endfor %}{% endset %}",
    'rendered text of 17000000 bytes exceeds the limit')
  fails_fast("{% for i in range(100000) %}" .. string.rep('x', 1000) .. "{% endfor %}", 'rendered text of 16778000 bytes exceeds the limit')
  -- filters and methods that build strings
  fails_fast("{% set s = 'a' * 1000000 %}{{ range(100) | map('string') | join(s) }}", 'a string of 99000190 bytes exceeds the limit')
  fails_fast("{{ ('x' * 1000000).replace('x', 'yyyyyyyyyyyyyyyyyyyy') }}", 'a string of 20000000 bytes exceeds the limit')
  fails_fast("{{ 'abc' | center(10**10) }}", 'a string of 10000000000 bytes exceeds the limit')
  fails_fast("{{ 'a\\nb' | indent(10**9) }}", 'a string of 1000000000 bytes exceeds the limit')
  fails_fast("{{ [1, 2] | tojson(indent=10**9) }}", 'tojson text of more than')
  fails_fast("{% set s = 'a' * 1000000 %}{{ range(100) | map('string') | list | tojson(separators=(s, ': ')) }}", 'tojson text of more than')
  -- what json.dumps refuses is a clean error (the fuzzer's find: a list as the indent crashed)
  fails_fast("{{ [1, 2] | tojson(indent=[1]) }}", 'tojson: indent must be an integer (got list)')
  fails_fast("{{ [1, 2] | tojson(indent=1.5) }}", 'tojson: indent must be an integer')
  fails_fast("{{ [1, 2] | tojson(separators=3) }}", 'tojson: separators must be two strings')
end)

t.test('macro recursion is bounded', function()
  fails_fast('{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}',
    "chat template: macro calls nested deeper than 100 (in 'f') (limits.depth)")
  t.eq(chat.render('{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(50) | length }}', {}), '91')
  -- a recursion that fans out, 2^40 calls: each call is a step (a lower limit keeps the test short)
  fails_fast('{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}',
    'rendering exceeded 200000 steps', {}, { limits = { steps = 200000 } })
end)

t.test('limits can be raised (or lowered) through the options', function()
  local fn = jinja.compile('{{ range(n) | length }}')
  t.raises(function() fn({ n = 200000 }) end, 'range of 200000 items exceeds the limit of 100000')
  t.eq(fn({ n = 200000 }, { limits = { range = 200000 } }), '200000')
  t.raises(function() fn({ n = 10 }, { limits = { steps = 5 } }) end, 'rendering exceeded 5 steps')
  t.raises(function() fn({ n = 10 }, { limits = { steps = 'x' } }) end, 'limits.steps must be a number')
  local loops = jinja.compile("{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}ok")
  t.raises(function() loops({}) end, 'rendering exceeded 5000000 steps')
  t.eq(loops({}, { limits = { steps = 2e7 } }), 'ok')
  local saved = jinja.limits.string
  jinja.limits.string = 10
  local ok, err = pcall(chat.render, "{{ 'a' * 11 }}", {})
  jinja.limits.string = saved
  t.eq(ok, false)
  t.truthy(tostring(err):find('a string of 11 bytes exceeds the limit of 10', 1, true), tostring(err))
  t.eq(chat.render("{{ 'a' * 11 }}", {}), 'aaaaaaaaaaa')
end)

t.test('compiled once, cached by source', function()
  local a = jinja.compile('{{ x }}', 'n')
  t.eq(a, jinja.compile('{{ x }}', 'n'), 'same function')
  t.eq(a({ x = 'v' }), 'v')
  t.truthy(jinja.source('{% for m in ms %}{{ m }}{% endfor %}'):find('for', 1, true), 'generated Lua')
end)

t.test('chat.load reads tokenizer_config.json (string and list forms)', function()
  local dir = os.tmpname()
  os.remove(dir)
  assert(os.execute('mkdir -p ' .. dir) == 0)
  local function write(name, s) local f = assert(io.open(dir .. '/' .. name, 'wb')); f:write(s); f:close() end
  write('tokenizer_config.json', json.encode(json.object {
    'bos_token', json.object { 'content', '<s>' }, 'eos_token', '</s>',
    'chat_template', { json.object { 'name', 'tool_use', 'template', 'T' }, json.object { 'name', 'default', 'template', '{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}' } } }))
  local tpl = chat.load(dir)
  t.eq(tpl:render({ { role = 'user', content = 'hi' } }), '<s>hi</s>')
  t.eq(chat.load(dir, { name = 'tool_use' }):render({}), 'T')
  t.raises(function() chat.load(dir, { name = 'nope' }) end, "no chat template named 'nope'")
  write('tokenizer_config.json', '{"chat_template": "{{ messages | length }}"}')
  t.eq(chat.load(dir):render({ {}, {} }), '2')
  os.execute('rm -rf ' .. dir)
end)

t.test('numerals past a double: inf as Python reads them, no index or slice bound', function()
  -- (LuaJIT's tonumber gives nil for an exponent of more digits than an int; found by fuzzing)
  t.eq(chat.render("{{ 21e7483648 }}|{{ 1e-99999999999 }}|{{ 'abc'[::21e7483648] }}|{{ [1, 2][1e400] }}|{{ 'abc'[1e400:] }}", {}),
    'inf|0|||')
end)

t.done()
