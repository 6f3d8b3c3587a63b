-- The Jinja subset on its own: error messages, compile-once caching, load().
local t = require('moonrl.testing')
local chat = require('moonrl.chat')
local jinja = require('moonrl.jinja')
local json = require('moonrl.json')

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

t.done()
