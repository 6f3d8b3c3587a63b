-- The tiny models of the Lua tests: a few presets of the model config (Hugging Face keys), each
-- taken as a fresh table with overrides, built, or saved in Hugging Face format with the default
-- example's tokenizer.
--   local tiny = dofile('tests/lib/models.lua')      -- tests run from the source root
--   tiny.config('qwen2', { num_hidden_layers = 1 })   -- a new table: the preset, then the overrides
--   tiny.model('qwen2', over, opts)                    -- moonrl.model.new(tiny.config('qwen2', over), opts)
--   tiny.save(dir, 'digits', over, opts)               -- that model and tiny.TOKENIZER saved to dir; returns dir
local moonrl = require('moonrl')

local M = {}

-- The default example's tokenizer: one token per digit, 15 ids (bos 1, eos 2).
M.TOKENIZER = 'examples/default'

M.presets = {
  -- one layer over the digit tokenizer's 15 ids, its bos and eos: the recipes' model
  digits = { model_type = 'llama', vocab_size = 15, hidden_size = 32, intermediate_size = 64, num_hidden_layers = 1,
    num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 64, tie_word_embeddings = true,
    bos_token_id = 1, eos_token_id = 2 },
  -- two layers, grouped K/V heads, a head of its own: packing, the update step, the corrections
  llama = { model_type = 'llama', vocab_size = 15, hidden_size = 32, intermediate_size = 48, num_hidden_layers = 2,
    num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 64 },
  -- the same with q/k/v biases
  qwen2 = { model_type = 'qwen2', vocab_size = 15, hidden_size = 32, intermediate_size = 48, num_hidden_layers = 2,
    num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 64 },
  -- one dense layer: what the mixture-of-experts tests hold against
  qwen3 = { model_type = 'qwen3', vocab_size = 15, hidden_size = 32, intermediate_size = 48, num_hidden_layers = 1,
    num_attention_heads = 4 },
  -- two sparse layers of 5 experts, top 2 (uneven blocks over 2 and 3 ranks), the digit ids
  qwen3_moe = { model_type = 'qwen3_moe', vocab_size = 15, hidden_size = 32, intermediate_size = 48,
    num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, head_dim = 8, max_position_embeddings = 64,
    tie_word_embeddings = true, bos_token_id = 1, eos_token_id = 2, initializer_range = 0.1, num_experts = 5,
    num_experts_per_tok = 2, moe_intermediate_size = 16, norm_topk_prob = true },
  -- multi-head latent attention (low-rank queries, a latent of 12, values narrower than the query heads),
  -- two dense layers, the digit ids
  deepseek_v3 = { model_type = 'deepseek_v3', vocab_size = 15, hidden_size = 32, intermediate_size = 48,
    num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 4, q_lora_rank = 16, kv_lora_rank = 12,
    qk_nope_head_dim = 6, qk_rope_head_dim = 4, v_head_dim = 8, max_position_embeddings = 64, tie_word_embeddings = true,
    bos_token_id = 1, eos_token_id = 2, initializer_range = 0.1, first_k_dense_replace = 2 },
  -- the same attention with DeepSeek-V3's experts: a dense first layer, then 6 experts in 3 groups (2 taken), top 2,
  -- one shared expert (uneven blocks over 2 ranks: 3, 3; over 4: 2, 2, 1, 1)
  deepseek_v3_moe = { model_type = 'deepseek_v3', vocab_size = 15, hidden_size = 32, intermediate_size = 48,
    num_hidden_layers = 3, num_attention_heads = 4, num_key_value_heads = 4, q_lora_rank = 16, kv_lora_rank = 12,
    qk_nope_head_dim = 6, qk_rope_head_dim = 4, v_head_dim = 8, max_position_embeddings = 64, tie_word_embeddings = true,
    bos_token_id = 1, eos_token_id = 2, initializer_range = 0.1, first_k_dense_replace = 1, n_routed_experts = 6,
    num_experts_per_tok = 2, n_group = 3, topk_group = 2, moe_intermediate_size = 16, n_shared_experts = 1,
    routed_scaling_factor = 2.5, norm_topk_prob = true },
}

function M.config(name, over)
  local preset = assert(M.presets[name], 'no tiny model preset ' .. tostring(name))
  local c = {}
  for k, v in pairs(preset) do c[k] = v end
  for k, v in pairs(over or {}) do c[k] = v end
  return c
end

function M.model(name, over, opts)
  return moonrl.model.new(M.config(name, over), opts)
end

function M.save(dir, name, over, opts)
  require('moonrl.train.models').save({ dir = dir }, M.model(name, over, opts), M.TOKENIZER, dir)
  return dir
end

return M
