-- The transformer (Llama / Qwen2 / Qwen3) on the CPU or a GPU: per-token log-probs,
-- entropy and values for a packed batch, and the backward into one gradient
-- buffer (see core/include/moonrl/model.h).
--
--   local model = moonrl.model.load('/models/Qwen3-0.6B')            -- config.json + safetensors
--   local m = moonrl.model.new({ model_type = 'llama', vocab_size = 256, hidden_size = 64,
--     intermediate_size = 128, num_hidden_layers = 2, num_attention_heads = 4 }, { seed = 1 })
--   local b = moonrl.model.batch({ {1, 5, 9, 2}, {1, 7, 2} })       -- packed, targets = next token
--   local logprobs, entropy = m:forward(b, { temperature = 1.0 })  -- float[b.n_tokens] each
--   m:zero_grad(); m:backward(dlogprobs, dentropy)                  -- float arrays (or nil)
--   local p, n = m:params()                                         -- the one parameter buffer
--   m:to_device('cuda')                                             -- its buffers and kernels on a GPU
--   local h = m:read_params(); m:write_params(h)                    -- host copies there
--   m:save('/tmp/out')                                              -- or m:save(dir, max_shard_bytes)
--   local s = moonrl.model.load_tp(dir, world)                      -- this rank's tensor-parallel slices
local moonrl = require('moonrl')
local ffi = require('ffi')
local json = require('moonrl.io.json')
local bit = require('bit')
local C = moonrl.C

local M = {}

