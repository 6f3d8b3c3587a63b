-- Subprocesses, background writes and stopping, from Lua.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local proc = require('moonrl.io.proc')

t.test('run a command and capture its output', function()
  local r = proc.run({ 'sh', '-c', 'cat; echo err >&2; exit 4' }, { stdin = 'abc', timeout = 10 })
  t.eq(r.stdout, 'abc')
  t.eq(r.stderr, 'err\n')
  t.eq(r.exit_status, 4)
  t.eq(r.ok, false)
end)

t.test('a command past its timeout is killed', function()
  local r = proc.run({ 'sleep', '20' }, { timeout = 0.2 })
  t.eq(r.timed_out, true)
  t.truthy(r.seconds < 5, 'killed promptly')
end)

t.test('many at once', function()
  local ps = {}
  for i = 1, 6 do ps[i] = proc.spawn({ 'sh', '-c', 'echo ' .. i }, { timeout = 10 }) end
  for i = 1, 6 do t.eq(ps[i]:wait().stdout, i .. '\n') end
end)

t.test('a missing program is a clear error', function()
  t.raises(function() proc.run({ '/no/such/moonrl-binary' }) end, "cannot start '/no/such/moonrl-binary'")
end)

t.test('background atomic write', function()
  local path = os.tmpname()
  local job = proc.write_file_async(path, 'state 123')
  job:wait()
  local f = io.open(path, 'rb')
  t.eq(f:read('*a'), 'state 123')
  f:close()
  os.remove(path)
  t.raises(function() proc.write_file_async('/no/such/dir/x', 'y'):wait() end, '/no/such/dir/x')
end)

t.test('a requested stop unwinds at the next safe point', function()
  moonrl.C.mrl_request_stop(0, 'unit test')
  local ok, err = pcall(moonrl.sleep, 5)
  moonrl.C.mrl_clear_stop()
  t.eq(ok, false)
  t.truthy(moonrl.is_stop_request(err), 'a StopRequest')
  t.eq(err.reason, 'unit test')
end)

t.done()
