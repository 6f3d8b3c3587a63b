-- moonrl.train.models: the models of a run: loading the policy with its tokenizer and chat
-- template, copies (a frozen reference, a critic), its optimizer, saving it, and the device and
-- precision the config asks for.
--
--   local models = require('moonrl.train.models')
--   local model, tok, tpl, tok_dir = models.load(dir, { chat = true })
--   local ref = models.clone(model)              -- a frozen copy (reference policy)
--   local critic = models.critic_from(model)     -- same weights plus a value head
--   local opt = models.adamw(model, { lr = 1e-5 })
--   models.save(run, model, tok_dir[, dir, max_shard_bytes])  -- run.dir/model in HF format, tokenizer files copied
local ffi = require('ffi')
local moonrl = require('moonrl')
local C = moonrl.C
local model_mod = require('moonrl.model')
local sections = require('moonrl.train.sections')

local M = {}

-- The model, its tokenizer and (when opts.chat and the tokenizer config has one) its chat template.
-- dir: a Hugging Face directory; opts.tokenizer: another directory for the tokenizer files.
-- opts.shard: a layout (moonrl.train.dist's shard_layout) of the ranks that shard the parameters
-- (dist.zero=3): each loads its own shard and gathers the rest into place part by part
-- (dist.shard_model).
-- opts.quantized: dir is a .gguf file whose layer matrices stored as Q4_0, Q4_1 or Q8_0 keep their
-- blocks (a quantized base, QLoRA: moonrl.io.gguf's model{quantized}); its tokenizer and config are
-- its converted directory's.
function M.load(dir, opts)
  opts = opts or {}
  local file = dir
  dir = require('moonrl.io.gguf').resolve(dir) -- a .gguf file: its converted directory
  local model
  if opts.quantized then
    if file == dir then error(string.format('%s: a quantized base is read from a .gguf file', file), 0) end
    if opts.pp or opts.tp or opts.shard or opts.value_head then
      error('a quantized base is a whole model (not with dist.tp, dist.pp, dist.zero=3 or a value head)', 0)
    end
    local g = require('moonrl.io.gguf').open(file)
    local ok, made = pcall(g.model, g, { quantized = true })
    g:close()
    if not ok then error(made, 0) end
    model = made
    model.source_file = file
  elseif opts.pp then -- pipeline parallel: this rank's stage (and tensor parallel: its slices of it; ZeRO-3: its shard)
    local P, L = opts.pp, opts.shard
    model = model_mod.load_stage(dir, P.stage, P.world, { tp = opts.tp, value_head = opts.value_head, tag = P.tag,
      shard = L and { world = L.world.size, shards = L.shards, index = L.index } })
    model.pp.tied, model.norm_group = P.tied, P.norm
    if L then require('moonrl.train.dist').shard_model(L, model) end
  elseif opts.tp and opts.tp.size > 1 then -- tensor parallel: this rank's slices, its sums over the group
    local L = opts.shard -- (and ZeRO-3: its shard of them)
    model = model_mod.load_tp(dir, opts.tp, { value_head = opts.value_head,
      shard = L and { world = L.world.size, shards = L.shards, index = L.index } })
    if L then require('moonrl.train.dist').shard_model(L, model) end
  elseif opts.shard then
    local L = opts.shard
    model = model_mod.load_shard(dir, L.world.size, L.shards, L.index, { value_head = opts.value_head })
    require('moonrl.train.dist').shard_model(L, model) -- (model.shard_layout: a critic made from it shards so too)
  else
    model = model_mod.load(dir)
  end
  model.source_dir = dir
  local tok_dir = opts.tokenizer or dir
  local tok = require('moonrl.tokenizer').load(tok_dir)
  local tpl
  if opts.chat then tpl = require('moonrl.chat').load(tok_dir) end
  return model, tok, tpl, tok_dir
end

-- m computed as policy is: its batches' tokens split over the same context-parallel group, its
-- rows sequence parallel as the policy's (a reference or a critic of the policy). Returns m.
function M.split_like(m, policy)
  if policy.cp_world then m:set_cp(policy.cp_world) end
  if policy.sequence_parallel then m:set_sequence_parallel(true) end
  return m
end

-- A pipeline stage model's stage, as M.load's opts.pp takes it, for another model of the same
-- stage on the channel `tag` (two a model: the policy 0, a reference 1, a critic 2).
function M.stage_of(model, tag)
  local P = model.pp
  return { world = P.world, tied = P.tied, norm = model.norm_group, tag = tag,
    stage = { stage = P.stage, stages = P.stages, first_layer = P.first_layer, layers = P.layers } }
end

-- A new model with model's config and a copy of its weights (a frozen reference policy), on
-- model's device. opts.init(copy): edits of the copy's host weights before it moves there.
function M.clone(model, opts)
  opts = opts or {}
  if model.pp then -- a pipeline stage: the same stage of the model's files, then its weights
    if opts.value_head then error('models.clone: a value head of a pipeline stage comes from models.critic_from', 2) end
    local copy = M.load(model.source_dir, { tp = model.tp_world, pp = M.stage_of(model, opts.tag or 1) })
    copy:write_params(model:read_params())
    copy:set_dtype(model:dtype())
    return M.split_like(copy, model)
  end
  local copy = model_mod.new(model.config, { value_head = opts.value_head or model.config.value_head })
  M.copy_weights(model, copy)
  if opts.init then opts.init(copy) end
  copy:set_dtype(model:dtype()) -- a reference policy or critic computes as the policy does
  copy:to_device(model:device())
  M.split_like(copy, model)
  return copy
end

-- Copy every parameter of src into the view of the same name in dst (dst may have more views,
-- e.g. a value head, which keep their initial values); either may be on a GPU.
function M.copy_weights(src, dst)
  local sp = src:read_params()
  local dp = dst:read_params()
  local by_name = {}
  for _, v in ipairs(dst:views()) do by_name[v.name] = v end
  for _, v in ipairs(src:views()) do
    local d = by_name[v.name]
    if d and d.numel == v.numel then ffi.copy(dp + d.offset, sp + v.offset, 4 * v.numel) end
  end
  dst:write_params(dp)
end

-- A critic's value head (score.weight) to zero: through its host weights, or (sharded) its part
-- in this rank's shard.
local function zero_value_head(critic)
  local off, cnt = critic:shard()
  local p = off and critic:param_buffer() or critic:read_params()
  for _, v in ipairs(critic:views()) do
    local a, b = math.max(v.offset, off or 0), math.min(v.offset + v.numel, off and off + cnt or math.huge)
    if v.name == 'score.weight' and b > a then ffi.fill(p + a, 4 * (b - a)) end
  end
  if not off then critic:write_params(p) end
end

-- A critic for PPO: the policy's weights with a scalar value head (score.weight) set to zero, so
-- the first value estimates are 0.
function M.critic_from(policy)
  if policy.pp then -- a pipeline stage: the same stage of the policy's files, with a value head on the last
    local critic = M.load(policy.source_dir, { tp = policy.tp_world, pp = M.stage_of(policy, 2), value_head = true })
    zero_value_head(critic)
    critic:set_dtype(policy:dtype())
    return M.split_like(critic, policy)
  end
  if policy.tp_world or policy:shard() or policy.quantized then
    -- tensor parallel, sharded: each rank its slices, its shard of them, from the policy's files
    -- (a quantized base: its dequantized weights, the converted directory's: the critic trains whole)
    local critic = M.load(policy.source_dir, { tp = policy.tp_world, shard = policy:shard() and policy.shard_layout,
      value_head = true })
    zero_value_head(critic)
    critic:set_dtype(policy:dtype())
    critic:to_device(policy:device())
    return M.split_like(critic, policy)
  end
  return M.clone(policy, { value_head = true, init = zero_value_head })
end

-- AdamW over what the model trains (Model:trainable): its one parameter buffer, no decay on norms
-- and biases; with LoRA its adapters' buffer. Deferred: its state is allocated by the session's
-- S:optimizer (or its first use), which under dist.zero=1 allocates only each rank's shard of it.
function M.adamw(model, o)
  -- (on a GPU: the optimizer's state and steps are there too) the gradient buffer when first
  -- used: never under dist.zero=2, which lends the backward windows
  local p, n, g, _, no_decay = model:trainable()
  local opt = require('moonrl.optim').adamw({ params = p, grads = g, n = n, lr = o.lr, betas = o.betas,
    eps = o.eps, weight_decay = o.weight_decay, no_decay = no_decay, model = model, defer = true })
  opt.model = model -- what a session's data-parallel wrapper hooks its gradient buckets into
  opt.no_decay, opt.lora = no_decay, model:lora() ~= nil -- (a ZeRO shard's ranges; LoRA: the adapters' state)
  return opt
end

-- model.lora (sections.lora_config) asks for adapters: rank > 0, or a PEFT directory to start from.
function M.lora_wanted(cfg)
  local l = type(cfg.model) == 'table' and cfg.model.lora
  return type(l) == 'table' and ((l.rank or 0) > 0 or l.dir ~= nil) and l or nil
end

-- model.lora.quantized_base: whether the policy is loaded as a quantized base (QLoRA; opts: the
-- session's, whose opts.lora = false trains the whole policy first). Usage errors, before the
-- model loads, where it cannot be.
function M.quantized_base(cfg, opts)
  local l = type(cfg.model) == 'table' and cfg.model.lora
  if not (type(l) == 'table' and l.quantized_base) then return false end
  if not M.lora_wanted(cfg) then
    moonrl.usage_error('model.lora.quantized_base: the quantized base is frozen: it needs adapters to train ' ..
      '(model.lora.rank or model.lora.dir)')
  end
  if opts and opts.lora == false then
    moonrl.usage_error('model.lora.quantized_base: this recipe trains the whole model before its adapters')
  end
  if type(cfg.model.dir) ~= 'string' or not cfg.model.dir:match('%.gguf$') then
    moonrl.usage_error('model.lora.quantized_base: model.dir must be a .gguf file (its blocks are the base); got ' ..
      tostring(cfg.model.dir))
  end
  -- (the base is read from its file on every rank; a copy of it whole is what these send)
  local d, e = type(cfg.dist) == 'table' and cfg.dist or {}, type(cfg.engine) == 'table' and cfg.engine or {}
  local why = (d.rollout_ranks or 0) > 0 and 'dist.rollout_ranks' or e.launch and 'engine.launch'
    or e.urls and 'engine.urls' or nil
  if why then moonrl.usage_error('model.lora.quantized_base: not with ' .. why .. ' (docs/lora.md)') end
  return true
end

-- LoRA's LR rule ("LoRA Without Regret": ~10x the full-parameter LR): a train.lr not given on the
-- command line (the recipe's default, a full-parameter one) is multiplied by 10. Returns the lr.
M.LORA_LR_SCALE = 10
function M.lora_lr(cfg)
  if cfg.train and cfg.train.lr then cfg.train.lr = M.lora_scaled(cfg, 'train.lr', cfg.train.lr) end
  return cfg.train and cfg.train.lr
end

-- A learning rate of a recipe's own (key: its config key, e.g. an example's warm-up 'sft.lr') under
-- the same rule: lr x 10 when the run trains LoRA adapters (model.lora) and key was not given.
function M.lora_scaled(cfg, key, lr)
  local config = require('moonrl.config')
  if M.lora_wanted(cfg) and config.current == cfg and config.given and not config.given[key] then
    return lr * M.LORA_LR_SCALE
  end
  return lr
end

-- The policy's adapters from model.lora: a usage error naming the key for what LoRA does not do yet
-- (checked before any work), then the adapters made (seeded from run.seed) or read from
-- model.lora.dir. Returns a line describing them (the trainable share).
function M.apply_lora(cfg, policy)
  local l = M.lora_wanted(cfg)
  if not l then return nil end
  local d, a = cfg.dist or {}, cfg.async or {}
  local why = (d.tp or 1) > 1 and 'dist.tp' or (d.cp or 1) > 1 and 'dist.cp' or (d.pp or 1) > 1 and 'dist.pp'
    or (d.zero or 0) >= 2 and 'dist.zero=' .. d.zero or (a.engine_threads or 0) > 0 and 'async.engine_threads'
    or a.weights_delta and 'async.weights_delta' or a.stream and 'async.stream'
    or (a.partial == 'continue' and (d.rollout_ranks or 0) > 0) and 'async.partial=continue with dist.rollout_ranks'
    or (type(cfg.moe) == 'table' and cfg.moe.expert_parallel) and 'moe.expert_parallel' or nil
  if why then moonrl.usage_error(string.format('model.lora: not yet with %s (docs/lora.md says what LoRA runs with)', why)) end
  local bits, bad = model_mod.lora_bits(l.targets) -- ('all-linear', or module names separated by commas)
  if not bits then moonrl.usage_error('model.lora.targets: ' .. bad) end
  if l.dir then
    local ok, err = pcall(function()
      if (l.rank or 0) > 0 then -- (the directory's own config decides; a rank given must agree)
        local c = model_mod.lora_config(l.dir)
        if c.rank ~= l.rank then error(string.format('rank %d, model.lora.rank=%d', c.rank, l.rank), 0) end
      end
      policy:load_lora(l.dir, { dropout = l.dropout })
    end)
    if not ok then moonrl.usage_error('model.lora.dir=' .. l.dir .. ': ' .. moonrl.error_text(err)) end
  else
    local ok, err = pcall(policy.set_lora, policy, { rank = l.rank, alpha = l.alpha, targets = l.targets,
      seed = cfg.run and cfg.run.seed or 0, dropout = l.dropout })
    if not ok then moonrl.usage_error('model.lora: ' .. moonrl.error_text(err)) end
  end
  local info = policy:lora()
  return info, model_mod.lora_text(info, info.n, policy.n_params)
end

-- LoRA in bf16: the frozen base stored in bf16 alone ("stored in bf16 where model.dtype allows":
-- its fp32 matrices freed, Model:freeze_base_bf16; it computes as before), except where the whole
-- fp32 weights are sent each phase (dist.rollout_ranks). engine: one made before, which reads the
-- policy's buffer (attached again). Returns the bytes freed, or nil.
function M.freeze_base(cfg, policy, engine)
  if not policy:lora() or policy:dtype() ~= 'bf16' or policy:frozen_base() then return nil end
  if ((type(cfg.dist) == 'table' and cfg.dist.rollout_ranks) or 0) > 0 then return nil end
  local freed = policy:freeze_base_bf16()
  if engine and engine.attach_params then engine:attach_params(nil) end
  return freed
end

-- The base of a model with LoRA adapters, as a model: its forwards are the model's with the adapters
-- off (the same weights and buffers: no copy; a forward clobbers the model's own last forward, so
-- it goes before the model's, as a reference's does); everything else is the model's.
function M.base_view(model)
  local view = setmetatable({ base_of = model }, { __index = model })
  function view.forward(_, batch, opts)
    model:lora_enable(false)
    local ok, lp, ent, val = pcall(model.forward, model, batch, opts)
    model:lora_enable(true)
    if not ok then error(lp, 0) end
    return lp, ent, val
  end
  return view
end

-- A new model (no adapters) whose weights are model's with its LoRA adapters merged in
-- (W + alpha/rank B A: mrl_model_lora_merged).
function M.merged(model)
  local copy = model_mod.new(model.config)
  local p = copy:params()
  moonrl.check(C.mrl_model_lora_merged(model.handle, p), 2)
  copy:set_dtype(model:dtype())
  return copy
end

-- Save model to dir (default run.dir/model) in Hugging Face format with the tokenizer files of
-- tokenizer_dir copied beside it, every file written atomically, the weights sharded past
-- max_shard_bytes (nil: 5 GB). Returns the directory.
function M.save(run, model, tokenizer_dir, dir, max_shard_bytes)
  dir = dir or (run.dir .. '/model')
  require('moonrl.train.checkpoint').save_model(model, dir, tokenizer_dir, max_shard_bytes)
  return dir
end

-- The device cfg.model.device names, as 'cpu' or 'cuda:N', checked (a usage error naming the
-- key: an unknown name, a build without CUDA, no GPU there, a GPU with rollout ranks or an engine
-- thread); nil when the config has no model.device. With several ranks, 'cuda' and 'auto' are
-- the rank's own GPU, its local rank's (as torchrun's LOCAL_RANK); 'cuda:N' is GPU N on every rank.
function M.model_device(cfg)
  local d = type(cfg.model) == 'table' and cfg.model.device or nil
  if d == nil then return nil end
  local w = require('moonrl.train.dist').world()
  local asked = d
  if w.size > 1 and (d == 'cuda' or (d == 'auto' and C.mrl_device_cuda_count() > 0)) then
    asked = 'cuda:' .. w.local_rank
  end
  local dev, why = model_mod.resolve_device(asked)
  if not dev then
    moonrl.usage_error(string.format('model.device=%s: %s%s', tostring(d), why, asked ~= d and string.format(
      ' (rank %d, local rank %d: one GPU a rank)', w.rank, w.local_rank) or ''))
  end
  if dev ~= 'cpu' and cfg.dist and (cfg.dist.rollout_ranks or 0) > 0 then
    moonrl.usage_error(string.format('model.device=%s: dist.rollout_ranks publish weights through host memory, '
      .. 'CPU models only for now', tostring(d)))
  end
  if dev ~= 'cpu' and cfg.async and (cfg.async.engine_threads or 0) > 0 then
    moonrl.usage_error(string.format('model.device=%s: async.engine_threads generates on a thread of its own beside '
      .. 'training, which a GPU does not do yet (one thread drives its kernels): async.engine_threads=0 generates '
      .. 'between the steps', tostring(d)))
  end
  return dev
end

-- The precision cfg.model.dtype asks for, checked (a usage error naming the key); nil when the
-- config has no model.dtype.
function M.model_dtype(cfg)
  local d = type(cfg.model) == 'table' and cfg.model.dtype or nil
  if d == nil then return nil end
  sections.check_choice('model.dtype', d, model_mod.dtypes)
  return d
end

-- moe.expert_parallel of a supervised recipe (SFT, DPO; RL recipes: moonrl.rl's setup_moe):
-- check_expert_parallel(policy, on) is session.start's check_policy (a usage error before the run
-- directory exists), expert_parallel(S, on) sets it over the ranks.
function M.check_expert_parallel(policy, on)
  if on and (policy and policy:num_moe_layers() or 0) == 0 then
    moonrl.usage_error(string.format("config key 'moe.expert_parallel': the model (%s) has no mixture-of-experts layers",
      policy and policy.config.model_type or 'none'))
  end
end

function M.expert_parallel(S, on)
  if on and S.world.size > 1 then S.policy:set_expert_parallel(S.world) end
end

return M
