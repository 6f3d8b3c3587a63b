-- The Lua library's layers: every module of lua/moonrl has a layer, and a module requires only
-- modules of its own layer or below, with no cycle among them. Read statically from the sources:
-- require('moonrl.X') anywhere in a file (inside a function too: a lazy require is still a
-- dependency), pcall(require, 'moonrl.X'), and moonrl.X where `moonrl` is require('moonrl') and X a
-- module its lazy loader would load. A require of a plugin (a module under plugins/) fails too:
-- plugins sit above the library (they require moonrl.rewards to register themselves); the library
-- reaches them by name through moonrl.registry.
local t = require('moonrl.testing')
local fs = require('moonrl.io.fs')

-- Bottom-up. A name ending in '.*' is every module of that folder; a module's own name wins over
-- its folder's. A module matching no line fails the test, so that the table stays complete.
local LAYERS = {
  -- 0: the FFI and the helpers every module uses (errors, logging, stop requests)
  { 'moonrl', 'moonrl.cdef' },
  -- 1: no model or text in sight: files, JSON, processes (and the sandbox's), progress,
  -- safetensors; the config (every section's defaults), the registries (they load user files and
  -- plugins), the Lua generator, the test harness
  { 'moonrl.io.*', 'moonrl.sandbox', 'moonrl.config', 'moonrl.registry', 'moonrl.rng', 'moonrl.testing' },
  -- 2: the pieces a recipe puts together, each on its own: text, tokenizer and chat templates, model,
  -- optimizer, engine, data, samples and the packed batch (which the algorithms' estimators and
  -- the evaluation read), the algorithms' math, rewards, tasks, tools and environments. GGUF files are read in io/ but
  -- G:model() builds a moonrl.model from one, so moonrl.io.gguf sits with the model. The
  -- OpenAI-compatible server over an engine is a piece too: `moonrl serve` runs it, and the RL
  -- loop starts it for agent programs (moonrl.train.agents).
  { 'moonrl.text.*', 'moonrl.tokenizer', 'moonrl.chat', 'moonrl.model', 'moonrl.optim', 'moonrl.engine',
    'moonrl.data', 'moonrl.batch', 'moonrl.algo', 'moonrl.algo.*', 'moonrl.rewards', 'moonrl.tasks', 'moonrl.tools', 'moonrl.env',
    'moonrl.io.gguf', 'moonrl.serve.server', 'moonrl.serve.transfer' },
  -- 3: the training stack every recipe shares: config sections, the update step, the session with
  -- its rollouts, checkpoints, guards, ranks, traces
  { 'moonrl.train.*' },
  -- 4: what recipes are written on: the recipe kinds (moonrl.rl) and the old names (moonrl.recipe)
  { 'moonrl.recipe', 'moonrl.rl' },
  -- 5: the programs around a recipe: the server, reports, the command line and its commands
  { 'moonrl.serve.*', 'moonrl.report.*', 'moonrl.cli.*', 'moonrl.cmd.*' },
}

local function layer_of(mod)
  for i, names in ipairs(LAYERS) do
    for _, name in ipairs(names) do if name == mod then return i - 1 end end
  end
  for i, names in ipairs(LAYERS) do
    for _, name in ipairs(names) do
      local folder = name:match('^(.*)%.%*$')
      if folder and mod:sub(1, #folder + 1) == folder .. '.' then return i - 1 end
    end
  end
end

-- ---------------------------------------------------------------- reading the sources

-- The tokens of a Lua source outside comments: { kind = 'name'|'string'|'op', text, line }.
-- Enough of Lua's lexical rules to find requires: strings and long brackets, comments.
local function tokens(src)
  local out, i, line, n = {}, 1, 1, #src
  local function long_bracket(at)   -- [[ or [=[ at `at`: the end of its closing bracket
    local eq = src:match('^%[(=*)%[', at)
    if not eq then return nil end
    local _, e = src:find(']' .. eq .. ']', at, true)
    return e or n
  end
  local function advance(to)
    for _ in src:sub(i, to):gmatch('\n') do line = line + 1 end
    i = to + 1
  end
  while i <= n do
    local c = src:sub(i, i)
    if c == '\n' then line = line + 1; i = i + 1
    elseif c:match('%s') then i = i + 1
    elseif src:sub(i, i + 1) == '--' then
      local e = long_bracket(i + 2)
      advance(e or ((src:find('\n', i, true) or n + 1) - 1))
    elseif c == '"' or c == "'" then
      local j, buf = i + 1, {}
      while j <= n do
        local d = src:sub(j, j)
        if d == '\\' then buf[#buf + 1] = src:sub(j, j + 1); j = j + 2
        elseif d == c or d == '\n' then break
        else buf[#buf + 1] = d; j = j + 1 end
      end
      out[#out + 1] = { kind = 'string', text = table.concat(buf), line = line }
      advance(j)
    elseif c == '[' and long_bracket(i) then
      local e = long_bracket(i)
      out[#out + 1] = { kind = 'string', text = '', line = line }   -- a long string: never a module name here
      advance(e)
    elseif c:match('[%a_]') then
      local w = src:match('^[%w_]+', i)
      out[#out + 1] = { kind = 'name', text = w, line = line }
      i = i + #w
    else
      local op = src:sub(i, i + 1) == '..' and '..' or c
      out[#out + 1] = { kind = 'op', text = op, line = line }
      i = i + #op
    end
  end
  return out
end

-- The library's modules: name -> file, from lua/moonrl/**/*.lua.
local function modules()
  local out = {}
  local function walk(dir, prefix)
    local names = fs.list(dir)
    table.sort(names)
    for _, f in ipairs(names) do
      local path = dir .. '/' .. f
      if fs.is_dir(path) then walk(path, prefix .. '.' .. f)
      elseif f:match('%.lua$') then
        local base = f:gsub('%.lua$', '')
        out[base == 'init' and prefix or (prefix .. '.' .. base)] = path
      end
    end
  end
  walk('lua/moonrl', 'moonrl')
  out['moonrl.cdef'] = '(generated from the C headers)'
  return out
end

-- The fields init.lua sets itself (moonrl.C, moonrl.check, ...): not modules of the lazy loader.
local function init_fields(src)
  local out = {}
  for name in src:gmatch('\nfunction M%.([%w_]+)') do out[name] = true end
  for name in src:gmatch('\nM%.([%w_]+) =') do out[name] = true end
  return out
end

local function plugin_exists(name)
  return fs.exists('plugins/' .. name:gsub('%.', '/') .. '.lua') or fs.exists('plugins/' .. name:gsub('%.', '/') .. '/init.lua')
end

-- Every dependency of the file: { to = module, line = n }; the plugins it requires, the same way.
local function dependencies(src, mods, fields)
  local toks = tokens(src)
  local deps, plugins, aliases = {}, {}, {}
  local function tok(k) return toks[k] or { kind = 'eof', text = '' } end
  -- the string a require at k names when it is a whole literal: require 'x', require('x'),
  -- pcall(require, 'x'); and the index after it
  local function required(k)
    local a = tok(k + 1)
    if a.kind == 'string' then return a.text, k + 2 end
    if a.text == '(' or a.text == ',' then
      local s, close = tok(k + 2), tok(k + 3)
      if s.kind == 'string' and close.text == ')' then return s.text, k + 4 end
    end
  end
  for k, tk in ipairs(toks) do
    if tk.kind == 'name' and tk.text == 'require' and tok(k - 1).text ~= '.' then
      local name, after = required(k)
      if name and (name == 'moonrl' or name:match('^moonrl%.')) then
        deps[#deps + 1] = { to = name, line = tk.line }
        if name == 'moonrl' then
          -- local X = require('moonrl'): X.field below may load a module; require('moonrl').field too
          if tok(k - 1).text == '=' and tok(k - 2).kind == 'name' and tok(k - 3).text == 'local' then
            aliases[tok(k - 2).text] = true
          end
          if tok(after).text == '.' and tok(after + 1).kind == 'name' then
            local f = tok(after + 1).text
            if mods['moonrl.' .. f] and not fields[f] then deps[#deps + 1] = { to = 'moonrl.' .. f, line = tk.line } end
          end
        end
      elseif name and plugin_exists(name) then
        plugins[#plugins + 1] = { to = name, line = tk.line }
      end
    elseif tk.kind == 'name' and aliases[tk.text] and tok(k - 1).text ~= '.' and tok(k + 1).text == '.' then
      local f = tok(k + 2).text
      if mods['moonrl.' .. f] and not fields[f] then deps[#deps + 1] = { to = 'moonrl.' .. f, line = tk.line } end
    end
  end
  return deps, plugins
end

-- ---------------------------------------------------------------- the graph

local mods = modules()
local fields = init_fields(fs.read(mods['moonrl']))
local graph = {}     -- from -> module -> the line of its first require
local plugins = {}   -- from -> plugin -> the line of its first require
for mod, path in pairs(mods) do
  graph[mod], plugins[mod] = {}, {}
  if mod ~= 'moonrl.cdef' then
    local deps, plugin_deps = dependencies(fs.read(path), mods, fields)
    for _, d in ipairs(deps) do
      if d.to ~= mod and not graph[mod][d.to] then graph[mod][d.to] = d.line end
    end
    for _, d in ipairs(plugin_deps) do plugins[mod][d.to] = plugins[mod][d.to] or d.line end
  end
end

local sorted_keys = require('moonrl.io.json').keys -- of a plain table: sorted

-- a failure listing what breaks a rule, one per line
local function none(list, what)
  if #list > 0 then error(what .. ':\n  ' .. table.concat(list, '\n  '), 0) end
end

t.test('every module of lua/moonrl has a layer', function()
  local missing = {}
  for _, mod in ipairs(sorted_keys(mods)) do
    if not layer_of(mod) then missing[#missing + 1] = string.format('%s (%s)', mod, mods[mod]) end
  end
  none(missing, 'modules without a layer in LAYERS')
end)

t.test('no module requires one of a higher layer', function()
  local bad = {}
  for _, from in ipairs(sorted_keys(graph)) do
    for _, to in ipairs(sorted_keys(graph[from])) do
      local lf, lt = layer_of(from), layer_of(to)
      if lf and lt and lt > lf then
        bad[#bad + 1] = string.format('%s:%d: %s (layer %d) requires %s (layer %d)', mods[from], graph[from][to], from, lf,
          to, lt)
      end
    end
  end
  none(bad, 'upward requires')
end)

t.test('no cycle among the modules', function()
  -- Tarjan's strongly connected components
  local index, low, on, stack, count, cycles = {}, {}, {}, {}, 0, {}
  local function visit(v)
    count = count + 1
    index[v], low[v] = count, count
    stack[#stack + 1], on[v] = v, true
    for _, w in ipairs(sorted_keys(graph[v] or {})) do
      if not index[w] then visit(w); low[v] = math.min(low[v], low[w])
      elseif on[w] then low[v] = math.min(low[v], index[w]) end
    end
    if low[v] == index[v] then
      local scc = {}
      repeat
        local w = table.remove(stack)
        on[w] = nil
        scc[#scc + 1] = w
      until w == v
      if #scc > 1 then
        table.sort(scc)
        local lines = {}
        for _, a in ipairs(scc) do
          for _, b in ipairs(scc) do
            if graph[a][b] then lines[#lines + 1] = string.format('%s:%d: %s -> %s', mods[a], graph[a][b], a, b) end
          end
        end
        cycles[#cycles + 1] = table.concat(lines, '\n  ')
      end
    end
  end
  for _, v in ipairs(sorted_keys(graph)) do if not index[v] then visit(v) end end
  none(cycles, 'modules that require one another (a cycle each)')
end)

t.test('no library module requires a plugin', function()
  local bad = {}
  for _, from in ipairs(sorted_keys(plugins)) do
    for _, p in ipairs(sorted_keys(plugins[from])) do
      bad[#bad + 1] = string.format('%s:%d: %s requires the plugin %s', mods[from], plugins[from][p], from, p)
    end
  end
  none(bad, 'plugins required by the library (load one by name: moonrl.registry.plugin)')
end)

t.done()
