-- Test helpers for the recipe tests: a tiny random model saved in Hugging Face format with the
-- default example's tokenizer (one token per digit, 15 ids), JSONL files, and running a recipe
-- file with command-line style overrides.
local moonrl = require('moonrl')
local config = require('moonrl.config')
local R = require('moonrl.recipe')

local M = {}

M.TOKENIZER = 'examples/default'

function M.tmpdir(tag)
  local d = os.tmpname()
  os.remove(d)
  d = d .. '-' .. tag
  require('moonrl.fs').mkdirs(d)
  return d
end

-- A tiny Llama (or opts.model_type) with the digit tokenizer, saved to dir; returns dir.
function M.tiny_model(dir, opts)
  opts = opts or {}
  local m = moonrl.model.new({ model_type = opts.model_type or 'llama', vocab_size = 15,
    hidden_size = opts.hidden_size or 32, intermediate_size = opts.intermediate_size or 64,
    num_hidden_layers = opts.layers or 1, num_attention_heads = 4, num_key_value_heads = 2,
    max_position_embeddings = 64, tie_word_embeddings = true, bos_token_id = 1, eos_token_id = 2 },
    { seed = opts.seed or 1 })
  R.save({ dir = dir }, m, M.TOKENIZER, dir)
  return dir
end

function M.write_jsonl(path, records)
  local json = require('moonrl.json')
  local f = assert(io.open(path, 'w'))
  for _, r in ipairs(records) do f:write(json.encode(r), '\n') end
  f:close()
  return path
end

-- Addition problems "a+b=" with their sums, from a fixed seed.
function M.additions(n, seed, max)
  local s, out = seed or 1, {}
  local function rand(k)
    s = (s * 48271) % 2147483647
    return s % k
  end
  for i = 1, n do
    local a, b = rand(max or 10), rand(max or 10)
    out[i] = { a = a, b = b, prompt = a .. '+' .. b .. '=', answer = tostring(a + b) }
  end
  return out
end

-- Run a recipe file with overrides {'key=value', ...}; returns what the recipe returns.
function M.run_recipe(path, words)
  config.overrides = config.parse_overrides(words)
  config.consumed = false
  local chunk = assert(loadfile(path))
  return chunk()
end

return M