-- The C config as a Lua table with the config.json names.
local function config_table(c)
  local t = {}
  for _, k in ipairs({ 'vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers',
    'num_attention_heads', 'num_key_value_heads', 'head_dim', 'max_position_embeddings',
    'bos_token_id', 'eos_token_id', 'rms_norm_eps', 'rope_theta', 'initializer_range' }) do
    t[k] = tonumber(c[k])
  end
  t.model_type = ffi.string(C.mrl_model_arch_names(c.arch).model_type)
  t.tie_word_embeddings = c.tie_word_embeddings ~= 0
  t.attention_bias = c.attention_bias ~= 0
  t.value_head = c.value_head ~= 0
  if c.rope_scaling == C.MRL_ROPE_LLAMA3 then
    t.rope_scaling = { rope_type = 'llama3', factor = tonumber(c.rope_factor),
      low_freq_factor = tonumber(c.rope_low_freq_factor), high_freq_factor = tonumber(c.rope_high_freq_factor),
      original_max_position_embeddings = tonumber(c.rope_original_max_position_embeddings) }
  elseif c.rope_scaling == C.MRL_ROPE_YARN then
    t.rope_scaling = { rope_type = 'yarn', factor = tonumber(c.rope_factor),
      original_max_position_embeddings = tonumber(c.rope_original_max_position_embeddings),
      beta_fast = tonumber(c.rope_beta_fast), beta_slow = tonumber(c.rope_beta_slow), truncate = c.rope_truncate ~= 0,
      mscale = c.rope_mscale ~= 0 and tonumber(c.rope_mscale) or nil,
      mscale_all_dim = c.rope_mscale_all_dim ~= 0 and tonumber(c.rope_mscale_all_dim) or nil,
      attention_factor = c.rope_attention_factor_given ~= 0 and tonumber(c.rope_attention_factor) or nil }
  end
  if t.model_type == 'deepseek_v3' then -- multi-head latent attention (model.h); head_dim is the padded head
    for _, k in ipairs({ 'kv_lora_rank', 'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim' }) do
      t[k] = tonumber(c[k])
    end
    t.q_lora_rank = c.q_lora_rank ~= 0 and tonumber(c.q_lora_rank) or json.null
    t.rope_interleave = c.rope_interleave ~= 0
    t.num_nextn_predict_layers = tonumber(c.num_nextn_predict_layers)
    if c.num_experts > 0 then -- DeepSeek-V3's experts (model.h)
      t.n_routed_experts = tonumber(c.num_experts)
      for _, k in ipairs({ 'num_experts_per_tok', 'moe_intermediate_size', 'n_shared_experts', 'n_group', 'topk_group',
        'first_k_dense_replace', 'routed_scaling_factor' }) do
        t[k] = tonumber(c[k])
      end
      t.norm_topk_prob = c.norm_topk_prob ~= 0
    else
      t.first_k_dense_replace = t.num_hidden_layers -- (every layer dense)
    end
  end
  if t.model_type == 'qwen3_moe' then -- the experts (model.h), so that M.new(m.config) makes the same model
    for _, k in ipairs({ 'num_experts', 'num_experts_per_tok', 'moe_intermediate_size', 'decoder_sparse_step',
      'router_aux_loss_coef' }) do
      t[k] = tonumber(c[k])
    end
    t.norm_topk_prob = c.norm_topk_prob ~= 0
    t.output_router_logits = c.output_router_logits ~= 0
    t.mlp_only_layers = json.array()
    for l = 0, t.num_hidden_layers - 1 do
      if bit.band(bit.rshift(c.mlp_only_layers[math.floor(l / 64)], l % 64), 1ULL) ~= 0ULL then
        t.mlp_only_layers[#t.mlp_only_layers + 1] = l
      end
    end
  end
  return t
end

-- ---- batches -----------------------------------------------------------------------

local Batch = {}
Batch.__index = Batch

-- seqs: a list of token lists. opts.targets: a list of target lists (same
-- lengths, -1 = none); by default each token's target is the next token of
-- its sequence and the last token of each sequence has none (-1).
-- opts.prefix: a list, prefix[i] = the (1-based) index of an earlier sequence
-- that sequence i continues (shared prompts, see mrl_batch in model.h), or
-- false / 0 for none.
function M.batch(seqs, opts)
  opts = opts or {}
  if type(seqs) ~= 'table' or #seqs == 0 then error('model.batch: expected a non-empty list of token lists', 2) end
  local n = 0
  for i, s in ipairs(seqs) do
    if type(s) ~= 'table' then error('model.batch: sequence ' .. i .. ' is not a list', 2) end
    n = n + #s
  end
  if n == 0 then error('model.batch: all sequences are empty', 2) end
  local tokens, targets = ffi.new('int32_t[?]', n), ffi.new('int32_t[?]', n)
  local cu = ffi.new('int32_t[?]', #seqs + 1)
  local pos = 0
  for i, s in ipairs(seqs) do
    cu[i - 1] = pos
    local tg = opts.targets and opts.targets[i]
    if tg and #tg ~= #s then error('model.batch: targets ' .. i .. ' has ' .. #tg .. ' entries for ' .. #s .. ' tokens', 2) end
    for j = 1, #s do
      tokens[pos] = s[j]
      targets[pos] = tg and tg[j] or (j < #s and s[j + 1] or -1)
      pos = pos + 1
    end
  end
  cu[#seqs] = n
  local c = ffi.new('mrl_batch')
  c.tokens, c.targets, c.cu_seqlens, c.n_tokens, c.n_seqs = tokens, targets, cu, n, #seqs
  local prefix
  if opts.prefix then
    prefix = ffi.new('int32_t[?]', #seqs)
    for i = 1, #seqs do
      local p = opts.prefix[i]
      prefix[i - 1] = (p and p ~= 0) and p - 1 or -1
    end
    c.prefix = prefix
  end
  return setmetatable({ tokens = tokens, targets = targets, cu_seqlens = cu, prefix = prefix, n_tokens = n,
    n_seqs = #seqs, c = c }, Batch)
end

-- A batch of no tokens: what a rank with nothing to do passes under expert parallelism, where
-- every forward and backward is a collective (model.h, mrl_model_set_expert_parallel).
function M.empty_batch()
  local tokens, cu = ffi.new('int32_t[1]'), ffi.new('int32_t[1]')
  local c = ffi.new('mrl_batch')
  c.tokens, c.targets, c.cu_seqlens, c.n_tokens, c.n_seqs = tokens, tokens, cu, 0, 0
  return setmetatable({ tokens = tokens, targets = tokens, cu_seqlens = cu, n_tokens = 0, n_seqs = 0, c = c }, Batch)
end

-- First and one-past-last flat index of sequence i (1-based).
function Batch:range(i) return self.cu_seqlens[i - 1], self.cu_seqlens[i] end

-- ---- the model ---------------------------------------------------------------------

local Model = {}
Model.__index = Model

local function wrap(handle)
  local m = setmetatable({ handle = ffi.gc(handle, C.mrl_model_free) }, Model)
  m.config = config_table(C.mrl_model_get_config(handle))
  m.whole_config = m.config -- (a tensor-parallel rank's config is its slices': load_tp)
  m.n_params = tonumber(C.mrl_model_num_params(handle))
  return m
end

-- cfg: a table with the keys of a config.json (model_type, vocab_size, ...).
-- opts.seed (default 0): the random init; opts.value_head: add score.weight.
local function parse_config(cfg, opts)
  if type(cfg) ~= 'table' then error('model.new: expected a config table', 3) end
  local t = {}
  for k, v in pairs(cfg) do t[k] = v end
  if opts.value_head then t.moonrl_value_head = true end
  local text = json.encode(t)
  local c = ffi.new('mrl_model_config')
  moonrl.check(C.mrl_model_config_parse(text, #text, 'model config table', c), 3)
  return c
end

function M.new(cfg, opts)
  opts = opts or {}
  local c = parse_config(cfg, opts)
  local h = ffi.new('mrl_model *[1]')
  moonrl.check(C.mrl_model_create(c, opts.seed or 0, h), 2)
  return wrap(h[0])
end

-- A quantized base (QLoRA, model.h's mrl_model_create_quantized; moonrl.io.gguf's model{quantized}
-- makes one from a GGUF file): tensors = { { name = a view's name (a layer's experts: the first
-- expert's), numel, type = ggml's type number (Q4_0 2, Q4_1 3, Q8_0 8), blocks = the bytes }, ... }
-- keep their GGML blocks, dequantized a layer at a time where used; the other views are the
-- caller's to write (m:param_buffer() + view.offset) before the model moves to a GPU. Frozen:
-- adapters train.
function M.new_quantized(cfg, tensors)
  local c = parse_config(cfg, {})
  local list = ffi.new('mrl_quant_tensor[?]', math.max(#tensors, 1))
  for i, t in ipairs(tensors) do
    list[i - 1].name, list[i - 1].numel, list[i - 1].type, list[i - 1].blocks = t.name, t.numel, t.type, t.blocks
  end
  local h = ffi.new('mrl_model *[1]')
  moonrl.check(C.mrl_model_create_quantized(c, list, #tensors, h), 2)
  local m = wrap(h[0])
  m.quantized = tonumber(C.mrl_model_quantized_bytes(h[0]))
  m.quantized_params = 0 -- (the weights its blocks hold)
  for _, t in ipairs(tensors) do m.quantized_params = m.quantized_params + t.numel end
  return m
end

-- The config of the model in dir (its config.json) as a table, without loading it.
function M.config_of(dir)
  local c = ffi.new('mrl_model_config')
  moonrl.check(C.mrl_model_config_load(dir .. '/config.json', c), 2)
  return config_table(c)
end

function M.load(dir)
  local h = ffi.new('mrl_model *[1]')
  local status = require('moonrl.io.progress').task('loading model ' .. tostring(dir), function()
    return C.mrl_model_load_dir(dir, h)
  end)
  moonrl.check(status, 2)
  return wrap(h[0])
end

-- Shard `index` of `shards` of the model in dir, in a job of `world` ranks (ZeRO-3, model.h's
-- mrl_model_load_dir_shard; shards = world but under hybrid sharding): the parameter buffer has
-- memory for that shard only, read by range from the files; the rest is gathered into place part
-- by part as the forward and backward need it (m:set_param_gather). opts.value_head: with a
-- value head (a critic made from the policy in dir).
function M.load_shard(dir, world, shards, index, opts)
  local h = ffi.new('mrl_model *[1]')
  local status = require('moonrl.io.progress').task('loading model ' .. tostring(dir), function()
    return C.mrl_model_load_dir_shard(dir, world, shards, index, opts and opts.value_head and 1 or 0, h)
  end)
  moonrl.check(status, 2)
  return wrap(h[0])
end

-- Rank world.rank of world.size's tensor-parallel slices of the model in dir (model.h's
-- mrl_model_load_dir_tp: the heads and the MLP split Megatron's way, the rest whole), its sums
-- and gathers over world (moonrl.train.dist's World): every rank of world runs the same forwards
-- and backwards and calls m:save together. opts.value_head: a critic's.
-- opts.shard = { world, shards, index }: its parameters sharded so too (ZeRO-3, model.h's
-- mrl_model_load_dir_tp_shard; then dist.shard_model gathers them).
function M.load_tp(dir, world, opts)
  local h = ffi.new('mrl_model *[1]')
  local sh, vh = opts and opts.shard, opts and opts.value_head and 1 or 0
  if sh then
    moonrl.check(C.mrl_model_load_dir_tp_shard(dir, world.rank, world.size, sh.world, sh.shards, sh.index, vh, h), 2)
  else
    moonrl.check(C.mrl_model_load_dir_tp(dir, world.rank, world.size, vh, h), 2)
  end
  local m = wrap(h[0])
  if world.size == 1 then return m end -- (the whole model)
  moonrl.check(C.mrl_model_set_tp_group(m.handle, C.mrl_dist_tp_allreduce, C.mrl_dist_tp_allgather, world.handle), 2)
  moonrl.check(C.mrl_model_set_tp_reduce_scatter(m.handle, C.mrl_dist_tp_reduce_scatter), 2)
  m.tp_world = world -- (its communicator outlives the model's use of it)
  local whole = ffi.new('mrl_model_config')
  C.mrl_model_tp(m.handle, nil, whole)
  m.whole_config = config_table(whole)
  return m
end

-- Pipeline stage `stage.stage` of `stage.stages` of the model in dir (model.h's
-- mrl_model_load_dir_stage): the whole model's layers [stage.first_layer, + stage.layers), the
-- embedding on the first stage, the head on the last. world: the pipeline's ranks
-- (moonrl.train.dist's World, rank = stage), over which its forwards and backwards send their
-- rows: every stage runs the same micro-batches (moonrl.train.pipeline orders them), the last
-- one's forward returns the outputs, the others' none. opts.tp: this rank's tensor-parallel
-- group (its slices of the stage); opts.shard: its parameters sharded (ZeRO-3, as load_tp's; then
-- dist.shard_model gathers them); opts.value_head: a critic's; opts.tag: the model's channel
-- over world (two per model: its rows, their gradients), the same on every stage.
function M.load_stage(dir, stage, world, opts)
  opts = opts or {}
  local h = ffi.new('mrl_model *[1]')
  local spec = ffi.new('mrl_model_stage', { stage.stage, stage.stages, stage.first_layer, stage.layers })
  local tp, sh = opts.tp, opts.shard -- (sh = { world, shards, index }: ZeRO-3, as load_tp's)
  moonrl.check(C.mrl_model_load_dir_stage_shard(dir, spec, tp and tp.rank or 0, tp and tp.size or 1,
    sh and sh.world or 1, sh and sh.shards or 1, sh and sh.index or 0, opts.value_head and 1 or 0, h), 2)
  local m = wrap(h[0])
  if tp and tp.size > 1 then
    moonrl.check(C.mrl_model_set_tp_group(m.handle, C.mrl_dist_tp_allreduce, C.mrl_dist_tp_allgather, tp.handle), 2)
    moonrl.check(C.mrl_model_set_tp_reduce_scatter(m.handle, C.mrl_dist_tp_reduce_scatter), 2)
    m.tp_world = tp
  end
  local whole = ffi.new('mrl_model_config')
  C.mrl_model_tp(m.handle, nil, whole)
  whole.num_hidden_layers = C.mrl_model_pp_layers(m.handle)
  m.whole_config = config_table(whole)
  if stage.stages > 1 then
    moonrl.check(C.mrl_model_set_pp_group(m.handle, C.mrl_dist_pp_send, C.mrl_dist_pp_recv, world.handle), 2)
    m.pp = { world = world, stage = stage.stage, stages = stage.stages, first_layer = stage.first_layer,
      layers = stage.layers, tag = 2 * (opts.tag or 0), hidden = m.config.hidden_size, wait = 0, batches = {},
      slot = 0 }
    -- a mixture of experts: the load-balancing statistics go with the rows (model.h)
    local n = tonumber(C.mrl_model_pp_aux_size(m.handle))
    if n > 0 then m.pp.aux_n, m.pp.aux = n, ffi.new('double[?]', n) end
  end
  return m
end

-- Pipeline parallel: n activation slots (model.h's mrl_model_pp_slots), and slot i for the next
-- forward and the backward after it.
function Model:pp_slots(n) moonrl.check(C.mrl_model_pp_slots(self.handle, n), 2) end
function Model:use_slot(i)
  local pp = self.pp
  moonrl.check(C.mrl_model_pp_use_slot(self.handle, i), 2)
  pp.batches[pp.slot] = self._batch -- (each slot's batch: its arrays stay borrowed until its backward)
  pp.slot, self._batch = i, pp.batches[i]
end

-- A receive buffer of n floats (grown as needed), and the time spent waiting for the rows.
local function pp_recv(pp, n, from, tag)
  if (pp.cap or 0) < n then pp.buf, pp.cap = ffi.new('float[?]', n), n end
  local t0 = moonrl.now()
  pp.world:recv(pp.buf, 4 * n, from, tag)
  pp.wait = pp.wait + (moonrl.now() - t0)
  return pp.buf
end

-- n floats of the stage's rows sent to rank `to` (a GPU stage's copied to a host buffer first:
-- the sends go by MPI, which copies them).
local function pp_send(self, pp, rows, n, to, tag)
  if self.gpu then
    if (pp.send_cap or 0) < n then pp.send_buf, pp.send_cap = ffi.new('float[?]', n), n end
    moonrl.check(C.mrl_device_memcpy(pp.send_buf, rows, 4 * n), 3)
    rows = pp.send_buf
  end
  pp.world:send(rows, 4 * n, to, tag)
end

-- A mixture of experts' load-balancing statistics (model.h's mrl_model_pp_aux_get / _set): after
-- the rows, on the same channel, so the receiving stage reads them in the same order.
local function aux_send(self, pp, to, tag)
  if not pp.aux then return end
  moonrl.check(C.mrl_model_pp_aux_get(self.handle, pp.aux), 3)
  pp.world:send(pp.aux, 8 * pp.aux_n, to, tag)
end

local function aux_recv(self, pp, from, tag)
  if not pp.aux then return end
  pp.world:recv(pp.aux, 8 * pp.aux_n, from, tag)
  moonrl.check(C.mrl_model_pp_aux_set(self.handle, pp.aux), 3)
end

-- Context parallel (model.h's mrl_model_set_cp_group, Ulysses): this model's forwards and
-- backwards split each batch's tokens over world's ranks (moonrl.train.dist's World), with
-- all-to-alls around attention; every rank of world runs the same ones, and each leaves its
-- tokens' part of the gradients (summed over world with the data-parallel sums).
-- On a GPU the all-to-alls and the gather run over an NCCL communicator of the group where it
-- starts (world.gpu_asked: auto, nccl or host, World:gpu_transport), else through the host.
local function cp_on_device(self)
  local cp = self.cp_world
  if not (cp and self.gpu) then return end
  local index = C.mrl_model_get_device(self.handle).index
  if cp:gpu_transport(cp.gpu_asked or 'auto', index) == 'nccl' then
    moonrl.check(C.mrl_model_set_cp_device_group(self.handle, C.mrl_nccl_tp_allgather, C.mrl_nccl_cp_alltoallv,
      cp.nccl), 3)
  end
  self.cp_transport = cp.gpu_via
end

function Model:set_cp(world)
  moonrl.check(C.mrl_model_set_cp_group(self.handle, world.rank, world.size, C.mrl_dist_tp_allgather,
    C.mrl_dist_cp_alltoallv, world.handle), 2)
  self.cp_world = world.size > 1 and world or nil -- (its communicator outlives the model's use of it)
  cp_on_device(self)
end

-- Sequence parallel (model.h's mrl_model_set_sequence_parallel) for a tensor-parallel model whose
-- vocabulary is split: the residual stream and norms on each rank's share of the tokens.
function Model:set_sequence_parallel(on)
  moonrl.check(C.mrl_model_set_sequence_parallel(self.handle, on and 1 or 0), 2)
  self.sequence_parallel = on and true or nil
end

-- A tensor-parallel model's slices read again from a model directory (a checkpoint's).
function Model:read_tp(dir) moonrl.check(C.mrl_model_read_tp(self.handle, dir), 2) end

-- The tensor-parallel size (1 without) and this rank.
function Model:tp()
  local r = ffi.new('int[1]')
  local n = C.mrl_model_tp(self.handle, r, nil)
  return tonumber(n), tonumber(r[0])
end

-- A sharded model's shard: offset, count (nil when the parameters are whole).
local shard_out = ffi.new('int64_t[2]')
function Model:shard()
  if C.mrl_model_shard(self.handle, shard_out, shard_out + 1) == 0 then return nil end
  return tonumber(shard_out[0]), tonumber(shard_out[1])
end
-- A sharded model's gathers (moonrl.train.dist's param_gather: the C object kept with the model);
-- writer: this rank writes the files of m:save, which every rank calls.
function Model:set_param_gather(g, writer)
  self._gather = g
  moonrl.check(C.mrl_model_set_param_gather(self.handle, C.mrl_dist_param_gather_start, C.mrl_dist_param_gather_wait,
    g, writer and 1 or 0), 2)
end
-- A sharded model's shard read again from a model directory (a checkpoint's).
function Model:read_shard(dir) moonrl.check(C.mrl_model_read_shard(self.handle, dir), 2) end

-- Returns logprobs, entropy (float[n_tokens] cdata) and, with opts.values
-- on a value-head model, values. opts.temperature divides the logits.
-- opts.routing (a qwen3_moe model): int16_t[n_tokens * num_moe_layers * num_experts_per_tok]
-- cdata, the experts each token goes to in each sparse layer instead of the router's top-k
-- (routing replay: mrl_batch.routing in model.h; -1 rows keep the router's own picks).
function Model:forward(batch, opts)
  opts = opts or {}
  batch.c.routing = opts.routing -- per call: a reference model given the same batch routes on its own
  local pp = self.pp
  if pp then -- a pipeline stage: its input rows from the stage before; a non-last stage's output to the next
    local rows = tonumber(C.mrl_model_pp_rows(self.handle, batch.c))
    if pp.stage > 0 then
      moonrl.check(C.mrl_model_pp_set_input(self.handle, pp_recv(pp, rows * pp.hidden, pp.stage - 1, pp.tag)), 2)
      aux_recv(self, pp, pp.stage - 1, pp.tag)
    end
    if pp.stage < pp.stages - 1 then
      moonrl.check(C.mrl_model_forward(self.handle, batch.c, opts.temperature or 1.0, nil, nil, nil), 2)
      self._batch, self._routing = batch, opts.routing -- (borrowed until the backward)
      pp_send(self, pp, C.mrl_model_pp_output(self.handle), rows * pp.hidden, pp.stage + 1, pp.tag)
      aux_send(self, pp, pp.stage + 1, pp.tag)
      return nil
    end
  end
  local n = batch.n_tokens
  local lp, ent = ffi.new('float[?]', n), ffi.new('float[?]', n)
  local val = opts.values and ffi.new('float[?]', n) or nil
  moonrl.check(C.mrl_model_forward(self.handle, batch.c, opts.temperature or 1.0, lp, ent, val), 2)
  self._batch, self._routing = batch, opts.routing -- the C side borrows these arrays until the backward
  return lp, ent, val
end

-- The forward's log-probs of the targets, the k (1..20) most likely tokens at every position
-- under softmax(logits / temperature): ids, lps (cdata [n_tokens * k], best first), and each
-- target's rank (1: the most likely). A whole model on the CPU (mrl_model_forward_top: what
-- moonrl serve scores prompts with).
function Model:forward_top(batch, k, temperature)
  local n = batch.n_tokens
  local lp, ids, lps = ffi.new('float[?]', n), ffi.new('int32_t[?]', n * k), ffi.new('float[?]', n * k)
  local ranks = ffi.new('int32_t[?]', n)
  batch.c.routing = nil
  moonrl.check(C.mrl_model_forward_top(self.handle, batch.c, temperature or 1.0, k, lp, ids, lps, ranks), 2)
  self._batch, self._routing = batch, nil
  return lp, ids, lps, ranks
end

-- Gradients of the loss with respect to each output (float arrays or nil);
-- added to the gradient buffer.
function Model:backward(dlogprobs, dentropy, dvalues)
  local pp = self.pp
  if not pp then
    moonrl.check(C.mrl_model_backward(self.handle, dlogprobs, dentropy, dvalues), 2)
    return
  end
  -- a pipeline stage: a non-last one starts from the next stage's gradient of its output rows, a
  -- non-first one sends its input rows' gradient to the stage before
  local rows = tonumber(C.mrl_model_pp_rows(self.handle, self._batch.c))
  if pp.stage < pp.stages - 1 then
    moonrl.check(C.mrl_model_pp_set_output_grad(self.handle, pp_recv(pp, rows * pp.hidden, pp.stage + 1, pp.tag + 1)), 2)
    aux_recv(self, pp, pp.stage + 1, pp.tag + 1) -- (the whole model's counts, which the loss's gradient needs)
    dlogprobs, dentropy, dvalues = nil, nil, nil
  end
  moonrl.check(C.mrl_model_backward(self.handle, dlogprobs, dentropy, dvalues), 2)
  if pp.stage > 0 then
    pp_send(self, pp, C.mrl_model_pp_input_grad(self.handle), rows * pp.hidden, pp.stage - 1, pp.tag + 1)
    aux_send(self, pp, pp.stage - 1, pp.tag + 1)
  end
end

local function whole(self, what)
  if self:frozen_base() then
    error(string.format('model:%s(): the base is %s; read_params() gives a whole copy', what, self.quantized and
      'quantized (model.lora.quantized_base: its matrices are GGML blocks, made whole a layer at a time)' or
      'stored in bf16 (frozen under LoRA: its matrices are their bf16 copies)'), 3)
  end
  if self:shard() then
    error(string.format('model:%s(): the parameters are sharded over the ranks (dist.zero=3): no rank holds them ' ..
      'whole', what), 3)
  end
end

function Model:zero_grad() C.mrl_model_zero_grad(self.handle) end
-- The one parameter buffer, writable: taking it marks the weights changed (a bf16 model converts
-- its copies again at its next forward or engine step), so that code writing into it (a
-- checkpoint load, a broadcast, a copy) needs nothing more. Code that keeps the pointer and writes
-- later calls weights_changed() after writing (moonrl.optim's AdamW does, given its model).
-- On a GPU the buffer is device memory: params() is an error there (a host write would crash),
-- and read_params / write_params move the floats.
function Model:params()
  whole(self, 'params')
  if self.gpu then
    error(string.format('model:params(): the parameters are on %s (device memory): read_params() gives a host '
      .. 'copy, write_params(ptr) writes one back', self:device()), 2)
  end
  C.mrl_model_weights_changed(self.handle)
  return C.mrl_model_params(self.handle), self.n_params
end

-- The parameter buffer where it lives (device memory on a GPU) and its length: for the C calls
-- that take either (the optimizer, the gradient helpers, moonrl.train.ops.sum), never for Lua to index.
function Model:param_buffer() return C.mrl_model_params(self.handle), self.n_params end

-- The parameters as host floats to read (or edit, then write_params): the buffer itself on the
-- CPU; on a GPU a copy in a host buffer of the model's own, refreshed by each call.

-- n floats at p (the model's device) as host floats: p itself on the CPU, else a copy into the
-- model's host buffer self[key] (made once, refreshed by each call).
local function host_floats(self, p, n, key)
  if not self.gpu then return p, n end
  self[key] = self[key] or ffi.new('float[?]', n)
  moonrl.check(C.mrl_device_memcpy(self[key], p, 4 * n), 3)
  return self[key], n
end

function Model:read_params()
  if self:frozen_base() then -- (made whole tensor by tensor into a copy)
    self._host = self._host or ffi.new('float[?]', self.n_params)
    moonrl.check(C.mrl_model_read_params(self.handle, self._host), 2)
    return self._host, self.n_params
  end
  whole(self, 'read_params')
  return host_floats(self, C.mrl_model_params(self.handle), self.n_params, '_host')
end

-- LoRA in bf16: the frozen base kept only as the bf16 copies its products read, its fp32
-- matrices freed (model.h's mrl_model_freeze_bf16; the model computes as before). Returns the
-- bytes freed.
function Model:freeze_base_bf16()
  local before = moonrl.memory().params
  moonrl.check(C.mrl_model_freeze_bf16(self.handle), 2)
  return before - moonrl.memory().params
end

-- Whether the base is stored in bf16 alone (freeze_base_bf16 made it so).
function Model:base_bf16() return C.mrl_model_frozen_bf16(self.handle) ~= 0 end
-- Whether the parameters are a frozen base whose buffer is not whole (a quantized base, or one
-- stored in bf16): params() and write_params() are errors, read_params() makes a whole copy.
function Model:frozen_base() return self.quantized ~= nil or self:base_bf16() end

-- All n_params floats of the host array src into the parameter buffer (src may be what
-- read_params gave); the bf16 copies are converted again before their next use.
function Model:write_params(src)
  whole(self, 'write_params')
  local dst = C.mrl_model_params(self.handle)
  if src ~= dst then moonrl.check(C.mrl_device_memcpy(dst, src, 4 * self.n_params), 2) end
  C.mrl_model_weights_changed(self.handle)
end

-- ---- the device (model.h, mrl_model_set_device) ----
-- 'cpu' (every model starts there), 'cuda' / 'cuda:N' (a GPU: parameters, gradients, optimizer
-- state, activations and the engine's KV cache in its memory, its kernels), or 'auto' (the first
-- GPU when moonrl was built with CUDA and one is visible, else the CPU).
M.devices = { 'cpu', 'cuda', 'cuda:N', 'auto' }

-- The device a model.device setting names, as 'cpu' or 'cuda:N', checked: nil and the reason
-- for a name that is none of M.devices, a build without CUDA, or a GPU that is not there.
function M.resolve_device(name)
  if name == 'auto' then return C.mrl_device_cuda_count() > 0 and 'cuda:0' or 'cpu' end
  if type(name) ~= 'string' then return nil, 'expected one of cpu, cuda, cuda:N, auto' end
  local d = ffi.new('mrl_device')
  if C.mrl_device_parse(name, d) ~= 0 then return nil, moonrl.last_error() end
  if d.kind == C.MRL_DEVICE_CPU then return 'cpu' end
  if C.mrl_device_cuda_built() == 0 then return nil, 'moonrl was built without CUDA (no nvcc at build time)' end
  local count = tonumber(C.mrl_device_cuda_count())
  if d.index >= count then
    return nil, string.format('cuda:%d asked, %d CUDA device(s) visible', tonumber(d.index), count)
  end
  return 'cuda:' .. tonumber(d.index)
end

-- Move the model to a device (a name of M.devices); returns the one it is on.
function Model:to_device(name)
  local dev, why = M.resolve_device(name)
  if not dev then error(string.format("model device '%s': %s", tostring(name), why), 2) end
  local d = ffi.new('mrl_device')
  moonrl.check(C.mrl_device_parse(dev, d), 2)
  moonrl.check(C.mrl_model_set_device(self.handle, d), 2)
  self.gpu = d.kind ~= C.MRL_DEVICE_CPU or nil
  self._host = nil
  local tp = self.tp_world
  if tp and tp.size > 1 and self.gpu then
    -- tensor parallel: the group's sums and gathers on the GPUs over NCCL (tp.gpu_asked: auto, nccl
    -- or host, moonrl.train.dist's World:gpu_transport, a collective of the group), else through
    -- the host
    if tp:gpu_transport(tp.gpu_asked or 'auto', d.index) == 'nccl' then
      moonrl.check(C.mrl_model_set_tp_device_group(self.handle, C.mrl_nccl_tp_allreduce, C.mrl_nccl_tp_allgather,
        tp.nccl), 2)
    end
    self.tp_transport = tp.gpu_via
  end
  cp_on_device(self)
  return dev
end

function Model:device()
  local d = C.mrl_model_get_device(self.handle)
  return d.kind == C.MRL_DEVICE_CPU and 'cpu' or ('cuda:' .. tonumber(d.index))
end

-- The device's description ("cpu", "cuda:0 (NVIDIA H200, 140 GiB, sm_90)").
function Model:device_description()
  local buf = ffi.new('char[256]')
  moonrl.check(C.mrl_device_describe(C.mrl_model_get_device(self.handle), buf, 256), 2)
  return ffi.string(buf)
end

-- ---- precision (model.h, "precision") ----
-- 'fp32' (the default): every product in fp32. 'bf16': fp32 master weights (the buffer, what
-- the optimizer steps and checkpoints hold) and bf16 copies of the matrices for every matrix
-- product, sums in fp32; norms, softmax, attention, the log-prob head and the losses in fp32.
-- The engine reads the same copies. 'auto': bf16 where the CPU has fast bf16 products
-- (AVX512-BF16 or AMX: M.bf16_products() names the path) and the model's matrices are wide
-- enough for them to pay (hidden_size >= M.BF16_MIN_HIDDEN), else fp32.
local dtype_codes = { fp32 = C.MRL_MODEL_FP32, bf16 = C.MRL_MODEL_BF16 }
M.dtypes = { 'fp32', 'bf16', 'auto' }

-- The bf16 product path of this CPU, or nil where it has none.
function M.bf16_products()
  local path = ffi.string(C.mrl_bf16_products())
  if path ~= 'none' then return path end
end

-- Below this hidden size bf16 products lose to fp32 on the CPUs measured (bench/RESULTS.md, "bf16
-- against fp32"), so 'auto' keeps such models in fp32.
M.BF16_MIN_HIDDEN = 512

-- 'fp32' or 'bf16' for a model.dtype setting (for a model of config `cfg`: its hidden_size; none:
-- a model wide enough); nil for a name that is none of M.dtypes.
function M.resolve_dtype(name, cfg)
  if name == 'auto' then
    local wide = not cfg or (cfg.hidden_size or 0) >= M.BF16_MIN_HIDDEN
    return (M.bf16_products() and wide) and 'bf16' or 'fp32'
  end
  if dtype_codes[name] then return name end
end

-- Switch to dtype (fp32, bf16 or auto); returns the one in use.
function Model:set_dtype(name)
  local d = M.resolve_dtype(name, self.config)
  if not d then error(string.format("model dtype must be one of fp32, bf16, auto (got '%s')", tostring(name)), 2) end
  moonrl.check(C.mrl_model_set_dtype(self.handle, dtype_codes[d]), 2)
  return d
end
function Model:dtype() return C.mrl_model_dtype(self.handle) == C.MRL_MODEL_BF16 and 'bf16' or 'fp32' end
-- The parameter buffer was written: the bf16 copies are converted again before their next use.
function Model:weights_changed() C.mrl_model_weights_changed(self.handle) end
-- What the optimizer calls after a step: the buffer it trains changed (Model:trainable's: with
-- LoRA only the adapters, which the products read as they are, so the base's bf16 copies stay).
function Model:trained()
  if C.mrl_model_lora(self.handle) ~= nil then C.mrl_model_lora_changed(self.handle)
  else C.mrl_model_weights_changed(self.handle) end
end
-- How many times the weights were written (mrl_model_weights_generation): a copy taken at g is current while this is g.
function Model:weights_generation() return tonumber(C.mrl_model_weights_generation(self.handle)) end

-- The weights read again from a Hugging Face directory (a checkpoint's, a save's) into this model
-- of the same config, checked tensor by tensor: its whole parameters, or its part (a ZeRO-3
-- shard's range of each tensor, a tensor-parallel rank's slices, a stage's layers). what names the
-- model in errors.
function Model:read_dir(dir, what)
  what = what or 'the model'
  -- a checkpoint of LoRA training holds the adapters (PEFT's files)
  if self:lora() or require('moonrl.io.fs').exists(dir .. '/adapter_config.json') then return self:load_lora(dir) end
  if self:shard() then return self:read_shard(dir) end
  if self:tp() > 1 or self.pp then return self:read_tp(dir) end
  local st = require('moonrl.io.safetensors').open(dir)
  local p = self:read_params() -- host memory (a GPU model's: a copy, written back below)
  for _, v in ipairs(self:views()) do
    if not st:has(v.name) then error(string.format('%s: no tensor %s for %s', dir, v.name, what), 0) end
    local info = st:info(v.name)
    if info.numel ~= v.numel then
      error(string.format('%s: tensor %s has %d elements, %s has %d (a different model config)', dir, v.name,
        info.numel, what, v.numel), 0)
    end
    st:read_f32(v.name, p + v.offset)
  end
  self:write_params(p)
end
-- The gradient buffer: created (zeroed) on the first call or the first backward, never for a model
-- that only runs forwards or the engine.
function Model:grads()
  local g = C.mrl_model_grads(self.handle)
  if g == nil then error(moonrl.last_error(), 2) end
  return g, self.n_params
end
-- Mixture of experts (qwen3_moe): the load-balancing loss of the last forward (0 for a dense
-- model), and the coefficient with which each backward adds its gradient (default: the config's
-- router_aux_loss_coef when output_router_logits, else 0).
function Model:router_aux_loss() return tonumber(C.mrl_model_router_aux_loss(self.handle)) end
function Model:set_router_aux_coef(coef)
  if type(coef) ~= 'number' or not (coef >= 0) then error('set_router_aux_coef: expected a number >= 0', 2) end
  C.mrl_model_set_router_aux_coef(self.handle, coef)
end
function Model:router_aux_coef() return tonumber(C.mrl_model_router_aux_coef(self.handle)) end
-- Training the multi-token prediction layer (deepseek_v3 with num_nextn_predict_layers 1; model.h's
-- mrl_model_set_mtp_loss): weight w > 0 adds w times the main loss's weights on its log-probs of the
-- next-but-one tokens; mtp_loss(): the last forward's mean -log-prob of them.
function Model:set_mtp_loss(w)
  if type(w) ~= 'number' or not (w >= 0) then error('set_mtp_loss: expected a number >= 0', 2) end
  moonrl.check(C.mrl_model_set_mtp_loss(self.handle, w), 2)
end
function Model:mtp_loss() return tonumber(C.mrl_model_mtp_loss(self.handle)) end
-- Routing replay (model.h, mrl_batch.routing): the sparse layers (0 for a dense model); the experts
-- the last forward sent each token to (int16_t[n_tokens * num_moe_layers * num_experts_per_tok]);
-- and of its (token, sparse layer) pairs, how many were replayed and how many of those differ
-- from the router's own top-k.
function Model:num_moe_layers() return tonumber(C.mrl_model_num_moe_layers(self.handle)) end
function Model:routing()
  local b = self._batch
  if not b then error('model:routing: no forward yet', 2) end
  local n = b.n_tokens * self:num_moe_layers() * (self.config.num_experts_per_tok or 0)
  local out = ffi.new('int16_t[?]', math.max(n, 1))
  moonrl.check(C.mrl_model_get_routing(self.handle, out, n), 2)
  return out, n
end
local replay_counts = ffi.new('int64_t[2]')
function Model:routing_replay_stats()
  C.mrl_model_routing_replay_stats(self.handle, replay_counts, replay_counts + 1)
  return tonumber(replay_counts[0]), tonumber(replay_counts[1])
end
-- Expert parallelism (model.h, mrl_model_set_expert_parallel): group, a moonrl.train.dist world or
-- group (nil: off), whose ranks then each run their block of every sparse layer's experts;
-- every forward and backward is then a collective of the group. expert_range() -> first
-- (0-based), count, and whether expert parallelism is on.
function Model:set_expert_parallel(group)
  moonrl.check(C.mrl_model_set_expert_parallel(self.handle, group and group.handle or nil), 2)
  self._ep_group = group -- the communicator must outlive the setting
end
local ep_range = ffi.new('int64_t[2]')
function Model:expert_range()
  local on = C.mrl_model_expert_range(self.handle, ep_range, ep_range + 1) == 1
  return tonumber(ep_range[0]), tonumber(ep_range[1]), on
end
function Model:set_recompute(on) C.mrl_model_set_recompute(self.handle, on and 1 or 0) end
function Model:activation_bytes(n_tokens) return tonumber(C.mrl_model_activation_bytes(self.handle, n_tokens)) end
-- config.json and the weights (F32), streamed a tensor at a time: model.safetensors, or past
-- max_shard_bytes (default 5e9, transformers' "5GB"; 0: no limit) model-0000K-of-0000N
-- shards with model.safetensors.index.json.
function Model:save(dir, max_shard_bytes)
  if max_shard_bytes == nil then moonrl.check(C.mrl_model_save_dir(self.handle, dir), 2); return end
  moonrl.check(C.mrl_model_save_dir_sharded(self.handle, dir, max_shard_bytes), 2)
end

-- { {name=, offset=, numel=, shape={...}, weight_decay=bool}, ... } in buffer order.
function Model:views()
  if not self._views then
    local v, list = ffi.new('mrl_param_view'), {}
    for i = 0, C.mrl_model_num_views(self.handle) - 1 do
      moonrl.check(C.mrl_model_view(self.handle, i, v))
      local shape = {}
      for d = 0, v.ndim - 1 do shape[d + 1] = tonumber(v.shape[d]) end
      list[#list + 1] = { name = ffi.string(v.name), offset = tonumber(v.offset), numel = tonumber(v.numel),
        shape = shape, weight_decay = v.weight_decay ~= 0 }
    end
    self._views = list
  end
  return self._views
end

-- The parameters [offset, offset + count) of the buffer as slices of Hugging Face tensors, in
-- buffer order: { {name=, shape={...} (the whole tensor's), offset= (the slice's first element
-- in the tensor, row-major), count=, at= (its first element in the range)}, ... }. A weight
-- export of a shard carries this table, so a receiver of another layout takes exactly the slices
-- it needs (Model:slice_plan). Default range: the model's shard, else the whole buffer. A
-- tensor-parallel rank's views are its slices: in the whole tensors' coordinates, a row-split
-- view's part is one slice, a column-split view's its columns of each row: a slice with rows = R
-- and stride = the whole row's length stands for R slices of count elements, the k-th at offset
-- + k stride in the tensor and at + k count in the range.
function Model:slices(offset, count)
  if not offset then
    offset, count = self:shard()
    if not offset then offset, count = 0, self.n_params end
  end
  local size, rank = self:tp()
  local last, out = offset + count, {}
  for _, v in ipairs(self:views()) do
    local lo, hi = math.max(offset, v.offset), math.min(last, v.offset + v.numel)
    if lo < hi then
      local split = size > 1 and C.mrl_model_tp_split(self.handle, v.name) or 0
      if split == 0 then
        out[#out + 1] = { name = v.name, shape = v.shape, offset = lo - v.offset, count = hi - lo, at = lo - offset }
      else
        local parts = size / C.mrl_model_tp_copies(self.handle, v.name) -- (a K/V head several ranks hold: theirs)
        local shape = { v.shape[1], v.shape[2] }
        shape[split] = shape[split] * parts
        if split == 1 then -- rows: this slice's block of the tensor
          local first = math.floor(rank * parts / size) * v.numel
          out[#out + 1] = { name = v.name, shape = shape, offset = first + lo - v.offset, count = hi - lo, at = lo - offset }
        else -- columns: each row's block (whole rows' blocks one after the other: one slice of `rows` of them)
          local cols, e = v.shape[2], lo - v.offset
          while e < hi - v.offset do
            local row, c0 = math.floor(e / cols), e % cols
            local run = math.min(cols - c0, hi - v.offset - e)
            local s, prev = { name = v.name, shape = shape, offset = row * cols * size + rank * cols + c0, count = run,
              at = v.offset + e - offset }, out[#out]
            local k = prev and prev.name == v.name and prev.count == cols and run == cols and (prev.rows or 1)
            if k and prev.offset + k * cols * size == s.offset and prev.at + k * cols == s.at then
              prev.rows, prev.stride = k + 1, cols * size
            else
              out[#out + 1] = s
            end
            e = e + run
          end
        end
      end
    end
  end
  return out
end

-- A later pipeline stage's copy of a tied head's embedding (its view; nil for any other model):
-- the first stage holds the tensor itself, which the copy follows.
function Model:tied_copy()
  if not (self.pp and self.pp.stage > 0 and self.config.tie_word_embeddings) then return nil end
  local v = self:views()[1] -- (the copy comes first)
  return v.name == 'model.embed_tokens.weight' and v or nil
end

-- The range of the buffer this model exports as its weights (Model:slices of it: what a trainer
-- sends a rollout rank): its shard when sharded; a pipeline stage's all but a tied head's copy of
-- the embedding (the first stage sends the tensor); else the whole buffer. offset, count.
function Model:export_range()
  local o, c = self:shard()
  if o then return o, c end
  local copy = self:tied_copy()
  if copy then return copy.numel, self.n_params - copy.numel end
  return 0, self.n_params
end

-- Where slices (Model:slices's, from a model of another process or layout) land in this model's
-- buffer: a list of copies { {at=, to=, count=}, ... } (at: in the sender's range; to: in this
-- buffer), adjacent ones merged. This model may hold a part of each tensor itself (a tensor-
-- parallel rank's slices: a block of rows, or a block of each row's columns): of each slice, the
-- elements this model holds are taken, the rest left. want(name): take that tensor (default:
-- all). A tensor this model lacks, a shape that differs or a slice past its tensor's end is an
-- error naming the tensor.
function Model:slice_plan(slices, want)
  local size, rank = self:tp()
  local by_name = {}
  for _, v in ipairs(self:views()) do by_name[v.name] = v end
  local plan = {}
  local function add(at, to, count)
    local last = plan[#plan]
    if last and last.at + last.count == at and last.to + last.count == to then last.count = last.count + count
    elseif count > 0 then plan[#plan + 1] = { at = at, to = to, count = count } end
  end
  -- (a slice of rows: each row its own)
  local flat = slices
  for i, s in ipairs(slices) do
    if s.rows and flat == slices then flat = {}; for j = 1, i - 1 do flat[j] = slices[j] end end
    if flat ~= slices then
      for k = 0, (s.rows or 1) - 1 do
        flat[#flat + 1] = { name = s.name, shape = s.shape, offset = s.offset + k * (s.stride or 0), count = s.count,
          at = s.at + k * s.count }
      end
    end
  end
  for _, s in ipairs(flat) do
    if not want or want(s.name) then
      local v = by_name[s.name]
      if not v then error(string.format('weight slices: this model has no tensor %s', tostring(s.name)), 2) end
      -- the whole tensor's shape, and this model's part of it (Model:slices' split)
      local split = size > 1 and C.mrl_model_tp_split(self.handle, v.name) or 0
      local parts = split > 0 and size / C.mrl_model_tp_copies(self.handle, v.name) or 1
      local whole = { v.shape[1], v.shape[2] }
      if split > 0 then whole[split] = whole[split] * parts end
      local same = #v.shape == #s.shape
      for d = 1, #v.shape do same = same and whole[d] == s.shape[d] end
      if not same then
        error(string.format('weight slices: %s is [%s] here, [%s] in the slices', s.name, table.concat(whole, ', '),
          table.concat(s.shape, ', ')), 2)
      end
      local a, b = s.offset, s.offset + s.count -- (in the whole tensor)
      if a < 0 or s.count < 0 or b > v.numel * parts then
        error(string.format('weight slices: %s slice [%d, +%d) is past its %d elements', s.name, s.offset, s.count,
          v.numel * parts), 2)
      end
      if split == 0 then
        add(s.at, v.offset + a, b - a)
      elseif split == 1 then -- rows: this model's block of them, one range
        local first = math.floor(rank * parts / size) * v.numel
        local lo, hi = math.max(a, first), math.min(b, first + v.numel)
        if lo < hi then add(s.at + lo - a, v.offset + lo - first, hi - lo) end
      else -- columns: its block of each row's
        local cols, W = v.shape[2], whole[2]
        local c0 = rank * cols
        for row = math.floor(a / W), math.floor((b - 1) / W) do
          local lo, hi = math.max(a, row * W + c0), math.min(b, row * W + c0 + cols)
          if lo < hi then add(s.at + lo - a, v.offset + row * cols + lo - row * W - c0, hi - lo) end
        end
      end
    end
  end
  return plan
end

-- {{offset, count}, ...} of the parameters without weight decay (for moonrl.optim.adamw).
function Model:no_decay_ranges()
  local r = {}
  for _, v in ipairs(self:views()) do
    if not v.weight_decay then r[#r + 1] = { v.offset, v.numel } end
  end
  return r
end

-- ---- LoRA adapters (model.h, mrl_model_set_lora) ----
-- The seven projections' module names, in the order of the C bits (MRL_LORA_Q << i); the experts'
-- gate, up and down of a qwen3_moe model follow the last three.
M.lora_modules = { 'q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj' }

-- targets ('all-linear', nil, a list of module names, or their names separated by commas, as
-- model.lora.targets gives them) as the C bits; nil and the reason for a name that is none of
-- M.lora_modules.
function M.lora_bits(targets)
  if targets == nil or targets == 'all-linear' then return C.MRL_LORA_ALL end
  if type(targets) == 'string' then
    local names = {}
    for s in targets:gmatch('[^,%s]+') do names[#names + 1] = s end
    targets = names
  end
  if type(targets) ~= 'table' or #targets == 0 then return nil, "expected 'all-linear' or a list of module names" end
  local bits = 0
  for _, t in ipairs(targets) do
    local found
    for i, name in ipairs(M.lora_modules) do
      if t == name then found = i end
    end
    if not found then
      return nil, string.format("'%s' is not a projection (one of %s, or 'all-linear')", tostring(t),
        table.concat(M.lora_modules, ', '))
    end
    bits = bit.bor(bits, bit.lshift(1, found - 1))
  end
  return bits
end

-- An adapter set's views (PEFT's names), as Model:views gives the model's.
local function adapter_views(count, view, handle)
  local v, list = ffi.new('mrl_param_view'), {}
  for i = 0, count(handle) - 1 do
    moonrl.check(view(handle, i, v))
    list[#list + 1] = { name = ffi.string(v.name), offset = tonumber(v.offset), numel = tonumber(v.numel),
      shape = { tonumber(v.shape[0]), tonumber(v.shape[1]) }, weight_decay = true }
  end
  return list
end

-- A config (mrl_lora_config) as { rank, alpha, targets = {names} }.
local function lora_info(c)
  local t = {}
  for i, name in ipairs(M.lora_modules) do
    if bit.band(c.targets, bit.lshift(1, i - 1)) ~= 0 then t[#t + 1] = name end
  end
  return { rank = tonumber(c.rank), alpha = tonumber(c.alpha), targets = t, dropout = tonumber(c.dropout) }
end

local function lora_cfg(o, where)
  local bits, why = M.lora_bits(o.targets)
  if not bits then error(where .. ': targets: ' .. why, 3) end
  return ffi.new('mrl_lora_config', { rank = o.rank, alpha = o.alpha or 32, targets = bits, seed = o.seed or 0,
    dropout = o.dropout or 0 })
end

-- The line that says what adapters (info: { rank, alpha, targets }) train: n of total parameters.
function M.lora_text(info, n, total)
  return string.format('LoRA: rank %d, alpha %g, %s: %d trainable parameters (%.2f%% of %d)', info.rank, info.alpha,
    table.concat(info.targets, ','), n, 100 * n / total, total)
end

-- The trainable share of adapters o (as set_lora takes them) on the model of dir (a Hugging Face
-- directory), counted from its config alone, as M.lora_text's line.
function M.lora_share(dir, o)
  local c = ffi.new('mrl_model_config')
  moonrl.check(C.mrl_model_config_load(dir .. '/config.json', c), 2)
  local total, n = ffi.new('int64_t[1]'), ffi.new('int64_t[1]')
  local cfg = lora_cfg(o, 'lora_share')
  moonrl.check(C.mrl_lora_count(c, cfg, total, n), 2)
  return M.lora_text(lora_info(cfg), tonumber(n[0]), tonumber(total[0]))
end

-- The forwards from now on are training forwards (each followed by its backward: LoRA's dropout
-- applies in them, its masks drawn from key: a number the caller gives the same in a resumed run),
-- or not (the default: log-probs, evaluation).
function Model:set_training(on, key) C.mrl_model_set_training(self.handle, on and 1 or 0, key or 0) end

-- Adapters on: o.rank, o.alpha (default 32: docs/lora.md), o.targets (as lora_bits takes), o.seed,
-- o.dropout (0 <= p < 1, in training forwards). The base is frozen from then on (its gradients are never computed).
function Model:set_lora(o)
  moonrl.check(C.mrl_model_set_lora(self.handle, lora_cfg(o, 'set_lora')), 2)
  self._lora_views = nil
end

-- The adapters as { rank, alpha, targets = {names}, n = parameters }, or nil when none.
function Model:lora()
  local c = C.mrl_model_lora(self.handle)
  if c == nil then return nil end
  local info = lora_info(c)
  info.n = tonumber(C.mrl_model_lora_num_params(self.handle))
  return info
end

-- The adapters' parameter buffer where it lives (device memory on a GPU: for the C calls that take
-- either, never for Lua to index) and length; their gradients; on (true) or off.
function Model:lora_buffer() return C.mrl_model_lora_params(self.handle), tonumber(C.mrl_model_lora_num_params(self.handle)) end

-- The adapters' parameters as host floats (the buffer itself on the CPU; on a GPU a copy, refreshed
-- by each call), and back (all of them, from host floats; the adapters changed).
function Model:read_lora()
  local p, n = self:lora_buffer()
  return host_floats(self, p, n, '_lora_host')
end
function Model:write_lora(src)
  local p, n = self:lora_buffer()
  if src ~= p then moonrl.check(C.mrl_device_memcpy(p, src, 4 * n), 2) end
  C.mrl_model_lora_changed(self.handle)
end
function Model:lora_grads() return C.mrl_model_lora_grads(self.handle), tonumber(C.mrl_model_lora_num_params(self.handle)) end
function Model:lora_enable(on) C.mrl_model_lora_enable(self.handle, on and 1 or 0) end

-- The adapters' views, as Model:views gives the model's (PEFT's names).
function Model:lora_views()
  self._lora_views = self._lora_views or adapter_views(C.mrl_model_lora_num_views, C.mrl_model_lora_view, self.handle)
  return self._lora_views
end

-- What the optimizer trains: the adapters with LoRA, else the whole parameter buffer. Returns
-- the buffer, its length, a function giving the gradient buffer, the views and the ranges
-- without weight decay.
function Model:trainable()
  if self:lora() then
    local p, n = self:lora_buffer()
    return p, n, function() return (self:lora_grads()) end, self:lora_views(), {}
  end
  local p, n = self:param_buffer()
  return p, n, function() return (self:grads()) end, self:views(), self:no_decay_ranges()
end

-- Adapters (views, their values at p, info as Model:lora gives) as a PEFT directory: adapter_config.json
-- and adapter_model.safetensors (dtype o.dtype, default 'F32'); o.base: base_model_name_or_path.
local function write_peft(dir, views, p, info, o)
  local fs = require('moonrl.io.fs')
  fs.mkdirs(dir)
  local w = require('moonrl.io.safetensors').writer()
  for _, v in ipairs(views) do w:add(v.name, o.dtype or 'F32', v.shape, p + v.offset) end
  w:metadata('format', 'pt')
  w:write(dir .. '/adapter_model.safetensors')
  local cfg = json.object()
  for k, v in pairs({ peft_type = 'LORA', task_type = 'CAUSAL_LM', r = info.rank, lora_alpha = info.alpha,
    lora_dropout = info.dropout or 0.0, target_modules = info.targets, bias = 'none', fan_in_fan_out = false, inference_mode = true,
    use_rslora = false, use_dora = false, init_lora_weights = true, base_model_name_or_path = o.base or json.null,
    modules_to_save = json.null, layers_to_transform = json.null, rank_pattern = json.object(),
    alpha_pattern = json.object() }) do cfg[k] = v end
  local tmp = dir .. '/adapter_config.json.tmp'
  fs.write(tmp, json.encode(cfg, { indent = 2 }) .. '\n')
  fs.rename(tmp, dir .. '/adapter_config.json')
  return dir
end

-- The adapters as a PEFT directory (write_peft; o.dtype, o.base).
function Model:save_lora(dir, o)
  local info = self:lora()
  if not info then error('save_lora: the model has no LoRA adapters', 2) end
  return write_peft(dir, self:lora_views(), (self:read_lora()), info, o or {})
end

-- A PEFT adapter directory's config, checked: { rank, alpha, targets } as set_lora takes them;
-- an error naming the file and key for what moonrl does not compute the same way.
function M.lora_config(dir)
  local path = dir .. '/adapter_config.json'
  local text = require('moonrl.io.fs').read(path)
  if not text then error(string.format('LoRA adapter %s: no adapter_config.json', dir), 2) end
  local ok, c = pcall(json.decode, text)
  if not ok or type(c) ~= 'table' then error(string.format('%s: not JSON (%s)', path, tostring(c)), 2) end
  local function bad(key, why) error(string.format('%s: %s: %s', path, key, why), 3) end
  if c.peft_type ~= nil and c.peft_type ~= 'LORA' then bad('peft_type', "'" .. tostring(c.peft_type) .. "' (LORA only)") end
  if type(c.r) ~= 'number' or c.r < 1 or c.r % 1 ~= 0 then bad('r', 'expected a positive integer') end
  if c.lora_alpha ~= nil and (type(c.lora_alpha) ~= 'number' or not (c.lora_alpha > 0)) then bad('lora_alpha', 'expected a positive number') end
  for _, k in ipairs({ 'use_rslora', 'use_dora', 'fan_in_fan_out' }) do
    if c[k] == true then bad(k, 'not supported (plain LoRA only)') end
  end
  if c.bias ~= nil and c.bias ~= 'none' and c.bias ~= json.null then bad('bias', "'" .. tostring(c.bias) .. "' (only 'none')") end
  for _, k in ipairs({ 'rank_pattern', 'alpha_pattern' }) do
    if type(c[k]) == 'table' and next(c[k]) ~= nil then bad(k, 'per-module ranks are not supported') end
  end
  if c.layers_to_transform ~= nil and c.layers_to_transform ~= json.null then
    bad('layers_to_transform', 'not supported: every layer is adapted')
  end
  if type(c.modules_to_save) == 'table' and #c.modules_to_save > 0 then bad('modules_to_save', 'not supported') end
  local targets = c.target_modules
  if targets == 'all-linear' then targets = nil end
  if targets ~= nil and M.lora_bits(targets) == nil then bad('target_modules', select(2, M.lora_bits(targets))) end
  if c.lora_dropout ~= nil and (type(c.lora_dropout) ~= 'number' or c.lora_dropout < 0 or c.lora_dropout >= 1) then
    bad('lora_dropout', 'expected a number in [0, 1)')
  end
  return { rank = c.r, alpha = c.lora_alpha or 8, targets = targets, dropout = c.lora_dropout or 0 }
end

-- The tensors of a PEFT adapter directory into an adapter set (views, its buffer p): every tensor
-- checked by name and shape first; a tensor the set does not have, or one it misses, is an error
-- naming it.
local function read_peft(dir, views, p)
  local st = require('moonrl.io.safetensors').open(dir .. '/adapter_model.safetensors')
  local by, seen = {}, {}
  for _, v in ipairs(views) do by[v.name] = v end
  for _, name in ipairs(st:names()) do
    local v = by[name]
    if not v then error(string.format('LoRA adapter %s: tensor %s is not one of the model\'s adapters', dir, name), 3) end
    local sh = st:info(name).shape
    if #sh ~= 2 or sh[1] ~= v.shape[1] or sh[2] ~= v.shape[2] then
      error(string.format('LoRA adapter %s: %s has shape [%s], the model\'s is [%d, %d]', dir, name,
        table.concat(sh, ', '), v.shape[1], v.shape[2]), 3)
    end
    seen[name] = true
  end
  for _, v in ipairs(views) do
    if not seen[v.name] then error(string.format('LoRA adapter %s: no tensor %s in adapter_model.safetensors', dir, v.name), 3) end
  end
  for _, v in ipairs(views) do st:read_f32(v.name, p + v.offset) end
end

-- The weights of a PEFT adapter directory into the model's adapters (made from its config when the
-- model has none; else they must agree). o.dropout: the training's dropout (default the file's).
function Model:load_lora(dir, o)
  local c = M.lora_config(dir)
  if o and o.dropout then c.dropout = o.dropout end
  local have = self:lora()
  if not have then
    self:set_lora(c)
  elseif have.rank ~= c.rank or have.alpha ~= c.alpha or M.lora_bits(have.targets) ~= M.lora_bits(c.targets) then
    -- (the dropout is the run's: model.lora.dropout, a training setting, not the adapters')
    error(string.format('load_lora %s: rank %d alpha %g targets %s, the model\'s adapters are rank %d alpha %g targets %s',
      dir, c.rank, c.alpha, type(c.targets) == 'table' and table.concat(c.targets, ',') or 'all-linear',
      have.rank, have.alpha, table.concat(have.targets, ',')), 2)
  end
  local p = self:read_lora()
  read_peft(dir, self:lora_views(), p)
  self:write_lora(p)
end

-- ---- adapter sets of their own (mrl_lora_create): what an engine serves beside the weights ----
--   local ad = model:new_adapter{ rank = 8, alpha = 16, targets = 'all-linear' }  -- or M.load_adapter(model, dir)
--   ad:views(), ad:buffer() (p, n), ad:info() ({ rank, alpha, targets }), ad:save(dir, o)
--   engine:set_adapter(slot, ad); engine:generate(reqs, { adapter = slot })
local Adapter = {}
Adapter.__index = Adapter

function Model:new_adapter(o)
  local out = ffi.new('mrl_lora *[1]')
  moonrl.check(C.mrl_lora_create(self.handle, lora_cfg(o, 'new_adapter'), out), 2)
  return setmetatable({ handle = ffi.gc(out[0], C.mrl_lora_free), model = self }, Adapter)
end

-- A PEFT adapter directory (M.lora_config's checks) as an adapter set for model.
function M.load_adapter(model, dir)
  local ad = model:new_adapter(M.lora_config(dir))
  read_peft(dir, ad:views(), (ad:buffer()))
  ad.dir = dir
  return ad
end

function Adapter:views()
  self._views = self._views or adapter_views(C.mrl_lora_num_views, C.mrl_lora_view, self.handle)
  return self._views
end
function Adapter:buffer() return C.mrl_lora_params(self.handle), tonumber(C.mrl_lora_num_params(self.handle)) end
function Adapter:info() return lora_info(C.mrl_lora_get_config(self.handle)) end
function Adapter:save(dir, o) return write_peft(dir, self:views(), (self:buffer()), self:info(), o or {}) end

return M
