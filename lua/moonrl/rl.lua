-- moonrl.rl: the RL loop as a library. A recipe is a table of stages; the library runs them every
-- step and gives every recipe the rest: the run directory, checkpoints and resume, the guards,
-- data-parallel ranks, rollout ranks and async rollouts (moonrl.train.session, moonrl.train.rollout), the
-- config sections every RL recipe shares, start-up checks, held-out evaluation and the step line.
--
--   local rl = require('moonrl.rl')
--   local grpo = rl.recipe { name = 'grpo', config = { grpo = { steps = 100, ... } } }
--   return grpo:main()                   -- runs it (or hands it to rl.extend, see below)
--
--   -- examples/rloo.lua: another recipe extending it, overriding one stage
--   local rloo = rl.extend('grpo', { name = 'rloo', config = { grpo = { loss = 'reinforce' } } })
--   function rloo:advantages(samples, info) ... end
--   return rloo:main()
--
-- The loop (Recipe:main):
--   cfg <- moonrl.config(recipe.config)   the recipe's config (its parents' merged under it)
--   self:check()                          registries and keys checked, before any work
--   S <- moonrl.train.session.start(...) model, engine, data, session; self:setup()
--   S:rollout(self:rollout)               where and when rollouts run: async.*, dist.rollout_ranks
--   for step in S:steps() do              resumes, checkpoints at the step's end, stops, rolls back
--     samples, info <- S:next_batch()
--     self:train_step(step, samples, info)   advantages -> update -> metrics -> evaluate -> log
--   end
--   return self:finish()
--
-- Stages: methods of the recipe, each overridable (self.cfg: the config, self.c: the recipe's
-- section cfg[self.section], self.S: the session, self.group: samples per prompt, self.ref:
-- the frozen reference policy when <section>.kl_coef > 0, self.sampling: the engine's options):
--   setup()                               after the session starts, before the loop (critics ...)
--   rollout(step) -> samples, info        prompts -> generate -> score (here, ahead or on rollout
--                                         ranks: it must only use what it is given and self)
--   prompts(step) -> records              <section>.prompts records: data.path or data.task
--   generate(records, seed_step) -> samples   self.group completions each, flattened (batch.flatten)
--   score(samples) -> samples, metrics    the reward (reward=NAME); a failing reward drops its group
--   train_step(step, samples, info) -> flat metrics   the stages below, in order
--   advantages(samples, info)             s.adv (or s.adv_tokens) of each sample: the estimator
--                                         named by <section>.advantage (moonrl.algo.estimators)
--   update(samples, info) -> m            <section>.epochs passes of train.policy_step with the loss
--                                         named by <section>.loss (moonrl.algo.losses)
--   policy_options(samples, epoch) -> o   the options of one train.policy_step
--   metrics(m, samples, info)             reward, accuracy, lengths, data, async, throughput
--   evaluate(step) -> m | nil             every eval.every steps: held-out accuracy (eval.*)
--   log(m) -> flat                        the step line and metrics.jsonl
--   finish() -> result                    the last checkpoint, the model saved
-- Checkpoints are the session's: at the end of a step (run.checkpoint_every, on a stop); state a
-- recipe keeps across steps goes in self.S.extra (JSON), and is then saved and restored too.
local moonrl = require('moonrl')
local algo = require('moonrl.algo')
local config = require('moonrl.config')
local batch = require('moonrl.batch')
local metrics = require('moonrl.train.metrics')
local prompts = require('moonrl.train.prompts')
local sections = require('moonrl.train.sections')
local session = require('moonrl.train.session')
local train = require('moonrl.train.step')
local E = require('moonrl.train.evaluation')
local models = require('moonrl.train.models')
local episodes = require('moonrl.train.episodes')
local agents = require('moonrl.train.agents')
local trace = require('moonrl.train.trace')

local M = {}
-- Two kinds of recipe on one base: RL recipes (rl.recipe: rollouts, advantages, a policy update)
-- and supervised ones (rl.supervised: SFT, DPO, batches from a dataset). The base gives both the
-- config merged over their kind's sections, aliases, the start-up checks, evaluation and the end.
local Base = {}
Base.__index = Base
M.Base = Base
local Recipe = setmetatable({}, { __index = Base })
Recipe.__index = Recipe
M.Recipe = Recipe
local Supervised = setmetatable({}, { __index = Base })
Supervised.__index = Supervised
M.Supervised = Supervised

-- ---- config: a recipe's merged over its parent's ---------------------------------------------

M.base_config = sections.rl_config

-- In a recipe's config: a key or section of its parent's (or of base_config) that this recipe has
-- not: `model = { dir = rl.NONE }` for a recipe that builds its own model.
M.NONE = setmetatable({}, { __tostring = function() return 'rl.NONE' end })

local is_slot = config.is_slot
local function is_section(v) return type(v) == 'table' and not is_slot(v) and next(v) ~= nil and #v == 0 end

-- A deep copy of over merged onto base: sections merge key by key, other values replace (a plain
-- number over a typed default keeps its type and range: config.over), rl.NONE removes.
function M.merge(base, over)
  local out = {}
  for k, v in pairs(base or {}) do out[k] = is_section(v) and M.merge(v, {}) or v end
  for k, v in pairs(over or {}) do
    local b = out[k]
    if v == M.NONE then out[k] = nil
    elseif is_section(v) and is_section(b) then out[k] = M.merge(b, v)
    else out[k] = config.over(b, v) end
  end
  return out
end

-- ---- aliases: the old names of renamed keys -------------------------------------------------

local leaf = config.get_path

-- aliases = { ['grpo.eval_every'] = 'eval.every', ... }: each old key is declared (optional, of its
-- target's type, so that --show-config lists it) and, when given, sets its target.
local function declare_aliases(cfg, aliases)
  for old, target in pairs(aliases or {}) do
    local v = leaf(cfg, target)
    if v == nil then error(string.format("rl: the alias '%s' names '%s', which the config has not", old, target), 3) end
    local typ = is_slot(v) and v.type or type(v)
    config.set_path(cfg, old, config.optional(typ, 'the old name of ' .. target, is_slot(v) and v.range or nil))
  end
end

local function resolve_aliases(cfg, aliases)
  for old, target in pairs(aliases or {}) do
    local v = leaf(cfg, old)
    if v ~= nil then config.set_path(cfg, target, v) end
  end
end

-- ---- recipes ---------------------------------------------------------------------------------

-- def: name (the run's and checkpoints' recipe name), section (the config section of the
-- algorithm, default name), config (merged over base_config), phase (the loop's phase name in
-- checkpoints, default 'main'), aliases (old key -> its new name: the old one keeps working),
-- own_heldout (true: its eval_records has a held-out split without eval.data / eval.task), and
-- stage functions.
local function define(class, base_config, def, section)
  local self = setmetatable({}, class)
  for k, v in pairs(def) do self[k] = v end
  self.section = def.section or section
  self.config = M.merge(base_config(), def.config)
  -- an RL recipe's section: its steps, prompts, samples ... get their types and ranges
  if class == Recipe then sections.typed_algorithm(self.config[self.section]) end
  declare_aliases(self.config, def.aliases)
  return self
end

function M.recipe(def) return define(Recipe, M.base_config, def, def.name) end

-- A supervised recipe (see "Supervised recipes" below): section defaults to 'train' (its steps
-- are train.steps), its config is merged over sections.supervised_config().
function M.supervised(def) return define(Supervised, sections.supervised_config, def, 'train') end

-- Whether r is a recipe (of either kind, or extending one).
function M.is_recipe(r) return type(r) == 'table' and (r.main == Recipe.main or r.main == Supervised.main) end

local loading = 0

local function find(name)
  local fs = require('moonrl.io.fs')
  for _, p in ipairs({ name, moonrl.home .. '/recipes/' .. name, moonrl.home .. '/recipes/' .. name .. '.lua' }) do
    if fs.exists(p) and not fs.stat(p).is_dir then return p end
  end
  error(string.format("rl.extend: recipe '%s' not found (no such file, and no recipes/%s.lua)", name, name), 3)
end

-- The recipe a file defines, without running it (its `return X:main()` returns X while loading).
function M.load(name)
  local path = find(name)
  loading = loading + 1
  local ok, r = pcall(dofile, path)
  loading = loading - 1
  if not ok then error(r, 0) end
  if not M.is_recipe(r) then
    error(path .. ' is not a moonrl.rl recipe (it must end with `return recipe:main()`)', 2)
  end
  return r
end

-- A recipe that extends parent (a recipe, or a recipe's name or path: 'grpo'): it has the
-- parent's stages (override any; R.parent is the parent, to call its version: R the recipe the
-- stage belongs to, never self, whose parent is R itself when a recipe extends R) and its config
-- with def.config merged over it; def.name (default the parent's), def.section likewise.
function M.extend(parent, def)
  if type(parent) == 'string' then parent = M.load(parent) end
  def = def or {}
  local self = setmetatable({}, { __index = parent })
  for k, v in pairs(def) do self[k] = v end
  self.parent, self.name, self.section = parent, def.name or parent.name, def.section or parent.section
  self.config = M.merge(parent.config, def.config)
  if self.main == Recipe.main then sections.typed_algorithm(self.config[self.section]) end -- (keys it adds too)
  local aliases = {}
  for k, v in pairs(parent.aliases or {}) do aliases[k] = v end
  for k, v in pairs(def.aliases or {}) do aliases[k] = v end
  self.aliases = aliases
  declare_aliases(self.config, def.aliases)
  return self
end

-- The config of this run: the recipe's (its parents' merged under it) with the command line's
-- overrides, old key names resolved; self.cfg, and self.c its section.
function Base:configure()
  local cfg = moonrl.config(self.config)
  resolve_aliases(cfg, self.aliases)
  self.cfg, self.c = cfg, cfg[self.section]
  if type(self.c) ~= 'table' then error(string.format("recipe '%s': its config has no section '%s'", self.name,
    self.section), 0) end
  return cfg
end

-- The checks every recipe's config gets before any work: data.path or data.task, the held-out
-- set (own: the recipe has one of its own), the reward's name.
function Base:check_sections(own)
  local cfg = self.cfg
  sections.check_data(cfg)
  E.check(cfg, { own = own })
  if not (cfg.reward_model and cfg.reward_model.dir) then sections.check_reward(cfg) end
  local key, count, tokens = self:batch_size()
  if key then sections.check_batch_memory(key, count, tokens) end
end

-- The config keys a resumed run may change beside the session's: the evaluation's (and their old
-- names).
function Base:free_keys()
  local free = {}
  for i, k in ipairs(sections.EVAL_KEYS) do free[i] = k end
  for old, target in pairs(self.aliases or {}) do -- an old name is as free as its target
    for _, k in ipairs(sections.EVAL_KEYS) do if k == target then free[#free + 1] = old end end
  end
  return free
end

function Base:log(m) return self.S:log(m, { quiet = self.cfg.quiet == true }) end

-- Run the recipe (see the top); a file loaded by rl.load / rl.extend returns the recipe instead.
function Recipe:main()
  if loading > 0 then return self end
  local cfg = self:configure()
  self:check()
  self.S = session.start(cfg, self:start_options())
  self:setup_moe() -- before setup: recipes override it
  self:setup()
  local S = self.S
  S:rollout(function(step) return self:rollout(step) end, self.rollout_options)
  self.history = {}
  -- the first step's clock starts here: setup's time (a warm-up) is not the step's
  S.run.step_t0, S.run.phases = moonrl.now(), {}
  for step in S:steps(S.total, self.phase) do -- (S.total: a warm-up's loop set another total)
    local samples, info = S:next_batch() -- generated now, ahead (async.mode), or by rollout ranks
    self.history[step] = self:train_step(step, samples, info)
  end
  return self:finish()
end

-- The sequences a step holds, for the memory check of the counts (Base:check_sections): the
-- config key that sets them, their number (every batch in flight: async.*) and tokens each.
function Recipe:batch_size()
  local c = self.c
  if not (c.prompts and c.max_tokens) then return nil end
  return self.section .. '.prompts', c.prompts * (c.samples or 1) * (sections.lag(self.cfg) + 1), c.max_tokens
end

-- What this recipe computes for the advantage estimators beyond the scores (a critic: 'values').
Recipe.provides = {}

-- The start-up checks: every name the config gives is looked up in its registry now, so a typo is
-- one line and exit 2 before the model loads.
function Recipe:check()
  local c, sec = self.c, self.section
  if c.advantage ~= nil then
    local e = algo.estimators.check(c.advantage, sec .. '.advantage')
    for _, need in ipairs(e.needs) do
      if not self.provides[need] then
        moonrl.usage_error(string.format("config key '%s.advantage': the estimator '%s' needs %s, which the recipe '%s' " ..
          'does not compute (ppo has a critic)', sec, c.advantage, need, self.name))
      end
    end
  end
  if c.loss ~= nil then algo.losses.check(c.loss, sec .. '.loss') end
  if c.kl_estimator ~= nil then algo.kl_estimators.check(c.kl_estimator, sec .. '.kl_estimator') end
  if c.agg ~= nil and not algo.agg.MODES[c.agg] then
    local modes = {}
    for k in pairs(algo.agg.MODES) do modes[#modes + 1] = k end
    table.sort(modes)
    moonrl.usage_error(string.format("config key '%s.agg': unknown aggregation '%s' (known: %s)", sec, tostring(c.agg),
      table.concat(modes, ', ')))
  end
  self:check_sections(self.own_heldout)
  self.env = sections.check_env(self.cfg) -- (nil: single-turn rollouts)
end

function Recipe:start_options()
  local cfg, c = self.cfg, self.c
  local o = { name = self.name, steps = c.steps, steps_key = self.section .. '.steps', free_keys = self:free_keys(),
    check_policy = function(policy) self:check_moe(policy) end }
  if cfg.data then
    o.chat, o.fields, o.optional = cfg.data.chat, { prompt = cfg.data.prompt, answer = cfg.data.answer }, { answer = true }
    if cfg.data.task then o.data = prompts.task_records(cfg, 'train'):shuffled(cfg.run.seed) end
  end
  return o
end

-- moe.*: checked against the policy once it is loaded, before the run directory exists (session.start's
-- check_policy), then applied (the engine's routing record, the aux coefficient, expert parallelism).
function Recipe:check_moe(policy)
  local moe = self.cfg.moe or {}
  local asked = moe.routing_replay and 'routing_replay' or moe.expert_parallel and 'expert_parallel' or
    moe.aux_loss_coef ~= nil and 'aux_loss_coef'
  if asked and (policy and policy:num_moe_layers() or 0) == 0 then
    moonrl.usage_error(string.format("config key 'moe.%s': the model (%s) has no mixture-of-experts layers", asked,
      policy and policy.config.model_type or 'none'))
  end
  if moe.aux_loss_coef and moe.aux_loss_coef > 0 and policy and policy.config.model_type == 'deepseek_v3' then
    moonrl.usage_error("config key 'moe.aux_loss_coef': DeepSeek-V3's router (sigmoid scores, balanced by its "
      .. 'e_score_correction_bias) has no load-balancing loss')
  end
end

function Recipe:setup_moe()
  local S, moe = self.S, self.cfg.moe or {}
  if moe.aux_loss_coef ~= nil then S.policy:set_router_aux_coef(moe.aux_loss_coef) end
  if moe.routing_replay and S.engine then S.engine:record_routing(true) end
  if moe.expert_parallel and S.world.size > 1 and S.role ~= 'rollout' then S.policy:set_expert_parallel(S.world) end
end

function Recipe:setup()
  local S, c = self.S, self.c
  self.ref = (c.kl_coef or 0) > 0 and S:reference() or nil -- a frozen copy of the initial policy
  self.group = c.samples or 1
  self.sampling = { temperature = c.temperature, top_p = c.top_p, top_k = c.top_k, max_tokens = c.max_tokens,
    eos_ids = prompts.eos_ids(S.tok, S.policy), tokenizer = S.tok }
end

-- ---- the rollout: prompts -> generate -> score -------------------------------------------------

function Recipe:rollout(step)
  local records = self:prompts(step)
  local samples, rm = self:score(self:generate(records, step))
  return samples, { reward = rm }
end

-- Multi-turn episodes (env.name: moonrl.train.episodes) in place of single completions: one
-- sample an episode, self.group episodes a record, with the episodes' counts second.
function Recipe:episodes(records, seed_step, o)
  local S, e = self.S, self.cfg.env
  o = o or {}
  local names
  if e.tools then
    names = {}
    for n in e.tools:gmatch('[^,%s]+') do names[#names + 1] = n end
  end
  local sampling = o.sampling or self.sampling
  sampling.step = seed_step
  return episodes.run({ engine = S.engine, tok = S.tok,
    tpl = e.template == 'chat' and S.tpl or nil, env = self.env, records = records, group = o.group or self.group,
    sampling = sampling, step = seed_step, seed = self.cfg.run.seed, concurrency = e.concurrency,
    limits = { max_turns = e.max_turns, max_tokens = e.max_tokens, max_seconds = e.max_seconds,
      max_step_seconds = e.max_step_seconds },
    extension = e.extension, tools = names, tool_format = e.tool_format,
    template_vars = e.enable_thinking ~= nil and { enable_thinking = e.enable_thinking } or nil, system = self.cfg.data and self.cfg.data.system,
    span = trace.complete })
end

function Recipe:prompts(step) return self.S:prompts(self.c.prompts) end

-- seed_step: what the samples' seeds derive from (with the prompt and sample index).
-- Episodes played by agent programs (agent.command: moonrl.train.agents) against this process's
-- engine, with the episodes' counts second.
function Recipe:agent_episodes(records, seed_step, o)
  local S, a = self.S, self.cfg.agent
  o = o or {}
  local sampling = o.sampling or self.sampling
  sampling.step = seed_step
  return agents.run({ engine = S.engine, tok = S.tok, tpl = S.tpl, records = records, group = o.group or self.group,
    sampling = sampling, step = seed_step, seed = self.cfg.run.seed, command = a.command, concurrency = a.concurrency,
    workers = a.workers, max_seconds = a.max_seconds, model_name = self.name })
end

function Recipe:generate(records, seed_step)
  local S = self.S
  if self.env then return S:phase('generate', self.episodes, self, records, seed_step) end
  if self.cfg.agent and self.cfg.agent.command then return S:phase('generate', self.agent_episodes, self, records, seed_step) end
  self.sampling.step = seed_step
  local results = S:phase('generate', function() return S.engine:generate(batch.requests(records, self.group), self.sampling) end)
  return batch.flatten(records, results)
end

-- env_stats: the episodes' counts (Recipe:episodes), reported with the rewards (env/...).
function Recipe:score(samples, env_stats)
  local S = self.S
  local scores, kept, rm = S:phase('reward', S.score, S, samples, self.group, env_stats)
  for i, s in ipairs(kept) do s.score = scores[i - 1] end
  return kept, rm
end

-- ---- a step: advantages -> update -> metrics -> evaluate -> log -------------------------------

function Recipe:train_step(step, samples, info)
  self:advantages(samples, info)
  samples = M.expand_pieces(samples)
  local m = self:update(samples, info)
  self:metrics(m, samples, info)
  m.eval = self:evaluate(step)
  return self:log(m)
end

-- An episode split where the template's rendering left its tokens (env.extension=split) trains
-- as its pieces then itself, every piece with the episode's advantage and origin.
function M.expand_pieces(samples)
  local any = false
  for _, s in ipairs(samples) do if s.pieces then any = true; break end end
  if not any then return samples end
  local out = {}
  for _, s in ipairs(samples) do
    for _, p in ipairs(s.pieces or {}) do
      if s.adv_tokens then
        error('env.extension=split: an episode split in pieces needs one advantage a sample (grpo, rloo, reinforce...), ' ..
          'not one a token', 0)
      end
      local piece = {}
      for k, v in pairs(s) do piece[k] = v end
      for k, v in pairs(p) do piece[k] = v end
      piece.pieces, piece.old_logprobs = nil, nil
      out[#out + 1] = piece
    end
    out[#out + 1] = s
  end
  return out
end

-- What an advantage estimator is given besides the samples (moonrl.algo.estimators).
function Recipe:advantage_context(samples)
  return { scores = batch.scores(samples), nseq = #samples, group = self.group, cfg = self.c }
end

-- Set each sample's advantage from an estimator's result: n numbers (s.adv) or n per-token lists
-- (s.adv_tokens), scaled by s.adv_scale (async.stale=downweight); extra: more per-sample fields.
function M.set_advantages(samples, adv, extra)
  local tokens = type(adv) == 'table' and type(adv[1]) == 'table'
  local off = type(adv) == 'table' and 1 or 0
  for i, s in ipairs(samples) do
    if tokens then
      local a = adv[i]
      if s.adv_scale then for k = 1, #a do a[k] = a[k] * s.adv_scale end end
      s.adv_tokens = a
    else
      s.adv = adv[i - 1 + off] * (s.adv_scale or 1)
    end
  end
  for field, list in pairs(extra or {}) do
    for i, s in ipairs(samples) do s[field] = list[i] end
  end
end

function Recipe:advantages(samples, info)
  if self.env and self.cfg.env.credit == 'turn' then
    return M.set_advantages(samples, M.turn_advantages(samples, self.group, self.cfg.env.discount))
  end
  local estimate = algo.estimators.get(self.c.advantage or 'grpo')
  M.set_advantages(samples, estimate(samples, self:advantage_context(samples, info)))
end

-- env.credit=turn: per-turn credit over episodes. Turn k of an episode gets the discounted return
-- from it, G_k = sum over m >= k of discount^(m-k) r_m (r_m: turn m's step reward; the score of an
-- episode judged by the reward function counts at its last turn), normalised against the same turn
-- of the group's other episodes that reached it: A_k = (G_k - mean) / (std + 1e-6), as GRPO does
-- with whole episodes (0 where one episode alone reached turn k). Every token of the turn gets A_k;
-- the environment's tokens are masked anyway. Returns per-token lists (samples' order).
function M.turn_advantages(samples, group, discount)
  discount = discount or 1
  local returns = {}
  for i, s in ipairs(samples) do
    local ep = s.episode or {}
    local r = {}
    for k = 1, ep.turns or 0 do r[k] = (ep.turn_rewards or {})[k] or 0 end
    if ep.reward == nil and #r > 0 then r[#r] = r[#r] + (s.score or 0) end
    local g, acc = {}, 0
    for k = #r, 1, -1 do acc = r[k] + discount * acc; g[k] = acc end
    returns[i] = g
  end
  local out = {}
  for first = 1, #samples, group do
    local last = math.min(first + group - 1, #samples)
    local stats = {} -- turn k -> { sum, sum of squares, n }
    for i = first, last do
      for k, g in ipairs(returns[i]) do
        local st = stats[k] or { 0, 0, 0 }
        st[1], st[2], st[3] = st[1] + g, st[2] + g * g, st[3] + 1
        stats[k] = st
      end
    end
    for i = first, last do
      local s, adv_turn = samples[i], {}
      for k, g in ipairs(returns[i]) do
        local st = stats[k]
        local mean = st[1] / st[3]
        local std = math.sqrt(math.max(st[2] / st[3] - mean * mean, 0))
        adv_turn[k] = st[3] > 1 and (g - mean) / (std + 1e-6) or 0
      end
      -- the turn of each token: the episode's turn_ends (its turns' last tokens), the first turn of
      -- this sample being the episode's (#returns - #ends + 1)-th (an episode split in pieces: its last)
      local ends = (s.episode or {}).turn_ends or { #s.ids }
      local list, k = {}, #returns[i] - #ends + 1
      local j = 1
      for t = 1, #s.ids do
        while ends[j] and t > ends[j] do j, k = j + 1, k + 1 end
        local m = s.loss_mask and s.loss_mask[t] or 1
        list[t] = m == 1 and (adv_turn[k] or 0) or 0
      end
      out[i] = list
    end
  end
  return out
end

-- One epoch's step.policy_step options (the recipe's section: loss, clips, agg, KL, entropy; the
-- async section's off-policy correction, and its decoupled PPO in place of the section's loss).
function Recipe:policy_options(samples, epoch)
  local S, c, t = self.S, self.c, self.cfg.train
  local off = train.off_policy(self.cfg)
  return { session = S, model = S.policy, opt = S.opt, samples = samples, ref = self.ref,
    loss = off.decoupled and 'decoupled_ppo' or c.loss, correction = off.correction,
    behav_imp_weight_cap = off.behav_imp_weight_cap,
    measure_mismatch = epoch == 1, lr = S:lr(), temperature = c.temperature, clip_low = c.clip_low,
    clip_high = c.clip_high, agg = c.agg, norm = c.max_tokens, kl_coef = c.kl_coef, kl_estimator = c.kl_estimator,
    entropy_coef = c.entropy_coef, micro_batch_tokens = t.micro_batch_tokens, max_grad_norm = t.max_grad_norm,
    routing_replay = self.cfg.moe and self.cfg.moe.routing_replay }
end

-- On-policy with one epoch (log π_old = log πθ); else log π_old computed first. m.mismatch is the
-- first epoch's (engine vs trainer log-probs, before any update).
function Recipe:update(samples, info)
  local S, epochs = self.S, self.c.epochs or 1
  if epochs > 1 and #samples > 0 then
    local old = S:phase('old_logprobs', train.logprobs, S.policy, samples, self.cfg.train.micro_batch_tokens,
      { temperature = self.c.temperature, routing_replay = self.cfg.moe and self.cfg.moe.routing_replay, world = S.world })
    for i, s in ipairs(samples) do s.old_logprobs = old[i] end
  end
  self.update_t0 = moonrl.now()
  local m, mismatch, moe = { tokens = 0 }, nil, nil
  for epoch = 1, #samples > 0 and epochs or 0 do
    m = S:phase('train', train.policy_step, self:policy_options(samples, epoch))
    mismatch, moe = mismatch or m.mismatch, moe or m.moe
  end
  m.mismatch, m.moe = mismatch, moe -- the first epoch's: on the weights that generated the samples
  return m
end

function Recipe:metrics(m, samples, info)
  local S, rm = self.S, info.reward or {}
  m.reward, m.accuracy = metrics.reward_metrics(batch.scores(samples), #samples)
  m.reward.errors, m.reward.dropped_groups = rm.errors, rm.dropped_groups
  if rm.stats then m.reward[tostring(self.cfg.reward.name):gsub('%W', '_')] = rm.stats end -- (reward/code/executions, ...)
  m.env = episodes.metrics(rm.env)
  if S.engine and S.engine.remote then m.engine = S.engine:metrics() end
  if S.engine and S.engine.mtp then -- speculative decoding (engine.mtp): this step's drafts kept, tokens a step
    local st, last = S.engine:stats(), self.spec_last or { d = 0, a = 0, g = 0, s = 0 }
    local d, a, g, n = st.spec_drafts - last.d, st.spec_accepted - last.a, st.generated_tokens - last.g, st.steps - last.s
    self.spec_last = { d = st.spec_drafts, a = st.spec_accepted, g = st.generated_tokens, s = st.steps }
    m.engine = { spec_acceptance = d > 0 and a / d or 0, tokens_per_step = n > 0 and g / n or 0 }
  end
  m.response_length = metrics.length_metrics(samples)
  m.data = S:data_metrics()
  m.async = S.rollouts:metrics(info)
  m.tokens_per_s = { generate = metrics.rate(m.tokens or 0, info.gen_seconds or 0),
    train = metrics.rate((m.tokens or 0) * (self.c.epochs or 1), moonrl.now() - (self.update_t0 or moonrl.now())) }
end

-- ---- held-out evaluation -----------------------------------------------------------------------

-- The held-out records (with prompt_ids), read once: eval.data, eval.task or data.task's split.
function Recipe:eval_records()
  self.eval_set = self.eval_set or E.records(self.S, self.cfg)
  return self.eval_set
end

-- Greedy answers to the held-out prompts judged by the reward (moonrl.train.evaluation.accuracy).
function Recipe:heldout_metrics()
  return E.accuracy(self.S, self.cfg, self:eval_records(), { max_tokens = self.c.max_tokens, eos_ids = self.sampling.eos_ids,
    episodes = self.env and function(records, sampling)
      return (self:episodes(records, 0, { group = 1, sampling = sampling }))
    end or self.cfg.agent and self.cfg.agent.command and function(records, sampling)
      return (self:agent_episodes(records, 0, { group = 1, sampling = sampling }))
    end or nil })
end

function Recipe:evaluate(step)
  local m = E.due(self.cfg, step) and self.S:phase('eval', self.heldout_metrics, self) or nil
  return self:harness(step, m)
end

-- lm-evaluation-harness's scores (eval.harness) into the evaluation's metrics (eval/harness/<task>/<metric>).
function Base:harness(step, m)
  if not E.harness_due(self.cfg, step) then return m end
  local S = self.S
  local h = S:phase('harness', E.harness, S, self.cfg, string.format('%s/harness/step-%d', S.dir, S.global_step))
  if not h then return m end
  m = m or {}
  m.harness = h
  return m
end

function Recipe:finish()
  local S = self.S
  local dirs = S:finish()
  return { history = self.history, dir = S.dir, model = S.policy, dirs = dirs }
end

-- ---- supervised recipes ----------------------------------------------------------------------
-- rl.supervised { name = 'sft', config = {...} }: a recipe that learns from batches of a dataset,
-- without rollouts. The loop (Supervised:main):
--   cfg <- moonrl.config(recipe.config)   over sections.supervised_config()
--   self:check()                          the data, held-out set and reward settings
--   self:open_data()                      its datasets, before the run directory exists
--   S <- moonrl.train.session.start(...)  model, engine (with eval.every), data; moe.expert_parallel
--   self:setup()                          what the loop needs (held-out samples, reference log-probs)
--   for step in S:steps() do
--     samples <- self:batch(step)
--     self:train_step(step, samples)      update (the 'train' phase) -> metrics -> evaluate -> log
--   end
--   return self:finish()
-- Stages to write: batch(step) -> samples and update(samples, step) -> m (train.sft_step,
-- train.supervised_step); the others have defaults. self.heldout (from setup) are the records the
-- evaluation answers every eval.every steps.

function Supervised:main()
  if loading > 0 then return self end
  local cfg = self:configure()
  self:check()
  self:open_data()
  self.S = session.start(cfg, self:start_options())
  models.expert_parallel(self.S, cfg.moe and cfg.moe.expert_parallel)
  self:setup()
  local S = self.S
  self.history = {}
  for step in S:steps(S.total, self.phase) do
    self.first_step, self.last_step = self.first_step or step, step
    self.history[step] = self:train_step(step, self:batch(step))
  end
  return self:finish()
end

-- own_heldout: the recipe has a held-out set of its own (SFT's split of its data).
function Supervised:check() self:check_sections(self.own_heldout) end

-- The sequences a step holds (Recipe:batch_size): SFT's train.batch examples, DPO's 2 × train.pairs.
function Supervised:batch_size()
  local c = self.c
  if c.batch then return self.section .. '.batch', c.batch, c.max_length or 0 end
  if c.pairs then return self.section .. '.pairs', 2 * c.pairs, c.max_length or 0 end
end

function Supervised:open_data() end

function Supervised:start_options()
  local cfg = self.cfg
  return { name = self.name, steps = self.c.steps, steps_key = self.section .. '.steps', chat = cfg.data.chat,
    engine = E.wanted(cfg) or (cfg.eval ~= nil and cfg.eval.harness ~= nil), free_keys = self:free_keys(),
    check_policy = function(p) models.check_expert_parallel(p, cfg.moe and cfg.moe.expert_parallel) end }
end

-- The held-out records the evaluation answers (eval.data, eval.task, data.task's split), when it is on.
function Supervised:setup()
  self.heldout = E.wanted(self.cfg) and E.records(self.S, self.cfg) or {}
end

function Supervised:train_step(step, samples)
  local S = self.S
  local t0 = moonrl.now()
  local m = S:phase('train', self.update, self, samples, step)
  if m.tokens then m.tokens_per_s = { train = metrics.rate(m.tokens, moonrl.now() - t0) } end
  self:metrics(m, step)
  m.eval = self:evaluate(step)
  return self:log(m)
end

function Supervised:metrics(m, step) end

-- Every eval.every steps: greedy answers to the held-out prompts judged by the reward.
function Supervised:evaluate(step)
  local m = #self.heldout > 0 and E.due(self.cfg, step) and self.S:phase('eval', E.accuracy, self.S, self.cfg, self.heldout)
    or nil
  return self:harness(step, m)
end

-- history: the step lines' records by step; first, last: the steps this process ran (nil: none,
-- a phase a resumed run had finished).
function Supervised:finish()
  local S = self.S
  local dirs = S:finish()
  return { history = self.history, first = self.first_step, last = self.last_step, dir = S.dir, model = S.policy,
    dirs = dirs }
end

return M
