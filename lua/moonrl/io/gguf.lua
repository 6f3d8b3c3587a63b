-- GGUF files (llama.cpp's format; moonrl/gguf.h): metadata and tensors, dequantized to fp32.
--
--   local g = require('moonrl.io.gguf').open('model.gguf')
--   g.metadata['general.architecture']      -- numbers, strings, booleans; arrays as Lua lists
--   g.tensors[i] = { name, type ('Q4_K', ...), shape = {ne0, ne1, ...} (ne0 fastest), numel, bytes }
--   local buf, n = g:read('blk.0.attn_q.weight')  -- float cdata of n, dequantized
--   g:close()                                  -- (also at garbage collection)
-- Errors (a corrupt, truncated or unsupported file) name the file and what is wrong.
local ffi = require('ffi')
local moonrl = require('moonrl')
local C = moonrl.C

local M = {}
local G = {}
G.__index = G

local num, str, len = ffi.new('double[1]'), ffi.new('const char *[1]'), ffi.new('int64_t[1]')

local function value(h, i)
  local t = C.mrl_gguf_kv_type(h, i)
  if t == C.MRL_GGUF_STRING then
    moonrl.check(C.mrl_gguf_kv_string(h, i, -1, str, len))
    return ffi.string(str[0], len[0])
  end
  if t ~= C.MRL_GGUF_ARRAY then
    moonrl.check(C.mrl_gguf_kv_number(h, i, -1, num))
    if t == C.MRL_GGUF_BOOL then return num[0] ~= 0 end
    return num[0]
  end
  local et, n, out = C.mrl_gguf_kv_array_type(h, i), tonumber(C.mrl_gguf_kv_array_len(h, i)), {}
  for j = 0, n - 1 do
    if et == C.MRL_GGUF_STRING then
      moonrl.check(C.mrl_gguf_kv_string(h, i, j, str, len))
      out[j + 1] = ffi.string(str[0], len[0])
    else
      moonrl.check(C.mrl_gguf_kv_number(h, i, j, num))
      out[j + 1] = et == C.MRL_GGUF_BOOL and num[0] ~= 0 or num[0]
    end
  end
  return out
end

function M.open(path)
  local h = ffi.new('mrl_gguf *[1]')
  moonrl.check(C.mrl_gguf_open(path, h), 2)
  local g = setmetatable({ handle = ffi.gc(h[0], C.mrl_gguf_close), path = path, metadata = {}, tensors = {},
    version = C.mrl_gguf_version(h[0]) }, G)
  for i = 0, tonumber(C.mrl_gguf_kv_count(g.handle)) - 1 do
    g.metadata[ffi.string(C.mrl_gguf_kv_key(g.handle, i))] = value(g.handle, i)
  end
  local info = ffi.new('mrl_gguf_tensor')
  for i = 0, tonumber(C.mrl_gguf_tensor_count(g.handle)) - 1 do
    moonrl.check(C.mrl_gguf_tensor_info(g.handle, i, info))
    local shape = {}
    for d = 0, info.ndim - 1 do shape[d + 1] = tonumber(info.shape[d]) end
    g.tensors[i + 1] = { name = ffi.string(info.name), type = ffi.string(info.type_name), shape = shape,
      numel = tonumber(info.numel), bytes = tonumber(info.bytes), index = i }
  end
  return g
end

-- Tensor `name` dequantized: a float cdata and its element count.
function G:read(name)
  local i = C.mrl_gguf_find_tensor(self.handle, name)
  if i < 0 then error(string.format('%s: no tensor %s', self.path, name), 2) end
  local t = self.tensors[tonumber(i) + 1]
  local buf = ffi.new('float[?]', t.numel)
  moonrl.check(C.mrl_gguf_read_f32(self.handle, i, buf, t.numel), 2)
  return buf, t.numel
end

-- ---- GGUF -> a Hugging Face model directory -------------------------------------------------
-- config.json, model.safetensors (F32: the dequantized weights), tokenizer.json,
-- tokenizer_config.json (with the chat template) and generation_config.json; what moonrl and
-- Transformers load. Architectures llama, qwen2, qwen3, qwen3moe (Qwen3-MoE: its stacked [E, ...] expert
-- tensors split into mlp.experts.{e}.*), deepseek2 (DeepSeek-V3: below); tokenizers of model 'gpt2' (byte-level BPE) with the
-- pre-tokenizers gpt2, smollm, qwen2 and llama-bpe, and of model 'llama'
-- (SentencePiece BPE with byte fallback, as Llama 2, Mistral and TinyLlama have).

-- llama.cpp's architecture name -> Transformers' class and model_type (the C table, moonrl/model.h)
local ARCH, MODEL_TYPE, ARCH_NAMES = {}, {}, {}
for i = 0, C.MRL_ARCH_COUNT - 1 do
  local a = C.mrl_model_arch_names(i)
  local name = ffi.string(a.gguf)
  ARCH[name], MODEL_TYPE[name] = ffi.string(a.hf_class) .. 'ForCausalLM', ffi.string(a.model_type)
  ARCH_NAMES[#ARCH_NAMES + 1] = name
end

local function need(g, key)
  local v = g.metadata[key]
  if v == nil then error(string.format('%s: GGUF metadata %s is missing', g.path, key), 3) end
  return v
end

local function shown(v)
  if type(v) == 'table' then return 'an array' end
  if type(v) == 'string' then return string.format('the string %q', v) end
  return tostring(v)
end

-- A size of the model (heads, layers, widths): a whole number >= 1, or `default` when the key is
-- absent (nil: it must be there). 0, a fraction or a per-layer array is an error naming the key.
local function count(g, key, default)
  local v = g.metadata[key]
  if v == nil and default ~= nil then return default end
  v = need(g, key)
  if type(v) ~= 'number' or v ~= math.floor(v) or v < 1 or v > 2 ^ 31 then
    error(string.format('%s: GGUF metadata %s is %s: expected a whole number >= 1', g.path, key, shown(v)), 3)
  end
  return v
end

-- Llama 3's RoPE scaling from the rope_freqs tensor llama.cpp's converter writes instead of the
-- config's rope_scaling: one divisor per frequency (1 for the high ones, `factor` for the low
-- ones, a blend between). The config's four numbers are read back from it (factor: the largest
-- divisor; low_freq_factor 1, high_freq_factor 4 and original_max_position_embeddings 8192 as
-- every Llama 3.1 / 3.2 has them, or the file's rope.scaling.original_context_length), and the
-- divisors those give are checked against the tensor: other ones are an error, not a model that
-- would compute positions wrong.
local function llama3_rope(self, t, theta, hd, p)
  local n = hd / 2
  if t.numel ~= n then
    error(string.format('%s: rope_freqs has %d values, head_dim %d needs %d', self.path, t.numel, hd, n), 0)
  end
  local div = ffi.new('float[?]', n)
  moonrl.check(C.mrl_gguf_read_f32(self.handle, t.index, div, n), 2)
  local factor = 1
  for i = 0, n - 1 do factor = math.max(factor, div[i]) end
  if factor == 1 then return nil end -- no scaling
  local old = self.metadata[p .. 'rope.scaling.original_context_length'] or 8192
  local low, high = 1, 4
  for i = 0, n - 1 do
    local wl = 2 * math.pi * theta ^ (2 * i / hd)
    local want
    if wl < old / high then want = 1
    elseif wl > old / low then want = factor
    else
      local smooth = (old / wl - low) / (high - low)
      want = 1 / ((1 - smooth) / factor + smooth)
    end
    if math.abs(div[i] - want) > 1e-4 * want then
      error(string.format('%s: rope_freqs[%d] = %.6g is not Llama 3 RoPE scaling (factor %g, low 1, high 4, ' ..
        'original context %d give %.6g): not supported', self.path, i, div[i], factor, old, want), 0)
    end
  end
  return { rope_type = 'llama3', factor = factor, low_freq_factor = low, high_freq_factor = high,
    original_max_position_embeddings = old }
end

-- Special token id `key` (nil when absent): a token of the vocabulary, both of the model (vocab_size)
-- and of the tokenizer (tokenizer.ggml.tokens). BOS and EOS are checked (generation starts with
-- one and stops at the other); llama.cpp warns and drops a bad padding or unknown id, and so does
-- tokenizer_config (pad_token / unk_token null).
function G:token_id(key, vocab)
  local id = self.metadata[key]
  if id == nil then return nil end
  local tokens = self.metadata['tokenizer.ggml.tokens']
  local n = type(tokens) == 'table' and math.min(#tokens, vocab) or vocab
  if type(id) ~= 'number' or id ~= math.floor(id) or id < 0 or id >= n then
    error(string.format('%s: GGUF metadata %s is %s, not a token of the vocabulary (ids 0 to %d)', self.path, key,
      shown(id), n - 1), 3)
  end
  return id
end

-- DeepSeek-V3 (llama.cpp's deepseek2, its converter's layout): multi-head latent attention written as
-- multi-query attention over the latent (head_count_kv 1, key_length kv_lora_rank + rope, value_length
-- kv_lora_rank) with the per-head sizes in key_length_mla / value_length_mla (older files: key_length
-- and value_length themselves, and attn_kv_b whole instead of attn_k_b / attn_v_b); RoPE on
-- rope.dimension_count dimensions, its pairs interleaved (DeepSeek's checkpoints); the experts with
-- expert_gating_func 2 (sigmoid), their groups, shared experts, scaling and leading dense layers;
-- yarn's mscale_all_dim from yarn_log_multiplier (0.1 * mscale_all_dim), mscale taken equal to it
-- (DeepSeek-V3's configs: their ratio, cos and sin's factor, 1).
local function deepseek2_config(self, cfg, p, has)
  local m = self.metadata
  local dr = count(self, p .. 'rope.dimension_count')
  local mla = m[p .. 'attention.key_length_mla'] ~= nil
  local qk = count(self, p .. (mla and 'attention.key_length_mla' or 'attention.key_length'))
  cfg.num_key_value_heads = cfg.num_attention_heads
  cfg.kv_lora_rank = count(self, p .. 'attention.kv_lora_rank')
  cfg.q_lora_rank = m[p .. 'attention.q_lora_rank'] and count(self, p .. 'attention.q_lora_rank')
    or require('moonrl.io.json').null
  cfg.qk_rope_head_dim, cfg.qk_nope_head_dim = dr, qk - dr
  cfg.v_head_dim = count(self, p .. (mla and 'attention.value_length_mla' or 'attention.value_length'))
  cfg.rope_interleave = true
  cfg.head_dim = nil
  if qk <= dr then
    error(string.format('%s: GGUF metadata %sattention.key_length%s %d leaves no room past rope.dimension_count %d',
      self.path, p, mla and '_mla' or '', qk, dr), 3)
  end
  cfg.first_k_dense_replace = count(self, p .. 'leading_dense_block_count', cfg.num_hidden_layers)
  if m[p .. 'expert_count'] and cfg.first_k_dense_replace < cfg.num_hidden_layers then
    local gating = m[p .. 'expert_gating_func']
    if gating ~= 2 then
      error(string.format('%s: GGUF metadata %sexpert_gating_func is %s: only 2 (sigmoid, DeepSeek-V3\'s router) is ' ..
        'supported', self.path, p, shown(gating)), 3)
    end
    cfg.n_routed_experts = count(self, p .. 'expert_count')
    cfg.num_experts_per_tok = count(self, p .. 'expert_used_count')
    cfg.moe_intermediate_size = count(self, p .. 'expert_feed_forward_length')
    cfg.n_shared_experts = m[p .. 'expert_shared_count'] or 0
    cfg.n_group = count(self, p .. 'expert_group_count', 1)
    cfg.topk_group = count(self, p .. 'expert_group_used_count', 1)
    cfg.routed_scaling_factor = m[p .. 'expert_weights_scale'] or 1.0
    cfg.norm_topk_prob = m[p .. 'expert_weights_norm'] == true
  end
  local mul = m[p .. 'rope.scaling.yarn_log_multiplier']
  if cfg.rope_scaling and type(mul) == 'number' and mul > 0 then
    cfg.rope_scaling.mscale_all_dim, cfg.rope_scaling.mscale = mul / 0.1, mul / 0.1
  end
end

function G:hf_config()
  local arch = need(self, 'general.architecture')
  if not ARCH[arch] then
    error(string.format("%s: architecture '%s' is not supported (%s)", self.path, arch, table.concat(ARCH_NAMES, ', ')), 2)
  end
  local p = arch .. '.'
  local m = self.metadata
  local heads = count(self, p .. 'attention.head_count')
  local kv_heads = count(self, p .. 'attention.head_count_kv', heads)
  local hidden = count(self, p .. 'embedding_length')
  local head_dim = count(self, p .. 'attention.key_length', false)
  if not head_dim then
    if hidden % heads ~= 0 then
      error(string.format('%s: GGUF metadata %sembedding_length %d is not a multiple of %sattention.head_count %d ' ..
        '(and %sattention.key_length, the head size, is missing)', self.path, p, hidden, p, heads, p), 2)
    end
    head_dim = hidden / heads
  end
  if heads % kv_heads ~= 0 then
    error(string.format('%s: GGUF metadata %sattention.head_count %d is not a multiple of %sattention.head_count_kv %d',
      self.path, p, heads, p, kv_heads), 2)
  end
  local tokens = m['tokenizer.ggml.tokens']
  local vocab = count(self, p .. 'vocab_size', type(tokens) == 'table' and #tokens > 0 and #tokens or nil)
  local has = {}
  for _, t in ipairs(self.tensors) do has[t.name] = true end
  local scaling = m[p .. 'rope.scaling.type']
  if scaling and scaling ~= 'none' and scaling ~= 'yarn' then
    error(string.format('%s: rope scaling %s is not supported yet (yarn is)', self.path, tostring(scaling)), 2)
  end
  local cfg = {
    architectures = { ARCH[arch] }, model_type = MODEL_TYPE[arch],
    vocab_size = vocab, hidden_size = hidden,
    intermediate_size = count(self, p .. 'feed_forward_length'),
    num_hidden_layers = count(self, p .. 'block_count'), num_attention_heads = heads,
    num_key_value_heads = kv_heads, head_dim = head_dim,
    max_position_embeddings = count(self, p .. 'context_length', 2048),
    rms_norm_eps = m[p .. 'attention.layer_norm_rms_epsilon'] or 1e-6,
    rope_theta = m[p .. 'rope.freq_base'] or 10000,
    tie_word_embeddings = not has['output.weight'],
    bos_token_id = self:token_id('tokenizer.ggml.bos_token_id', vocab),
    eos_token_id = self:token_id('tokenizer.ggml.eos_token_id', vocab),
    torch_dtype = 'float32',
  }
  if scaling == 'yarn' then -- (llama.cpp's converter: a Qwen config's long-context yarn)
    local factor, old = m[p .. 'rope.scaling.factor'], m[p .. 'rope.scaling.original_context_length']
    if type(factor) ~= 'number' or type(old) ~= 'number' then
      error(string.format('%s: GGUF metadata %srope.scaling.type yarn needs %srope.scaling.factor and ' ..
        '%srope.scaling.original_context_length', self.path, p, p, p), 2)
    end
    cfg.rope_scaling = { rope_type = 'yarn', factor = factor, original_max_position_embeddings = old }
  end
  if arch == 'qwen2' then cfg.attention_bias = has['blk.0.attn_q.bias'] or false end
  for _, t in ipairs(self.tensors) do
    if t.name == 'rope_freqs.weight' then cfg.rope_scaling = llama3_rope(self, t, cfg.rope_theta, cfg.head_dim, p) end
  end
  if arch == 'deepseek2' then deepseek2_config(self, cfg, p, has) end
  if arch == 'qwen3moe' then
    -- the experts: llama.cpp's qwen3moe always renormalises the picked weights (norm_topk_prob, as
    -- every Qwen3-MoE checkpoint has it) unless expert_weights_norm says otherwise; a layer
    -- without a router (ffn_gate_inp) keeps the dense MLP (mlp_only_layers)
    cfg.num_experts = count(self, p .. 'expert_count')
    cfg.num_experts_per_tok = count(self, p .. 'expert_used_count')
    cfg.moe_intermediate_size = count(self, p .. 'expert_feed_forward_length')
    cfg.intermediate_size = count(self, p .. 'feed_forward_length', cfg.moe_intermediate_size)
    local norm = m[p .. 'expert_weights_norm']
    cfg.norm_topk_prob = norm == nil or norm == true
    cfg.decoder_sparse_step = 1
    cfg.mlp_only_layers = require('moonrl.io.json').array()
    for l = 0, cfg.num_hidden_layers - 1 do
      if not has[string.format('blk.%d.ffn_gate_inp.weight', l)] then cfg.mlp_only_layers[#cfg.mlp_only_layers + 1] = l end
    end
  end
  return cfg
end

-- GGUF tensor name -> Hugging Face name.
local LAYER = { attn_norm = 'input_layernorm', ffn_norm = 'post_attention_layernorm', attn_q = 'self_attn.q_proj',
  attn_k = 'self_attn.k_proj', attn_v = 'self_attn.v_proj', attn_output = 'self_attn.o_proj',
  attn_q_norm = 'self_attn.q_norm', attn_k_norm = 'self_attn.k_norm', ffn_gate = 'mlp.gate_proj',
  ffn_up = 'mlp.up_proj', ffn_down = 'mlp.down_proj', ffn_gate_inp = 'mlp.gate',
  -- deepseek2's (multi-head latent attention, the shared experts, the router's choice bias)
  attn_q_a = 'self_attn.q_a_proj', attn_q_a_norm = 'self_attn.q_a_layernorm', attn_q_b = 'self_attn.q_b_proj',
  attn_kv_a_mqa = 'self_attn.kv_a_proj_with_mqa', attn_kv_a_norm = 'self_attn.kv_a_layernorm',
  attn_kv_b = 'self_attn.kv_b_proj', ffn_gate_shexp = 'mlp.shared_experts.gate_proj',
  ffn_up_shexp = 'mlp.shared_experts.up_proj', ffn_down_shexp = 'mlp.shared_experts.down_proj' }
-- the experts of a qwen3moe layer, each kind one tensor [E, rows, cols] (ne0 = cols fastest)
local EXPERTS = { ffn_gate_exps = 'gate_proj', ffn_up_exps = 'up_proj', ffn_down_exps = 'down_proj' }
local TOP = { ['token_embd.weight'] = 'model.embed_tokens.weight', ['output_norm.weight'] = 'model.norm.weight',
  ['output.weight'] = 'lm_head.weight' }

local function hf_name(name)
  if TOP[name] then return TOP[name] end
  local b = name:match('^blk%.(%d+)%.exp_probs_b%.bias$')
  if b then return string.format('model.layers.%s.mlp.gate.e_score_correction_bias', b) end
  local l, part, kind = name:match('^blk%.(%d+)%.([%w_]+)%.(%a+)$')
  if l and LAYER[part] then return string.format('model.layers.%s.%s.%s', l, LAYER[part], kind) end
  return nil
end

-- llama.cpp's converter reorders the rows of each head of a llama model's q_proj and k_proj
-- (from the halves that rotate_half pairs to interleaved pairs, its RoPE): put them back.
-- rows = heads * hd rows of row_bytes (floats, or a quantized row's blocks); GGUF row
-- h*hd + 2i + j is HF row h*hd + j*hd/2 + i.
local function unpermute(ptr, rows, row_bytes, heads)
  local hd, buf = rows / heads, ffi.cast('uint8_t *', ptr)
  local tmp = ffi.new('uint8_t[?]', rows * row_bytes)
  ffi.copy(tmp, buf, rows * row_bytes)
  for h = 0, heads - 1 do
    for i = 0, hd / 2 - 1 do
      for j = 0, 1 do
        ffi.copy(buf + (h * hd + j * hd / 2 + i) * row_bytes, tmp + (h * hd + 2 * i + j) * row_bytes, row_bytes)
      end
    end
  end
end

-- the heads whose rows a llama model's tensor `hf` (q_proj, k_proj) has reordered, else nil
local function permuted_heads(cfg, hf)
  if cfg.model_type ~= 'llama' then return nil end
  if hf:find('q_proj.weight', 1, true) then return cfg.num_attention_heads end
  if hf:find('k_proj.weight', 1, true) then return cfg.num_key_value_heads end
end

-- The GGML blocks a quantized base keeps (kernels.h's dequant op reads them), by type name.
local BLOCKS = { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 }

-- The quantized base's tensors (moonrl.model's new_quantized): each layer matrix (and stacked
-- experts) of a type in BLOCKS, its blocks as the file holds them (llama's q/k rows put back);
-- kept[hf name] = true for the views they cover.
local function quantized_tensors(self, cfg)
  local list, kept = {}, {}
  for _, t in ipairs(self.tensors) do
    local n = hf_name(t.name)
    local l, kind = t.name:match('^blk%.(%d+)%.([%w_]+)%.weight$')
    local first = n and n:match('^model%.layers%.%d+%.[%w_]+%.[%w_]+_proj%.weight$') and n
      or l and EXPERTS[kind] and string.format('model.layers.%s.mlp.experts.0.%s.weight', l, EXPERTS[kind])
    if first and BLOCKS[t.type] then
      local blocks = ffi.new('uint8_t[?]', t.bytes)
      moonrl.check(C.mrl_gguf_read_raw(self.handle, t.index, blocks, t.bytes), 3)
      local heads = permuted_heads(cfg, first)
      if heads then unpermute(blocks, t.shape[2], t.bytes / t.shape[2], heads) end
      list[#list + 1] = { name = first, numel = t.numel, type = BLOCKS[t.type], blocks = blocks }
      if first:find('.experts.0.', 1, true) then
        for e = 0, (cfg.num_experts or cfg.n_routed_experts) - 1 do kept[first:gsub('%.experts%.0%.', '.experts.' .. e .. '.')] = true end
      else
        kept[first] = true
      end
    end
  end
  return list, kept
end

-- A moonrl model with this file's weights, dequantized to fp32; opts.quantized: a quantized base
-- (QLoRA): the layers' matrices stored as Q4_0, Q4_1 or Q8_0 keep their blocks (moonrl.model's
-- new_quantized), the other tensors are dequantized. Returns the model and its config.
function G:model(opts)
  local cfg = self:hf_config()
  local model_mod = require('moonrl.model')
  local model, kept
  if opts and opts.quantized then
    local list
    list, kept = quantized_tensors(self, cfg)
    model = model_mod.new_quantized(cfg, list)
  else
    model, kept = model_mod.new(cfg), {}
  end
  local base = model.quantized and model:param_buffer() or model:params() -- (a quantized base: the views outside its blocks)
  local function at(v) return base + v.offset end
  local src, expert = {}, {} -- expert[hf name] = { tensor, e }: a slice of a stacked [E, ...] tensor
  for _, t in ipairs(self.tensors) do
    local n = hf_name(t.name)
    if n then src[n] = t end
    local l, kind = t.name:match('^blk%.(%d+)%.([%w_]+)%.weight$')
    if l and EXPERTS[kind] then
      for e = 0, (cfg.num_experts or cfg.n_routed_experts or 0) - 1 do
        expert[string.format('model.layers.%s.mlp.experts.%d.%s.weight', l, e, EXPERTS[kind])] = { t, e }
      end
    end
  end
  local stacked, stacked_t -- the stacked tensor read last (its experts are read one after the other)
  local views, total = {}, 0
  for _, v in ipairs(model:views()) do
    if not kept[v.name] then views[#views + 1], total = v, total + 4 * v.numel end
  end
  local prog = require('moonrl.io.progress').new('dequantize ' .. self.path:match('[^/]*$'), total, { unit = 'B' })
  local done = 0
  -- deepseek2's kv_b_proj as llama.cpp's converter splits it: attn_k_b [H, rkv, dn] (each head's key
  -- rows transposed) and attn_v_b [H, dv, rkv]; put back as each head's dn key rows then dv value rows
  local byname = {}
  for _, t in ipairs(self.tensors) do byname[t.name] = t end
  local function kv_b(v)
    local l = v.name:match('^model%.layers%.(%d+)%.')
    local kb, vb = byname['blk.' .. l .. '.attn_k_b.weight'], byname['blk.' .. l .. '.attn_v_b.weight']
    local H, dn, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if not kb or not vb then error(string.format('%s: no GGUF tensor for %s (attn_kv_b, or attn_k_b and attn_v_b)',
      self.path, v.name), 0) end
    if kb.numel ~= H * r * dn or vb.numel ~= H * dv * r then
      error(string.format('%s: tensors %s and %s have %d and %d elements, %s needs %d and %d', self.path, kb.name,
        vb.name, kb.numel, vb.numel, v.name, H * r * dn, H * dv * r), 0)
    end
    local k, x = ffi.new('float[?]', kb.numel), ffi.new('float[?]', vb.numel)
    moonrl.check(C.mrl_gguf_read_f32(self.handle, kb.index, k, kb.numel), 2)
    moonrl.check(C.mrl_gguf_read_f32(self.handle, vb.index, x, vb.numel), 2)
    local out = at(v)
    for h = 0, H - 1 do
      local row0 = h * (dn + dv)
      for j = 0, dn - 1 do
        for c = 0, r - 1 do out[(row0 + j) * r + c] = k[(h * r + c) * dn + j] end
      end
      ffi.copy(out + (row0 + dn) * r, x + h * dv * r, 4 * dv * r)
    end
    done = done + 4 * v.numel
    prog:update(done)
  end
  local function read(v)
    local x = expert[v.name]
    if x then
      local t, e = x[1], x[2]
      local E = cfg.num_experts or cfg.n_routed_experts -- (qwen3_moe's key, deepseek_v3's)
      if t.numel ~= E * v.numel then
        error(string.format('%s: tensor %s has %d elements, %d experts of %s need %d', self.path, t.name, t.numel,
          E, v.name:gsub('%.experts%.%d+%.', '.experts.*.'), E * v.numel), 0)
      end
      if stacked_t ~= t then
        stacked = ffi.new('float[?]', t.numel)
        moonrl.check(C.mrl_gguf_read_f32(self.handle, t.index, stacked, t.numel), 2)
        stacked_t = t
      end
      ffi.copy(at(v), stacked + e * v.numel, 4 * v.numel)
      done = done + 4 * v.numel
      prog:update(done)
      return
    end
    local t = src[v.name]
    if not t and v.name:find('kv_b_proj.weight', 1, true) then return kv_b(v) end
    if not t then error(string.format('%s: no GGUF tensor for %s', self.path, v.name), 0) end
    if t.numel ~= v.numel then
      error(string.format('%s: tensor %s has %d elements, %s needs %d', self.path, t.name, t.numel, v.name, v.numel), 0)
    end
    local p = at(v)
    moonrl.check(C.mrl_gguf_read_f32(self.handle, t.index, p, v.numel), 2)
    local heads = permuted_heads(cfg, v.name)
    if heads then unpermute(p, v.shape[1], 4 * v.shape[2], heads) end
    done = done + 4 * v.numel
    prog:update(done)
  end
  for _, v in ipairs(views) do
    local ok, err = pcall(read, v)
    if not ok then prog:cancel(); error(err, 0) end
  end
  prog:finish()
  return model, cfg
end

-- The byte-level BPE pre-tokenizers of llama.cpp's tokenizer.ggml.pre names, as tokenizer.json has them.
local GPT2_SPLIT = { type = 'ByteLevel', add_prefix_space = false, trim_offsets = true, use_regex = true }
local function split(regex)
  return { type = 'Sequence', pretokenizers = {
    { type = 'Split', pattern = { Regex = regex }, behavior = 'Isolated', invert = false },
    { type = 'ByteLevel', add_prefix_space = false, trim_offsets = true, use_regex = false } } }
end
local PRE = {
  gpt2 = GPT2_SPLIT, default = GPT2_SPLIT,
  smollm = { type = 'Sequence', pretokenizers = { { type = 'Digits', individual_digits = true }, GPT2_SPLIT } },
  qwen2 = split([[(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+]]),
  ['llama-bpe'] = split([[(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+]]),
}
-- token_type (llama.cpp): 0 undefined (taken as normal), 1 normal, 2 unknown, 3 control,
-- 4 user-defined, 5 unused, 6 byte
local NORMAL, UNKNOWN, CONTROL, USER, BYTE = 1, 2, 3, 4, 6

-- The vocabulary's tokens and types, checked: a list of strings, a type list as long with known types.
function G:vocab_lists()
  local m = self.metadata
  local tokens, types = need(self, 'tokenizer.ggml.tokens'), m['tokenizer.ggml.token_type']
  local function bad(fmt, ...) error(string.format('%s: GGUF metadata ' .. fmt, self.path, ...), 3) end
  if type(tokens) ~= 'table' or #tokens == 0 then bad('tokenizer.ggml.tokens: expected a non-empty array of strings') end
  for i, t in ipairs(tokens) do
    if type(t) ~= 'string' then bad('tokenizer.ggml.tokens[%d]: expected a string, not a %s', i - 1, type(t)) end
  end
  if types == nil then
    types = {}
    for i = 1, #tokens do types[i] = NORMAL end
  elseif type(types) ~= 'table' or #types ~= #tokens then
    bad('tokenizer.ggml.token_type has %s entries, tokenizer.ggml.tokens %d',
      type(types) == 'table' and tostring(#types) or 'no array of', #tokens)
  else
    for i, ty in ipairs(types) do
      if type(ty) ~= 'number' or ty ~= math.floor(ty) or ty < 0 or ty > BYTE then
        bad('tokenizer.ggml.token_type[%d] (token %q): unknown token type %s (0..6)', i - 1, tokens[i], tostring(ty))
      end
    end
  end
  return tokens, types
end

local function added_list(json, tokens, types, special_types)
  local added = json.array()
  for i, t in ipairs(tokens) do
    if special_types[types[i]] ~= nil then
      added[#added + 1] = json.object({ 'id', i - 1, 'content', t, 'single_word', false, 'lstrip', false, 'rstrip',
        false, 'normalized', false, 'special', special_types[types[i]] })
    end
  end
  return added
end

-- A byte-level BPE vocabulary ('gpt2'): its merges as they are.
function G:gpt2_tokenizer_json(json)
  local m = self.metadata
  local pre_name = m['tokenizer.ggml.pre'] or 'default'
  local pre = PRE[pre_name]
  if not pre then
    error(string.format("%s: tokenizer pre-tokenizer '%s' is not supported (gpt2, smollm, qwen2, llama-bpe)", self.path,
      pre_name), 3)
  end
  local tokens, types = self:vocab_lists()
  local vocab = json.object()
  for i, t in ipairs(tokens) do vocab[t] = i - 1 end
  local merges = json.array()
  for i, mg in ipairs(m['tokenizer.ggml.merges'] or {}) do merges[i] = mg end
  return json.encode(json.object({ 'version', '1.0', 'truncation', json.null, 'padding', json.null,
    'added_tokens', added_list(json, tokens, types, { [CONTROL] = true, [USER] = false }), 'normalizer', json.null,
    'pre_tokenizer', pre,
    'post_processor', { type = 'ByteLevel', add_prefix_space = true, trim_offsets = false, use_regex = true },
    'decoder', { type = 'ByteLevel', add_prefix_space = true, trim_offsets = true, use_regex = true },
    'model', json.object({ 'type', 'BPE', 'dropout', json.null, 'unk_token', json.null,
      'continuing_subword_prefix', json.null, 'end_of_word_suffix', json.null, 'fuse_unk', false,
      'byte_fallback', false, 'ignore_merges', false, 'vocab', vocab, 'merges', merges }) }))
end

-- add_bos / add_eos as llama.cpp reads them (a SentencePiece vocabulary adds BOS unless told not to).
function G:add_bos_eos()
  local m = self.metadata
  local spm = m['tokenizer.ggml.model'] == 'llama'
  local bos, eos = m['tokenizer.ggml.add_bos_token'], m['tokenizer.ggml.add_eos_token']
  if bos == nil then bos = spm end
  if eos == nil then eos = false end
  return bos == true, eos == true
end

-- A SentencePiece BPE vocabulary ('llama': tokens with scores, <0xNN> byte tokens, ▁ for spaces) as
-- Hugging Face's converter writes it for Llama / Mistral: a BPE model with byte_fallback whose merges
-- come from the scores. SentencePiece merges the adjacent pair whose joined piece scores highest
-- (leftmost first); a merge (left, right) for every split of each normal piece into two normal
-- pieces, ranked by the joined piece's score (then its id, then the parts' ids), gives the same
-- segmentation. Normalizer: "▁" prepended (tokenizer.ggml.add_space_prefix, default true) and
-- spaces replaced by "▁"; the decoder undoes both and turns byte tokens back into bytes.
function G:spm_tokenizer_json(json)
  local m = self.metadata
  local tokens, types = self:vocab_lists()
  local scores = m['tokenizer.ggml.scores']
  if scores == nil then
    error(string.format('%s: GGUF metadata tokenizer.ggml.scores is missing (a SentencePiece vocabulary needs them)',
      self.path), 3)
  end
  if type(scores) ~= 'table' or #scores ~= #tokens then
    error(string.format('%s: GGUF metadata tokenizer.ggml.scores has %s entries, tokenizer.ggml.tokens %d', self.path,
      type(scores) == 'table' and tostring(#scores) or 'no array of', #tokens), 3)
  end
  local vocab, id_of, has_byte = json.object(), {}, false
  for i, t in ipairs(tokens) do
    local ty = types[i]
    if type(scores[i]) ~= 'number' or scores[i] ~= scores[i] then
      error(string.format('%s: GGUF metadata tokenizer.ggml.scores[%d]: expected a number', self.path, i - 1), 3)
    end
    if ty == BYTE then
      if not t:match('^<0x%x%x>$') then
        error(string.format('%s: GGUF metadata tokenizer.ggml.tokens[%d]: byte token %q is not <0xNN>', self.path, i - 1,
          t), 3)
      end
      has_byte = true
    end
    if id_of[t] == nil then
      vocab[t] = i - 1
      id_of[t] = i - 1
    end
  end
  local function normal(id) return id ~= nil and (types[id + 1] == NORMAL or types[id + 1] == 0) end
  local list = {}
  for i, t in ipairs(tokens) do
    if normal(i - 1) and id_of[t] == i - 1 then
      for k = 2, #t do
        local c = t:byte(k)
        if c < 0x80 or c >= 0xC0 then -- a character boundary
          local l, r = id_of[t:sub(1, k - 1)], id_of[t:sub(k)]
          if normal(l) and normal(r) then list[#list + 1] = { -scores[i], i - 1, l, r } end
        end
      end
    end
  end
  table.sort(list, function(a, b)
    for j = 1, 4 do
      if a[j] ~= b[j] then return a[j] < b[j] end
    end
    return false
  end)
  -- "left right" (what every tokenizers version reads) unless a piece holds a space: then [left, right]
  local pairs_form = false
  for _, e in ipairs(list) do
    if tokens[e[3] + 1]:find(' ', 1, true) or tokens[e[4] + 1]:find(' ', 1, true) then pairs_form = true; break end
  end
  local merges = json.array()
  for i, e in ipairs(list) do
    local l, r = tokens[e[3] + 1], tokens[e[4] + 1]
    merges[i] = pairs_form and json.array({ l, r }) or l .. ' ' .. r
  end
  local unk = m['tokenizer.ggml.unknown_token_id']
  if unk == nil then
    for i = 1, #tokens do
      if types[i] == UNKNOWN then unk = i - 1; break end
    end
  end
  local unk_token = unk and tokens[unk + 1] or json.null
  local prefix = m['tokenizer.ggml.add_space_prefix']
  if prefix == nil then prefix = true end
  local norms = json.array()
  if prefix then norms[#norms + 1] = { type = 'Prepend', prepend = '▁' } end
  norms[#norms + 1] = json.object({ 'type', 'Replace', 'pattern', { String = ' ' }, 'content', '▁' })
  local decs = json.array({ json.object({ 'type', 'Replace', 'pattern', { String = '▁' }, 'content', ' ' }),
    { type = 'ByteFallback' }, { type = 'Fuse' } })
  if prefix then decs[#decs + 1] = json.object({ 'type', 'Strip', 'content', ' ', 'start', 1, 'stop', 0 }) end
  -- BOS / EOS around each sequence, as the Llama converter's TemplateProcessing
  local add_bos, add_eos = self:add_bos_eos()
  local single, pair, specials = json.array(), json.array(), json.object()
  local function special(key, type_id, into)
    local id = m[key]
    local t = id and tokens[id + 1]
    if not t then return end
    into[#into + 1] = { SpecialToken = json.object({ 'id', t, 'type_id', type_id }) }
    specials[t] = json.object({ 'id', t, 'ids', json.array({ id }), 'tokens', json.array({ t }) })
  end
  for _, seq in ipairs({ { 'A', 0, single }, { 'A', 0, pair }, { 'B', 1, pair } }) do
    local name, type_id, into = seq[1], seq[2], seq[3]
    if add_bos then special('tokenizer.ggml.bos_token_id', type_id, into) end
    into[#into + 1] = { Sequence = json.object({ 'id', name, 'type_id', type_id }) }
    if add_eos then special('tokenizer.ggml.eos_token_id', type_id, into) end
  end
  return json.encode(json.object({ 'version', '1.0', 'truncation', json.null, 'padding', json.null,
    'added_tokens', added_list(json, tokens, types, { [UNKNOWN] = true, [CONTROL] = true, [USER] = false }),
    'normalizer', { type = 'Sequence', normalizers = norms }, 'pre_tokenizer', json.null,
    'post_processor', json.object({ 'type', 'TemplateProcessing', 'single', single, 'pair', pair,
      'special_tokens', specials }),
    'decoder', { type = 'Sequence', decoders = decs },
    'model', json.object({ 'type', 'BPE', 'dropout', json.null, 'unk_token', unk_token,
      'continuing_subword_prefix', json.null, 'end_of_word_suffix', json.null, 'fuse_unk', true,
      'byte_fallback', has_byte, 'ignore_merges', false, 'vocab', vocab, 'merges', merges }) }))
end

function G:tokenizer_json()
  local json = require('moonrl.io.json')
  local model = self.metadata['tokenizer.ggml.model']
  if model == 'gpt2' then return self:gpt2_tokenizer_json(json) end
  if model == 'llama' then return self:spm_tokenizer_json(json) end
  error(string.format("%s: tokenizer model '%s' is not supported yet (byte-level BPE 'gpt2' and SentencePiece "
    .. "'llama' are)", self.path, tostring(model)), 2)
end

function G:tokenizer_config()
  local json = require('moonrl.io.json')
  local m = self.metadata
  local tokens = m['tokenizer.ggml.tokens'] or {}
  local function tok(key) local id = m[key]; return id and tokens[id + 1] or json.null end
  local add_bos, add_eos = self:add_bos_eos()
  return json.encode(json.object({ 'add_bos_token', add_bos, 'add_eos_token', add_eos,
    'bos_token', tok('tokenizer.ggml.bos_token_id'), 'eos_token', tok('tokenizer.ggml.eos_token_id'),
    'pad_token', tok('tokenizer.ggml.padding_token_id'), 'unk_token', tok('tokenizer.ggml.unknown_token_id'),
    'chat_template', m['tokenizer.chat_template'] or json.null, 'model_max_length', json.null,
    'tokenizer_class', 'PreTrainedTokenizerFast' }))
end

-- Write the Hugging Face directory.
function G:convert(dir)
  local fs, json = require('moonrl.io.fs'), require('moonrl.io.json')
  -- the architecture, then the tokenizer's metadata: checked before the weights are read
  self:hf_config()
  local tokenizer, tokenizer_config = self:tokenizer_json(), self:tokenizer_config()
  local model, cfg = self:model()
  fs.mkdirs(dir)
  require('moonrl.io.progress').task('writing ' .. dir, function() model:save(dir) end)
  fs.write(dir .. '/config.json', json.encode(cfg))
  fs.write(dir .. '/tokenizer.json', tokenizer)
  fs.write(dir .. '/tokenizer_config.json', tokenizer_config)
  fs.write(dir .. '/generation_config.json', json.encode(json.object({ 'bos_token_id', cfg.bos_token_id or json.null,
    'eos_token_id', cfg.eos_token_id or json.null })))
  return dir
end

-- The SHA-256 of the file at path (what sha256sum prints), computed once per version of the file:
-- remembered in ROOT/sums/ under the path and its identity (device, inode, size, mtime and ctime,
-- fs.identify), so that a copy with the same name, size and mtime (cp -p, rsync -t, tar) or an edit
-- whose mtime was set back (touch -r: it still changes ctime) is hashed again.
local function content_sum(fs, root, path, id)
  local key = path .. '\n' .. id.key
  local memo = root .. '/sums/' .. fs.sha256(key)
  local known, sum = (fs.read(memo) or ''):match('^(.*)\n(%x+)\n$')
  if known == key and #sum == 64 then return sum end
  sum = require('moonrl.io.progress').task('sha256 ' .. path:match('[^/]*$'), function() return fs.sha256_file(path) end)
  fs.mkdirs(root .. '/sums')
  fs.write(memo, key .. '\n' .. sum .. '\n')
  return sum
end

-- A model path that may be a .gguf file: the Hugging Face directory to load, converted once into
-- MOONRL_CACHE (default ~/.cache/moonrl) at gguf/SHA256, keyed by the file's content: two files
-- that differ in any byte never share an entry, whatever their names and times.
function M.resolve(path)
  if type(path) ~= 'string' or not path:match('%.gguf$') then return path end
  local fs = require('moonrl.io.fs')
  local id = fs.identify(path)
  if not id or not id.is_file then error(path .. ': no such file', 2) end
  local root = (os.getenv('MOONRL_CACHE') or ((os.getenv('HOME') or '/tmp') .. '/.cache/moonrl')) .. '/gguf'
  local dir = root .. '/' .. content_sum(fs, root, path, id)
  local function done() return fs.stat(dir .. '/config.json') and fs.stat(dir .. '/tokenizer_config.json') end
  if done() then return dir end
  local g = M.open(path)
  local tmp = dir .. '.tmp-' .. moonrl.C.mrl_process_id()
  local ok, err = pcall(g.convert, g, tmp)
  g:close()
  -- what was converted must be what was hashed: a file changed meanwhile is not kept under the old sum
  local now = ok and fs.identify(path)
  if ok and not (now and now.key == id.key) then ok, err = false, path .. ': changed while it was converted; run again' end
  if ok and not done() then ok, err = pcall(fs.rename, tmp, dir) end
  fs.remove(tmp) -- gone once renamed; else a failure, or another process converted the same bytes first
  if not done() then error(err, 0) end
  return dir
end

function G:close()
  if self.handle ~= nil then
    C.mrl_gguf_close(ffi.gc(self.handle, nil))
    self.handle = nil
  end
end

return M
