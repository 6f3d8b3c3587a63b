-- moonrl convert: a GGUF file (llama.cpp's format) to a Hugging Face model directory.
local moonrl = require('moonrl')

local M = {}

local USAGE = [[
usage: moonrl convert FILE.gguf DIR
  writes DIR/config.json, model.safetensors (the weights dequantized to F32), tokenizer.json,
  tokenizer_config.json (with the chat template) and generation_config.json: a directory moonrl
  and Transformers load. Architectures llama, qwen2, qwen3, qwen3moe; byte-level BPE tokenizers.]]

function M.main(args)
  if #args ~= 2 or not args[1]:match('%.gguf$') then moonrl.usage_error(USAGE) end
  local gguf = require('moonrl.io.gguf')
  local ok, g = pcall(gguf.open, args[1])
  if not ok then moonrl.usage_error('convert: ' .. moonrl.error_text(g)) end
  local t0 = moonrl.now()
  local ok2, err = pcall(g.convert, g, args[2])
  g:close()
  if not ok2 then moonrl.usage_error('convert: ' .. moonrl.error_text(err)) end
  print(string.format('%s -> %s (%d tensors, %.1f s)', args[1], args[2], #g.tensors, moonrl.now() - t0))
  return 0
end

return M
