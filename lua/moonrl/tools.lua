-- moonrl.tools: tools a model calls, by name, each a function with its JSON-schema declaration (the
-- chat template's `tools` variable), and the tool calls found in a model's output.
--
--   local tools = require('moonrl.tools')
--   tools.register('lookup', { description = 'a word\'s definition',
--     parameters = { type = 'object', properties = { word = { type = 'string' } }, required = { 'word' } },
--     call = function(args, episode) return dictionary[args.word] or 'unknown word' end })
--   tools.get('calculator')           -- a built-in, loaded from plugins/tools/ on first use
--   tools.schemas({ 'calculator' })   -- OpenAI-style declarations: { { type = 'function', ['function'] = {...} } }
--   local calls, errors = tools.parse(text)     -- the calls in a model's turn (below)
--   local out = tools.call(calls[1], episode)   -- the tool's observation (a string), never an error
--
-- parse(text, format): format 'hermes' (Qwen's and Hermes' templates: each call a JSON object
-- {"name": ..., "arguments": {...}} between <tool_call> and </tool_call>), 'llama3' (Llama 3.1's:
-- the turn, after an optional <|python_tag|>, is one JSON object {"name": ..., "parameters": {...}},
-- or several separated by ';'), or 'auto' (the default: hermes where the text has <tool_call>, else
-- llama3 where the turn is a JSON object, else no call). Returns the calls ({ name, arguments, raw })
-- and the malformed ones ({ message, raw }): a bad JSON, a missing name, arguments that are not an
-- object, an unknown tool (with opts.known, a set of names). call(c, episode) runs the tool with
-- c.arguments and the episode's state table (a tool keeps what it needs there, as the python tool
-- its interpreter); what the tool raises, or returns that is not a string, becomes an "error: ..."
-- observation, its output past opts.max_bytes (16 KiB) is cut, and tools.close(episode) ends what
-- the episode's tools hold.
--
-- Built in (plugins/tools/*.lua, loaded on first use): calculator (arithmetic over numbers: + - *
-- / // % ** and parentheses, evaluated by its own parser) and python (one sandboxed interpreter an
-- episode, kept across its turns: plugins/tools/python.lua).
local json = require('moonrl.io.json')
local registry = require('moonrl.registry')

local M = {}

local BUILTIN = { calculator = true, python = true }
local R = registry.new('tool', {
  check = function(e)
    local t = e.fn
    if type(t) ~= 'table' or not registry.callable(t.call) then
      error(string.format("tool '%s' must be a table { description, parameters, call = function(args, episode) }", e.name), 0)
    end
  end })

-- Register a tool: spec = { description = text, parameters = JSON schema (a table), call =
-- function(args, episode) -> string }; opts: a doc line or { replace = true }.
function M.register(name, spec, opts)
  return R.register(name, spec, type(opts) == 'table' and opts or { doc = opts or (type(spec) == 'table' and spec.description) })
end

function M.get(name)
  if not R.has(name) and BUILTIN[name] then registry.plugin('tool', name) end
  return R.get(name)
end

function M.names() return registry.names_with(R, BUILTIN) end

-- The declarations of the named tools, as the chat templates' `tools` variable takes them.
function M.schemas(names)
  local out = {}
  for i, name in ipairs(names) do
    local t = M.get(name)
    out[i] = { type = 'function', ['function'] = { name = name, description = t.description or '',
      parameters = t.parameters or { type = 'object', properties = json.object({}) } } }
  end
  return out
end

-- one call from a decoded JSON value
local function call_of(v, raw, args_key, known)
  if type(v) ~= 'table' then return nil, 'a tool call must be a JSON object' end
  if type(v.name) ~= 'string' or v.name == '' then return nil, 'a tool call names no tool ("name")' end
  local args = v[args_key]
  if args == nil then args = v.arguments or v.parameters end
  if type(args) == 'string' then -- (some models write the arguments as a JSON string)
    local ok, a = pcall(json.decode, args)
    args = ok and a or args
  end
  if args == nil or args == json.null then args = {} end
  if type(args) ~= 'table' then return nil, string.format("tool '%s': its arguments are not a JSON object", v.name) end
  if known and not known[v.name] then return nil, string.format("no tool '%s'", v.name) end
  return { name = v.name, arguments = args, raw = raw }
end

local function add(calls, errors, v, raw, args_key, known)
  local c, err = call_of(v, raw, args_key, known)
  if c then calls[#calls + 1] = c else errors[#errors + 1] = { message = err, raw = raw } end
end

function M.parse(text, format, opts)
  opts = opts or {}
  local known = opts.known
  format = format or 'auto'
  local calls, errors = {}, {}
  if format == 'auto' then
    if text:find('<tool_call>', 1, true) then format = 'hermes'
    elseif text:match('^%s*<|python_tag|>') or text:match('^%s*{') then format = 'llama3'
    else return calls, errors end
  end
  if format == 'hermes' then
    local at = text:find('<tool_call>', 1, true)
    while at do -- (each <tool_call>, up to the next one or the end)
      local next_at = text:find('<tool_call>', at + 11, true)
      local body = text:sub(at + 11, (next_at or #text + 1) - 1)
      local inner = body:match('^(.-)</tool_call>')
      if not inner then
        errors[#errors + 1] = { message = 'a <tool_call> without its </tool_call>', raw = body }
      else
        local ok, v = pcall(json.decode, inner)
        if ok then add(calls, errors, v, inner, 'arguments', known)
        else errors[#errors + 1] = { message = 'a tool call that is not JSON: ' .. tostring(v):match('[^\n]*'), raw = inner } end
      end
      at = next_at
    end
  elseif format == 'llama3' then
    local body = text:gsub('^%s*<|python_tag|>', ''):gsub('<|eom_id|>%s*$', ''):gsub('<|eot_id|>%s*$', '')
    local ok, v = pcall(json.decode, body)
    if ok then add(calls, errors, v, body, 'parameters', known)
    else -- (several calls, separated by ';')
      local any = false
      for part in (body .. ';'):gmatch('(.-);') do
        if part:match('%S') then
          any = true
          local ok2, v2 = pcall(json.decode, part)
          if ok2 then add(calls, errors, v2, part, 'parameters', known)
          else errors[#errors + 1] = { message = 'a tool call that is not JSON', raw = part } end
        end
      end
      if not any then errors[#errors + 1] = { message = 'a tool call that is not JSON', raw = body } end
    end
  else
    error(string.format("tools.parse: format '%s' (auto, hermes, llama3)", tostring(format)), 2)
  end
  return calls, errors
end

-- Run a parsed call (see the top): the observation, and whether the tool gave it without error.
function M.call(c, episode, opts)
  opts = opts or {}
  local max = opts.max_bytes or 16384
  local okget, tool = pcall(M.get, c.name)
  if not okget then return string.format("error: no tool '%s'", tostring(c.name)), false end
  local ok, out = pcall(tool.call, c.arguments or {}, episode or {})
  if not ok then return 'error: ' .. tostring(out):match('[^\n]*'), false end
  if type(out) ~= 'string' then
    return string.format("error: tool '%s' returned %s, not text", c.name, type(out)), false
  end
  if #out > max then out = out:sub(1, max) .. string.format('\n[cut: %d bytes more]', #out - max) end
  return out, true
end

-- End what an episode's tools hold (each tool's close(episode), where it has one).
function M.close(episode)
  for _, name in ipairs(R.names()) do
    local t = R.get(name)
    if t.close then pcall(t.close, episode) end
  end
end

return M
