-- moonrl.recipe: the small pieces every recipe (recipes/*.lua) shares, so that the
-- recipes themselves read like the algorithm.
--
--   local S = R.start(cfg, { name = 'grpo', steps = cfg.grpo.steps, steps_key = 'grpo.steps' })
--     -- a moonrl.train.session (run directory, checkpoints, resume, guards) holding what the config's
--     -- sections ask for: S.policy, S.tok, S.tpl, S.tok_dir (model.dir), S.opt and S.lr_at (train),
--     -- S.engine (engine), the dataset (data, with opts.fields)
--   for step in S:steps() do ... end; S:finish()
--   S:prompts(n)        -- n records with prompt_ids; bad or over-long ones skipped (data.on_error)
--   S:score(reward, samples, group)  -- rewards; a sample whose reward fails drops its group
--   S:reference()       -- a frozen copy of the initial policy (call it before the loop)
--   R.model_config(), R.data_config{...}, R.train_config{...}, R.engine_config(), R.reward_config(name)
--     -- the config sections recipes share
--   local R = require('moonrl.recipe')
--   local b = R.pack(samples)                -- prompt_ids + ids -> packed batch with a response mask
--   for mb in R.micro_batches(samples, 2048) do ... end   -- by token budget, order kept
--   local ref = R.clone(model)               -- a frozen copy (reference policy)
--   local critic = R.critic_from(model)      -- same weights plus a value head
--   R.save(run, model, tokenizer_dir)        -- run.dir/model in HF format, tokenizer files copied
--   R.masked_mean(x, mask, n), R.mean_std(list)
--   R.train_loop(S, { batch, update, metrics })   -- a supervised recipe's loop (SFT, DPO, a warm-up)
--   R.sft_step(S, opt, samples, o), R.supervised_step(S, opt, { batches, loss })  -- one update
--   R.finish(S)                              -- the last checkpoint, the model, the run directory line
--   run.threads=auto: R.start times the policy at 1 and all threads and keeps the faster
--     (R.measure_threads, R.auto_threads)
--
-- A sample is a table with prompt_ids (Lua list) and ids (the response tokens, Lua list); the
-- packed sequence is prompt_ids .. ids. The log-prob of token t+1 sits at output t (see
-- model.h), so the response's log-probs are outputs P-1 .. P+R-2 of a sequence with a prompt
-- of P tokens and R response tokens; those are the mask's ones.
local ffi = require('ffi')
local moonrl = require('moonrl')
local C = moonrl.C
local json = require('moonrl.io.json')
local fs = require('moonrl.io.fs')
local model_mod = require('moonrl.model')
local function rewards_mod() return require('moonrl.rewards') end

local M = {}

-- ---- loading a policy and turning text into token ids ------------------------------------

-- The model, its tokenizer and (when opts.chat and the tokenizer config has one) its chat template.
-- dir: a Hugging Face directory; opts.tokenizer: another directory for the tokenizer files.
function M.load(dir, opts)
  opts = opts or {}
  dir = require('moonrl.io.gguf').resolve(dir) -- a .gguf file: its converted directory
  local model = model_mod.load(dir)
  local tok_dir = opts.tokenizer or dir
  local tok = require('moonrl.tokenizer').load(tok_dir)
  local tpl
  if opts.chat then tpl = require('moonrl.chat').load(tok_dir) end
  return model, tok, tpl, tok_dir
end

-- The end-of-sequence ids: the tokenizer's eos, the model's eos, and opts.extra.
function M.eos_ids(tok, model, extra)
  local ids, seen = {}, {}
  local function add(id)
    if id and id >= 0 and not seen[id] then seen[id] = true; ids[#ids + 1] = id end
  end
  add(tok.eos_id)
  add(model and model.config.eos_token_id)
  for _, id in ipairs(extra or {}) do add(id) end
  return ids
end

-- Prompt token ids: through the chat template as one user turn (plus an optional system turn)
-- with the generation prompt, or the raw text encoded with the tokenizer's special tokens.
function M.prompt_ids(tok, tpl, text, system)
  if tpl then
    local messages = {}
    if system and system ~= '' then messages[1] = { role = 'system', content = system } end
    messages[#messages + 1] = { role = 'user', content = text }
    return tok:encode(tpl:render(messages, { add_generation_prompt = true }), { add_special = false })
  end
  return tok:encode(text)
end

-- Completion token ids: the text followed by the end-of-sequence token.
function M.completion_ids(tok, text, eos)
  local ids = tok:encode(text, { add_special = false })
  eos = eos or tok.eos_id
  if eos then ids[#ids + 1] = eos end
  return ids
end

-- A JSONL dataset (moonrl.data) in a seeded random order; fields maps record names to JSON keys.
-- Returns the view and a function next_batch(n) that cycles through epochs forever.
function M.dataset(path, fields, seed, optional)
  local ds = require('moonrl.data').jsonl(path, { fields = fields, optional = optional }):shuffled(seed)
  local it
  local function next_batch(n)
    it = it or ds:batches(n, { epochs = math.huge })
    return it()
  end
  return ds, next_batch
end

-- Packed batch of samples: b (moonrl.model batch) plus b.mask (float[n_tokens]), b.first[i] (the
-- 0-based output index of sample i's first response log-prob) and b.len[i] (response tokens).
-- With opts.share_prompts, consecutive samples with the same prompt (the same prompt_ids table,
-- as flatten gives the samples of a group) share it: the prompt without its last token is packed
-- once and each sample continues it with "last prompt token + response" (mrl_batch.prefix in
-- model.h), so the prompt is computed once per group; log-probs and gradients are those of
-- packing every sample whole. Then b.n_seqs counts the shared prompts too (fully masked), and
-- b.sample_cu (int32[#samples + 1]) cuts the rows into one segment per sample instead (a shared
-- prompt's rows go with its first sample; they are masked): the cu_seqlens of per-sample losses.
-- Without sharing b.sample_cu is b.cu_seqlens.
function M.pack(samples, first, last, opts)
  first, last = first or 1, last or #samples
  local share = opts and opts.share_prompts
  local seqs, prefix, starts, lens = {}, {}, {}, {}
  local src = {} -- src[k] = { sample, position of its first token }: where sequence k's routing rows come from
  local i = first
  while i <= last do
    local s = samples[i]
    local P = #s.prompt_ids
    local j = i -- samples i..j share the prompt
    if share and P >= 2 then
      while j < last and samples[j + 1].prompt_ids == s.prompt_ids do j = j + 1 end
    end
    local parent = false
    if j > i then
      local seq = {}
      for k = 1, P - 1 do seq[k] = s.prompt_ids[k] end
      seqs[#seqs + 1] = seq
      parent = #seqs
      src[#seqs] = { s, 0 }
    end
    for k = i, j do
      local sk = samples[k]
      local seq, keep = {}, parent and 1 or P -- prompt tokens this sequence carries
      for t = 1, keep do seq[t] = sk.prompt_ids[P - keep + t] end
      for t = 1, #sk.ids do seq[keep + t] = sk.ids[t] end
      seqs[#seqs + 1] = seq
      prefix[#seqs] = parent
      src[#seqs] = { sk, P - keep }
      starts[#starts + 1] = { #seqs, keep }
      lens[#lens + 1] = #sk.ids
    end
    i = j + 1
  end
  local b = model_mod.batch(seqs, { prefix = share and prefix or nil })
  local mask = ffi.new('float[?]', b.n_tokens)
  b.first, b.len = {}, lens
  b.sample_cu = b.cu_seqlens
  if #starts ~= b.n_seqs then b.sample_cu = ffi.new('int32_t[?]', #starts + 1) end -- zeroed
  for k = 1, #starts do
    local seq = starts[k][1]
    local off = b.cu_seqlens[seq - 1] + starts[k][2] - 1
    b.first[k] = off
    for t = off, off + lens[k] - 1 do mask[t] = 1 end
    -- sample k ends where its sequence ends and starts where sample k-1 ended
    if b.sample_cu ~= b.cu_seqlens then b.sample_cu[k] = b.cu_seqlens[seq] end
  end
  b.mask = mask
  if opts and opts.routing then b.routing = M.pack_routing(b, src, opts.routing) end
  return b
end

-- Routing replay (moe.routing_replay): the batch's mrl_batch.routing rows, width = sparse layers x
-- num_experts_per_tok, from each sample's engine record (s.routing, one row per position of
-- prompt + response); -1 (the trainer's own top-k) where a sample has none, or one that does not
-- match its tokens (ids changed after generation). nil when no sample has one.
function M.pack_routing(b, src, width)
  local r, any = ffi.new('int16_t[?]', b.n_tokens * width), false
  ffi.fill(r, 2 * b.n_tokens * width, 0xff)
  for k = 1, b.n_seqs do
    local s, pos0 = src[k][1], src[k][2]
    if s.routing and ffi.sizeof(s.routing) == 2 * width * (#s.prompt_ids + #s.ids) then
      any = true
      local t0, t1 = b.cu_seqlens[k - 1], b.cu_seqlens[k]
      ffi.copy(r + t0 * width, s.routing + pos0 * width, 2 * (t1 - t0) * width)
    end
  end
  return any and r or nil
end

-- Iterate over consecutive slices of samples whose packed size stays within max_tokens (a
-- sample longer than the budget gets a micro-batch of its own). Yields the packed batch and
-- the first and last sample index. opts: as pack's (the budget counts every sample whole), and
-- unit (1): runs of that many consecutive samples stay in one micro-batch (DPO's chosen and
-- rejected completions of a pair: 2), the budget counting each run whole.
function M.micro_batches(samples, max_tokens, opts)
  local unit = opts and opts.unit or 1
  local i = 1
  return function()
    if i > #samples then return nil end
    local j, tokens = i, 0
    while j + unit - 1 <= #samples do
      local n = 0
      for k = j, j + unit - 1 do n = n + #samples[k].prompt_ids + #samples[k].ids end
      if j > i and tokens + n > max_tokens then break end
      tokens = tokens + n
      j = j + unit
    end
    if j == i then j = #samples + 1 end -- fewer than unit samples left: them alone
    local first = i
    i = j
    return M.pack(samples, first, j - 1, opts), first, j - 1
  end
end

-- The micro-batches of an iterator (R.micro_batches) with, for each, whether it is the step's
-- last (the one whose backward arms the gradient sums). Under expert parallelism
-- (model:set_expert_parallel) every forward and backward of the model is a collective of its
-- ranks, so each rank runs as many as the rank with the most (world:max), the rest empty
-- batches (model.empty_batch, first = nil): through them a rank serves its experts to the others'
-- tokens. Returns an iterator of (b, first, last, is_last).
function M.collective_batches(model, world, it)
  if not (world and world.size > 1 and model.expert_range and select(3, model:expert_range())) then
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

-- An empty batch's forward and backward (see collective_batches).
local no_grad = ffi.new('float[1]')
function M.serve_experts(model, b)
  model:forward(b)
  model:backward(no_grad)
end

-- Per-sample copy of a per-token array over the response outputs: out[i] = Lua list of R floats.
function M.gather(b, x, out, first)
  out = out or {}
  first = first or 1
  for i = 1, #b.len do
    local t, list = b.first[i], {}
    for k = 1, b.len[i] do list[k] = x[t + k - 1] end
    out[first + i - 1] = list
  end
  return out
end

-- The inverse: a float[n_tokens] array with per-sample lists scattered onto the response outputs.
function M.scatter(b, lists, first)
  local x = ffi.new('float[?]', b.n_tokens)
  for i = 1, #b.len do
    local t, list = b.first[i], lists[(first or 1) + i - 1]
    for k = 1, b.len[i] do x[t + k - 1] = list[k] end
  end
  return x
end

-- The list of samples[i][field] (per-sample lists to scatter).
function M.gather_field(samples, field)
  local out = {}
  for i, s in ipairs(samples) do out[i] = s[field] end
  return out
end

-- Log-probs of every sample's response under model (no gradient), as per-sample lists; also
-- the value estimates when opts.values (a value-head model). opts.share_prompts (true): see pack;
-- opts.world: the ranks, for a model with expert parallelism (collective_batches).
function M.logprobs(model, samples, max_tokens, opts)
  opts = opts or {}
  local lps, vals = {}, opts.values and {} or nil
  -- opts.routing_replay: the forward replays the samples' engine routing (policy_step's option)
  local width = opts.routing_replay and model:num_moe_layers() * (model.config.num_experts_per_tok or 0) or 0
  for b, first in M.collective_batches(model, opts.world, M.micro_batches(samples, max_tokens,
      { share_prompts = opts.share_prompts ~= false, routing = width > 0 and width or nil })) do
    local lp, _, v = model:forward(b, { temperature = opts.temperature, values = opts.values, routing = b.routing })
    if first then -- (an empty batch: expert parallelism, collective_batches)
      M.gather(b, lp, lps, first)
      if vals then M.gather(b, v, vals, first) end
    end
  end
  return lps, vals
end

-- A new model with model's config and a copy of its weights (a frozen reference policy), on
-- model's device. opts.init(copy): edits of the copy's host weights before it moves there.
function M.clone(model, opts)
  opts = opts or {}
  local copy = model_mod.new(model.config, { value_head = opts.value_head or model.config.value_head })
  M.copy_weights(model, copy)
  if opts.init then opts.init(copy) end
  copy:set_dtype(model:dtype()) -- a reference policy or critic computes as the policy does
  copy:to_device(model:device())
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

-- A critic for PPO: the policy's weights with a scalar value head (score.weight) set to zero, so
-- the first value estimates are 0.
function M.critic_from(policy)
  return M.clone(policy, { value_head = true, init = function(critic)
    local p = critic:read_params()
    for _, v in ipairs(critic:views()) do
      if v.name == 'score.weight' then ffi.fill(p + v.offset, 4 * v.numel) end
    end
    critic:write_params(p)
  end })
end

-- AdamW over a model's one parameter buffer, no decay on norms and biases.
function M.adamw(model, o)
  local p, n = model:param_buffer() -- (on a GPU: the optimizer's state and steps are there too)
  local g = model:grads()
  local opt = require('moonrl.optim').adamw({ params = p, grads = g, n = n, lr = o.lr, betas = o.betas,
    eps = o.eps, weight_decay = o.weight_decay, no_decay = model:no_decay_ranges(), model = model })
  opt.model = model -- what a session's data-parallel wrapper hooks its gradient buckets into
  return opt
end

-- Save model to dir (default run.dir/model) in Hugging Face format with the tokenizer files of
-- tokenizer_dir copied beside it, every file written atomically. Returns the directory.
function M.save(run, model, tokenizer_dir, dir)
  dir = dir or (run.dir .. '/model')
  require('moonrl.train.checkpoint').save_model(model, dir, tokenizer_dir)
  return dir
end

-- Masked mean of a per-token array.
function M.masked_mean(x, mask, n)
  local s, c = 0, 0
  for t = 0, n - 1 do
    s = s + mask[t] * x[t]
    c = c + mask[t]
  end
  return c > 0 and s / c or 0
end

-- Mean, standard deviation (n divisor) and max of a Lua list or a cdata array of n numbers.
function M.stats(x, n)
  n = n or #x
  local off = type(x) == 'table' and 1 or 0
  local s, ss, mx = 0, 0, -math.huge
  for i = 0, n - 1 do
    local v = x[i + off]
    s, ss = s + v, ss + v * v
    if v > mx then mx = v end
  end
  if n == 0 then return 0, 0, 0 end
  local mean = s / n
  return mean, math.sqrt(math.max(ss / n - mean * mean, 0)), mx
end

-- Reward metrics of a step: mean and std of the n scores, and accuracy = the share of scores >= 1
-- (a verifier's full credit). Returns the two fields recipes log: reward = {mean, std}, accuracy.
function M.reward_metrics(scores, n)
  local mean, std = M.stats(scores, n)
  local off = type(scores) == 'table' and 1 or 0
  local correct = 0
  for i = 0, n - 1 do if scores[i + off] >= 1 then correct = correct + 1 end end
  return { mean = mean, std = std }, n > 0 and correct / n or 0
end

-- Response-length metrics of generated samples: mean, max and the share cut at max_tokens.
function M.length_metrics(samples)
  local lens, clipped = {}, 0
  for i, s in ipairs(samples) do
    lens[i] = #s.ids
    if s.finish_reason == 'length' then clipped = clipped + 1 end
  end
  local mean, _, mx = M.stats(lens)
  return { mean = mean, max = mx, clip_ratio = #samples > 0 and clipped / #samples or 0 }
end

-- A list of prompt records -> engine requests and, after generate(), the flat list of samples
-- (one per completion) that carry their record (prompt, answer, meta), group index and results.
function M.requests(records, n)
  local reqs = {}
  -- prompt_index: the record's place in the step's global batch (S:prompts), so that a rank
  -- draws the samples one process would draw for it
  for i, r in ipairs(records) do reqs[i] = { prompt_ids = r.prompt_ids, n = n, prompt_index = r.prompt_index } end
  return reqs
end

function M.flatten(records, results)
  local samples = {}
  for i, r in ipairs(records) do
    for j, out in ipairs(results[i]) do
      samples[#samples + 1] = { prompt_ids = r.prompt_ids, ids = out.ids, rollout_logprobs = out.logprobs, routing = out.routing,
        response = out.text or '', finish_reason = out.finish_reason, prompt = r.prompt, answer = r.answer,
        meta = r.meta, group = i, record = r, version = out.version, version_switches = out.version_switches }
    end
  end
  return samples
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
  local algo = require('moonrl.algo')
  local model, all = o.model, o.samples
  local temp = o.temperature or 1.0
  local tokens, seqs = 0, 0 -- of the global batch: the losses' denominators
  for _, s in ipairs(all) do
    tokens = tokens + #s.ids
    if #s.ids > 0 then seqs = seqs + 1 end
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
    local lp, ent = model:forward(b, { temperature = temp, routing = b.routing })
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
      for k = 1, b.len[i] do
        adv[t0 + k - 1] = s.adv_tokens and s.adv_tokens[k] or s.adv
        if s.old_logprobs then old[t0 + k - 1] = s.old_logprobs[k] end
        if behav then behav[t0 + k - 1] = s.rollout_logprobs and s.rollout_logprobs[k] or old[t0 + k - 1] end
        local rollout = measure and s.rollout_logprobs and s.rollout_logprobs[k]
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
    sums.entropy = sums.entropy + M.masked_mean(ent, b.mask, n) * mtok
    sums.clip_frac = sums.clip_frac + pm.clipfrac * mtok
    sums.approx_kl = sums.approx_kl + pm.approx_kl * mtok
  end
  for b, first, _, is_last in M.collective_batches(model, world, M.micro_batches(samples, o.micro_batch_tokens or 4096,
      share)) do
    if is_last and o.opt.arm then o.opt:arm() end -- the gradient sums start during this backward
    if first then micro_step(b, first)
    else M.serve_experts(model, b) end -- nothing left here: serve the experts to the other ranks (expert parallelism)
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
    lr = o.lr or o.opt.lr, tokens = tokens,
    mismatch = mm.n > 0 and { mean_abs = mm.sum / mm.n, max_abs = mm.max, token_mult_prob_error = mm.mult / mm.n } or nil }
  if n_moe > 0 then
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

-- ---- supervised updates: SFT, DPO, the default example's warm-up ------------------------------

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
  local sums = { loss = 0 }
  model:zero_grad()
  for b, first, last in o.batches do
    if not first then -- an empty batch (expert parallelism, S:micro_batches): serve the experts
      M.serve_experts(model, b)
    else
      local lp = model:forward(b)
      local loss, grad, parts = o.loss(b, lp, first, last)
      model:backward(grad)
      sums.loss = sums.loss + loss
      for k, v in pairs(parts or {}) do sums[k] = (sums[k] or 0) + v end
    end
  end
  local m = S and S:sum(sums) or sums
  m.grad_norm = opt:clip_grad_norm(o.max_grad_norm or 1.0)
  m.lr = o.lr
  M.apply_update(S, opt, o.lr, m)
  return m
end

-- The SFT step (recipes/sft.lua, the default example's warm-up): token-mean cross-entropy over
-- the response tokens of the whole batch of samples (prompt_ids, ids), on this rank's share. o: lr,
-- micro_batch_tokens (4096), max_grad_norm (1.0). Returns loss, grad_norm, lr, tokens (the
-- batch's response tokens).
function M.sft_step(S, opt, samples, o)
  local algo = require('moonrl.algo')
  local tokens = 0
  for _, s in ipairs(samples) do tokens = tokens + #s.ids end
  local m = M.supervised_step(S, opt, { lr = o.lr, max_grad_norm = o.max_grad_norm,
    batches = S:micro_batches(samples, o.micro_batch_tokens or 4096),
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
-- samples, then the update o.update(samples, step) -> m as the 'train' phase (R.sft_step,
-- R.supervised_step); then the train throughput (from m.tokens), o.metrics(m, step) for the
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
    if m.tokens then m.tokens_per_s = { train = M.rate(m.tokens, moonrl.now() - t0) } end
    if o.metrics then o.metrics(m, step) end
    history[step] = m
    if o.log ~= false then S:log(m, { quiet = o.quiet }) end
  end
  return history, first, last
end

-- The end of a recipe: S:finish() (the last checkpoint, the models saved) and the line that says
-- where everything is. Returns S:finish()'s directories.
function M.finish(S)
  local dirs = S:finish()
  local model = dirs.policy and ('; model in ' .. dirs.policy) or ''
  print('run directory: ' .. S.dir .. ' (metrics.jsonl, events.jsonl, tb/, trace.json, checkpoints/' .. model .. ')')
  return dirs
end

-- The scores of samples (their .score) as a double array (the advantages' input).
function M.scores(samples)
  local out = ffi.new('double[?]', math.max(#samples, 1))
  for i, s in ipairs(samples) do out[i - 1] = s.score end
  return out
end

-- Throughput helper: tokens / seconds (0 when no time passed).
function M.rate(tokens, seconds) return seconds > 0 and tokens / seconds or 0 end

-- The directory of a model path given as a directory or a file inside it.
function M.dir_of(path) return (path:gsub('/[^/]*%.json$', '')) end

-- ---- the config sections recipes share ------------------------------------------------------

local config = require('moonrl.config')

local function with(defaults, over)
  for k, v in pairs(over or {}) do defaults[k] = v end
  return defaults
end

-- model.dtype: fp32 | bf16 | auto (moonrl.model, "precision"); model.device: cpu | cuda | cuda:N |
-- auto (moonrl.model, "the device"). R.start applies both to the policy.
function M.model_config()
  return { dir = config.required('string', 'Hugging Face model directory'),
           tokenizer = config.optional('string', 'tokenizer directory (default model.dir)'),
           dtype = 'fp32', device = 'cpu' }
end


-- The data section: path, the record fields (JSON keys) given, and on_error: 'stop' (a bad
-- record is an error naming the file and line) or 'skip' (skipped and counted in data/skipped).
function M.data_config(fields)
  return with({ path = config.required('string', 'JSONL dataset'), on_error = 'stop' }, fields)
end

-- The data section of a recipe that also learns from a task (moonrl.tasks): data.path (JSONL)
-- or data.task, with the record fields; R.check_data says when neither is given.
function M.task_data_config(fields)
  local d = M.data_config(fields)
  d.path = config.optional('string', 'JSONL dataset (or data.task)')
  d.task = config.optional('string', 'a task from moonrl.tasks instead of data.path: ' ..
    table.concat(require('moonrl.tasks').names(), ', '))
  return d
end

-- Usage errors before any work: an unknown data.task, or neither data.path nor data.task.
function M.check_data(cfg)
  local d, tasks = cfg.data, require('moonrl.tasks')
  if not d then return end
  if d.task ~= nil then tasks.check(d.task, 'data.task')
  elseif d.path == nil then
    moonrl.usage_error(string.format("config key 'data.path' (string) is required: pass data.path=... or data.task=NAME " ..
      '(tasks: %s)', table.concat(tasks.names(), ', ')))
  end
end

-- data.task's split ('train' or 'heldout') as a moonrl.data view (its records: prompt, answer,
-- and what else the task gives, e.g. rejected).
function M.task_records(cfg, split)
  local t = require('moonrl.tasks').load(cfg.data.task, cfg.run.seed)
  return require('moonrl.data').records(t[split], { name = 'data.task=' .. cfg.data.task .. (split == 'train' and '' or ' (' .. split .. ')') })
end

function M.train_config(over)
  return with({ lr = 1e-6, schedule = 'constant', warmup = config.integer(0), weight_decay = 0.0,
    max_grad_norm = 1.0, micro_batch_tokens = config.integer(4096) }, over)
end

-- engine.cuda_graphs: a GPU engine replays its decode steps as CUDA graphs (moonrl.engine);
-- engine.kv_cache_dtype: auto (bf16 with model.dtype=bf16, else fp32), fp32 or bf16.
function M.engine_config(over)
  return with({ kv_cache_mb = config.integer(512), max_batch_tokens = config.integer(2048),
    max_seqs = config.integer(256), block_size = config.integer(16), cuda_graphs = true,
    kv_cache_dtype = 'auto' }, over)
end

-- The reward section: its name in the registry (`reward=math` sets it), what a failing reward
-- does (drop: its group is dropped and counted; zero: it scores 0; stop: an error) and the
-- seconds each sample may take (0: no limit).
function M.reward_config(name)
  return { name = name, on_error = 'drop', timeout = 30.0 }
end

-- cfg.data.path as a moonrl.data view of fields (record field -> JSON key; optional: those that
-- may be missing), data.on_error applied; a file that cannot be opened is a usage error naming
-- the key and the file (a recipe opens it before R.start: no run directory is left behind).
function M.open_data(cfg, fields, optional)
  local ok, view = pcall(require('moonrl.data').jsonl, cfg.data.path, { fields = fields, optional = optional,
    on_error = cfg.data.on_error == 'skip' and 'skip' or 'error' })
  if not ok then moonrl.usage_error('data.path: ' .. moonrl.error_text(view)) end
  return view
end

-- The reward by name, looked up now: a wrong name is a usage error listing the rewards.
function M.check_reward(cfg)
  if type(cfg.reward) ~= 'table' then return end
  local ok, err = pcall(rewards_mod().get, cfg.reward.name)
  if not ok then moonrl.usage_error('reward: ' .. moonrl.error_text(err)) end
end

local function check_choice(key, value, choices)
  for _, c in ipairs(choices) do if value == c then return end end
  moonrl.usage_error(string.format("config key '%s' must be one of %s, got '%s'", key, table.concat(choices, ', '),
    tostring(value)))
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
  check_choice('model.dtype', d, model_mod.dtypes)
  return d
end

-- ---- run.threads=auto: the thread count measured on the model -------------------------------

-- A small model runs fastest on one thread on some CPUs (its matrices are too small to split)
-- and on all cores on others (measured: 1 thread on a shared 2-core Zen 4, 2 threads ~1.8x faster
-- on an Intel machine), so `auto` times what a step does: a forward and a backward of a packed
-- batch of 16 sequences (up to 32 tokens each) at 1 thread and at n (the process's count: the
-- cores, or MOONRL_THREADS), interleaved, the best of each, and keeps the faster. A model of
-- over 30M parameters has products large enough to split: n, untimed. The timing takes a few
-- tenths of a second on a quiet machine (on a loaded one, where n threads can be many times
-- slower, a round or two); the weights are untouched (the gradients are zeroed after).
-- Returns the choice, how ('measured', 'model size', 'one core') and the seconds of each count
-- timed and the batch's tokens.
function M.measure_threads(model)
  local C = moonrl.C
  C.mrl_parallel_set_threads(0) -- the process's default (not what an earlier run in it chose)
  local n = tonumber(C.mrl_parallel_threads())
  if n <= 1 then return 1, 'one core' end
  if model.n_params > 30e6 then return n, 'model size' end
  local cfg = model.config
  local len, seqs = math.min(32, cfg.max_position_embeddings), {}
  for i = 1, 16 do
    local s = {}
    for t = 1, len do s[t] = (i * 7 + t * 3) % (cfg.vocab_size - 1) + 1 end
    seqs[i] = s
  end
  local b = model_mod.batch(seqs)
  local grad = ffi.new('float[?]', b.n_tokens)
  for t = 0, b.n_tokens - 1 do grad[t] = -1 / b.n_tokens end
  local function step(threads)
    C.mrl_parallel_set_threads(threads)
    local t0 = moonrl.now()
    model:forward(b)
    model:backward(grad)
    return moonrl.now() - t0
  end
  local best = { [1] = math.huge, [n] = math.huge }
  step(n); step(1) -- the first calls size the model's buffers and start the threads
  local spent = 0
  for _ = 1, 8 do -- alternating, so that a burst of load from elsewhere hits both
    for _, k in ipairs({ 1, n }) do
      local dt = step(k)
      spent = spent + dt
      if dt < best[k] then best[k] = dt end
    end
    if spent > 0.5 then break end
  end
  model:zero_grad()
  local choice = best[1] < best[n] and 1 or n
  C.mrl_parallel_set_threads(choice)
  return choice, 'measured', { [tostring(1)] = best[1], [tostring(n)] = best[n] }, b.n_tokens
end

-- Resolve run.threads=auto for session S with policy: the count of the run's checkpoint (a
-- resumed run keeps its choice: the bits depend on it), else the ranks' share of the host's cores
-- (a job of several processes: no timing, the ranks' counts must not differ by chance) or
-- MOONRL_THREADS when set, else measure_threads. Sets S.threads (recorded in manifest.json,
-- which `moonrl run --from` reads back) and says so on the run's first lines.
function M.auto_threads(S, policy)
  local C = moonrl.C
  local job = require('moonrl.train.dist').world() -- the whole job (trainers and rollout ranks)
  local t = S.memos.threads
  if t ~= nil then
    t = { chosen = t.chosen, by = 'checkpoint', seconds = t.seconds }
  elseif os.getenv('MOONRL_THREADS') then
    C.mrl_parallel_set_threads(0) -- the default: MOONRL_THREADS
    t = { chosen = tonumber(C.mrl_parallel_threads()), by = 'MOONRL_THREADS' }
  elseif job.size > 1 then
    C.mrl_parallel_set_threads(0) -- the default: the cores
    t = { chosen = math.max(1, math.floor(tonumber(C.mrl_parallel_threads()) / math.max(job.local_size, 1))), by = 'ranks' }
  else
    local chosen, by, seconds, tokens = M.measure_threads(policy)
    t = { chosen = chosen, by = by, seconds = seconds, tokens = tokens }
  end
  C.mrl_parallel_set_threads(t.chosen)
  S.memos.threads = { chosen = t.chosen, seconds = t.seconds } -- checkpointed with the run
  S.threads = t
  local parts = {}
  for k, v in pairs(t.seconds or {}) do parts[#parts + 1] = { tonumber(k), v } end
  table.sort(parts, function(a, b) return a[1] < b[1] end)
  for i, p in ipairs(parts) do parts[i] = string.format('%d: %.1f ms', p[1], 1000 * p[2]) end
  if S.world.rank == 0 and S.role ~= 'rollout' and S.cfg.quiet ~= true then
    print(string.format('threads: %d (run.threads=auto, %s%s)', t.chosen, t.by,
      #parts > 0 and (': a step of ' .. t.tokens .. ' tokens ' .. table.concat(parts, ', ')) or ''))
  end
  S:event('threads', { chosen = t.chosen, by = t.by, seconds = t.seconds }, { quiet = true })
  return t.chosen
end

-- ---- the recipe's session --------------------------------------------------------------------

local session = require('moonrl.train.session')
local rollout = require('moonrl.train.rollout')
-- The recipe-level session: a moonrl.train.session with the methods below and moonrl.train.rollout's.
local RS = setmetatable({}, { __index = session.Session })
RS.__index = RS
for k, f in pairs(rollout.methods) do RS[k] = f end

-- The `async` section of an RL recipe: where and when its rollouts run (moonrl.train.rollout).
M.async_config = rollout.config

-- The loop. On a rollout rank (dist.rollout_ranks) it runs the rollouts of every step for the
-- trainers and yields nothing: the recipe's loop body is the trainers' part.
function RS:steps(total, phase)
  local it = session.Session.steps(self, total, phase) -- restores a checkpoint on every rank
  -- the rollout ranks start the phase from the trainers' weights (those of an earlier phase,
  -- or of the checkpoint)
  if self.rollout_fn then self:begin_rollouts() end
  if self.role ~= 'rollout' then return it end
  if self.rollout_fn then self:serve_rollouts(total or self.run.total) end
  return function() return nil end -- a phase without a rollout: the trainers' alone
end

-- The end of a step: with a rollout, the batches asked for and the weights published (and the
-- stop decided with the rollout ranks) before the session's checkpoint and stop checks.
function RS:end_step()
  self.decided_stop = self:after_update()
  return session.Session.end_step(self)
end

-- A rollout rank keeps nothing: trainer rank 0 writes the checkpoints and the model.
function RS:finish(opts)
  if self.role == 'rollout' then
    -- with the trainers at their clean end (the phase done, not a stop): one timeline together
    self:close('finished', nil, not self.rollout_stopped and { job = require('moonrl.train.dist').current() } or nil)
    local dirs = {}
    for i, m in ipairs(self.models) do dirs[m.name] = self.dir .. '/' .. (i == 1 and 'model' or m.name) end
    return dirs
  end
  return session.Session.finish(self, opts)
end

-- cfg: the merged config; opts: name, steps (the step count), steps_key (its config key),
-- chat (use the chat template), fields / optional (the dataset's record fields, when the
-- recipe streams prompts from cfg.data.path), engine (false: none even with an engine section),
-- policy / tokenizer / tokenizer_dir (a model the recipe built itself, instead of model.dir; its
-- loaded tokenizer and the directory of its files), optimizer (false:
-- no S.opt from the train section, the recipe registers its own), free_keys (config
-- keys a resumed run may change, as session.start's), data (a moonrl.data view to stream prompts
-- from instead of cfg.data.path: a task's records, moonrl.tasks), check_policy(policy) (the
-- recipe's checks of the loaded model, before the run directory exists).
function M.start(cfg, opts)
  opts = opts or {}
  -- everything that can be checked or loaded is, before the run directory exists: a typo or a
  -- missing model leaves nothing behind
  if cfg.data and cfg.data.on_error then check_choice('data.on_error', cfg.data.on_error, { 'stop', 'skip' }) end
  if type(cfg.reward) == 'table' then check_choice('reward.on_error', cfg.reward.on_error, { 'drop', 'zero', 'stop' }) end
  check_choice('run.checkpoint_errors', cfg.run.checkpoint_errors, { 'stop', 'warn' })
  rollout.check_config(cfg)
  if not (cfg.reward_model and cfg.reward_model.dir) then M.check_reward(cfg) end -- (a reward model: once registered)
  local dtype, device = M.model_dtype(cfg), M.model_device(cfg)
  local policy, tok, tpl, tok_dir = opts.policy, opts.tokenizer, nil, opts.tokenizer_dir
  if not policy and cfg.model and cfg.model.dir then
    local ok, a, b, c, d = pcall(M.load, cfg.model.dir, { tokenizer = cfg.model.tokenizer, chat = opts.chat })
    if not ok then
      -- a run directory given for its model: say where the model is
      local dir = cfg.model.dir:gsub('/+$', '')
      local hint = ''
      if fs.exists(dir .. '/metrics.jsonl') and fs.exists(dir .. '/model/config.json') then
        hint = string.format(' (%s is a run directory: its model is model.dir=%s/model)', dir, dir)
      end
      moonrl.usage_error('model.dir: ' .. moonrl.error_text(a) .. hint)
    end
    policy, tok, tpl, tok_dir = a, b, c, d
  end
  if opts.check_policy then opts.check_policy(policy) end -- the recipe's checks of the model (usage errors)
  if policy and dtype then policy:set_dtype(dtype) end -- before the engine: it reads the same copies
  if policy and device and device ~= policy:device() then
    local ok, err = pcall(policy.to_device, policy, device) -- before the engine too: it works where the model is
    if not ok then moonrl.usage_error('model.device=' .. tostring(cfg.model.device) .. ': ' .. moonrl.error_text(err)) end
  end
  local engine
  if cfg.engine and opts.engine ~= false and policy then
    local e = cfg.engine
    check_choice('engine.kv_cache_dtype', e.kv_cache_dtype or 'auto', { 'auto', 'fp32', 'bf16' })
    local ok, made = pcall(moonrl.engine.new, policy, { kv_cache_bytes = e.kv_cache_mb * 2 ^ 20,
      block_size = e.block_size, max_batch_tokens = e.max_batch_tokens, max_seqs = e.max_seqs, seed = cfg.run.seed,
      cuda_graphs = e.cuda_graphs ~= false, kv_cache_dtype = e.kv_cache_dtype })
    if not ok then moonrl.usage_error('engine.*: ' .. moonrl.error_text(made)) end
    engine = made
  end
  if type(cfg.reward) == 'table' and cfg.reward_model and cfg.reward_model.dir then
    require('rewards.reward_model').register('reward_model', cfg.reward_model.dir)
    M.check_reward(cfg)
  end
  local data = opts.data
  if not data and opts.fields and cfg.data then
    data = M.open_data(cfg, opts.fields, opts.optional):shuffled(cfg.run.seed)
  end

  local inputs = {}
  if cfg.model and cfg.model.dir then inputs.model = cfg.model.dir end
  local S = session.start(cfg, { name = opts.name, total_steps = opts.steps, steps_key = opts.steps_key, inputs = inputs,
    free_keys = opts.free_keys })
  setmetatable(S, RS)
  S.total, S.policy, S.tok, S.tpl, S.tok_dir, S.engine = opts.steps, policy, tok, tpl, tok_dir, engine
  if policy then
    S:model('policy', policy, { tokenizer_dir = tok_dir })
    local bf16 = policy:dtype() == 'bf16'
    if S.world.rank == 0 and cfg.quiet ~= true then -- the run's precision, on its first line
      local gpu = policy:device() ~= 'cpu'
      print(string.format('precision: %s%s%s', policy:dtype(), bf16 and string.format(
        ' (fp32 master weights; bf16 products: %s)', gpu and 'cuBLASLt' or model_mod.bf16_products() or
        'reference: no bf16 hardware, slow') or '', gpu and ', on ' .. policy:device_description() or ''))
    end
    S:event('precision', { dtype = policy:dtype(), asked = dtype or 'fp32', device = policy:device(),
      bf16_products = model_mod.bf16_products() or 'none' }, { quiet = true })
  end
  if cfg.run.threads == 'auto' and policy then M.auto_threads(S, policy) end
  if cfg.train and policy and S.role ~= 'rollout' then
    if opts.optimizer ~= false then -- (false: the recipe makes it later, e.g. after a warm-up)
      S.opt = S:optimizer('policy', M.adamw(policy, { lr = cfg.train.lr, weight_decay = cfg.train.weight_decay }))
    end
    S.lr_at = moonrl.optim.schedule({ kind = cfg.train.schedule or 'constant', warmup = cfg.train.warmup or 0,
      total = opts.steps, lr = cfg.train.lr })
  end
  if engine then S.max_prompt_tokens = policy.config.max_position_embeddings - 1 end
  if data then
    S.data = S:dataset('train', data)
    data.src.on_skip = function(msg) S:event('data_skipped', { message = msg }, { quiet = true }) end
  end
  return S
end

-- The next records of the dataset (cycling through epochs), each with prompt_ids (through the
-- chat template when the config's data.chat, with data.system). A record that cannot be read,
-- rendered or encoded, or whose prompt leaves no room to generate, is skipped when
-- data.on_error is 'skip' (counted), else an error naming the file and line.
function RS:prompts(n)
  if self.group_stream then return self:group_prompt(n) end
  local all = self:global_prompts(n)
  if self.world.size == 1 then return all end
  return (self:shard(all))
end

-- How many prompts a rollout draws: n, or 1 when each group is a rollout of its own
-- (async.stream_unit=group, moonrl.train.rollout), for a recipe that draws its prompts itself.
function RS:rollout_count(n)
  if self.group_stream then
    self.group_batch = self.group_batch or n
    return 1
  end
  return n
end

-- A group stream's draw (moonrl.train.rollout): one record, the first of those a resumed run had drawn
-- but not trained on, else the next; the batch's size n noted.
function RS:group_prompt(n)
  self.group_batch = self.group_batch or n
  local rec = self.requeue and table.remove(self.requeue, 1)
  local out
  if rec then
    rec.prompt_index = 0
    out = { rec }
  else
    out = self:global_prompts(1)
  end
  self.group_drawn = out
  return out
end

-- The step's whole batch of n records (every rank reads the same), each with prompt_index, its
-- 0-based place in it; kept as self.batch_records for S:score.
function RS:global_prompts(n)
  local out = {}
  local d = self.cfg.data
  local skip = d.on_error == 'skip'
  -- one record at a time: a skipped record takes the next one, and none is passed over
  self.batches = self.batches or self.data:batches(1, { epochs = math.huge })
  local tries = 0
  while #out < n do
    local batch = self.batches()
    tries = tries + 1
    if not batch or tries > n + 10 * self.data:len() then
      error((d.path or ('data.task=' .. tostring(d.task))) .. ': no usable records (every one was skipped)', 0)
    end
    for _, r in ipairs(batch) do
      local ok, ids = pcall(M.prompt_ids, self.tok, self.tpl, r.prompt, d.system)
      local why = not ok and tostring(ids)
      if ok and self.max_prompt_tokens and #ids > self.max_prompt_tokens then
        why = string.format('prompt of %d tokens leaves no room to generate (the model has %d positions)', #ids,
          self.max_prompt_tokens + 1)
      end
      if why then
        why = string.format('%s:%d: %s', d.path or ('data.task=' .. tostring(d.task)), r.line or 0, why)
        if not skip then error(why .. ' (data.on_error=skip skips such records)', 0) end
        self.data.src.skipped = self.data.src.skipped + 1
        self:event('data_skipped', { message = why }, { quiet = true })
      else
        r.prompt_ids = ids
        out[#out + 1] = r
        r.prompt_index = #out - 1
      end
    end
  end
  self.batch_records = out
  return out
end

-- The dataset's skipped-record count (for the step's metrics).
function RS:data_metrics()
  return self.data and { skipped = self.data.src.skipped } or nil
end

-- Rewards of samples (a flat list, `group` consecutive samples per prompt) by the config's
-- reward (reward.name): the scores (double array), the samples kept, and metrics. A sample whose
-- reward fails drops its whole group with reward.on_error = 'drop' (its group's advantages
-- would be wrong), scores 0 with 'zero', is an error with 'stop'.
function RS:score(samples, group)
  local rc = self.cfg.reward
  local scores, _, failures = rewards_mod().score_batch(rc.name, samples, nil,
    { on_error = rc.on_error, timeout = rc.timeout })
  local m = { errors = #failures, dropped_groups = 0 }
  if #failures == 0 or rc.on_error ~= 'drop' then return self:gather_scored(scores, samples, m) end
  for i, f in ipairs(failures) do
    if i <= 3 then self:event('reward_error', { message = f.message }) end
  end
  group = group or 1
  local bad = {}
  for _, f in ipairs(failures) do bad[math.floor((f.index - 1) / group)] = true end
  local kept = {}
  for i, s in ipairs(samples) do
    if not bad[math.floor((i - 1) / group)] then kept[#kept + 1] = s end
  end
  for _ in pairs(bad) do m.dropped_groups = m.dropped_groups + 1 end
  local out = ffi.new('double[?]', math.max(#kept, 1))
  local k = 0
  for i = 1, #samples do
    if not bad[math.floor((i - 1) / group)] then out[k] = scores[i - 1]; k = k + 1 end
  end
  return self:gather_scored(out, kept, m)
end

-- With several ranks: every rank's scored samples, in the order of the global batch (the ranks'
-- shares are contiguous), so that advantages and metrics are those of one process. A rank's own
-- samples stay the same tables; the others' are rebuilt from their records (every rank has the
-- batch's records) and what the owner sends: tokens, log-probs, text, finish reason, score.
-- Each sample gets .rank, the rank that generated it (and trains on it: R.policy_step).
function RS:gather_scored(scores, samples, m)
  local w = self.world
  if w.size == 1 then return scores, samples, m end
  local mine = {}
  for i, s in ipairs(samples) do
    s.rank = w.rank
    mine[i] = json.object({ 'p', s.record and s.record.prompt_index or json.null, 'ids', json.array(s.ids),
      'lp', s.rollout_logprobs and json.array(s.rollout_logprobs) or json.null, 'f', s.finish_reason or json.null,
      't', s.response or '', 's', scores[i - 1] })
  end
  local blobs = w:gather_strings(json.encode(json.array(mine)))
  local all, values = {}, {}
  for r, text in ipairs(blobs) do
    if r - 1 == w.rank then
      for i, s in ipairs(samples) do all[#all + 1] = s; values[#all] = scores[i - 1] end
    else
      for _, e in ipairs(json.decode(text, 'rank ' .. (r - 1))) do
        local rec = self.batch_records[e.p + 1]
        all[#all + 1] = { prompt_ids = rec.prompt_ids, ids = e.ids, rollout_logprobs = e.lp ~= json.null and e.lp or nil,
          response = e.t, finish_reason = e.f ~= json.null and e.f or nil, prompt = rec.prompt, answer = rec.answer,
          meta = rec.meta, group = e.p + 1, record = rec, rank = r - 1 }
        values[#all] = e.s
      end
    end
  end
  local out = ffi.new('double[?]', math.max(#all, 1))
  for i, v in ipairs(values) do out[i - 1] = v end
  return out, all, w:sum(m)
end

-- A frozen copy of the initial policy (a KL reference). Before the loop: a resumed run restores
-- its checkpoint when the loop starts, so the copy is of the initial weights, as in the first run.
function RS:reference() return M.clone(self.policy) end

-- Session:micro_batches with the policy's expert parallelism (collective_batches): every rank as
-- many micro-batches, empty ones serving the experts, and the gradient sums armed on the last of
-- all (an empty batch's backward still adds to this rank's experts).
function RS:micro_batches(samples, max_tokens, opts)
  local policy = self.policy
  if not (policy and policy.expert_range and select(3, policy:expert_range())) then
    return session.Session.micro_batches(self, samples, max_tokens, opts)
  end
  local mine = opts and opts.mine and samples or self:local_samples(samples)
  local it = M.collective_batches(policy, self.world, M.micro_batches(mine, max_tokens, opts))
  return function()
    local b, first, last, is_last = it()
    if b and is_last then self:arm_gradient_sums() end
    return b, first, last
  end
end

-- moe.expert_parallel of a supervised recipe (SFT, DPO; RL recipes: moonrl.rl's setup_moe):
-- check_expert_parallel(policy, on) is R.start's check_policy (a usage error before the run
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

-- The learning rate of this step (the schedule; the guards' rollback factor is applied by update).
function RS:lr() return self.lr_at(self.step) end

return M
