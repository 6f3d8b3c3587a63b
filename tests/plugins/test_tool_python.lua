-- The python tool (plugins/tools/python.lua) and the sandbox session under it: state kept from cell
-- to cell (cold and on a warm pool), a last expression's value, errors with the cell's frames only,
-- output of child processes, a cell past its time interrupted with the state kept, one that
-- ignores the interruption, an interpreter that exits or passes its memory limit (restarted, state
-- gone), output past its cap cut, and what a cell cannot reach (the host's files). Skipped (77)
-- without namespaces.
local t = require('moonrl.testing')
local sandbox = require('moonrl.sandbox')
local python = require('tools.python')

if not sandbox.probe().namespaces then
  print('skip: no namespaces here')
  os.exit(77)
end

local pool = sandbox.pool('python')

for _, mode in ipairs({ 'cold', 'pool' }) do
  t.test('cells share their state, as a notebook\'s (' .. mode .. ')', function()
    local py = python.new({ timeout_s = 2, pool = mode == 'pool' and pool or nil })
    t.eq(py:run('x = 21\nx * 2').output, '42\n')
    t.eq(py:run('import os\nprint(x + 1)\nos.system("echo from a child")').output, '22\nfrom a child\n0\n')
    local e = py:run('def f():\n    return 1 / 0\nf()')
    t.truthy(e.error:find('^Traceback') and e.error:find('ZeroDivisionError', 1, true) and not e.error:find('repl.py', 1, true),
      'the cell\'s frames only: ' .. tostring(e.error))
    local slow = py:run('import time\ny = 5\nwhile True:\n    time.sleep(0.01)')
    t.eq(slow.timed_out, true)
    t.eq(py:run('y * x').output, '105\n', 'the state kept after an interrupted cell')
    t.eq(py:run('print(open("/etc/shadow").read())').error ~= nil, true, 'the host\'s files out of reach')
    local big = py:run('print("z" * (1 << 20))')
    t.eq(big.truncated, true)
    t.eq(#big.output, 64 * 1024)
    local stuck = py:run('import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True: pass', { timeout_s = 0.5 })
    t.eq(stuck.restarted, true)
    t.eq(stuck.timed_out, true)
    t.truthy(py:run('x').error:find('NameError', 1, true), 'a new interpreter: the state gone')
    local exit = py:run('import os\nos._exit(3)')
    t.eq(exit.restarted, true)
    t.truthy(exit.error:find('it exited', 1, true), exit.error)
    py:close()
    local small = python.new({ limits = { memory_mb = 64 }, pool = mode == 'pool' and pool or nil })
    local m = small:run('a = bytearray(200 << 20)')
    t.truthy(m.restarted and m.error:find('limit memory', 1, true) or (m.error or ''):find('MemoryError', 1, true),
      'the memory limit: ' .. tostring(m.error))
    small:close()
  end)
end

t.test('a session: what the program writes, taken by delimiter; the rest at its close', function()
  local s = sandbox.session({ 'sh', '-c', 'while read l; do echo "got $l"; done; echo bye; echo err >&2' })
  s:send('one\ntwo\n')
  t.eq(s:recv('\n', 5), 'got one\n')
  t.eq(s:recv('\n', 5), 'got two\n')
  local none, why = s:recv('\n', 0.2)
  t.eq(none, nil)
  t.eq(why, 'timeout')
  local r = s:close()
  t.eq(r.stdout, 'bye\n')
  t.eq(r.stderr, 'err\n')
  t.eq(r.ok, true)
  local w = sandbox.session({ 'sleep', '30' }, { limits = { wall_s = 0.3 } })
  t.eq(w:recv(nil, 2), '', 'its end (at its wall limit) ends the wait')
  t.eq(w:close().limit, 'wall')
end)

pool:close()
t.done()
