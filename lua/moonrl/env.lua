-- moonrl.env: environments of multi-turn episodes (env=NAME in the RL recipes), registered by name
-- as rewards are. An episode is one conversation: the environment opens it, the model answers, the
-- environment answers back (tool results, a game's feedback, a grader's verdict) until it says done
-- or a limit of the episode (env.max_turns, env.max_tokens, env.max_seconds) ends it.
--
--   local env = require('moonrl.env')
--   env.register('echo', {
--     tools = { 'calculator' },                 -- optional: the tools offered (the template's `tools`)
--     reset = function(ep, record)              -- ep: the episode's own table (below)
--       return { { role = 'user', content = record.prompt } }
--     end,
--     step = function(ep, turn)                 -- turn: the model's turn (below)
--       if #turn.tool_calls > 0 then return env.run_tools(ep, turn), nil, false end
--       return {}, turn.text == ep.record.answer and 1 or 0, true   -- observations, reward, done[, info]
--     end,
--     close = function(ep) end,                 -- optional: what the episode holds, ended
--   }, 'one line of documentation')
--   env.get('guess')                            -- a built-in, loaded from plugins/envs/ on first use
--   env.get('my_envs.lua:maze')                 -- FILE.lua:NAME: the file run once (its directory on
--                                               -- package.path), NAME what it returned or registered
--   env.check(name, 'env.name')                 -- a usage error naming the key (start-up checks)
--
-- reset and step run in a coroutine of their own: a step waiting for something (a process, a
-- socket, a sandboxed interpreter) calls env.pause() between polls, and the other episodes go on
-- generating meanwhile (moonrl.train.episodes resumes it after the engine's next step). A step that
-- blocks without pausing holds every episode until it returns. What reset or step raises ends
-- the episode ('env_error', counted); env.max_step_seconds ends a step that pauses past it.
--
-- ep (one per episode, the environment's to keep state in): ep.record (the prompt record: prompt,
-- answer, meta), ep.index (the sample's place in its group, 0-based), ep.turns (model turns so
-- far), ep.rng (a moonrl.rng generator seeded from the run's seed, the step, the prompt and
-- the sample: the same draws whatever the batch), ep.tools (the names offered), ep.stats
-- (counts the episode adds to: tool_calls, tool_errors by tool).
-- turn: text (the model's turn as text, its end token left out), tool_calls (the calls parsed in
-- the offered tools' format: { name, arguments }), tool_errors (the malformed ones: { message,
-- raw }), finish_reason ('stop', 'length'), n (the turn's number, 1-based).
-- step's reward: a number (turn-level rewards add up to the episode's score) or nil; an episode
-- whose steps gave no reward at all is scored by the config's reward (reward.name) on its last
-- turn's text, as a single-turn response is. Observations are chat messages ({ role, content }),
-- rendered by the chat template after the model's turn.
local registry = require('moonrl.registry')

local M = {}

local BUILTIN = { tools = true, guess = true }
local R = registry.new('environment', {
  check = function(e)
    local t = e.fn
    if type(t) ~= 'table' or not registry.callable(t.reset) or not registry.callable(t.step) then
      error(string.format("environment '%s' must be a table { reset = function(ep, record), step = function(ep, turn) }",
        e.name), 0)
    end
    if t.close ~= nil and not registry.callable(t.close) then
      error(string.format("environment '%s': close must be a function", e.name), 0)
    end
    if t.tools ~= nil and type(t.tools) ~= 'table' then
      error(string.format("environment '%s': tools must be a list of tool names", e.name), 0)
    end
  end })

-- Register an environment (see the top); opts: a doc line or { doc = ..., replace = true }.
function M.register(name, def, opts)
  return R.register(name, def, type(opts) == 'table' and opts or { doc = opts })
end

-- The environment named name: registered, built in, or FILE.lua:NAME.
function M.get(name)
  if R.has(name) then return R.get(name) end
  if BUILTIN[name] then
    registry.plugin('env', name)
    return R.get(name)
  end
  local file, key = registry.split_file_name(name)
  if file then
    local value = registry.require_file(file, 'env=' .. name .. ':')
    if type(value) == 'table' and type(value[key]) == 'table' and not R.has(key) then R.register(key, value[key]) end
    if not R.has(key) then
      error(string.format("%s registers no environment '%s' (and returns none under that key)", file, key), 2)
    end
    return R.get(key)
  end
  return R.get(name) -- (the error listing the known names)
end

function M.names() return registry.names_with(R, BUILTIN) end

-- The environment, or a usage error naming the config key (the recipes' start-up check).
function M.check(name, key)
  local ok, e = pcall(M.get, name)
  if ok then return e end
  require('moonrl').usage_error(string.format("config key '%s': %s (known: %s)", key,
    tostring(e):gsub('^[^:]*:%d+: ', ''):match('[^\n]*'), table.concat(M.names(), ', ')))
end

-- ---- inside a step ----------------------------------------------------------------------------

-- The coroutines of the episode runner (moonrl.train.episodes): pause() yields only inside them,
-- so that an environment or tool works the same called directly.
local runner = setmetatable({}, { __mode = 'k' })
M.PAUSE = setmetatable({}, { __tostring = function() return 'env.PAUSE' end })

function M.runner_coroutine(co) runner[co] = true end

-- Give way to the other episodes (see the top); a no-op outside an episode's coroutine.
function M.pause()
  local co = coroutine.running()
  if co and runner[co] then coroutine.yield(M.PAUSE) end
end

-- Whether this code runs in an episode's coroutine (a tool may then poll and pause rather than block).
function M.in_episode()
  local co = coroutine.running()
  return co ~= nil and runner[co] == true
end

-- Run the turn's tool calls (the offered tools, moonrl.tools) and return their observations, one
-- tool message each in the order of the calls, then one for each malformed call: what the model
-- wrote and why it is not a call. Counted in ep.stats (tool_calls, tool_errors by tool name;
-- malformed calls under 'malformed'); the time each takes goes to ep.stats.tool_seconds.
function M.run_tools(ep, turn)
  local tools = require('moonrl.tools')
  local now = require('moonrl').now
  local st = ep.stats
  st.tool_calls, st.tool_errors = st.tool_calls or {}, st.tool_errors or {}
  local out = {}
  for _, c in ipairs(turn.tool_calls or {}) do
    local t0 = now()
    local text, ok = tools.call(c, ep)
    local dt = now() - t0
    st.tool_seconds = (st.tool_seconds or 0) + dt
    st.tool_calls[c.name] = (st.tool_calls[c.name] or 0) + 1
    if not ok then st.tool_errors[c.name] = (st.tool_errors[c.name] or 0) + 1 end
    if ep.span then ep.span('tool ' .. c.name, t0, dt) end
    out[#out + 1] = { role = 'tool', name = c.name, content = text }
  end
  for _, e in ipairs(turn.tool_errors or {}) do
    st.tool_errors.malformed = (st.tool_errors.malformed or 0) + 1
    out[#out + 1] = { role = 'tool', name = 'error', content = 'error: ' .. e.message }
  end
  return out
end

return M
