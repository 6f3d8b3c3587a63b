-- moonrl.train.step: one optimizer step, the part of every recipe between a batch of samples and
-- new weights. The policy step (GRPO, PPO, RLVR) and the supervised step (SFT, DPO, a warm-up)
-- accumulate micro-batches with the WHOLE batch's denominators, so a step is the same whatever
-- train.micro_batch_tokens is; the update goes through the session's guards.
--
--   local train = require('moonrl.train.step')
--   local m = train.policy_step { session = S, model = S.policy, opt = S.opt, samples = samples,
--     loss = 'ppo', clip_low = 0.2, ..., correction = ..., micro_batch_tokens = 4096 }
--   local m = train.sft_step(S, S.opt, samples, { lr = S:lr() })
--   local m = train.supervised_step(S, opt, { batches = S:micro_batches(samples, 4096), loss = fn })
--   local lps = train.logprobs(model, samples, 4096)          -- no gradient
--   local off = train.off_policy(cfg)    -- what async.* asks of the loss: correction weights, decoupled PPO
-- The policy step in pieces: token_inputs (each micro-batch's advantages, old and behaviour
-- log-probs, the engine/trainer mismatch), the loss (by name, moonrl.algo.losses) with its KL and
-- entropy terms, the backward, and apply_update.
local ffi = require('ffi')
local moonrl = require('moonrl')
local algo = require('moonrl.algo')
local batch = require('moonrl.batch')
local model_mod = require('moonrl.model')
local metrics = require('moonrl.train.metrics')
local sections = require('moonrl.train.sections')
local pipeline = require('moonrl.train.pipeline')

local M = {}

-- Whether every forward and backward of model is a collective of the data-parallel ranks:
-- expert parallelism (model:set_expert_parallel: its exchanges), ZeRO-3 (its parameter gathers)
-- and ZeRO-2 (its gradient reduce-scatters, model.grad_windows: moonrl.train.dist).
function M.collective(model)
  return model._gather ~= nil or model.grad_windows or (model.expert_range and select(3, model:expert_range())) or false
end

