-- moonrl.chat: apply a model's own chat template (Jinja, from
-- tokenizer_config.json) to a conversation, as transformers'
-- apply_chat_template(tokenize=False) does.
--
--   local chat = require('moonrl.chat')
--   local tpl = chat.load(model_dir)        -- reads tokenizer_config.json (and chat_template.jinja)
--   tpl:render(messages, { add_generation_prompt = true, tools = ..., enable_thinking = false })
--   tpl.template, tpl.bos_token, tpl.eos_token
--   chat.render(template_string, { messages = ..., add_generation_prompt = ..., bos_token = ..., ... })
--   chat.compile(template_string [, name]) -> render(vars, opts)
--
-- The template's variables are the fields of the table given to render
-- (messages, tools, add_generation_prompt, bos_token, eos_token and any extra
-- keyword such as enable_thinking); tpl:render fills bos_token / eos_token
-- from the tokenizer config unless given. The field `now` (seconds since the
-- epoch) fixes the clock that strftime_now() reads; it is not a template
-- variable.
--
-- Messages and tools are Lua tables: lists are arrays ({...}), dicts are
-- tables with string keys. Use moonrl.io.json.object / json.decode for dicts
-- whose key order matters (tojson writes keys in that order; plain tables
-- are written with sorted keys). null is moonrl.io.json.null.
--
-- A chat_template.jinja file beside tokenizer_config.json takes precedence
-- over the config's chat_template (as in newer transformers).
-- A chat_template given as a list of {name, template} uses the one named
-- "default" (or the first when none is), like transformers; chat.load(dir,
-- {name = 'tool_use'}) picks another.
local json = require('moonrl.io.json')
local jinja = require('moonrl.text.jinja')

local M = {}

M.compile = jinja.compile

local function vars_of(t)
  local vars, opts = {}, {}
  for k, v in pairs(t or {}) do
    if k == 'now' then opts.now = v else vars[k] = v end
  end
  if vars.add_generation_prompt == nil then vars.add_generation_prompt = false end
  return vars, opts
end

function M.render(template, vars, name)
  local v, opts = vars_of(vars)
  return jinja.compile(template, name or 'chat_template')(v, opts)
end

local Template = {}
Template.__index = Template

function Template:render(messages, extra)
  local vars = {}
  for k, v in pairs(extra or {}) do vars[k] = v end
  vars.messages = messages
  if vars.bos_token == nil then vars.bos_token = self.bos_token end
  if vars.eos_token == nil then vars.eos_token = self.eos_token end
  local v, opts = vars_of(vars)
  return self.fn(v, opts)
end

local function token_text(t)
  if type(t) == 'string' then return t end
  if type(t) == 'table' and type(t.content) == 'string' then return t.content end
  return nil
end

local function read(path)
  local f = require('moonrl.io.fs').open(path)
  if not f then return nil end
  local s = f:read('*a')
  f:close()
  return s
end

function M.load(dir, opts)
  opts = opts or {}
  local cfg_path = dir .. '/tokenizer_config.json'
  local text = read(cfg_path)
  local cfg = text and json.decode(text, cfg_path) or json.object()
  if not json.is_object(cfg) then error(cfg_path .. ': expected a JSON object', 2) end
  local template = cfg.chat_template
  local source = cfg_path
  local wanted = opts.name or 'default'
  if type(template) == 'table' and template ~= json.null then
    local chosen
    for _, entry in ipairs(template) do -- (an entry that is no {name, template} object names nothing)
      if type(entry) == 'table' and entry.name == wanted then chosen = entry.template end
    end
    if not chosen and opts.name then
      error(string.format("%s: no chat template named '%s'", cfg_path, opts.name), 2)
    end
    template = chosen or (type(template[1]) == 'table' and template[1].template)
  end
  -- a separate chat_template.jinja (newer transformers saves it there) takes precedence
  local jinja_path = dir .. '/chat_template.jinja'
  local separate = not opts.name and read(jinja_path)
  if separate then template, source = separate, jinja_path end
  if type(template) ~= 'string' then
    error(string.format('%s: no chat_template (and no chat_template.jinja in %s)', cfg_path, dir), 2)
  end
  local self = setmetatable({
    template = template, source = source,
    bos_token = token_text(cfg.bos_token) or '', eos_token = token_text(cfg.eos_token) or '',
  }, Template)
  self.fn = jinja.compile(template, source)
  return self
end

return M
