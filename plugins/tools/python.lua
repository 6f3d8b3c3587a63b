-- The python tool (tool=python for the agent recipes): one sandboxed Python interpreter kept alive
-- across an episode's turns, its state (variables, imports, files in its /tmp) carried from cell
-- to cell as a notebook's, each cell's output (print, errors, the value of a last expression)
-- handed back as text.
--
--   local python = require('tools.python')
--   local py = python.new{ limits = { wall_s = 600, memory_mb = 512 }, timeout_s = 10 }
--   local r = py:run('x = 21\nx * 2')   -- { output = '42\n', error = nil, timed_out = false, truncated = false }
--   py:close()
--
-- The interpreter is a sandbox session (moonrl.sandbox.session: the sandbox's namespaces, limits
-- and filter; opts.pool: a sandbox.pool to start it from, warm). A cell past timeout_s (10) is
-- interrupted inside (TimeoutError in its result, the state kept); one that cannot be interrupted
-- (a C call that never returns) or an interpreter that dies or reaches its limits ends the
-- session: the result says `restarted`, and the next cell starts a new interpreter, its state
-- gone. Output past 64 KiB a cell is cut (`truncated`). What a cell writes to the interpreter's
-- own channel can only garble its own result.
local moonrl = require('moonrl')
local env = require('moonrl.env')
local sandbox = require('moonrl.sandbox')
local json = require('moonrl.io.json')

local M = {}

local source
local function repl()
  source = source or require('moonrl.io.fs').read_beside('python_repl.py')
  return source
end

local Python = {}
Python.__index = Python

-- The interpreter's answer line. Inside a multi-turn episode (moonrl.env.in_episode) it is polled,
-- the episode giving way between polls (env.pause), so that the engine goes on with the others;
-- elsewhere one blocking wait.
local function recv_line(session, timeout)
  if not env.in_episode() then return session:recv('\n', timeout) end
  local deadline = moonrl.now() + timeout
  while true do
    local line, a, b = session:recv('\n', 0.001)
    if line then return line, a end
    if b or moonrl.now() > deadline then return nil, b and true or 'timeout' end
    env.pause()
  end
end

function M.new(opts)
  opts = opts or {}
  local limits = { wall_s = 600 }
  for k, v in pairs(opts.limits or {}) do limits[k] = v end
  return setmetatable({ opts = opts, limits = limits, timeout_s = opts.timeout_s or 10, cells = 0 }, Python)
end

function Python:start()
  self.session = sandbox.session({ 'python3', '/box/repl.py' }, { limits = self.limits, pool = self.opts.pool,
    network = self.opts.network, files = { ['repl.py'] = { data = repl(), read_only = true } } })
end

-- Runs a cell: { output, error, timed_out, truncated, restarted }.
function Python:run(code, opts)
  if type(code) ~= 'string' then error('tool python: a cell is a string of code', 2) end
  local timeout = (opts or {}).timeout_s or self.timeout_s
  if not self.session then self:start() end
  self.cells = self.cells + 1
  local ok, err = pcall(self.session.send, self.session, string.format('MRLCELL %d %g\n', #code, timeout) .. code, timeout)
  local line, ended
  if ok then line, ended = recv_line(self.session, timeout + 2) end
  local r = line and select(2, pcall(json.decode, line))
  if type(r) == 'table' then
    if r.error == json.null then r.error = nil end
    return r
  end
  -- the interpreter is gone, or stuck past its cell's time: ended, a new one next time
  local res = self.session:close(true)
  self.session = nil
  local why = not ok and tostring(err) or ended == true and 'it exited' or 'no result in time'
  return { output = res.stdout .. res.stderr, timed_out = why == 'no result in time' or res.limit == 'wall',
    truncated = false, restarted = true, error = string.format('the interpreter ended (%s%s): its state is gone', why,
      res.limit ~= 'none' and ', limit ' .. res.limit or '') }
end

function Python:close()
  if self.session then
    local r = self.session:close(true)
    self.session = nil
    return r
  end
end

-- The python tool of moonrl.tools: one interpreter an episode (kept in its state table), closed
-- with the episode (tools.close).
M.tool = {
  description = 'Run Python code in a sandboxed interpreter kept across this conversation\'s turns; returns what it '
    .. 'printed and the value of its last expression.',
  parameters = { type = 'object', properties = { code = { type = 'string', description = 'the Python code to run' } },
    required = { 'code' } },
  call = function(args, episode)
    if type(args.code) ~= 'string' then error('the argument "code" must be a string', 0) end
    episode.python = episode.python or M.new(episode.python_opts)
    local r = episode.python:run(args.code)
    local out = r.output or ''
    if r.error then out = out .. (out ~= '' and '\n' or '') .. r.error end
    return out
  end,
  close = function(episode)
    if episode.python then episode.python:close() end
    episode.python = nil
  end,
}

require('moonrl.tools').register('python', M.tool, { doc = 'a sandboxed Python interpreter an episode' })

return M