-- The micro-batches of an iterator (batch.micro_batches) with, for each, whether it is the step's
-- last (the one whose backward arms the gradient sums). Where the model's forwards and backwards
-- are collectives of its ranks (M.collective) each rank runs as many as the rank with the most
-- (world:max; world nil: the model's expert-parallel group, if any), the rest empty batches
-- (model.empty_batch, first = nil): through them a rank serves its experts to the others'
-- tokens, gathers its shards for them, sums its gradients with theirs. Returns an iterator of
-- (b, first, last, is_last).
function M.collective_batches(model, world, it)
  world = world or model._ep_group -- (expert parallelism's group: a caller that named no world)
  if not (world and world.size > 1 and M.collective(model)) then
    -- no expert parallelism: packed as they are used, one ahead to know the last
    local nb, nf, nl = it()
    return function()
      local b, first, last = nb, nf, nl
      if not b then return nil end
      nb, nf, nl = it()
      return b, first, last, nb == nil
    end
  end
  local list = {} -- (every rank needs the count first)
  for b, first, last in it do list[#list + 1] = { b, first, last } end
  local n = world:max(#list)
  local i = 0
  return function()
    i = i + 1
    if i > n then return nil end
    local e = list[i]
    if e then return e[1], e[2], e[3], i == n end
    return model_mod.empty_batch(), nil, nil, i == n
  end
end

-- An empty batch's forward and backward (see collective_batches); refs: models whose forwards
-- the step runs before the model's (a reference), each run too where it is collective.
local no_grad = ffi.new('float[1]')

function M.serve_experts(model, b, refs)
  for _, r in ipairs(refs or {}) do
    if r and M.collective(r) then r:forward(b) end
  end
  model:forward(b)
  model:backward(no_grad)
end

-- Log-probs of every sample's response under model (no gradient), as per-sample lists; also
-- the value estimates when opts.values (a value-head model). opts.share_prompts (true): see pack;
-- opts.world: the ranks, for a model with expert parallelism (collective_batches).
function M.logprobs(model, samples, max_tokens, opts)
  opts = opts or {}
  local lps, vals = {}, opts.values and {} or nil
  -- opts.routing_replay: the forward replays the samples' engine routing (policy_step's option)
  local width = opts.routing_replay and model:num_moe_layers() * (model.config.num_experts_per_tok or 0) or 0
  local it = batch.micro_batches(samples, max_tokens, { share_prompts = opts.share_prompts ~= false,
    routing = width > 0 and width or nil })
  if model.pp then -- pipeline parallel: the stages' forwards, the last stage's outputs on every stage
    local list = {} -- (expert parallelism, ZeRO-3: as many on every pipeline, empty ones passed through)
    for b, first in M.collective_batches(model, opts.world, it) do list[#list + 1] = { b, first } end
    local outs = pipeline.forward_only(model, list, { temperature = opts.temperature, values = opts.values })
    for i, e in ipairs(list) do
      local o = outs[i]
      if o[1] and e[2] then batch.gather(e[1], o[1], lps, e[2]) end
      if vals and o[3] and e[2] then batch.gather(e[1], o[3], vals, e[2]) end
    end
    pipeline.broadcast_lists(model, lps, #samples)
    if vals then pipeline.broadcast_lists(model, vals, #samples) end
    return lps, vals
  end
  for b, first in M.collective_batches(model, opts.world, it) do
    local lp, _, v = model:forward(b, { temperature = opts.temperature, values = opts.values, routing = b.routing })
    if first then -- (an empty batch: expert parallelism, collective_batches)
      batch.gather(b, lp, lps, first)
      if vals then batch.gather(b, v, vals, first) end
    end
  end
  return lps, vals
end

-- One optimizer step of the policy on a list of samples (the update of GRPO, RLVR and PPO).
-- Each sample has prompt_ids, ids and either adv (one number for the whole response: GRPO)
-- or adv_tokens (a list, one per response token: PPO with GAE), and optionally old_logprobs
-- (a list; when absent the batch is on-policy and log π_old = log πθ, detached). o:
--   model, opt; ref (a frozen reference model: adds the KL loss term, coef kl_coef, estimator
--   kl_estimator); loss (a name in moonrl.algo.losses: ppo, dual_clip, gspo, reinforce,
--   decoupled_ppo, or one registered), clip_low, clip_high, dual_clip, agg, norm;
--   entropy_coef (0); temperature (1); micro_batch_tokens (4096); max_grad_norm (1); lr;
--   share_prompts (true): the samples of one prompt share its rows (see pack);
--   measure_mismatch (true): when the samples carry the engine's rollout_logprobs and the weights
--   are still those that generated them (the first update after generation), report how far the
--   trainer's log-probs are from the engine's (metrics.mismatch: mean_abs, max_abs,
--   token_mult_prob_error), since a gap silently turns on-policy RL off-policy.
--   correction ({ mode, clip, lower, upper, weight }; off by default): off-policy correction
--   weights (algo.correction.weights: 'tis', 'tis_seq', 'mis_token', 'mis_seq', 'mis_geo', 'none')
--   of the behaviour log-probs = the samples' rollout_logprobs against the proximal ones =
--   old_logprobs (else the current log-probs, detached), multiplied into the policy loss per token;
--   loss = 'decoupled_ppo' (AReaL) takes the same behaviour log-probs, with behav_imp_weight_cap
--   and behav_cap_mode. A sample without rollout_logprobs gets ratio 1. Their metrics: metrics.is
--   (correction.summary of the whole batch) and metrics.is.behav (decoupled_ppo's weights).
--   routing_replay (false; a qwen3_moe model): the forward replays the experts the engine picked
--   for each token (the samples' s.routing, see pack_routing), not the router's own top-k.
-- Micro-batches accumulate gradients with the GLOBAL denominators (tokens and sequences of the
-- whole list), so the step equals one step on the whole batch. Returns metrics: loss, kl,
-- entropy, clip_frac, approx_kl, grad_norm, lr, tokens; for a model with sparse layers also moe:
-- aux_loss (the load-balancing loss, token-weighted over the micro-batches), aux_coef, replayed
-- (the share of (token, sparse layer) pairs whose experts were replayed) and routing_mismatch (of
-- those, the share whose replayed experts differ from the trainer's own top-k).
function M.policy_step(o)
  local model, all = o.model, o.samples
  local temp = o.temperature or 1.0
  local tokens, seqs = 0, 0 -- of the global batch: the losses' denominators
  for _, s in ipairs(all) do
    local n = batch.loss_tokens(s)
    tokens = tokens + n
    if n > 0 then seqs = seqs + 1 end
  end
  local S = o.session
  local world = S and S.world
  -- this rank trains on the samples it generated (S:score gathers them all), or on its share
  local samples = S and S:local_samples(all) or all
  local sums = { loss = 0, kl = 0, entropy = 0, clip_frac = 0, approx_kl = 0 }
  local measure = o.measure_mismatch ~= false
  local mm = { sum = 0, max = 0, mult = 0, n = 0 }
  local corr, decoupled = o.correction, o.loss == 'decoupled_ppo'
  local is_acc = corr and algo.correction.accumulator()
  local behav_acc = decoupled and algo.correction.accumulator()
  model:zero_grad()
  local share = { share_prompts = o.share_prompts ~= false }
  local n_moe = model.num_moe_layers and model:num_moe_layers() or 0
  if n_moe > 0 then
    sums.moe_aux, sums.moe_tokens, sums.moe_replayed, sums.moe_differ = 0, 0, 0, 0
    if o.routing_replay then share.routing = n_moe * model.config.num_experts_per_tok end
  end
  -- one micro-batch of this rank's samples (from first): forward, loss, backward
  local function micro_step(b, first)
    local n = b.n_tokens
    local ref_lp = o.ref and o.ref:forward(b, { temperature = temp })
    model:set_training(true, M.training_key(S)) -- (LoRA's dropout: this forward and its backward)
    local lp, ent = model:forward(b, { temperature = temp, routing = b.routing })
    model:set_training(false)
    if n_moe > 0 then
      local replayed, differ = model:routing_replay_stats()
      sums.moe_aux, sums.moe_tokens = sums.moe_aux + model:router_aux_loss() * n, sums.moe_tokens + n
      sums.moe_replayed, sums.moe_differ = sums.moe_replayed + replayed, sums.moe_differ + differ
    end
    local adv, old = ffi.new('float[?]', n), ffi.new('float[?]', n)
    local behav = (corr or decoupled) and ffi.new('float[?]', n) -- the engine's log-probs
    ffi.copy(old, lp, 4 * n)
    for i = 1, #b.len do
      local s, t0 = samples[first + i - 1], b.first[i]
      local lm = s.loss_mask -- (an episode's environment tokens: no engine log-prob to hold against)
      for k = 1, b.len[i] do
        adv[t0 + k - 1] = s.adv_tokens and s.adv_tokens[k] or s.adv
        if s.old_logprobs then old[t0 + k - 1] = s.old_logprobs[k] end
        local engine_lp = s.rollout_logprobs and not (lm and lm[k] == 0) and s.rollout_logprobs[k]
        if behav then behav[t0 + k - 1] = engine_lp or old[t0 + k - 1] end
        local rollout = measure and engine_lp
        if rollout then
          local d = math.abs(lp[t0 + k - 1] - rollout)
          mm.sum, mm.mult, mm.n = mm.sum + d, mm.mult + math.exp(d), mm.n + 1
          if d > mm.max then mm.max = d end
        end
      end
    end
    local grad = ffi.new('float[?]', n)
    local args = { logprob = lp, old_logprob = old, advantages = adv, ref_logprob = ref_lp,
      mask = b.mask, cu_seqlens = b.sample_cu, nseq = #b.len, grad = grad,
      agg = o.agg, norm = o.norm, global_tokens = tokens, global_seqs = seqs,
      clip_low = o.clip_low, clip_high = o.clip_high, dual_clip = o.dual_clip }
    if corr then
      local cm
      args.weights, cm = algo.correction.weights{ mode = corr.mode, clip = corr.clip, lower = corr.lower,
        upper = corr.upper, weight = corr.weight, proximal_logprob = old, behavior_logprob = behav,
        mask = b.mask, cu_seqlens = b.sample_cu, nseq = #b.len, out = ffi.new('float[?]', n) }
      algo.correction.accumulate(is_acc, cm)
    end
    if decoupled then
      args.behavior_logprob = behav
      args.behav_imp_weight_cap, args.behav_cap_mode = o.behav_imp_weight_cap, o.behav_cap_mode
    end
    local loss, pm = algo.losses.get(o.loss or 'ppo')(args) -- by name (moonrl.algo.losses)
    if decoupled then algo.correction.accumulate(behav_acc, pm, 'behav_') end
    local mtok = pm.tokens
    if ref_lp then -- KL to the reference as a loss term; its parts over micro-batches sum to agg(k)
      args.coef, args.estimator = o.kl_coef or 0.001, o.kl_estimator
      local kl_loss, km = algo.kl.loss(args)
      loss = loss + kl_loss
      sums.kl = sums.kl + km.kl
    end
    local dent
    if (o.entropy_coef or 0) ~= 0 then
      dent = ffi.new('float[?]', n)
      local eargs = { entropy = ent, mask = b.mask, cu_seqlens = b.sample_cu, nseq = #b.len, grad = dent,
        coef = o.entropy_coef, agg = o.agg, norm = o.norm, global_tokens = tokens, global_seqs = seqs }
      loss = loss + algo.kl.entropy_bonus(eargs)
    end
    model:backward(grad, dent, nil)
    sums.loss = sums.loss + loss
    sums.entropy = sums.entropy + metrics.masked_mean(ent, b.mask, n) * mtok
    sums.clip_frac = sums.clip_frac + pm.clipfrac * mtok
    sums.approx_kl = sums.approx_kl + pm.approx_kl * mtok
  end
  local it, pipe = batch.micro_batches(samples, o.micro_batch_tokens or 4096, share), nil
  if model.pp then -- pipeline parallel: 1F1B over the stages, the loss on the last (moonrl.train.pipeline)
    local all -- (micro_step adds to these tables: the last stage's go to every stage)
    all, pipe = M.run_micro_batches(model, M.collective_batches(model, world, it), function(b, first) micro_step(b, first) end,
      { sums = sums, mm = mm, is = is_acc or false, behav = behav_acc or false }, { o.ref })
    sums, mm, is_acc, behav_acc = all.sums, all.mm, all.is or nil, all.behav or nil
    if n_moe > 0 then -- (the other stages' layers' routing replay: pipeline.run counted it)
      local c = model.pp.world:sum({ model.pp.replayed, model.pp.replay_differ })
      sums.moe_replayed, sums.moe_differ = sums.moe_replayed + c[1], sums.moe_differ + c[2]
    end
  else
    for b, first, _, is_last in M.collective_batches(model, world, it) do
      if is_last and o.opt.arm then o.opt:arm() end -- the gradient sums start during this backward
      if first then micro_step(b, first)
      else M.serve_experts(model, b, { o.ref }) end -- nothing left here: serve the experts to the other ranks (expert parallelism)
    end
  end
  if world and world.size > 1 then -- the parts of every rank, added
    sums.mm_sum, sums.mm_mult, sums.mm_n = mm.sum, mm.mult, mm.n
    sums = world:sum(sums)
    mm.sum, mm.mult, mm.n, mm.max = sums.mm_sum, sums.mm_mult, sums.mm_n, world:max(mm.max)
  end
  local gnorm = o.opt:clip_grad_norm(o.max_grad_norm or 1.0)
  local inv = tokens > 0 and 1 / tokens or 0
  local m = { loss = sums.loss, kl = o.ref and sums.kl or nil, entropy = sums.entropy * inv,
    clip_frac = sums.clip_frac * inv, approx_kl = sums.approx_kl * inv, grad_norm = gnorm,
    lr = o.lr or o.opt.lr, tokens = tokens, pipeline = pipe,
    mismatch = mm.n > 0 and { mean_abs = mm.sum / mm.n, max_abs = mm.max, token_mult_prob_error = mm.mult / mm.n } or nil }
  if n_moe > 0 then
    -- (under pipeline parallel the last stage's: its statistics are every stage's, model.h)
    m.moe = { aux_loss = sums.moe_aux / math.max(sums.moe_tokens, 1), aux_coef = model:router_aux_coef(),
      replayed = sums.moe_replayed / math.max(sums.moe_tokens * n_moe, 1),
      routing_mismatch = sums.moe_replayed > 0 and sums.moe_differ / sums.moe_replayed or 0 }
  end
  if is_acc or behav_acc then -- the off-policy correction's metrics, of the whole batch
    m.is = is_acc and algo.correction.summary(algo.correction.reduce(is_acc, world)) or {}
    if behav_acc then m.is.behav = algo.correction.summary(algo.correction.reduce(behav_acc, world)) end
  end
  M.apply_update(o.session, o.opt, o.lr, m)
  return m
end

-- One update's micro-batches (batches: an iterator of (b, first, last), as S:micro_batches gives)
-- through model: step(b, first, last, acc) for each (a forward, a loss adding its numbers to acc,
-- a backward), an empty batch (expert parallelism, first nil) serving the experts instead; under
-- pipeline parallel in 1F1B over the stages, step running on the last stage only, whose acc then
-- goes to every stage (refs: models whose forwards step runs, pipeline.run's). Returns acc and
-- the pipeline's bubble (M.pipeline_run; nil without).
function M.run_micro_batches(model, batches, step, acc, refs)
  if not model.pp then
    for b, first, last in batches do
      if first then step(b, first, last, acc) else M.serve_experts(model, b, refs) end
    end
    return acc
  end
  local list = {}
  for b, first, last in batches do list[#list + 1] = { b, first, last } end
  local pipe = M.pipeline_run(model, list, function(b, first, i)
    if first then step(b, first, list[i][3], acc) else M.serve_experts(model, b, refs) end -- (an empty batch: collective)
  end, refs)
  return pipeline.share(model, acc), pipe
end

-- Pipeline parallel (model.pp): one update's micro-batches (list: { {b, first, ...}, ... }) under
-- 1F1B, step(b, first, i) run by the last stage for the i-th (pipeline.run). Returns the bubble:
-- the share of the pipeline's span (its slowest stage's loop) a stage was not computing (waiting
-- for rows, or done before the others), { bubble = the mean over the stages (1F1B's ideal:
-- (p - 1) / (m + p - 1)), bubble_max, stages, micro_batches } (the same on every stage).
function M.pipeline_run(model, list, step, refs)
  local wait, took = pipeline.run(model, list, step, refs)
  local pp = model.pp
  local span = pp.world:max(took)
  local idle = span > 0 and 1 - (took - wait) / span or 0
  return { bubble = pp.world:sum(idle) / pp.stages, bubble_max = pp.world:max(idle), stages = pp.stages,
    micro_batches = #list }
end

-- Apply an update whose gradients are in opt's buffer: through the session's guards when there
-- is one (o.session: skips non-finite or spiking updates, rolls back), else opt:step. A zero
-- gradient norm is no update at all (every advantage 0: Adam's moments would still move the
-- weights). opts.detectors = false: only the non-finite checks (a second model's update, whose
-- values would muddle the policy's windows).
function M.apply_update(S, opt, lr, m, opts)
  if m.grad_norm == 0 then return false end
  if S then return S:update(opt, lr, m, opts) end
  opt:step(lr)
  return true
end

-- A training forward's key (LoRA's dropout masks, model:set_training): the global step, the
-- forwards of this step so far and the rank, so that a resumed run draws the same masks.
function M.training_key(S)
  if not S then return 0 end
  if S._key_step ~= S.global_step then S._key_step, S._key_n = S.global_step, 0 end
  S._key_n = S._key_n + 1
  return (S.global_step * 4096 + S._key_n) * 1024 + ((S.world and S.world.rank or 0) % 1024)
end

-- One optimizer step of a supervised loss: the gradient accumulated over micro-batches whose
-- losses take the denominators of the WHOLE batch (so the step equals one step on the whole
-- batch), the parts summed over the ranks, the gradient norm clipped, the update applied through
-- the session's guards (apply_update). o:
--   batches   an iterator of (packed batch, first, last) over this rank's samples
--             (S:micro_batches, which under expert parallelism also gives empty batches, first nil)
--   loss(b, lp, first, last) -> loss, grad, parts   a micro-batch's loss (a number), its gradient
--             with respect to the log-probs lp (float[b.n_tokens]), and other numbers to add up
--   lr; max_grad_norm (1.0); model (opt.model)
-- Returns the metrics: loss and the parts (summed over micro-batches and ranks), grad_norm, lr.
function M.supervised_step(S, opt, o)
  local model = o.model or opt.model
  model:zero_grad()
  local sums, pipe = M.run_micro_batches(model, o.batches, function(b, first, last, acc)
    model:set_training(true, M.training_key(S)) -- (LoRA's dropout: this forward and its backward)
    local lp = model:forward(b)
    model:set_training(false)
    local loss, grad, parts = o.loss(b, lp, first, last)
    model:backward(grad)
    acc.loss = acc.loss + loss
    for k, v in pairs(parts or {}) do acc[k] = (acc[k] or 0) + v end
  end, { loss = 0 })
  local m = S and S:sum(sums) or sums
  m.grad_norm = opt:clip_grad_norm(o.max_grad_norm or 1.0)
  m.lr, m.pipeline = o.lr, pipe
  M.apply_update(S, opt, o.lr, m)
  return m
end

-- The SFT step (recipes/sft.lua, the default example's warm-up): token-mean cross-entropy over
-- the response tokens of the whole batch of samples (prompt_ids, ids), on this rank's share. o: lr,
-- micro_batch_tokens (4096), max_grad_norm (1.0). Returns loss, grad_norm, lr, tokens (the
-- batch's response tokens).
function M.sft_step(S, opt, samples, o)
  local tokens = 0
  for _, s in ipairs(samples) do tokens = tokens + batch.loss_tokens(s) end
  local m = M.supervised_step(S, opt, { lr = o.lr, max_grad_norm = o.max_grad_norm,
    batches = S and S:micro_batches(samples, o.micro_batch_tokens or 4096) or
      batch.micro_batches(samples, o.micro_batch_tokens or 4096), -- (no session: one process)
    loss = function(b, lp)
      local grad = ffi.new('float[?]', b.n_tokens)
      return algo.sft.loss({ logprob = lp, mask = b.mask, cu_seqlens = b.cu_seqlens, nseq = b.n_seqs, grad = grad,
        global_tokens = tokens }), grad
    end })
  m.tokens = tokens
  return m
end

-- The loop of a recipe that learns from a dataset, without rollouts (SFT, DPO; the default
-- example's warm-up): for each step of S:steps(o.steps, o.phase), the batch o.batch(step) ->
-- samples, then the update o.update(samples, step) -> m as the 'train' phase (M.sft_step,
-- M.supervised_step); then the train throughput (from m.tokens), o.metrics(m, step) for the
-- recipe's own (evaluations ...), and the step line and metrics record (o.log = false: none).
-- Returns every step's metrics, by step, and the first and last step this process ran (nil when
-- none: a rollout rank, or a phase a resumed run had finished).
function M.train_loop(S, o)
  local history, first, last = {}, nil, nil
  for step in S:steps(o.steps, o.phase) do
    first, last = first or step, step
    local samples = o.batch(step)
    local t0 = moonrl.now()
    local m = S:phase('train', o.update, samples, step)
    if m.tokens then m.tokens_per_s = { train = metrics.rate(m.tokens, moonrl.now() - t0) } end
    if o.metrics then o.metrics(m, step) end
    history[step] = m
    if o.log ~= false then S:log(m, { quiet = o.quiet }) end
  end
  return history, first, last
end

-- What the async section asks of the policy loss when the samples may come from older weights:
--   correction            the importance weights on the engine's log-probs (policy_step's
--                         o.correction): async.correction, whose auto is tis when the rollouts run
--                         ahead of training (async.mode one_step_off or async) and none in sync
--   decoupled             true: the loss is AReaL's decoupled PPO ('decoupled_ppo', proximal policy
--                         = the trainer before the update): async.decoupled, whose auto is on in
--                         async mode (samples up to max_staleness versions behind) and off otherwise
--   behav_imp_weight_cap  decoupled PPO's cap of the behaviour weight (async.behav_cap; nil: none)
-- A recipe puts them into its policy_step options (moonrl.rl's policy_options); a config without
-- an async section asks nothing.
function M.off_policy(cfg)
  local a, off = cfg.async, { decoupled = false }
  if not a then return off end
  local mode = a.correction
  if mode == 'auto' then mode = sections.lag(cfg) > 0 and 'tis' or 'none' end
  if mode ~= 'none' then
    off.correction = { mode = mode, clip = a.correction_clip,
      lower = a.correction_lower > 0 and a.correction_lower or nil, upper = a.correction_upper > 0 and a.correction_upper or nil }
  end
  off.decoupled = sections.decoupled(cfg)
  if off.decoupled and a.behav_cap > 0 then off.behav_imp_weight_cap = a.behav_cap end
  return off
end

return M
