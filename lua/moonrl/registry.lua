-- moonrl.registry: things recipes look up by name, and the user's Lua files that add to them.
--
--   local registry = require('moonrl.registry')
--   local estimators = registry.new('advantage estimator')
--   estimators.register('rloo', fn, 'leave-one-out baseline')   -- doc: one line, or a table
--                                          -- { doc = ..., needs = { 'values' }, replace = true }
--   estimators.get('rloo')                 -- fn; an unknown name is an error listing the known ones
--   estimators.check('rloo', 'grpo.advantage')  -- the same as a usage error naming the config key
--                                          -- (one line, exit 2): what recipes call at start-up
--   estimators.names(), estimators.doc(name), estimators.entry(name) -> { fn, doc, needs, name }
--   registry.names_with(R, builtin)      -- R's names and the built-ins' (a set: plugins loaded on first use)
--   estimators.describe()                  -- "name  doc" lines, for --help texts
--
-- The registries: moonrl.algo.estimators (advantages), moonrl.algo.losses (policy losses),
-- moonrl.algo.kl_estimators, moonrl.rewards, moonrl.tasks, moonrl.tools. A name registered twice is an
-- error unless { replace = true }.
--
--   registry.require_file('my_rewards.lua')   -- what `moonrl run R --require FILE.lua` does:
--     the file's directory goes first on package.path (it can require its neighbours), the file
--     runs once (a second call returns what the first returned), and a missing file, a syntax
--     error or an error while it runs is a usage error naming the file and line.
--
--   registry.plugin('reward', 'math')         -- a plugin by kind and name: its module (under
--     plugins/) loaded once; loading, it registers what it provides (rewards.math registers the
--     built-in rewards math and gsm8k). The library loads plugins only this way, never with a
--     require of its own: plugins sit above it (they require the registries they add to).
--   registry.code_files()                     -- the Lua files loaded through the two above, in
--     load order (moonrl.train.manifest records them with the run)
local moonrl = require('moonrl')

local M = {}

local function callable(fn)
  if type(fn) == 'function' then return true end
  local mt = getmetatable(fn)
  return type(mt) == 'table' and type(mt.__call) == 'function'
end
M.callable = callable

