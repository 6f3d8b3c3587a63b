-- moonrl.train.session: one run of a recipe and everything a checkpoint must hold, written once for
-- every recipe: the models and optimizers, the data positions and random generators, the step
-- and phase, the guards' windows and the recipe's own extra state. The recipe keeps only its
-- algorithm:
--
--   local S = moonrl.train.session.start(cfg, { name = 'grpo', total_steps = cfg.grpo.steps, steps_key = 'grpo.steps' })
--   S:model('policy', model, { tokenizer_dir = dir })   -- the first model is the policy
--   S:optimizer('policy', opt)
--   S:dataset('train', view)                            -- a moonrl.data view (its position)
--   local rng = S:rng('draw', seed)                     -- rng:int(n) in [0, n), its state saved
--   S.extra.buffer = {...}                              -- JSON-able recipe state, saved too
--   local before = S:memo('before', fn)                 -- fn() once; a resumed run reads the value back
--   for step in S:steps(total, 'grpo') do               -- resumes, checkpoints, stops, rolls back
--     ...
--     local applied = S:update(opt, lr, m)              -- the guards, then opt:step (or not)
--     S:log(m)
--   end
--   S:finish()                                          -- the last checkpoint; the model saved
--
-- Resume (cfg.run.resume): 'auto' continues from the newest checkpoint of run.dir that
-- verifies (skipping, with a one-line warning, any that is cut or corrupt), 'never' starts
-- fresh (and refuses a run.dir that holds a run), a path resumes from that checkpoint. The
-- config must be the one the checkpoint was written with, except the keys that cannot change
-- the math (M.FREE_KEYS and the recipe's step count). Restoring happens when the loop of the
-- checkpoint's phase starts (S:steps), so what a recipe computes before its loop (a frozen
-- reference, DPO's reference log-probs) comes from the initial model, as in the first run; a
-- phase the checkpoint had finished is skipped.
--
-- Safe points: the end of every step. A stop (SIGINT, SIGTERM, run.max_seconds) writes a
-- checkpoint there and saves the model, then the run exits 130 / 143 / 124. A stop or error
-- that escapes mid-step (the engine honours a stop while it generates) still saves the last
-- complete step when no optimizer stepped yet in this one. Checkpoints: every
-- run.checkpoint_every steps and run.checkpoint_minutes, and at the end; the newest
-- run.keep_checkpoints are kept.
local ffi = require('ffi')
local moonrl = require('moonrl')
local C = moonrl.C
local ckpt = require('moonrl.train.checkpoint')
local fault = require('moonrl.train.fault')
local fs = require('moonrl.io.fs')
local guard_mod = require('moonrl.train.guard')
local progress = require('moonrl.io.progress')
local json = require('moonrl.io.json')
local run_mod = require('moonrl.train.run')
local dist = require('moonrl.train.dist')
local rng_mod = require('moonrl.rng')
local model_mod = require('moonrl.model')
local batch = require('moonrl.batch')
local sections = require('moonrl.train.sections')
local models = require('moonrl.train.models')
local prompts = require('moonrl.train.prompts')
local threads = require('moonrl.train.threads')
local train = require('moonrl.train.step')
local rollout = require('moonrl.train.rollout')

local M = {}
local Session = {}
Session.__index = Session
M.Session = Session
-- One object: the methods of the parts it is made of are its own (the prompts and rewards of
-- moonrl.train.prompts, the guarded update of moonrl.train.guard). Its rollouts are an object of
-- their own (S.rollouts, moonrl.train.rollout), as are its run directory (S.run) and its models.
for k, f in pairs(prompts.session_methods) do Session[k] = f end
for k, f in pairs(guard_mod.session_methods) do Session[k] = f end

-- Keys a resumed run may change: they do not change the math of the steps it redoes.
M.FREE_KEYS = { 'run.max_seconds', 'run.log_level', 'run.resume', 'run.dir', 'run.threads', 'run.checkpoint_every',
  'run.checkpoint_minutes', 'run.keep_checkpoints', 'run.checkpoint_errors', 'run.hang_seconds',
  'guard.max_rollbacks', 'quiet', 'save', 'dist.timeout', 'dist.zero', 'dist.shard_group', 'dist.offload', 'dist.offload_chunk_mb', 'dist.bucket_mb', 'run.progress',
  'run.progress_seconds', 'run.memory_budget_mb', 'run.max_shard_gb',
  -- the mesh: a checkpoint's model is whole and its optimizer files say what they hold (checkpoint.load_optimizer)
  'dist.tp', 'dist.cp', 'dist.pp', 'dist.pp_layers', 'dist.sequence_parallel' }

-- ---- start --------------------------------------------------------------------------------

-- Whether the rollouts go to servers in other processes (moonrl.train.remote): engine.backend
-- other than moonrl, or engine.urls / engine.launch.
function M.remote_wanted(cfg)
  local e = cfg.engine
  return e ~= nil and (e.backend ~= 'moonrl' or e.urls ~= nil or e.launch ~= nil)
end

-- What an engine in other processes does not do (yet), refused at start-up naming the keys.
function M.check_remote(cfg, policy)
  local e = cfg.engine
  sections.check_choice('engine.backend', e.backend, { 'moonrl', 'vllm' })
  if not e.urls and not e.launch then
    moonrl.usage_error(string.format('engine.backend=%s: give its servers (engine.urls) or a command to start them ' ..
      '(engine.launch, or engine.launch=auto)', e.backend))
  end
  if e.urls and e.launch then moonrl.usage_error("config keys 'engine.urls' and 'engine.launch': one of them") end
  local function no(what) moonrl.usage_error(what .. ': not with an engine in other processes (engine.urls, engine.launch) yet') end
  if cfg.dist and ((cfg.dist.rollout_ranks or 0) > 0) then no('dist.rollout_ranks') end
  if dist.current() and dist.current().size > 1 then no('more than one process') end
  if cfg.agent and cfg.agent.command then no('agent.command') end
  if cfg.async and (cfg.async.stream or cfg.async.partial == 'continue' or (cfg.async.engine_threads or 0) > 0) then
    no('async.stream, async.partial=continue and async.engine_threads')
  end
  if policy:shard() or policy:tp() > 1 or policy.pp then no('a sharded or model-parallel policy') end
end

-- The session of a run: its policy, tokenizer, engine and data loaded from the config's sections,
-- then its run state (M.open). cfg: the merged config; opts: name, steps (the step count), steps_key (its config key),
-- chat (use the chat template), fields / optional (the dataset's record fields, when the
-- recipe streams prompts from cfg.data.path), engine (false: none even with an engine section),
-- policy / tokenizer / tokenizer_dir (a model the recipe built itself, instead of model.dir; its
-- loaded tokenizer and the directory of its files), optimizer (false:
-- no S.opt from the train section, the recipe registers its own), free_keys (config
-- keys a resumed run may change, beside M.FREE_KEYS), data (a moonrl.data view to stream prompts
-- from instead of cfg.data.path: a task's records, moonrl.tasks), check_policy(policy) (the
-- recipe's checks of the loaded model, before the run directory exists).
function M.start(cfg, opts)
  opts = opts or {}
  -- everything that can be checked or loaded is, before the run directory exists: a typo or a
  -- missing model leaves nothing behind
  if cfg.data and cfg.data.on_error then sections.check_choice('data.on_error', cfg.data.on_error, { 'stop', 'skip' }) end
  if type(cfg.reward) == 'table' then sections.check_choice('reward.on_error', cfg.reward.on_error, { 'drop', 'zero', 'stop' }) end
  if type(cfg.sandbox) == 'table' then sections.check_choice('sandbox.network', cfg.sandbox.network, { 'none', 'loopback' }) end
  sections.check_choice('run.checkpoint_errors', cfg.run.checkpoint_errors, { 'stop', 'warn' })
  rollout.check_config(cfg)
  if not (cfg.reward_model and cfg.reward_model.dir) then sections.check_reward(cfg) end -- (a reward model: once registered)
  local dtype, device = models.model_dtype(cfg), models.model_device(cfg)
  if cfg.dist and cfg.dist.offload ~= 'none' then
    sections.check_choice('dist.offload', cfg.dist.offload, { 'none', 'optimizer' })
    if not device or device == 'cpu' then
      moonrl.usage_error('dist.offload=optimizer moves a GPU model\'s fp32 master weights and optimizer state to host ' ..
        'memory: this model is on the CPU (model.device), where they are already')
    end
  end
  local policy, tok, tpl, tok_dir = opts.policy, opts.tokenizer, nil, opts.tokenizer_dir
  local mesh = M.mesh_of(cfg, device) -- dist.tp: each rank loads its slices; dist.cp: its share of the tokens
  local shard = M.shard_world(cfg, device, mesh) -- dist.zero=3 over several ranks: each loads its shard
  if not policy and cfg.model and cfg.model.dir then
    local quantized = models.quantized_base(cfg, opts)
    local ok, a, b, c, d = pcall(models.load, cfg.model.dir, { tokenizer = cfg.model.tokenizer, chat = opts.chat,
      shard = shard, tp = mesh and mesh.tp, pp = mesh and mesh.pp and M.pipeline_stage(cfg, mesh), quantized = quantized })
    if not ok then
      -- a run directory given for its model: say where the model is
      local dir = cfg.model.dir:gsub('/+$', '')
      local hint = ''
      if fs.exists(dir .. '/metrics.jsonl') and fs.exists(dir .. '/model/config.json') then
        hint = string.format(' (%s is a run directory: its model is model.dir=%s/model)', dir, dir)
      end
      moonrl.usage_error((mesh and mesh.tp and moonrl.error_text(a):find('tensor parallel', 1, true) and
        string.format('dist.tp=%d: ', mesh.tp.size) or quantized and 'model.lora.quantized_base: ' or 'model.dir: ')
        .. moonrl.error_text(a) .. hint)
    end
    policy, tok, tpl, tok_dir = a, b, c, d
  end
  if opts.check_policy then opts.check_policy(policy) end -- the recipe's checks of the model (usage errors)
  if policy and dtype then policy:set_dtype(dtype) end -- before the engine: it reads the same copies

  if cfg.dist and cfg.dist.sequence_parallel and (cfg.dist.tp or 1) <= 1 then
    moonrl.usage_error('dist.sequence_parallel splits the tensor-parallel groups\' tokens: it needs dist.tp > 1')
  end
  if policy and mesh and mesh.tp and cfg.dist.sequence_parallel then
    local ok, err = pcall(policy.set_sequence_parallel, policy, true)
    if not ok then moonrl.usage_error('dist.sequence_parallel: ' .. moonrl.error_text(err)) end
  end
  if policy and mesh and mesh.cp then
    local ok, err = pcall(policy.set_cp, policy, mesh.cp)
    if not ok then moonrl.usage_error(string.format('dist.cp=%d: %s', mesh.cp.size, moonrl.error_text(err))) end
  end
  if policy and device and device ~= policy:device() then
    local ok, err = pcall(policy.to_device, policy, device) -- before the engine too: it works where the model is
    if not ok then moonrl.usage_error('model.device=' .. tostring(cfg.model.device) .. ': ' .. moonrl.error_text(err)) end
  end
  local lora_line -- model.lora: the adapters, where the model is (before the engine; a recipe may make them later: opts.lora = false)
  if policy and opts.lora ~= false and models.lora_wanted(cfg) then
    models.lora_lr(cfg)
    lora_line = select(2, models.apply_lora(cfg, policy))
    models.freeze_base(cfg, policy)
  end
  local gen, gen_sync = policy, nil -- (the model the engine generates with, and its refresh)
  if policy and policy.pp and cfg.engine and opts.engine ~= false then
    -- a stage is no whole model: the rollout ranks (which hold the policy whole) generate, and
    -- where this process generates (rollouts without rollout ranks, evaluation) the engine runs
    -- on tensor-parallel slices over the pipeline's ranks (its stages x its slices: mesh.norm),
    -- refreshed from the stages after each update (moonrl.train.reshard)
    if (cfg.dist.rollout_ranks or 0) > 0 and not sections.eval_wanted(cfg) then
      opts.engine = false
    else
      local ok, made = pcall(models.load, cfg.model.dir, { tp = mesh.norm })
      if not ok then
        moonrl.usage_error(string.format('dist.pp=%d: the engine generates on slices over the pipeline\'s %d ranks ' ..
          '(its stages x dist.tp): %s', policy.pp.stages, mesh.norm.size, moonrl.error_text(made)))
      end
      gen = made
      if dtype then gen:set_dtype(dtype) end
      if device and device ~= gen:device() then gen:to_device(device) end
      -- (ZeRO-3: a stage's shards lie on the ranks of the other pipelines too: the plan spans the
      -- trainers, each shard sent once, by its first replica)
      local sharded = policy:shard() ~= nil
      gen_sync = require('moonrl.train.reshard').plan(sharded and mesh.world or mesh.norm, policy, gen,
        { sends = not sharded or policy.shard_layout.replica == 0 })
    end
  end
  local engine
  local remote_engine = cfg.engine and opts.engine ~= false and policy and M.remote_wanted(cfg)
  if remote_engine then M.check_remote(cfg, policy) end
  if cfg.engine and opts.engine ~= false and policy and not remote_engine then
    local e = cfg.engine
    sections.check_choice('engine.kv_cache_dtype', e.kv_cache_dtype or 'auto', { 'auto', 'fp32', 'bf16' })
    sections.check_choice('engine.mla_cache', e.mla_cache or 'latent', { 'latent', 'expanded' })
    local ok, made = pcall(moonrl.engine.new, gen, { kv_cache_bytes = e.kv_cache_mb * 2 ^ 20,
      block_size = e.block_size, max_batch_tokens = e.max_batch_tokens, max_seqs = e.max_seqs, seed = cfg.run.seed,
      cuda_graphs = e.cuda_graphs ~= false, kv_cache_dtype = e.kv_cache_dtype, pack_weights = e.pack_weights ~= false,
      mla_cache = e.mla_cache, mtp = e.mtp == true })
    if not ok then moonrl.usage_error('engine.*: ' .. moonrl.error_text(made)) end
    engine = made
  end
  local engine_copy
  if engine and policy:shard() and gen == policy then -- the engine generates alone: a copy of its own, refreshed after each update
    -- in bf16 its compute copy (no fp32 weights whole on the rank); a whole fp32 copy where the
    -- process publishes whole weights (async modes in one process: a weight store) or in fp32
    local remote = cfg.dist and (cfg.dist.rollout_ranks or 0) > 0
    if policy:dtype() == 'bf16' and (sections.lag(cfg) == 0 or remote) then
      engine_copy = dist.compute_copy(policy, engine.pack_weights)
      engine:set_home_copy(engine_copy.handle)
    else
      engine_copy = dist.whole_copy(policy)
      engine:set_home(engine_copy.buf, engine_copy.n)
    end
  end
  if type(cfg.reward) == 'table' and cfg.reward_model and cfg.reward_model.dir then
    require('moonrl.registry').plugin('reward', 'reward_model').register('reward_model', cfg.reward_model.dir)
    sections.check_reward(cfg)
  end
  local data = opts.data
  if not data and opts.fields and cfg.data then
    data = prompts.open_data(cfg, opts.fields, opts.optional):shuffled(cfg.run.seed)
  end

  local inputs = {}
  if cfg.model and cfg.model.dir then inputs.model = cfg.model.dir end
  local S = M.open(cfg, { name = opts.name, total_steps = opts.steps, steps_key = opts.steps_key, inputs = inputs,
    free_keys = opts.free_keys })
  if mesh then -- the data over the data-parallel groups (S.world); every rank of the mesh stops together
    S.world, S.mesh_world = mesh.dp, mesh.world -- (with rollout ranks: the trainers)
    -- tensor parallel: the slices' sums within each group
    if mesh.tp then S.tp_world, S.tp_follower = mesh.tp, mesh.tp_rank > 0 end
    -- the model-parallel group (tensor x pipeline): the ranks that write a checkpoint's model together
    S.mp_world = mesh.pp and mesh.norm or mesh.tp
    if mesh.pp then S.tp_follower = mesh.tp_rank > 0 or mesh.pp_rank > 0 end
    -- context parallel: a group's ranks share each sample's tokens; the gradient sums, the optimizer
    -- state's shards, checkpoints and saves over the data- and context-parallel ranks of a slot
    if mesh.cp then S.cp_world, S.grad_world = mesh.cp, mesh.grad end
    if mesh.pp then S.pp_world = mesh.pp end -- (pipeline parallel: a step's numbers are the last stage's)
    -- where this rank sits, in its heartbeat (moonrl status)
    local at = {}
    if mesh.tp then at[#at + 1] = string.format('tp %d/%d', mesh.tp_rank, mesh.tp.size) end
    if mesh.cp then at[#at + 1] = string.format('cp %d/%d', mesh.cp_rank, mesh.cp.size) end
    if mesh.pp then at[#at + 1] = string.format('pp %d/%d', mesh.pp_rank, mesh.pp.size) end
    at[#at + 1] = string.format('dp %d/%d', mesh.dp.rank, mesh.dp.size)
    S.status:set({ mesh = table.concat(at, ' ') })
    S.status:write(true)
  end
  if remote_engine then -- (after the run directory: the servers' logs go there)
    local e = cfg.engine
    local urls = {}
    for u in (e.urls or ''):gmatch('[^,%s]+') do urls[#urls + 1] = u end
    fs.mkdirs(S.dir .. '/engine')
    engine = require('moonrl.train.remote').new({ backend = e.backend, urls = urls, launch = e.launch,
      servers = e.servers, model_dir = require('moonrl.io.gguf').resolve(cfg.model.dir), model_name = 'policy', policy = policy, tok = tok,
      seed = cfg.run.seed, request_timeout = e.request_timeout, retries = e.retries, launch_timeout = e.launch_timeout,
      sync_dir = e.sync_dir, weight_sync = e.weight_sync, sync_dtype = e.sync_dtype, bucket_mb = e.bucket_mb,
      log_dir = S.dir .. '/engine',
      eos_ids = (policy.config.eos_token_id or -1) >= 0 and { policy.config.eos_token_id } or {},
      event = function(kind, fields) S:event(kind, fields, { quiet = true }) end })
    S:event('engine', { backend = e.backend, servers = engine:where() }, { quiet = true })
  end
  S.total, S.policy, S.tok, S.tpl, S.tok_dir, S.engine = opts.steps, policy, tok, tpl, tok_dir, engine
  S.engine_copy = engine_copy
  if gen_sync then -- a pipeline's engine: its slices follow each update (and a restore)
    S.engine_model, S.engine_sync = gen, function() require('moonrl.train.reshard').sync(gen_sync) end
  end
  if policy then
    S:model('policy', policy, { tokenizer_dir = tok_dir })
    local bf16 = policy:dtype() == 'bf16'
    if S.world.rank == 0 and cfg.quiet ~= true then -- the run's precision, on its first line
      local gpu = policy:device() ~= 'cpu'
      print(string.format('precision: %s%s%s', policy:dtype(), bf16 and string.format(
        ' (fp32 master weights; bf16 products: %s)', gpu and 'cuBLASLt' or model_mod.bf16_products() or
        'reference: no bf16 hardware, slow') or '', gpu and ', on ' .. policy:device_description() or ''))
    end
    if lora_line then M.announce_lora(S, policy, lora_line) end
    S:event('precision', { dtype = policy:dtype(), asked = dtype or 'fp32', device = policy:device(),
      bf16_products = model_mod.bf16_products() or 'none', tp_transport = policy.tp_transport,
      cp_transport = policy.cp_transport,
      tp_nccl_error = policy.tp_transport == 'host' and policy.tp_world.nccl_error or nil }, { quiet = true })
  end
  if lora_line then S:merge_engine() end -- (engine.lora_merged)
  if cfg.run.threads == 'auto' and policy then threads.auto_threads(S, policy) end
  if cfg.train and policy and S.role ~= 'rollout' then
    if opts.optimizer ~= false then -- (false: the recipe makes it later, e.g. after a warm-up)
      S.opt = S:optimizer('policy', models.adamw(policy, { lr = cfg.train.lr, weight_decay = cfg.train.weight_decay }))
    end
    S.lr_at = M.lr_schedule(cfg, opts.steps)
  end
  if engine then S.max_prompt_tokens = policy.config.max_position_embeddings - 1 end
  if data then
    S.data = S:dataset('train', data)
    data.src.on_skip = function(msg) S:event('data_skipped', { message = msg }, { quiet = true }) end
  end
  return S
end


function M.lr_schedule(cfg, steps)
  return moonrl.optim.schedule({ kind = cfg.train.schedule or 'constant', warmup = cfg.train.warmup or 0,
    total = steps, lr = cfg.train.lr })
end

-- model.lora for a recipe that trains the whole policy first (session.start's opts.lora = false):
-- from here the policy trains adapters over its weights as they are now, saved once as the run's
-- lora_base (what its checkpoints name as the adapters' base). A resumed run whose checkpoint held
-- the adapters has them already. train.lr (not given) follows LoRA's rule (models.lora_lr).
function Session:start_lora()
  if not models.lora_wanted(self.cfg) then return end
  local policy, line = self.policy, nil
  models.lora_lr(self.cfg)
  self.lr_at = M.lr_schedule(self.cfg, self.total)
  if not policy:lora() then
    local base = self.dir .. '/lora_base'
    if self.world.rank == 0 and not fs.exists(base .. '/config.json') then
      fs.remove(base .. '.tmp')
      ckpt.save_model(policy, base .. '.tmp')
      fs.rename(base .. '.tmp', base)
    end
    self.world:barrier()
    policy.source_dir = base
    line = select(2, models.apply_lora(self.cfg, policy))
    if self.world.size > 1 then M.broadcast_lora(self, policy) end
  else
    local info = policy:lora()
    line = string.format('LoRA: rank %d, alpha %g (from the checkpoint)', info.rank, info.alpha)
  end
  models.freeze_base(self.cfg, policy, self.engine)
  self:merge_engine()
  M.announce_lora(self, policy, line)
end

-- Rank 0's adapters to every rank (as a model's weights go: on a GPU over its transport).
function M.broadcast_lora(S, model)
  local p, n = model:lora_buffer()
  if model:device() ~= 'cpu' then S.world:gpu_broadcast(p, 4 * n, 0) else S.world:broadcast(p, 4 * n, 0) end
  model:trained()
end

-- engine.lora_merged: the engine generates from a copy of the policy's weights with its adapters
-- merged in (W + alpha/rank B A: mrl_model_lora_merged), made again after each update (and a
-- restore): the base's speed for one more copy of the weights. The copy is the session's engine
-- copy (S.engine_copy), which the optimizer's steps refresh.
function Session:merge_engine()
  local e = self.cfg.engine
  if not (type(e) == 'table' and e.lora_merged and self.engine and self.policy and self.policy:lora()) then return end
  if self.engine.remote then
    moonrl.usage_error('engine.lora_merged: the rollout servers get the adapters (engine.urls, engine.launch), not merged weights')
  end
  local policy, n = self.policy, self.policy.n_params
  local buf = ffi.new('float[?]', n)
  local copy = { buf = buf, n = n, bytes = function() return 4 * n end }
  function copy.refresh() moonrl.check(C.mrl_model_lora_merged(policy.handle, buf), 2) end
  copy.refresh()
  self.engine:set_home(buf, n)
  self.engine_copy = copy
end

-- The adapters' line (rank 0, not quiet) and event: their config and the trainable share.
function M.announce_lora(S, policy, line)
  if policy.quantized then -- (model.lora.quantized_base: what its blocks hold, and would in fp32)
    line = line .. string.format('; the base\'s matrices as blocks: %.1f MiB (%.1f MiB in fp32)',
      policy.quantized / 2 ^ 20, 4 * policy.quantized_params / 2 ^ 20)
  elseif policy:base_bf16() then
    line = line .. '; the base stored in bf16 (its fp32 matrices freed)'
  end
  if S.world.rank == 0 and S.cfg.quiet ~= true then print(line) end
  local info = policy:lora()
  S:event('lora', { rank = info.rank, alpha = info.alpha, targets = info.targets, trainable = info.n,
    params = policy.n_params, share = info.n / policy.n_params, lr = S.cfg.train and S.cfg.train.lr,
    quantized_base = policy.quantized, quantized_params = policy.quantized_params, base_bf16 = policy:base_bf16() or nil },
    { quiet = true })
end

-- dist.zero=3 on several ranks: the layout (dist.shard_layout) of the ranks that shard the
-- policy's parameters (nil: whole). What sharded parameters do not do yet is a usage error naming the key.
-- With a mesh (dist.tp, dist.cp): over the ranks that hold the same slices (its grad group).
function M.shard_world(cfg, device, mesh)
  if not (cfg.dist and cfg.dist.zero == 3) then return nil end
  local w = mesh and mesh.grad or dist.world(cfg.dist.timeout)
  if w.size == 1 then return nil end -- one process: nothing to shard
  if not mesh and (cfg.dist.rollout_ranks or 0) > 0 then -- (a mesh is the trainers' already)
    -- the trainers shard among themselves and write their shards into the rollout ranks' shared-
    -- memory store, or send them over MPI (rollout.lua's deliver_shards); the rollout ranks hold
    -- the policy whole
    local g = M.groups(w, cfg)
    if g.role == 'rollout' then return nil end
    w = g.world
  end
  return dist.shard_layout(w, cfg.dist.shard_group)
end

-- The config table of model.dir's whole model (read before it loads: the mesh's checks, the stages).
local function model_config(cfg) return model_mod.config_of(require('moonrl.io.gguf').resolve(cfg.model.dir)) end

-- dist.tp and dist.cp: the mesh (dist.mesh) of the ranks that train, nil when both are 1. What
-- they do not do yet is a usage error naming the key.
function M.mesh_of(cfg, device)
  local TP, CP, PP = cfg.dist and cfg.dist.tp or 1, cfg.dist and cfg.dist.cp or 1, cfg.dist and cfg.dist.pp or 1
  local RTP = cfg.dist and cfg.dist.rollout_tp or 1
  if RTP > 1 then -- the rollout ranks in tensor-parallel groups (their engines generate on slices)
    local R, a = cfg.dist.rollout_ranks or 0, cfg.async or {}
    local function no(what) moonrl.usage_error(string.format('dist.rollout_tp=%d %s', RTP, what)) end
    if R == 0 then no('splits the rollout ranks into tensor-parallel groups: it needs dist.rollout_ranks') end
    if R % RTP ~= 0 then no(string.format('does not divide the dist.rollout_ranks=%d', R)) end
    if a.weights == 'shm' then no('with async.weights=shm: not yet (the slices go to the rollout ranks by MPI)') end
    if a.stream or a.partial == 'continue' then no('with async.stream or async.partial=continue: not yet') end
    if device and device ~= 'cpu' then no('with model.device=' .. tostring(cfg.model.device) .. ': not yet (CPU models only)') end
    local g = M.groups(dist.world(cfg.dist.timeout), cfg)
    if g.role == 'rollout' then return dist.mesh(g.world, RTP, 1, 1) end
  end
  if TP <= 1 and CP <= 1 and PP <= 1 then return nil end
  local key = PP > 1 and 'pp' or CP > 1 and TP <= 1 and 'cp' or 'tp'
  local function no(what)
    moonrl.usage_error(string.format('dist.%s=%d with %s: not yet', key, key == 'cp' and CP or key == 'pp' and PP or TP,
      what))
  end
  local R = cfg.dist.rollout_ranks or 0
  -- (an engine thread would step the group from a second thread; without one, a batch of an
  -- asynchronous mode in one process is generated between steps, by the group together)
  if R == 0 and cfg.async and (cfg.async.engine_threads or 0) > 0 then
    no('async.engine_threads=' .. cfg.async.engine_threads)
  end
  local w = dist.world(cfg.dist.timeout)
  if R > 0 then -- the trainers form the mesh; the rollout ranks hold the policy whole (their slices sent them)
    if cfg.async and cfg.async.weights == 'shm' then no('async.weights=shm (the slices go to the rollout ranks by MPI)') end
    local g = M.groups(w, cfg)
    if g.role == 'rollout' then return nil end
    w = g.world
  end
  local mesh = dist.mesh(w, TP, CP, PP)
  -- a GPU model's tensor-parallel sums and a tied embedding's gradient sum between the pipeline's
  -- ends: over NCCL (dist.gpu_transport), else through the host
  for _, g in ipairs({ mesh.tp or false, mesh.cp or false, mesh.tied or false, mesh.norm or false }) do
    if g then g.gpu_asked = cfg.dist.gpu_transport end
  end
  return mesh
end

-- Pipeline parallel: this rank's stage of the mesh, its layers (dist.pp_layers, else balanced by
-- a layer's and the head's cost, pipeline.stages) as models.load takes it.
function M.pipeline_stage(cfg, mesh)
  local pipeline = require('moonrl.train.pipeline')
  local P, c = mesh.pp.size, model_config(cfg)
  local L, counts = c.num_hidden_layers, nil
  if (cfg.dist.pp_layers or '') ~= '' then
    counts = {}
    for n in tostring(cfg.dist.pp_layers):gmatch('[^,%s]+') do counts[#counts + 1] = tonumber(n) or -1 end
    local total, ok = 0, #counts == P
    for _, n in ipairs(counts) do total, ok = total + n, ok and n >= 1 and n == math.floor(n) end
    if not ok or total ~= L then
      moonrl.usage_error(string.format('dist.pp_layers=%s: %d layer counts of at least 1 each, adding up to the %d ' ..
        'layers (num_hidden_layers), one a stage of dist.pp=%d', cfg.dist.pp_layers, P, L, P))
    end
  else
    counts = pipeline.stages(L, P, pipeline.costs(c))
    if not counts then
      moonrl.usage_error(string.format('dist.pp=%d: more stages than the model\'s %d layers (num_hidden_layers)', P, L))
    end
  end
  local first = 0
  for k = 1, mesh.pp_rank do first = first + counts[k] end
  return { world = mesh.pp, tied = mesh.tied, norm = mesh.norm, tag = 0, counts = counts,
    stage = { stage = mesh.pp_rank, stages = P, first_layer = first, layers = counts[mesh.pp_rank + 1] } }
end

-- (the numbers' ranges are the config schema's: moonrl.config checked them)
local function check_dist(d)
  if not d then return end
  if d.gpu_transport ~= 'auto' and d.gpu_transport ~= 'nccl' and d.gpu_transport ~= 'host' then
    moonrl.usage_error(string.format("config key 'dist.gpu_transport' must be auto, nccl or host, got %s",
      tostring(d.gpu_transport)))
  end
end

-- The run state alone (M.start's second half): the ranks, the run directory, the checkpoint to
-- resume from. opts: name (the recipe), total_steps (for the step line), steps_key (the config
-- key of the step count: free to change on resume), free_keys (more such keys), inputs
-- ({ name = path } of the input model and data, recorded in checkpoints).
function M.open(cfg, opts)
  opts = opts or {}
  local name = opts.name or 'run'
  check_dist(cfg.dist)
  local world = dist.world(cfg.dist and cfg.dist.timeout)
  local rollout_ranks = cfg.dist and cfg.dist.rollout_ranks or 0
  if rollout_ranks >= world.size and rollout_ranks > 0 then
    moonrl.usage_error(string.format('dist.rollout_ranks=%d leaves no rank to train (the job has %d)', rollout_ranks,
      world.size))
  end
  if world.size > 1 and not opts.ranks_ready and not opts.groups_ready then
    local groups = M.groups(world, cfg)
    local o = {}
    for k, v in pairs(opts) do o[k] = v end
    o.groups_ready = true
    local self = M.open(cfg, o)
    self.world, self.link, self.role, self.remote = groups.world, groups.link, groups.role, groups.remote
    return self
  end
  if world.size > 1 and not opts.ranks_ready then
    -- ranks on one host share its cores (unless run.threads or MOONRL_THREADS says otherwise)
    if cfg.run.threads == 0 and not os.getenv('MOONRL_THREADS') then
      moonrl.C.mrl_parallel_set_threads(math.max(1, math.floor(tonumber(moonrl.C.mrl_parallel_threads()) / world.local_size)))
    end
    return M.start_ranks(world, cfg, opts)
  end
  local resume = cfg.run.resume
  progress.configure({ mode = cfg.run.progress, seconds = cfg.run.progress_seconds })
  local dir, lock, held
  if opts.decided then
    dir, held = opts.decided.dir, 'run' -- a rank > 0: rank 0 opened the directory and chose the checkpoint
  else
    dir, lock, held = run_mod.open_dir(cfg, name, { reuse = resume ~= 'never' })
  end
  local function release() if lock then lock:release() end end
  local self = setmetatable({ cfg = cfg, name = name, world = world, models = {}, optimizers = {}, datasets = {}, rngs = {},
    extra = {}, memos = json.object(), global_step = 0, step = 0, phases_done = {}, lr_scale = 1.0,
    rollbacks = 0, skips = 0, skips_in_row = 0, guard = guard_mod.new(cfg.guard), inputs = opts.inputs or {},
    ckpt_root = dir .. '/checkpoints', last_ckpt_step = 0, last_ckpt_time = moonrl.now() }, Session)
  local free = {}
  for _, k in ipairs(M.FREE_KEYS) do free[k] = true end
  for _, k in ipairs(opts.free_keys or {}) do free[k] = true end
  if opts.steps_key then free[opts.steps_key] = true end

  local from
  local warnings = {}
  local function warn(msg) warnings[#warnings + 1] = msg; moonrl.log('warn', '%s', msg) end
  local function set_aside(msg, d) -- kept for a look, out of the way of the checkpoints to come
    warn(msg)
    if not fs.exists(d .. '.corrupt') then pcall(fs.rename, d, d .. '.corrupt') end
  end
  if opts.decided then
    from = opts.decided.from
  elseif resume == 'auto' then
    from = held == 'run' and ckpt.latest(self.ckpt_root, set_aside) or nil
  elseif resume ~= 'never' then
    local ok, why = ckpt.verify(resume)
    if not ok then
      release()
      moonrl.usage_error('run.resume=' .. resume .. ': ' .. why)
    end
    from = resume
  end
  if from then
    -- what the checkpoint says is checked before anything uses it: types, ranges, the run's metrics
    local ok, saved = pcall(ckpt.read, from)
    local why = not ok and moonrl.error_text(saved) or ckpt.check_state(saved) or
      ckpt.check_metrics(dir .. '/metrics.jsonl', saved.state)
    if why then
      release()
      moonrl.usage_error(string.format('cannot resume from %s: %s', from, why))
    end
    if saved.run.recipe ~= name then
      release()
      moonrl.usage_error(string.format("cannot resume from %s: it was written by the recipe '%s', not '%s'", from,
        tostring(saved.run.recipe), name))
    end
    local diff = ckpt.config_changes(saved.run.config or {}, cfg, free)
    if #diff > 0 then
      release()
      moonrl.usage_error(string.format('cannot resume from %s: the config changed: %s (start a new run.dir, ' ..
        'or pass run.resume=never with a new run.dir)', from, table.concat(diff, ', ')))
    end
    local v = moonrl.version()
    if saved.run.git ~= v.git then
      warn(string.format('resuming %s written by moonrl git %s with git %s: steps may differ in their last bits',
        from, tostring(saved.run.git), v.git))
    end
    self.resume = { dir = from, state = saved.state, run = saved.run }
    for k, val in pairs(saved.state.memo or {}) do self.memos[k] = val end
    self.last_ckpt_step = saved.state.step
  end
  self.run = run_mod.start(cfg, { name = name, dir = dir, lock = lock, total_steps = opts.total_steps,
    metrics_bytes = from and self.resume.state.metrics_bytes or (held == 'run' and 0 or nil), world_size = opts.world_size,
    silent = opts.silent, rank = (dist.current() or dist.SOLO).rank })
  self.dir = dir
  -- the heartbeat file of this rank (moonrl status reads it): every rank writes its own
  self.status = progress.status_writer(dir, world.rank, { recipe = name, world_size = world.size,
    attempt = fault.attempt })
  self.status:write(true)
  for _, msg in ipairs(warnings) do self.run:event('checkpoint_skipped', { message = msg }, { quiet = true }) end
  if from then
    self.run:event('resume', { checkpoint = from, step = self.resume.state.step, attempt = fault.attempt }, { quiet = true })
    if world.rank == 0 then print(string.format('resuming from %s (step %d)', from, self.resume.state.step)) end
  elseif held == 'run' then
    self.run:event('fresh_start', { message = 'no complete checkpoint in ' .. self.ckpt_root, attempt = fault.attempt },
      { quiet = true })
  end
  self.run.on_phase = function(phase)
    self.status:phase(phase)
    fault.point(self.global_step, phase)
  end
  moonrl.on_exit(function(ok, err) self:abort(ok, err) end)
  return self
end

-- With dist.rollout_ranks = R > 0 the last R ranks of the job only generate and score (role
-- 'rollout'), the others train (role 'train'); each group has its communicator (S.world), and
-- trainer rank 0 and the rollout ranks share S.link (weights one way, batches the other).
local made_groups -- (once a job: a sharded policy's loading asks for them before M.open)
function M.groups(world, cfg)
  if made_groups then return made_groups end
  local R = cfg.dist and cfg.dist.rollout_ranks or 0
  if R == 0 then return { world = world, role = 'train' } end
  if not cfg.async then moonrl.usage_error('dist.rollout_ranks: this recipe has no rollout to hand to rollout ranks') end
  local rollout = world.rank >= world.size - R
  local group = world:split(rollout and 1 or 0, rollout and 'rollout' or 'trainers')
  local link = world:split((rollout or world.rank == 0) and 0 or -1, 'link')
  made_groups = { world = group, link = link, role = rollout and 'rollout' or 'train', remote = not rollout }
  return made_groups
end

-- A job of several ranks: rank 0 opens (or reopens) the run directory and picks the checkpoint
-- to resume from, as one process would; the others follow its choice and write nothing of the
-- run's files (M.start with opts.decided). An error on rank 0 (a usage error: a bad run.dir)
-- is the same error on every rank.
function M.start_ranks(world, cfg, opts)
  local o = {}
  for k, v in pairs(opts) do o[k] = v end
  o.ranks_ready, o.world_size = true, world.size
  local msg, made, ok
  if world.rank == 0 then
    ok, made = pcall(M.open, cfg, o)
    if ok then
      msg = 'ok\n' .. json.encode(json.object({ 'dir', made.dir, 'from', made.resume and made.resume.dir or json.null }))
    else
      msg = (moonrl.is_usage_error(made) and 'usage\n' or 'error\n') .. moonrl.error_text(made)
    end
  end
  msg = world:broadcast_string(msg or '')
  local kind, rest = msg:match('^(%a+)\n(.*)$')
  if world.rank == 0 then
    if not ok then error(made, 0) end
    return made
  end
  if kind == 'usage' then moonrl.usage_error(rest) end
  if kind ~= 'ok' then moonrl.run_error('rank 0 could not start the run: ' .. tostring(rest)) end
  local d = json.decode(rest, 'rank 0')
  o.decided, o.silent = { dir = d.dir, from = d.from ~= json.null and d.from or nil }, true
  return M.open(cfg, o)
end

-- ---- registering state ----------------------------------------------------------------------

local function put(list, name, entry)
  for i, e in ipairs(list) do
    if e.name == name then list[i] = entry; return entry end
  end
  list[#list + 1] = entry
  return entry
end

-- opts.tokenizer_dir: its tokenizer files are saved beside it (a checkpoint is then a model).
-- With several ranks every rank starts from rank 0's weights (as DDP does).
function Session:model(name, model, opts)
  put(self.models, name, { name = name, model = model, tokenizer_dir = opts and opts.tokenizer_dir })
  if self.world.size > 1 and not model:shard() then -- (a sharded model's ranks each loaded their own shard)
    local p, n = model:param_buffer()
    if model:frozen_base() then -- (every rank read the same files; its adapters below)
    elseif model:device() ~= 'cpu' then
      local device = C.mrl_model_get_device(model.handle).index
      self.world:gpu_transport(self.cfg.dist and self.cfg.dist.gpu_transport or 'auto', device)
      self.world:gpu_broadcast(p, 4 * n, 0)
    else
      self.world:broadcast(p, 4 * n, 0)
    end
    if model:lora() then M.broadcast_lora(self, model) end
    model:weights_changed()
  end
  return model
end

-- With several ranks the optimizer becomes data parallel (moonrl.train.dist): its gradients are summed
-- over the ranks before it reads them, and with dist.zero=1 its state is sharded. opt.model: the
-- model whose buffers it steps (models.adamw sets it). opt may be deferred (models.adamw's are):
-- its state is allocated here, except under ZeRO-1, where only each rank's shard ever gets one.
function Session:optimizer(name, opt)
  -- dist.offload=optimizer: a GPU model's master weights and optimizer state in host memory
  if self.cfg.dist and self.cfg.dist.offload == 'optimizer' and opt.offload and opt.model and opt.model:device() ~= 'cpu' then
    opt:offload(self.cfg.dist.offload_chunk_mb * 2 ^ 20 / 4)
  end
  local gw = self.grad_world or self.world -- (context parallel: the sums over the data- and context-parallel ranks)
  if not (gw.size > 1 and opt.model) and opt.create then opt:create() end
  if gw.size > 1 and opt.model then
    opt = dist.data_parallel(gw, opt, opt.model, { zero = self.cfg.dist.zero, bucket_mb = self.cfg.dist.bucket_mb,
      gpu_transport = self.cfg.dist.gpu_transport, shard_group = self.cfg.dist.shard_group })
    if opt.model == self.policy and self.engine_copy then -- the engine's copy follows each update
      -- (in place: the engine reads it from its next round, each generate being one; an engine
      -- thread reads a weight store's copies of it)
      opt.after_step[#opt.after_step + 1] = self.engine_copy.refresh
    end
    self:event('data_parallel', { optimizer = name, world_size = gw.size, zero = self.cfg.dist.zero,
      state_bytes_per_rank = opt:state_bytes(), state_bytes = 8 * opt.n, gpu_transport = opt.gpu or 'none',
      nccl_error = opt.gpu and self.world.nccl_error or nil,
      buckets = opt.buckets and tonumber(moonrl.C.mrl_dist_buckets_count(opt.buckets)) or 0 }, { quiet = true })
  end
  local function after_each_step(fn)
    local step = opt.step
    opt.step = function(o, ...)
      local a, b = step(o, ...)
      fn()
      return a, b
    end
  end
  -- (one process: LoRA's merged copy follows each update; a data-parallel one's after_step does it)
  if opt.model == self.policy and self.engine_copy and not opt.after_step then after_each_step(self.engine_copy.refresh) end
  -- a pipeline's engine: its slices follow each update
  if opt.model == self.policy and self.engine_sync then after_each_step(self.engine_sync) end
  local m = opt.model
  if m and (m.tp_world or m.pp) then -- tensor, pipeline parallel: the whole model's gradient norm; this part's state file
    dist.parallel_norm(opt, m, { tp = m.tp_world, group = m.pp and m.norm_group or m.tp_world })
    opt.tp_prefix = ckpt.tp_prefix(m.tp_world and m.tp_world.rank or 0, m.tp_world and m.tp_world.size or 1,
      m.pp and m.pp.stage, m.pp and m.pp.stages)
  end
  put(self.optimizers, name, { name = name, opt = opt })
  return opt
end

-- ---- the global batch and the ranks -----------------------------------------------------------
-- Every rank reads the same global batch; each computes on its share. One rank: all of it.

-- This rank's contiguous share of a list (its items, and the index of the first).
function Session:shard(list)
  local first, last = self.world:share(#list)
  local out = {}
  for i = first, last do out[#out + 1] = list[i] end
  return out, first
end

-- Sums over the global batch: every number of t (nested too) summed over the ranks.
function Session:sum(t) return self.world:sum(t) end

-- The samples this rank trains on: those it generated (S:score marks them with .rank), else
-- its share of the list.
function Session:local_samples(samples)
  local w = self.world
  if w.size == 1 then return samples end
  if samples[1] and samples[1].rank then
    local out = {}
    for _, s in ipairs(samples) do if s.rank == w.rank then out[#out + 1] = s end end
    return out
  end
  return (self:shard(samples))
end

-- The next backward is the step's last: every optimizer's gradient sums start during it
-- (dist.data_parallel's buckets, mrl_dist_buckets_arm).
function Session:arm_gradient_sums()
  if self.pp_world then return end -- (pipeline parallel: the sums wait for the last stage's backwards, moonrl.train.pipeline)
  for _, o in ipairs(self.optimizers) do if o.opt.arm then o.opt:arm() end end
end

-- batch.micro_batches over this rank's samples (local_samples; opts.mine: samples are this rank's
-- already, e.g. a shard of pairs); the last one arms the gradient buckets so that their sums
-- start while its backward runs.
function Session:micro_batches(samples, max_tokens, opts)
  local mine = opts and opts.mine and samples or self:local_samples(samples)
  local it = batch.micro_batches(mine, max_tokens, opts)
  local policy = self.policy
  if policy and self.world.size > 1 and train.collective(policy) then
    -- expert parallelism, ZeRO-2 and 3 (step.collective_batches): every rank as many
    -- micro-batches, empty ones serving the others' collectives, and the gradient sums armed on
    -- the last of all (an empty batch's backward still adds to this rank's experts)
    local cit = train.collective_batches(policy, self.world, it)
    return function()
      local b, first, last, is_last = cit()
      if b and is_last then self:arm_gradient_sums() end
      return b, first, last
    end
  end
  return function()
    local b, first, last = it()
    if b and last == #mine then self:arm_gradient_sums() end
    return b, first, last
  end
end

function Session:dataset(name, view)
  put(self.datasets, name, { name = name, view = view })
  return view
end

function Session:rng(name, seed)
  return put(self.rngs, name, { name = name, rng = rng_mod.new(seed) }).rng
end

-- fn() the first time; its value (JSON-able) is saved in checkpoints and read back on resume.
function Session:memo(key, fn)
  local v = self.memos[key]
  if v == nil then
    v = fn()
    self.memos[key] = v
  end
  return v
end

-- The parts of the state that are small and change every step: data positions, generators,
-- the guards, counters, extra state, memos (a deep copy, as JSON text).
-- Data positions and generators ({ data = {...}, rngs = {...} }): what a batch moves on.
function Session:positions()
  local data, rngs = json.object(), json.object()
  for _, d in ipairs(self.datasets) do data[d.name] = d.view:state() end
  for _, r in ipairs(self.rngs) do rngs[r.name] = r.rng.state end
  return json.object({ 'data', data, 'rngs', rngs })
end

-- Put back positions() (either part may be absent).
function Session:restore_positions(p)
  for _, d in ipairs(self.datasets) do
    if p.data and p.data[d.name] then d.view:restore(p.data[d.name]) end
  end
  for _, r in ipairs(self.rngs) do
    if p.rngs and p.rngs[r.name] then r.rng.state = p.rngs[r.name] end
  end
end

function Session:small_state()
  local pos = self:positions()
  return json.encode(json.object({ 'data', pos.data, 'rngs', pos.rngs, 'extra', self.extra, 'memo', self.memos,
    'guard', self.guard:state(), 'lr_scale', self.lr_scale, 'rollbacks', self.rollbacks, 'skips', self.skips,
    'skips_in_row', self.skips_in_row }))
end

-- Put back a table of small_state()'s fields (state.json holds them); keep_data: leave the data
-- positions and generators as they are.
function Session:restore_small(s, keep_data)
  if not keep_data then self:restore_positions(s) end
  self.extra = s.extra or {}
  for k, v in pairs(s.memo or {}) do self.memos[k] = v end
  self.guard:restore(s.guard)
  self.lr_scale, self.rollbacks, self.skips = s.lr_scale or 1, s.rollbacks or 0, s.skips or 0
  self.skips_in_row = s.skips_in_row or 0
end

-- ---- checkpoints ----------------------------------------------------------------------------

local function opt_steps(self)
  local t = {}
  for i, o in ipairs(self.optimizers) do t[i] = o.opt:steps() end
  return t
end

-- Write a checkpoint of the state now (or, with small = the text of small_state() and step, of
-- an earlier step whose models and optimizers are still those of now). Returns the path, or nil
-- when the write failed and run.checkpoint_errors is 'warn'.
function Session:checkpoint(reason, small, step, phase_step)
  step = step or self.global_step
  local state = json.decode(small or self:small_state(), 'state')
  state.format, state.step, state.phase, state.phase_step = ckpt.VERSION, step, self.loop_phase or json.null, phase_step or self.step
  local done = json.array()
  for p in pairs(self.phases_done) do done[#done + 1] = p end
  table.sort(done)
  state.phases_done, state.metrics_bytes, state.metrics_lines, state.reason = done, self.run:metrics_bytes(),
    self.run.metrics_lines, reason
  local v = moonrl.version()
  local inputs = json.object()
  for k, p in pairs(self.inputs) do inputs[k] = ckpt.input_identity(p) end
  for _, d in ipairs(self.datasets) do inputs['data.' .. d.name] = ckpt.input_identity(d.view.src and d.view.src.path) end
  local run_info = json.object({ 'recipe', self.name, 'moonrl', v.version, 'git', v.git, 'threads', v.threads,
    'config', self.cfg, 'inputs', inputs })
  local t0 = moonrl.now()
  local name = ckpt.dir_name(step)
  moonrl.C.mrl_heartbeat('checkpoint ' .. name)
  self.status:phase('checkpoint')
  local w = self.grad_world or self.world -- (context parallel: its ranks hold the same model)
  -- ZeRO-1 (moonrl.train.dist): each rank's optimizer state is its shard, which it writes itself
  -- into the checkpoint (nothing is gathered); plain data parallel: rank 0 writes the whole state
  local sharded = #self.optimizers > 0 and self.optimizers[1].opt.sharded or false
  if w.size > 1 then run_info.world_size = w.size end
  local ok, path, bytes = true, nil, nil
  if w.rank == 0 or sharded then
    fault.arm_checkpoint(step)
    ok, path, bytes = pcall(ckpt.write, self.ckpt_root, name, { models = self.models, optimizers = self.optimizers,
      state = state, run = run_info, max_shard_bytes = self:max_shard_bytes(), world = sharded and w or nil,
      sharded = sharded, tp = self.mp_world and { world = self.mp_world, rank = self.mp_world.rank, all = self.mesh_world } })
    fault.disarm()
  end
  if w.size > 1 then -- every rank learns how it went
    local msg = w:broadcast_string(w.rank ~= 0 and '' or ok and string.format('ok\n%d\n%s', bytes, path)
      or ('error\n' .. moonrl.error_text(path)))
    local kind, rest = msg:match('^(%a+)\n(.*)$')
    ok = kind == 'ok'
    if ok then bytes, path = rest:match('^(%d+)\n(.*)$'); bytes = tonumber(bytes) else path = rest end
  end
  if not ok then
    local why = moonrl.error_text(path)
    local msg = string.format('checkpoint %s/%s failed: %s', self.ckpt_root, name, why)
    self.failed_ckpt_step = step -- not tried again for this step (at the end, or when ending on the error)
    pcall(self.run.event, self.run, 'checkpoint_failed', { step = step, message = why }, { quiet = true })
    if w.rank == 0 and not self.tp_follower then pcall(fs.remove, self.ckpt_root .. '/.tmp-' .. name) end -- the space back; the older ones are intact
    if self.cfg.run.checkpoint_errors ~= 'warn' then moonrl.run_error(msg .. ' (the previous checkpoints are intact)') end
    moonrl.log('warn', '%s; going on (run.checkpoint_errors=warn), the previous checkpoints are intact', msg)
    return nil
  end
  self.status:phase(nil)
  if w.rank == 0 and not self.tp_follower then pcall(ckpt.prune, self.ckpt_root, self.cfg.run.keep_checkpoints) end
  local secs = moonrl.now() - t0
  self.last_ckpt_step, self.last_ckpt_time = step, moonrl.now()
  self.run:event('checkpoint', { step = step, path = path, bytes = bytes, seconds = secs, reason = reason }, { quiet = true })
  self.last_checkpoint = { path = path, bytes = bytes, seconds = secs }
  return path
end

-- Load a checkpoint into the registered models, optimizers and state. opts.keep_data: leave
-- the data positions and generators as they are now (a rollback that skips the batches);
-- opts.models_only; opts.optimizers = false: leave the optimizers as they are.
function Session:restore(dir, state, opts)
  opts = opts or {}
  -- the data positions against the datasets of this run (now declared), before anything is loaded
  local why = not opts.models_only and not opts.keep_data and ckpt.check_positions(state, self.datasets)
  if why then moonrl.usage_error(string.format('cannot resume from %s: %s', dir, why)) end
  for i, m in ipairs(self.models) do ckpt.load_model(dir, m.name, m.model, i == 1) end
  if self.engine_copy then self.engine_copy.refresh() end -- (a sharded policy's: the engine's copy of it)
  if self.engine_sync then self.engine_sync() end -- (a pipeline's: the engine's slices)
  if opts.models_only then return end
  if opts.optimizers ~= false then
    for _, o in ipairs(self.optimizers) do ckpt.load_optimizer(dir, o.name, o.opt) end
  end
  self:restore_small(state, opts.keep_data)
  self.global_step, self.step = state.step, state.phase_step
  self.phases_done = {}
  for _, p in ipairs(state.phases_done or {}) do self.phases_done[p] = true end
  self.last_ckpt_step, self.last_ckpt_time = state.step, moonrl.now()
end

-- ---- the loop -----------------------------------------------------------------------------

local function contains(list, x)
  for _, v in ipairs(list or {}) do if v == x then return true end end
  return false
end

-- Steps 1..total of a phase (a recipe with one loop needs no phase name). The loop of the
-- checkpoint's phase restores everything; a phase the checkpoint had finished is skipped, its
-- models restored at once (what the recipe does between phases sees the trained weights); a
-- phase after the checkpoint's finished one starts at its step 1 from the checkpoint's weights,
-- data and extra state, with the optimizers the recipe made for it.
local function phase_steps(self, total, phase)
  phase = phase or 'main'
  total = total or self.run.total
  local r = self.resume
  if r and contains(r.state.phases_done, phase) then
    self:restore(r.dir, r.state, { models_only = true })
    self.phases_done[phase] = true
    return function() return nil end
  end
  self.loop_phase, self.step, self.run.total = phase, 0, total
  -- what the run is made from, now that its models and data are declared (moonrl.train.manifest)
  if self.world.rank == 0 and not self.run.silent and self.role ~= 'rollout' then require('moonrl.train.manifest').write(self) end
  if r then
    if r.state.phase == phase then
      self:restore(r.dir, r.state)
    elseif contains(r.state.phases_done, r.state.phase) then
      self:restore(r.dir, r.state, { optimizers = false })
      self.step = 0
    else
      error(string.format("the checkpoint %s is in phase '%s', but this recipe's loop is in phase '%s'", r.dir,
        tostring(r.state.phase), phase), 2)
    end
    self.resume = nil
  end
  -- the loop's progress on rank 0's terminal (moonrl.io.progress), its rate and ETA in the heartbeat
  local p = progress.new(phase == 'main' and self.name or phase, total, { start = self.step, silent = self.run.silent })
  self.progress, self.last_loss = p, nil
  self.status:set({ loop = phase, loop_since = progress.wall(), total = total, step = self.step,
    global_step = self.global_step })
  self.status:write(true)
  return function()
    if self.in_step then self:end_step() end
    if self.pending_rollback then self:rollback() end
    p:update(self.step)
    if self.step >= total then
      self.phases_done[phase] = true
      p:finish()
      self.status:set({ step = self.step, phase = false, eta = false })
      self.status:write(true)
      return nil
    end
    self.step, self.global_step = self.step + 1, self.global_step + 1
    self.status:set({ step = self.step, global_step = self.global_step, phase = false, rate = p:rate() or false,
      eta = p:eta() or false, loss = self.last_loss or false })
    self.status:write()
    self.run.step = self.global_step
    self.world:set_step(self.global_step)
    if self.link then self.link:set_step(self.global_step) end
    self.step_start = { small = self:small_state(), opt_steps = opt_steps(self) }
    self.in_step = true
    moonrl.C.mrl_heartbeat(string.format('step %d phase %s begin', self.global_step, phase))
    fault.point(self.global_step, 'step')
    return self.step
  end
end

-- The rollouts of this run (moonrl.train.rollout): fn(step) -> samples, info makes batch `step`;
-- where and when it runs is the config's (async.*, dist.rollout_ranks). opts.engine: the engine it
-- generates with (default S.engine).
function Session:rollout(fn, opts)
  self.rollouts = rollout.new(self, fn, opts)
  return self.rollouts
end

-- This step's batch (samples, info), however the rollouts made it.
function Session:next_batch()
  if not self.rollouts then error('S:next_batch: declare the rollout first (S:rollout(fn))', 2) end
  return self.rollouts:next_batch()
end

-- The loop. On a rollout rank (dist.rollout_ranks) it runs the rollouts of every step for the
-- trainers and yields nothing: the recipe's loop body is the trainers' part.
function Session:steps(total, phase)
  local it = phase_steps(self, total, phase) -- restores a checkpoint on every rank
  -- the rollout ranks start the phase from the trainers' weights (those of an earlier phase,
  -- or of the checkpoint)
  if self.rollouts then self.rollouts:begin() end
  if self.role ~= 'rollout' then return it end
  if self.rollouts then self.rollouts:serve(total or self.run.total) end
  return function() return nil end -- a phase without a rollout: the trainers' alone
end

-- The end of a step: with a rollout, the batches asked for and the weights published (and the
-- stop decided with the rollout ranks), then the checkpoint and stop checks.
function Session:end_step()
  self.decided_stop = self.rollouts and self.rollouts:after_update()
  self.in_step = false
  fault.point(self.global_step, 'end')
  moonrl.C.mrl_heartbeat(string.format('step %d end', self.global_step))
  if self.pending_rollback then return end
  local w = self.mesh_world or self.world -- (tensor or context parallel: every rank of the mesh stops together)
  local stop = self.decided_stop -- made already, with the rollout ranks (moonrl.train.rollout)
  self.decided_stop = nil
  if stop == nil then
    stop = moonrl.stop_requested()
    if w.size > 1 and w:any(stop) ~= stop then -- a signal that reached some ranks stops them all
      moonrl.C.mrl_request_stop(-2, 'a stop requested on another rank')
      stop = true
    end
  end
  if stop then self:stop() end
  local c = self.cfg.run
  local now = moonrl.now()
  local every = c.checkpoint_every > 0 and self.global_step % c.checkpoint_every == 0
  local minutes = c.checkpoint_minutes > 0 and now - self.last_ckpt_time >= 60 * c.checkpoint_minutes
  if w.size > 1 then minutes = w:any(minutes) end
  if every or minutes then self:checkpoint(every and 'every' or 'minutes') end
end

-- Log the step's metrics (run:log) with the guards' counters.
function Session:log(m, opts)
  m = m or {}
  m.guard = m.guard or {}
  m.guard.skipped = m.guard.skipped or 0
  m.guard.rollback = m.guard.rollback or 0
  if self.lr_scale ~= 1 then m.guard.lr_scale = self.lr_scale end
  if self.world.size > 1 and self.optimizers[1] and self.optimizers[1].opt.overlapped then
    local o = self.optimizers[1].opt
    m.dist = m.dist or { buckets = o.buckets and tonumber(moonrl.C.mrl_dist_buckets_count(o.buckets)) or 0,
      buckets_overlapped = o.overlapped }
    if (o.zero or 0) >= 2 then -- ZeRO-2 and 3: what this rank moved since the last step's line (MB, 10^6 bytes)
      local sent, gathered = o:traffic()
      m.dist.reduce_scatter_mb, m.dist.gather_mb = sent / 1e6, gathered / 1e6
      -- and the most the backward's gradient windows held at once (MiB), given back at the step
      m.memory = m.memory or {}
      m.memory.grads_windows_peak_mb = tonumber(moonrl.C.mrl_dist_grad_shard_window_peak(o.grad_shard)) / 2 ^ 20
    end
  end
  if self.policy and self.policy:shard() then -- where a sharded policy's memory goes (MiB)
    local _, cnt = self.policy:shard()
    local peak = ffi.new('int64_t[1]')
    moonrl.C.mrl_model_gathered_bytes(self.policy.handle, peak)
    m.memory = m.memory or {}
    m.memory.params_shard_mb = 4 * cnt / 2 ^ 20
    m.memory.params_gathered_peak_mb = tonumber(peak[0]) / 2 ^ 20
  end
  if self.engine_copy then -- (a sharded policy's whole copy, or LoRA's merged one)
    m.memory = m.memory or {}
    m.memory.engine_copy_mb = self.engine_copy.bytes() / 2 ^ 20
  end
  local p = self.progress
  if p and not (opts and opts.quiet) then p:clear() end -- the step line prints above the live line
  -- every trainer rank logs each step (the recipe's loop is the same on each), so the largest
  -- rank's resident peak is a collective here, as the stop decision is in end_step
  local w = self.world
  local rank_max = w.size > 1 and function(x) return w:max(x) end or nil
  local flat = self.run:log(self.step, m, { quiet = opts and opts.quiet, rank_max = rank_max })
  if p then
    local extra = {}
    for _, kv in ipairs({ { 'loss', 'loss' }, { 'reward/mean', 'reward' }, { 'accuracy', 'acc' } }) do
      if type(flat[kv[1]]) == 'number' then extra[#extra + 1] = string.format('%s %.4g', kv[2], flat[kv[1]]) end
    end
    p:update(self.step, table.concat(extra, ' '), true)
  end
  return flat
end

function Session:phase(name, fn, ...) return self.run:phase(name, fn, ...) end

function Session:event(kind, fields, opts)
  fields = fields or {}
  if fields.step == nil then fields.step = self.global_step end
  self.run:event(kind, fields, opts)
end

-- A frozen copy of the initial policy (a KL reference). Before the loop: a resumed run restores
-- its checkpoint when the loop starts, so the copy is of the initial weights, as in the first run.
-- (a sharded policy's: the initial model loaded whole from model.dir: no rank holds the policy whole)
function Session:reference()
  local ref
  -- LoRA: the policy's base is the initial policy (its adapters start at B = 0): the reference is
  -- the policy with its adapters off for the forward, no copy of the weights
  if self.policy:lora() then
    self:event('reference', { what = 'the policy with its LoRA adapters off (no copy)' }, { quiet = true })
    return models.base_view(self.policy)
  end
  if self.policy.pp and not self.policy:shard() then return models.clone(self.policy, { tag = 1 }) end -- (its stage's copy)
  if self.policy.pp then -- a sharded stage (ZeRO-3): its stage of the initial model, whole
    ref = models.load(self.cfg.model.dir, { tp = self.tp_world, pp = models.stage_of(self.policy, 1) })
    ref:set_dtype(self.policy:dtype())
    if self.policy:device() ~= 'cpu' then ref:to_device(self.policy:device()) end
    return models.split_like(ref, self.policy)
  end
  if self.tp_world then -- tensor parallel: its slices of the initial model
    ref = models.load(self.cfg.model.dir, { tp = self.tp_world })
    ref:set_dtype(self.policy:dtype())
    ref = models.split_like(ref, self.policy)
  elseif not self.policy:shard() then
    ref = models.clone(self.policy)
  else
    ref = models.load(self.cfg.model.dir)
    ref:set_dtype(self.policy:dtype())
    ref:to_device(self.policy:device())
    ref = models.split_like(ref, self.policy) -- (context parallel: computed as the policy is)
  end
  -- expert parallelism: the reference's experts split as the policy's, so that its log-probs are
  -- the policy's bits before an update (a KL of exactly 0, not rounding noise Adam would amplify);
  -- its forwards are then collectives too (train.serve_experts' refs)
  if self.policy.expert_range and select(3, self.policy:expert_range()) then ref:set_expert_parallel(self.world) end
  return ref
end

-- The learning rate of this step (the schedule; the guards' rollback factor is applied by update).
function Session:lr() return self.lr_at(self.step) end

-- ---- the end ------------------------------------------------------------------------------

-- run.max_shard_gb in bytes (at least 1: a tiny limit is one tensor a shard, never "no limit").
function Session:max_shard_bytes() return math.max(1, math.floor(self.cfg.run.max_shard_gb * 1e9)) end

-- Save the models where a finished run keeps them: the policy in RUN_DIR/model, others in
-- RUN_DIR/<name>. A failure is an error: a run never ends well without its model.
function Session:save_models()
  local out = {}
  local w = self.grad_world or self.world
  if w.size > 1 then -- rank 0 saves; every rank learns how it went
    local ok, err = true, nil
    -- a sharded model: every rank gathers it with rank 0, which writes it (m:save)
    for i, m in ipairs(self.models) do
      if m.model:shard() and ok then
        if not guard_mod.finite(dist.sharded_sum(m.model)) then
          ok, err = false, string.format('the %s has parameters that are not finite: not saving it', m.name)
        else
          ok, err = pcall(ckpt.save_model, m.model, self.dir .. '/' .. (i == 1 and 'model' or m.name),
            w.rank == 0 and m.tokenizer_dir or nil, self:max_shard_bytes())
        end
      end
    end
    if w.rank == 0 and ok then ok, err = pcall(self.save_models, setmetatable({ world = dist.SOLO, grad_world = false }, { __index = self })) end
    local msg = w:broadcast_string(ok and '' or ('error\n' .. moonrl.error_text(err)))
    if msg ~= '' then
      if w.rank == 0 then error(err, 0) end
      moonrl.run_error('rank 0 could not save the model: ' .. msg:sub(7))
    end
    for i, m in ipairs(self.models) do out[m.name] = self.dir .. '/' .. (i == 1 and 'model' or m.name) end
    return out
  end
  for i, m in ipairs(self.models) do
    local dir = self.dir .. '/' .. (i == 1 and 'model' or m.name)
    if not m.model:shard() then -- (a sharded one: saved by every rank above)
      local p, n = m.model:trainable() -- (summed where it lives: ops.sum works on a GPU's too)
      if not guard_mod.finite(require('moonrl.train.ops').sum(p, n)) then
        error(string.format('the %s has parameters that are not finite: not saving it to %s', m.name, dir), 0)
      end
      local ok, err = pcall(progress.task, 'saving the ' .. m.name .. ' to ' .. dir, function()
        -- (tensor parallel: every slot gathers, slot 0 writes; the tokenizer's files are its)
        ckpt.save_model(m.model, dir, not self.tp_follower and m.tokenizer_dir or nil, self:max_shard_bytes())
        if i == 1 and m.model:lora() and self.cfg.model.lora.save_merged then -- and the adapters merged in
          models.save({ dir = self.dir }, models.merged(m.model), m.tokenizer_dir, self.dir .. '/model_merged',
            self:max_shard_bytes())
          out.merged = self.dir .. '/model_merged'
        end
      end)
      if not ok then moonrl.run_error(string.format('cannot save the %s to %s: %s', m.name, dir, moonrl.error_text(err))) end
    end
    out[m.name] = dir
  end
  return out
end

-- state: what the heartbeat file says at the end (finished, stopped, error), message: why.
-- state, message: what the heartbeat file says (moonrl status); opts.job: the job's
-- communicator when every rank closes together (a clean end: one timeline, Run:finish).
function Session:close(state, message, opts)
  self.closed = true
  if self.engine and self.engine.remote then pcall(self.engine.close, self.engine) end -- (its launched servers stop)
  if self.progress then self.progress:cancel() end
  self.status:set({ state = state or 'finished', message = message or false, phase = false, eta = false })
  self.status:write(true)
  self.run:finish(opts)
end

-- A clean stop at a safe point: checkpoint, save the model, close, and raise the stop.
function Session:stop()
  if self.global_step > self.last_ckpt_step then self:checkpoint('stop') end
  if self.cfg.save ~= false then self:save_models() end
  self:event('stop', { reason = moonrl.C.mrl_stop_requested() ~= 0 and ffi.string(moonrl.C.mrl_stop_reason()) or '?' },
    { quiet = true })
  if self.progress then self.progress:cancel() end
  print(string.format('stopped at step %d; resume with run.dir=%s (run.resume=auto)', self.global_step, self.dir))
  self:close('stopped', moonrl.C.mrl_stop_requested() ~= 0 and ffi.string(moonrl.C.mrl_stop_reason()) or nil)
  moonrl.check_stop()
end

-- The end of the run: the last checkpoint, the models saved (opts.save, default cfg.save), and
-- the line that says where everything is. A rollout rank keeps nothing: trainer rank 0 writes
-- the checkpoints and the models. Returns the table of saved model directories, by model name.
function Session:finish(opts)
  local dirs = self.role == 'rollout' and self:close_rollouts() or self:save_end(opts)
  local where = {}
  for i, m in ipairs(self.models) do
    if dirs[m.name] then where[#where + 1] = (i == 1 and 'model' or m.name) .. ' in ' .. dirs[m.name] end
  end
  print('run directory: ' .. self.dir .. ' (metrics.jsonl, events.jsonl, tb/, trace.json, checkpoints/' ..
    (#where > 0 and '; ' .. table.concat(where, ', ') or '') .. ')')
  return dirs
end

-- A rollout rank's end, with the trainers at their clean end (the phase done, not a stop): one
-- timeline together. Returns where trainer rank 0 saved the models.
function Session:close_rollouts()
  self:close('finished', nil, not self.rollouts.rollout_stopped and { job = dist.current() } or nil)
  local dirs = {}
  for i, m in ipairs(self.models) do dirs[m.name] = self.dir .. '/' .. (i == 1 and 'model' or m.name) end
  return dirs
end

-- A trainer's end: the last checkpoint, the models saved.
function Session:save_end(opts)
  opts = opts or {}
  if (self.global_step > self.last_ckpt_step or #ckpt.list(self.ckpt_root) == 0) and self.failed_ckpt_step ~= self.global_step then
    self:checkpoint('end')
  end
  local save = opts.save
  if save == nil then save = self.cfg.save ~= false end
  local dirs = save and self:save_models() or {}
  self:event('finish', { step = self.global_step }, { quiet = true })
  self:close('finished', nil, { job = dist.current() })
  return dirs
end

-- The recipe ended without S:finish() (ok), or an error or stop escaped it: save what is
-- consistent, record why, close the files.
function Session:abort(ok_exit, err)
  if self.closed then return end
  if self.world.size > 1 then
    -- a rank cannot checkpoint alone (the others are elsewhere: a collective would wait for
    -- them); the job restarts from the last checkpoint the ranks wrote together
    local message = not ok_exit and tostring(type(err) == 'table' and (err.reason or err.message) or err) or nil
    if not ok_exit then pcall(self.event, self, 'error', { message = message }, { quiet = true }) end
    pcall(self.close, self, ok_exit and 'finished' or moonrl.is_stop_request(err) and 'stopped' or 'error', message)
    return
  end
  local is_stop = moonrl.is_stop_request(err)
  if self.progress then self.progress:cancel() end -- the messages to come print on a clean line
  local saved = true
  local ok, perr = pcall(function()
    if self.in_step then
      local same = true
      for i, n in ipairs(opt_steps(self)) do if n ~= self.step_start.opt_steps[i] then same = false end end
      if same and self.global_step - 1 > self.last_ckpt_step then
        -- nothing of this step touched the weights: the state at its start is the previous step's
        self:checkpoint(is_stop and 'stop' or 'error', self.step_start.small, self.global_step - 1, self.step - 1)
      elseif not same then
        saved = false
        self:event('unsaved', { message = string.format('step %d ended after its update: the state since the ' ..
          'checkpoint of step %d is lost', self.global_step, self.last_ckpt_step) }, { quiet = true })
      end
    elseif self.global_step > self.last_ckpt_step and self.failed_ckpt_step ~= self.global_step then
      self:checkpoint(is_stop and 'stop' or 'error')
    end
    if is_stop and saved and self.cfg.save ~= false then self:save_models() end
  end)
  if not ok then moonrl.log('error', 'while saving after %s: %s', is_stop and 'the stop' or 'the error', moonrl.error_text(perr)) end
  local message
  if not ok_exit then
    message = tostring(type(err) == 'table' and (err.reason or err.message) or err)
    pcall(self.event, self, is_stop and 'stop' or 'error', { message = message }, { quiet = true })
  end
  pcall(self.close, self, ok_exit and 'finished' or is_stop and 'stopped' or 'error', message)
end

return M
