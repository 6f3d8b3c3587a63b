-- moonrl.recipe: the small pieces every recipe (recipes/*.lua) shares, so that the
-- recipes themselves read like the algorithm.
--
--   local R = require('moonrl.recipe')
--   local b = R.pack(samples)                -- prompt_ids + ids -> packed batch with a response mask
--   for mb in R.micro_batches(samples, 2048) do ... end   -- by token budget, order kept
--   local ref = R.clone(model)               -- a frozen copy (reference policy)
--   local critic = R.critic_from(model)      -- same weights plus a value head
--   R.save(run, model, tokenizer_dir)        -- run.dir/model in HF format, tokenizer files copied
--   R.masked_mean(x, mask, n), R.mean_std(list)
--
-- A sample is a table with prompt_ids (Lua list) and ids (the response tokens, Lua list); the
-- packed sequence is prompt_ids .. ids. The log-prob of token t+1 sits at output t (see
-- model.h), so the response's log-probs are outputs P-1 .. P+R-2 of a sequence with a prompt
-- of P tokens and R response tokens; those are the mask's ones.
local ffi = require('ffi')
local moonrl = require('moonrl')
local model_mod = require('moonrl.model')

local M = {}

-- ---- loading a policy and turning text into token ids ------------------------------------

-- The model, its tokenizer and (when opts.chat and the tokenizer config has one) its chat template.
-- dir: a Hugging Face directory; opts.tokenizer: another directory for the tokenizer files.
function M.load(dir, opts)
  opts = opts or {}
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
    end
    for k = i, j do
      local sk = samples[k]
      local seq, keep = {}, parent and 1 or P -- prompt tokens this sequence carries
      for t = 1, keep do seq[t] = sk.prompt_ids[P - keep + t] end
      for t = 1, #sk.ids do seq[keep + t] = sk.ids[t] end
      seqs[#seqs + 1] = seq
      prefix[#seqs] = parent
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
  return b
end

-- Iterate over consecutive slices of samples whose packed size stays within max_tokens (a
-- sample longer than the budget gets a micro-batch of its own). Yields the packed batch and
-- the first and last sample index. opts: as pack's (the budget counts every sample whole).
function M.micro_batches(samples, max_tokens, opts)
  local i = 1
  return function()
    if i > #samples then return nil end
    local j, tokens = i, 0
    while j <= #samples do
      local n = #samples[j].prompt_ids + #samples[j].ids
      if j > i and tokens + n > max_tokens then break end
      tokens = tokens + n
      j = j + 1
    end
    local first = i
    i = j
    return M.pack(samples, first, j - 1, opts), first, j - 1
  end
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
-- the value estimates when opts.values (a value-head model). opts.share_prompts (true): see pack.
function M.logprobs(model, samples, max_tokens, opts)
  opts = opts or {}
  local lps, vals = {}, opts.values and {} or nil
  for b, first in M.micro_batches(samples, max_tokens, { share_prompts = opts.share_prompts ~= false }) do
    local lp, _, v = model:forward(b, { temperature = opts.temperature, values = opts.values })
    M.gather(b, lp, lps, first)
    if vals then M.gather(b, v, vals, first) end
  end
  return lps, vals
end

-- A new model with model's config and a copy of its weights (a frozen reference policy).
function M.clone(model, opts)
  opts = opts or {}
  local copy = model_mod.new(model.config, { value_head = opts.value_head or model.config.value_head })
  M.copy_weights(model, copy)
  return copy
end

-- Copy every parameter of src into the view of the same name in dst (dst may have more views,
-- e.g. a value head, which keep their initial values).
function M.copy_weights(src, dst)
  local sp, dp = src:params(), dst:params()
  local by_name = {}
  for _, v in ipairs(dst:views()) do by_name[v.name] = v end
  for _, v in ipairs(src:views()) do
    local d = by_name[v.name]
    if d and d.numel == v.numel then ffi.copy(dp + d.offset, sp + v.offset, 4 * v.numel) end
  end
end

-- A critic for PPO: the policy's weights with a scalar value head (score.weight) set to zero, so
-- the first value estimates are 0.
function M.critic_from(policy)
  local critic = M.clone(policy, { value_head = true })
  for _, v in ipairs(critic:views()) do
    if v.name == 'score.weight' then ffi.fill(critic:params() + v.offset, 4 * v.numel) end
  end
  return critic
end

-- AdamW over a model's one parameter buffer, no decay on norms and biases.
function M.adamw(model, o)
  local p, n = model:params()
  local g = model:grads()
  return require('moonrl.optim').adamw({ params = p, grads = g, n = n, lr = o.lr, betas = o.betas,
    eps = o.eps, weight_decay = o.weight_decay, no_decay = model:no_decay_ranges() })
end

local TOKENIZER_FILES = { 'tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json',
  'chat_template.jinja', 'generation_config.json', 'vocab.json', 'merges.txt' }

local function copy_file(from, to)
  local f = io.open(from, 'rb')
  if not f then return false end
  local data = f:read('*a')
  f:close()
  local o = assert(io.open(to, 'wb'))
  o:write(data)
  o:close()
  return true
end

-- Save model to dir (default run.dir/model) in Hugging Face format with the tokenizer files of
-- tokenizer_dir copied beside it. Returns the directory.
function M.save(run, model, tokenizer_dir, dir)
  dir = dir or (run.dir .. '/model')
  model:save(dir)
  if tokenizer_dir then
    for _, name in ipairs(TOKENIZER_FILES) do copy_file(tokenizer_dir .. '/' .. name, dir .. '/' .. name) end
  end
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
  for i, r in ipairs(records) do reqs[i] = { prompt_ids = r.prompt_ids, n = n } end
  return reqs
end

function M.flatten(records, results)
  local samples = {}
  for i, r in ipairs(records) do
    for j, out in ipairs(results[i]) do
      samples[#samples + 1] = { prompt_ids = r.prompt_ids, ids = out.ids, rollout_logprobs = out.logprobs,
        response = out.text or '', finish_reason = out.finish_reason, prompt = r.prompt, answer = r.answer,
        meta = r.meta, group = i, record = r }
    end
  end
  return samples
end

-- One optimizer step of the policy on a list of samples (the update of GRPO, RLVR and PPO).
-- Each sample has prompt_ids, ids and either adv (one number for the whole response: GRPO)
-- or adv_tokens (a list, one per response token: PPO with GAE), and optionally old_logprobs
-- (a list; when absent the batch is on-policy and log π_old = log πθ, detached). o:
--   model, opt; ref (a frozen reference model: adds the KL loss term, coef kl_coef, estimator
--   kl_estimator); loss ('ppo' or 'gspo'), clip_low, clip_high, dual_clip, agg, norm;
--   entropy_coef (0); temperature (1); micro_batch_tokens (4096); max_grad_norm (1); lr;
--   share_prompts (true): the samples of one prompt share its rows (see pack);
--   measure_mismatch (true): when the samples carry the engine's rollout_logprobs and the weights
--   are still those that generated them (the first update after generation), report how far the
--   trainer's log-probs are from the engine's (metrics.mismatch: mean_abs, max_abs,
--   token_mult_prob_error), since a gap silently turns on-policy RL off-policy.
-- Micro-batches accumulate gradients with the GLOBAL denominators (tokens and sequences of the
-- whole list), so the step equals one step on the whole batch. Returns metrics: loss, kl,
-- entropy, clip_frac, approx_kl, grad_norm, lr, tokens.
function M.policy_step(o)
  local algo = require('moonrl.algo')
  local model, samples = o.model, o.samples
  local temp = o.temperature or 1.0
  local tokens, seqs = 0, 0
  for _, s in ipairs(samples) do
    tokens = tokens + #s.ids
    if #s.ids > 0 then seqs = seqs + 1 end
  end
  local sums = { loss = 0, kl = 0, entropy = 0, clip_frac = 0, approx_kl = 0 }
  local measure = o.measure_mismatch ~= false
  local mm = { sum = 0, max = 0, mult = 0, n = 0 }
  model:zero_grad()
  local share = { share_prompts = o.share_prompts ~= false }
  for b, first in M.micro_batches(samples, o.micro_batch_tokens or 4096, share) do
    local n = b.n_tokens
    local ref_lp = o.ref and o.ref:forward(b, { temperature = temp })
    local lp, ent = model:forward(b, { temperature = temp })
    local adv, old = ffi.new('float[?]', n), ffi.new('float[?]', n)
    ffi.copy(old, lp, 4 * n)
    for i = 1, #b.len do
      local s, t0 = samples[first + i - 1], b.first[i]
      for k = 1, b.len[i] do
        adv[t0 + k - 1] = s.adv_tokens and s.adv_tokens[k] or s.adv
        if s.old_logprobs then old[t0 + k - 1] = s.old_logprobs[k] end
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
    local loss, pm = algo.policy_loss[o.loss or 'ppo'](args)
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
  local gnorm = o.opt:clip_grad_norm(o.max_grad_norm or 1.0)
  -- no signal (every advantage 0): no step, or Adam's moments would keep moving the weights
  if gnorm > 0 then o.opt:step(o.lr) end
  local inv = tokens > 0 and 1 / tokens or 0
  return { loss = sums.loss, kl = o.ref and sums.kl or nil, entropy = sums.entropy * inv,
    clip_frac = sums.clip_frac * inv, approx_kl = sums.approx_kl * inv, grad_norm = gnorm,
    lr = o.lr or o.opt.lr, tokens = tokens,
    mismatch = mm.n > 0 and { mean_abs = mm.sum / mm.n, max_abs = mm.max, token_mult_prob_error = mm.mult / mm.n } or nil }
end

-- Throughput helper: tokens / seconds (0 when no time passed).
function M.rate(tokens, seconds) return seconds > 0 and tokens / seconds or 0 end

-- The directory of a model path given as a directory or a file inside it.
function M.dir_of(path) return (path:gsub('/[^/]*%.json$', '')) end

-- Stop early at a safe point when run.max_seconds is reached (0: no limit) or a stop was asked.
function M.check_stop(cfg, run)
  moonrl.check_stop()
  local limit = cfg.run and cfg.run.max_seconds or 0
  return limit > 0 and (moonrl.now() - run.t0) >= limit
end

return M
