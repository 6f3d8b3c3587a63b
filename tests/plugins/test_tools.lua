-- moonrl.tools: the registry and its declarations for the chat templates, tool calls parsed from a
-- model's turn in Hermes/Qwen and Llama 3.1 formats (malformed ones reported, never raised), the
-- calls run with their failures as observations (a tool that raises, returns no text, or 100 MB),
-- the calculator's arithmetic (and what it refuses), and the python tool through the registry,
-- one interpreter an episode.
local t = require('moonrl.testing')
local tools = require('moonrl.tools')
local json = require('moonrl.io.json')

t.test('the registry: built-ins, declarations, a tool of the user\'s', function()
  t.truthy(tools.names()[1] == 'calculator' and tools.names()[2] == 'python', table.concat(tools.names(), ' '))
  local s = tools.schemas({ 'calculator' })
  t.eq(s[1].type, 'function')
  t.eq(s[1]['function'].name, 'calculator')
  t.eq(s[1]['function'].parameters.required[1], 'expression')
  tools.register('echo', { description = 'says it back', parameters = { type = 'object' },
    call = function(args) return tostring(args.text) end })
  t.eq(tools.call({ name = 'echo', arguments = { text = 'hi' } }), 'hi')
  t.raises(function() tools.register('bad', { call = 42 }) end, "tool 'bad' must be a table")
  t.raises(function() tools.register('echo', { call = print }) end, "tool 'echo' is already registered")
  t.raises(function() tools.get('nope') end, "unknown tool 'nope'")
end)

t.test('tool calls in a model\'s turn: Hermes/Qwen <tool_call>, Llama 3.1 JSON, the malformed ones reported', function()
  local calls, errors = tools.parse('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n' ..
    '</tool_call>\n<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>')
  t.eq(#calls, 2)
  t.eq(#errors, 0)
  t.eq(calls[1].name, 'calculator')
  t.eq(calls[1].arguments.expression, '2*3')
  t.eq(calls[2].arguments.code, 'print(1)', 'arguments given as a JSON string')
  calls = tools.parse('<|python_tag|>{"name": "calculator", "parameters": {"expression": "7+1"}}')
  t.eq(calls[1].name, 'calculator')
  t.eq(calls[1].arguments.expression, '7+1')
  calls = tools.parse('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', 'llama3')
  t.eq(#calls, 2)
  t.eq(calls[2].arguments.x, 1)
  t.eq(#tools.parse('the answer is 42'), 0, 'no call in plain text')
  local _, bad = tools.parse('<tool_call>{"name": "calculator", "arguments": {</tool_call>' ..
    '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "x", "arguments": 3}</tool_call>' ..
    '<tool_call>{"name": "ghost", "arguments": {}}</tool_call><tool_call>{"name": "calculator"', 'auto',
    { known = { calculator = true, x = true } })
  local msgs = {}
  for i, e in ipairs(bad) do msgs[i] = e.message end
  t.eq(#bad, 5, table.concat(msgs, ' | '))
  t.truthy(msgs[1]:find('not JSON', 1, true) and msgs[2]:find('names no tool', 1, true) and
    msgs[3]:find('not a JSON object', 1, true) and msgs[4]:find("no tool 'ghost'", 1, true) and
    msgs[5]:find('without its </tool_call>', 1, true), table.concat(msgs, ' | '))
end)

t.test('a call\'s failures are observations: a tool that raises, returns no text, or too much', function()
  tools.register('boom', { call = function() error('it broke') end })
  tools.register('table', { call = function() return {} end })
  tools.register('flood', { call = function() return string.rep('x', 100 * 2 ^ 20) end })
  local out, ok = tools.call({ name = 'boom', arguments = {} })
  t.truthy(not ok and out:find('^error: ') and out:find('it broke', 1, true), out)
  out, ok = tools.call({ name = 'table', arguments = {} })
  t.truthy(not ok and out:find('returned table, not text', 1, true), out)
  out, ok = tools.call({ name = 'flood', arguments = {} })
  t.truthy(ok and #out < 17000 and out:find('[cut: ', 1, true), 'cut to its budget')
  out, ok = tools.call({ name = 'ghost', arguments = {} })
  t.truthy(not ok and out:find("no tool 'ghost'", 1, true), out)
end)

t.test('the calculator: exact integers, precedence, and what it refuses', function()
  local calc = require('tools.calculator')
  local function eval(e) return tools.call({ name = 'calculator', arguments = { expression = e } }) end
  t.eq(eval('1234 * 5678'), '7006652')
  t.eq(eval('2 + 3 * 4 - 6 / 3'), '12')
  t.eq(eval('-2 ** 2'), '-4')
  t.eq(eval('2 ** 3 ** 2'), '512')
  t.eq(eval('(1 + 2) * -(3 - 10) // 2 % 7'), '3')
  t.eq(eval('1.5e3 / 4'), '375')
  t.eq(eval('10 / 4'), '2.5')
  t.eq(eval('9007199254740991 + 0'), '9007199254740991')
  for _, bad in ipairs({ '1 / 0', 'os.exit(1)', '2 +', '(1 + 2', '1 2', '', string.rep('1+', 600) .. '1', '10 ** 400' }) do
    local out, ok = eval(bad)
    t.truthy(not ok and out:find('^error: '), bad .. ' -> ' .. out)
  end
  t.eq(calc.format(calc.evaluate('7 // 2')), '3')
end)

t.test('the python tool through the registry: one interpreter an episode, closed with it', function()
  if not require('moonrl.sandbox').probe().namespaces then return print('  (no namespaces: skipped)') end
  local a, b = {}, {}
  t.eq(tools.call({ name = 'python', arguments = { code = 'x = 6\nx * 7' } }, a), '42\n')
  t.eq(tools.call({ name = 'python', arguments = { code = 'x + 1' } }, a), '7\n', 'the state of the episode')
  local out = tools.call({ name = 'python', arguments = { code = 'x' } }, b)
  t.truthy(out:find('NameError', 1, true), 'another episode, another interpreter: ' .. out)
  tools.close(a)
  tools.close(b)
  t.eq(a.python, nil)
  t.eq(json.encode(tools.parse('<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>')[1].arguments),
    '{"code": "1"}')
end)

t.done()
