-- A small test harness for Lua tests (tests/**/*.lua, run with `moonrl run`).
--
--   local t = require('moonrl.testing')
--   t.test('name', function() t.eq(1 + 1, 2) end)
--   t.done()   -- raises if any test failed, so the run exits non-zero
local M = { passed = 0, failed = 0 }

local function fmt(v)
  if type(v) == 'string' then return string.format('%q', v) end
  return tostring(v)
end

-- MOONRL_TEST_ONLY=text runs only the tests whose name holds text (plain; a developer's -k).
local only = os.getenv('MOONRL_TEST_ONLY')

function M.test(name, fn)
  if only and only ~= '' and not name:find(only, 1, true) then return end
  local t0 = require('moonrl').now()
  local ok, err = xpcall(fn, debug.traceback)
  local took = string.format(' (%.1f s)', require('moonrl').now() - t0) -- (where a suite's time goes)
  if ok then
    M.passed = M.passed + 1
    io.stdout:write('ok   ', name, took, '\n')
  else
    M.failed = M.failed + 1
    io.stdout:write('FAIL ', name, took, '\n', tostring(err), '\n')
  end
end

function M.eq(got, want, what)
  if got ~= want then
    error(string.format('%s: expected %s, got %s', what or 'value', fmt(want), fmt(got)), 2)
  end
end

function M.near(got, want, tol, what)
  tol = tol or 1e-6
  if type(got) ~= 'number' or math.abs(got - want) > tol * math.max(1, math.abs(want)) then
    error(string.format('%s: expected %s (tolerance %g), got %s', what or 'value', fmt(want), tol, fmt(got)), 2)
  end
end

function M.truthy(v, what)
  if not v then error((what or 'condition') .. ' is false', 2) end
end

-- fn must raise an error whose message contains `pattern` (plain text).
function M.raises(fn, pattern, what)
  local ok, err = pcall(fn)
  if ok then error((what or 'call') .. ': expected an error, none raised', 2) end
  local msg = type(err) == 'table' and (err.message or tostring(err)) or tostring(err)
  if pattern and not msg:find(pattern, 1, true) then
    error(string.format('%s: error %q does not contain %q', what or 'call', msg, pattern), 2)
  end
  return msg
end

function M.done()
  io.stdout:write(string.format('%d passed, %d failed\n', M.passed, M.failed))
  if M.failed > 0 then error(string.format('%d test(s) failed', M.failed), 0) end
end

return M
