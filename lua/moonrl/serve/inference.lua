-- moonrl.serve.inference: what the commands that generate (moonrl generate, moonrl serve) load.
--
--   local m, err = require('moonrl.serve.inference').load(path, { tokenizer = PATH, template = true })
--   -- m = { dir, model, tokenizer, template, template_error }
--   local eos = inference.eos_ids(m.dir, m.model, m.tokenizer)
local moonrl = require('moonrl')

local M = {}

-- path: a Hugging Face model directory, or a .gguf file (its directory converted once into
-- MOONRL_CACHE: moonrl.io.gguf.resolve). Loads the model and its tokenizer (opts.tokenizer: a
-- tokenizer.json or its directory, else the model's) and, with opts.template, the model's chat
-- template (moonrl.chat.load; when it has none, m.template is nil and m.template_error says why).
-- opts.tp: a World (moonrl.train.dist) whose ranks each load their tensor-parallel slices
-- (moonrl.model.load_tp).
-- Returns m = { dir, model, tokenizer, template, template_error }, or nil and the error of the
-- step that failed, as raised.
function M.load(path, opts)
  opts = opts or {}
  local ok, dir = pcall(require('moonrl.io.gguf').resolve, path)
  if not ok then return nil, dir end
  local model
  if opts.tp and opts.tp.size > 1 then -- tensor parallel: this rank's slices, its sums over the group
    ok, model = pcall(moonrl.model.load_tp, dir, opts.tp)
  else
    ok, model = pcall(moonrl.model.load, dir)
  end
  if not ok then return nil, model end
  local tok
  ok, tok = pcall(require('moonrl.tokenizer').load, opts.tokenizer or dir)
  if not ok then return nil, tok end
  local m = { dir = dir, model = model, tokenizer = tok }
  if opts.template then
    ok, m.template = pcall(require('moonrl.chat').load, dir)
    if not ok then m.template, m.template_error = nil, m.template end
  end
  return m
end

-- The end-of-sequence ids: the model's config's, generation_config.json's in dir (one id or a
-- list) and the tokenizer's, each once.
function M.eos_ids(dir, model, tok)
  local set, list = {}, {}
  local function add(id)
    if type(id) == 'number' and id >= 0 and not set[id] then
      set[id] = true
      list[#list + 1] = id
    end
  end
  add(model.config.eos_token_id)
  local ok, g = pcall(require('moonrl.io.json').read_file, dir .. '/generation_config.json')
  if ok and type(g) == 'table' then
    if type(g.eos_token_id) == 'table' then
      for _, id in ipairs(g.eos_token_id) do add(id) end
    else
      add(g.eos_token_id)
    end
  end
  add(tok.eos_id)
  return list
end

return M