-- A new registry of `kind` (a noun for messages: 'advantage estimator'). opts.check(entry):
-- raises when a registered value is not of the kind (default: it must be callable).
function M.new(kind, opts)
  opts = opts or {}
  local entries, R = {}, {}
  local check = opts.check or function(e)
    if not callable(e.fn) then error(string.format("%s '%s' must be a function, got %s", kind, e.name, type(e.fn)), 0) end
  end
  function R.register(name, fn, doc)
    if type(name) ~= 'string' or name == '' then
      error(string.format('%s register: name must be a non-empty string, got %s', kind, tostring(name)), 2)
    end
    local o = type(doc) == 'table' and doc or { doc = doc }
    if entries[name] and not o.replace then
      error(string.format("%s '%s' is already registered (pass { replace = true })", kind, name), 2)
    end
    local e = { name = name, fn = fn, doc = o.doc or '', needs = o.needs or {} }
    local ok, err = pcall(check, e)
    if not ok then error(err, 2) end
    entries[name] = e
    return fn
  end
  function R.names()
    local out = {}
    for k in pairs(entries) do out[#out + 1] = k end
    table.sort(out)
    return out
  end
  function R.has(name) return entries[name] ~= nil end
  function R.entry(name) return entries[name] end
  function R.doc(name) return entries[name] and entries[name].doc end
  local function unknown(name)
    return string.format("unknown %s '%s' (known: %s)", kind, tostring(name), table.concat(R.names(), ', '))
  end
  function R.get(name)
    local e = entries[name]
    if not e then error(unknown(name), 2) end
    return e.fn
  end
  -- A usage error (exit 2) naming the config key when name is not registered; returns the entry.
  function R.check(name, key)
    local e = entries[name]
    if not e then moonrl.usage_error(string.format("config key '%s': %s", key, unknown(name))) end
    return e
  end
  function R.describe()
    local lines = {}
    for _, n in ipairs(R.names()) do lines[#lines + 1] = string.format('  %-16s %s', n, entries[n].doc) end
    return table.concat(lines, '\n')
  end
  R.kind = kind
  return R
end

-- ---- user files: --require FILE.lua and reward=FILE.lua:NAME -----------------------------------

local loaded = {}

-- The Lua files loaded by require_file and plugin, in load order (each once).
local code = {}
local function record_code(path)
  if path and not code[path] then
    code[path] = true
    code[#code + 1] = path
  end
end
function M.code_files()
  local out = {}
  for i, path in ipairs(code) do out[i] = path end
  return out
end

-- The first line of an error (its "file.lua:12: " kept), without a traceback.
local function one_line(e)
  local text = type(e) == 'table' and e.message or tostring(e)
  return (tostring(text):match('^[^\n]*'))
end

-- "label file.lua:12: message" when the message names a Lua file and line; else the file first.
local function located(label, path, msg, note)
  if msg:match('^[^%s]-%.lua:%d+: ') then return string.format('%s %s%s', label, msg, note or '') end
  return string.format('%s %s: %s%s', label, path, msg, note or '')
end

-- Run a user's Lua file once (see the top). label: how messages name the origin ('--require').
function M.require_file(path, label)
  label = label or '--require'
  if loaded[path] then return loaded[path].value end
  local fs = require('moonrl.io.fs')
  local f, err = fs.open(path)
  if not f then -- (a FIFO or a device is refused, never opened: its open would wait)
    moonrl.usage_error(fs.exists(path) and label .. ' ' .. err or string.format('%s %s: no such file', label, path))
  end
  f:close()
  local dir = path:match('^(.*)/[^/]*$') or '.'
  package.path = dir .. '/?.lua;' .. dir .. '/?/init.lua;' .. package.path
  local chunk, err = loadfile(path)
  if not chunk then moonrl.usage_error(located(label, path, one_line(err))) end
  local ok, value = xpcall(chunk, function(e)
    if moonrl.is_usage_error(e) then return e end
    return one_line(e)
  end)
  if not ok then
    if moonrl.is_usage_error(value) then error(value, 0) end
    -- the error's own file:line (the user's file, or what it called: then say which was loading)
    local mine = value:find(path, 1, true) or value:find(path:match('[^/]*$') .. ':', 1, true)
    moonrl.usage_error(located(label, path, value, not mine and (' (while loading ' .. path .. ')') or nil))
  end
  loaded[path] = { value = value }
  record_code(path) -- part of the run's code (its manifest)
  return value
end

-- ---- plugins: loaded by name -------------------------------------------------------------------

-- kind -> plugin name -> its module, found on package.path (MOONRL_HOME/plugins).
local PLUGINS = {
  reward = {
    math = 'rewards.math', gsm8k = 'rewards.math', format = 'rewards.format', countdown = 'rewards.countdown',
    exact = 'rewards.exact', code = 'rewards.code',
    reward_model = 'rewards.reward_model', -- .register(name, dir, opts): a learned reward (recipe's reward_model.dir)
  },
  tool = { calculator = 'tools.calculator', python = 'tools.python' },
  env = { tools = 'envs.tools', guess = 'envs.guess' },
}

-- The plugin `name` of `kind` (see the top): loads its module once and returns it; its file joins
-- code_files(). An unknown name is an error listing the known ones.
function M.plugin(kind, name)
  local mod = PLUGINS[kind] and PLUGINS[kind][name]
  if not mod then
    local known = {}
    for k in pairs(PLUGINS[kind] or {}) do known[#known + 1] = k end
    table.sort(known)
    error(string.format("unknown %s plugin '%s' (known: %s)", kind, tostring(name), table.concat(known, ', ')), 2)
  end
  local value = require(mod)
  record_code(package.searchpath(mod, package.path))
  return value
end

-- The sorted names of registry R and of the built-ins (a set of names whose plugins load on first use).
function M.names_with(R, builtin)
  local seen, out = {}, {}
  for _, n in ipairs(R.names()) do seen[n] = true end
  for n in pairs(builtin) do seen[n] = true end
  for n in pairs(seen) do out[#out + 1] = n end
  table.sort(out)
  return out
end

-- A name of the form FILE.lua:NAME: the file and the name (nil when it is not one).
function M.split_file_name(s)
  if type(s) ~= 'string' then return nil end
  local file, name = s:match('^(.+%.lua):([%w_%.%-]+)$')
  return file, name
end

return M
