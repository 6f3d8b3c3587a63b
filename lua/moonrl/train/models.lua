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
function M.load(dir, opts)
  opts = opts or {}
  dir = require('moonrl.io.gguf').resolve(dir) -- a .gguf file: its converted directory
  local model
  if opts.pp then -- pipeline parallel: this rank's stage (and tensor parallel: its slices of it; ZeRO-3: its shard)
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
  if policy.tp_world or policy:shard() then
    -- tensor parallel, sharded: each rank its slices, its shard of them, from the policy's files
    local critic = M.load(policy.source_dir, { tp = policy.tp_world, shard = policy:shard() and policy.shard_layout,
      value_head = true })
    zero_value_head(critic)
    critic:set_dtype(policy:dtype())
    critic:to_device(policy:device())
    return M.split_like(critic, policy)
  end
  return M.clone(policy, { value_head = true, init = zero_value_head })
end

-- AdamW over a model's one parameter buffer, no decay on norms and biases. Deferred: its state is
-- allocated by the session's S:optimizer (or its first use), which under dist.zero=1 allocates
-- only each rank's shard of it.
function M.adamw(model, o)
  local p, n = model:param_buffer() -- (on a GPU: the optimizer's state and steps are there too)
  -- the gradient buffer when first used: never under dist.zero=2, which lends the backward windows
  local g = function() return (model:grads()) end
  local opt = require('moonrl.optim').adamw({ params = p, grads = g, n = n, lr = o.lr, betas = o.betas,
    eps = o.eps, weight_decay = o.weight_decay, no_decay = model:no_decay_ranges(), model = model, defer = true })
  opt.model = model -- what a session's data-parallel wrapper hooks its gradient buckets into
  return opt
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
