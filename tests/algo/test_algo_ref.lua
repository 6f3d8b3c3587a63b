-- moonrl.algo against an independent PyTorch reference (tests/algo/ref_algo.py): random packed
-- batches (with empty and fully masked sequences, masked tokens inside responses, groups of one,
-- all-equal groups), every estimator and loss with its options; moonrl's values, metrics and
-- gradients go to a JSON file with the inputs, and the Python script recomputes them (padded
-- tensors, float64, torch.autograd) and compares.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local proc = require('moonrl.io.proc')
local algo = require('moonrl.algo')
local A = algo.agg

math.randomseed(20261130)
local function uniform(a, b) return a + (b - a) * math.random() end

-- ---------------------------------------------------------------- JSON out
local function encode(v, out)
  local tv = type(v)
  if tv == 'number' then
    if v ~= v or v == math.huge or v == -math.huge then error('non-finite number in case data') end
    out[#out + 1] = string.format('%.17g', v)
  elseif tv == 'boolean' then out[#out + 1] = tostring(v)
  elseif tv == 'string' then out[#out + 1] = string.format('%q', v)
  elseif tv == 'table' then
    if v[1] ~= nil or next(v) == nil and getmetatable(v) == 'list' then
      out[#out + 1] = '['
      for i = 1, #v do
        if i > 1 then out[#out + 1] = ',' end
        encode(v[i], out)
      end
      out[#out + 1] = ']'
    else
      out[#out + 1] = '{'
      local first = true
      for k, x in pairs(v) do
        if not first then out[#out + 1] = ',' end
        first = false
        out[#out + 1] = string.format('%q:', k)
        encode(x, out)
      end
      out[#out + 1] = '}'
    end
  else error('cannot encode ' .. tv) end
  return out
end

local function list(x, n)
  local l = {}
  for i = 0, n - 1 do l[i + 1] = tonumber(x[i]) end
  return l
end

-- ---------------------------------------------------------------- random batches
-- Sequences: a prompt (masked) then a response; some responses have masked tokens inside (tool
-- output), one sequence is fully masked, one is empty.
local function make_batch(nseq)
  local lengths, masks = {}, {}
  for i = 1, nseq do
    local p, r = math.random(0, 4), math.random(1, 12)
    if i == 2 then p, r = 3, 0 end          -- prompt only: fully masked
    if i == 3 then p, r = 0, 0 end          -- empty sequence
    lengths[i] = p + r
    for _ = 1, p do masks[#masks + 1] = 0 end
    for k = 1, r do masks[#masks + 1] = (k > 1 and math.random() < 0.15) and 0 or 1 end
  end
  local cu, n, ntok = A.cu_from_lengths(lengths)
  local b = { cu_seqlens = cu, nseq = n, ntok = ntok, mask = A.array(masks) }
  b.cu_list = list(cu, n + 1)
  return b
end

local function rand_tokens(n, lo, hi)
  local x = A.zeros(n)
  for i = 0, n - 1 do x[i] = uniform(lo, hi) end
  return x
end

local cases = {}
local function add(kind, name, b, inputs, opts, out)
  local c = { kind = kind, name = name, cu = b.cu_list, mask = list(b.mask, b.ntok), opts = opts, out = out }
  for k, v in pairs(inputs) do c[k] = v end
  cases[#cases + 1] = c
end

-- args table for a loss: the batch fields + the given arrays + options
local function args_of(b, arrays, opts)
  local a = { cu_seqlens = b.cu_seqlens, nseq = b.nseq, mask = b.mask }
  for k, v in pairs(arrays) do a[k] = v end
  for k, v in pairs(opts) do a[k] = v end
  return a
end

-- ---------------------------------------------------------------- advantages
t.test('GRPO and RLOO cases', function()
  -- groups (by id, shuffled): sizes 4, 4 (all-equal rewards), 1, 3, 2
  local ids_by_group = { { 7, 4 }, { 3, 4 }, { 9, 1 }, { 5, 3 }, { 1, 2 } }
  local ids = {}
  for _, g in ipairs(ids_by_group) do for _ = 1, g[2] do ids[#ids + 1] = g[1] end end
  for i = #ids, 2, -1 do local j = math.random(i); ids[i], ids[j] = ids[j], ids[i] end
  local nseq = #ids
  local b = make_batch(nseq)
  local scores = A.zeros(nseq)
  for i = 1, nseq do scores[i - 1] = ids[i] == 3 and 0.5 or (math.random() < 0.5 and 1 or 0) + uniform(-0.3, 0.3) end
  local gid = A.array(ids, 'int32_t')
  local variants = {
    {}, { eps_mode = 'sqrt' }, { eps = 1e-4 }, { scale = 'batch', eps = 1e-4 }, { scale = 'none' },
  }
  for k, o in ipairs(variants) do
    local args = { scores = scores, nseq = nseq, group = gid }
    for kk, v in pairs(o) do args[kk] = v end
    local adv = algo.advantages.grpo(args)
    local tok = algo.advantages.to_tokens{ values = adv, cu_seqlens = b.cu_seqlens, nseq = nseq, mask = b.mask }
    add('grpo', 'grpo#' .. k, b, { scores = list(scores, nseq), group_ids = ids }, o,
      { adv = list(adv, nseq), tok = list(tok, b.ntok) })
  end
  local adv = algo.advantages.rloo{ scores = scores, nseq = nseq, group = gid }
  add('rloo', 'rloo', b, { scores = list(scores, nseq), group_ids = ids }, {}, { adv = list(adv, nseq) })
  -- contiguous groups given by size
  local sizes = {}
  for i = 1, 12 do sizes[i] = math.floor((i - 1) / 4) end
  local s12 = rand_tokens(12, 0, 1)
  local b12 = make_batch(12)
  local a12 = algo.advantages.grpo{ scores = s12, nseq = 12, group = 4 }
  local t12 = algo.advantages.to_tokens{ values = a12, cu_seqlens = b12.cu_seqlens, nseq = 12, mask = b12.mask }
  add('grpo', 'grpo group=4', b12, { scores = list(s12, 12), group_ids = sizes }, {},
    { adv = list(a12, 12), tok = list(t12, b12.ntok) })
end)

t.test('REINFORCE++ and GAE cases', function()
  local b = make_batch(9)
  local scores = rand_tokens(9, -1, 1)
  local old, ref, values = rand_tokens(b.ntok, -3, 0), rand_tokens(b.ntok, -3, 0), rand_tokens(b.ntok, -1, 1)
  local inputs = { scores = list(scores, 9), old_logprob = list(old, b.ntok), ref_logprob = list(ref, b.ntok),
    values = list(values, b.ntok) }
  for k, o in ipairs({ { gamma = 1 }, { gamma = 0.9, kl_coef = 0.05 }, { gamma = 0.95, kl_coef = 0.1, kl_estimator = 'k3' } }) do
    local tr = algo.advantages.token_rewards(args_of(b, { scores = scores, old_logprob = old, ref_logprob = ref }, o))
    local ret = A.zeros(b.ntok)
    local adv = algo.advantages.reinforce_pp(args_of(b, { token_rewards = tr, returns = ret }, o))
    add('reinforce_pp', 'reinforce_pp#' .. k, b, inputs, o,
      { adv = list(adv, b.ntok), returns = list(ret, b.ntok), token_rewards = list(tr, b.ntok) })
  end
  for k, o in ipairs({ { gamma = 1, lam = 1 }, { gamma = 0.99, lam = 0.95, kl_coef = 0.02 },
    { gamma = 0.9, lam = 0.8, whiten = false } }) do
    local tr = algo.advantages.token_rewards(args_of(b, { scores = scores, old_logprob = old, ref_logprob = ref }, o))
    local adv, ret = algo.advantages.gae(args_of(b, { token_rewards = tr, values = values }, o))
    add('gae', 'gae#' .. k, b, inputs, o, { adv = list(adv, b.ntok), returns = list(ret, b.ntok) })
  end
end)

-- ---------------------------------------------------------------- losses
local function run_loss(kind, name, fn, b, arrays, opts, grad_len)
  local grad = A.zeros(grad_len or b.ntok)
  local loss, metrics = fn(args_of(b, arrays, opts) --[[grad below]])
  -- recompute with a gradient array (the first call checks that grad is optional)
  local a = args_of(b, arrays, opts)
  a.grad = grad
  local loss2, metrics2 = fn(a)
  t.near(loss2, loss, 1e-12, name .. ': loss with and without grad')
  local inputs = {}
  for k, v in pairs(arrays) do inputs[k] = list(v, k == 'ref_seq' and b.nseq or b.ntok) end
  local m = {}
  for k, v in pairs(metrics2) do if k ~= 'tokens' and k ~= 'ppl' and k ~= 'pg_loss' then m[k] = v end end
  add(kind, name, b, inputs, opts, { loss = loss, metrics = m, grad = list(grad, b.ntok) })
  return loss, metrics
end

local MODES = { 'token-mean', 'seq-mean-token-sum', 'seq-mean-token-mean', 'seq-mean-token-sum-norm' }

t.test('PPO and GSPO cases', function()
  local b = make_batch(10)
  local lp = rand_tokens(b.ntok, -3, -0.1)
  local old, roll, adv = A.zeros(b.ntok), A.zeros(b.ntok), rand_tokens(b.ntok, -2, 2)
  for i = 0, b.ntok - 1 do
    old[i] = lp[i] + uniform(-0.5, 0.5)
    roll[i] = old[i] + uniform(-1.5, 1.5)
  end
  local arrays = { logprob = lp, old_logprob = old, advantages = adv }
  local tis = { logprob = lp, old_logprob = old, advantages = adv, rollout_logprob = roll }
  for _, mode in ipairs(MODES) do
    run_loss('ppo', 'ppo ' .. mode, algo.policy_loss.ppo, b, arrays, { agg = mode, norm = 16 })
  end
  local _, m = run_loss('ppo', 'ppo clip-higher dual-clip', algo.policy_loss.ppo, b, arrays,
    { clip_low = 0.2, clip_high = 0.28, dual_clip = 3 })
  t.truthy(m.clipfrac_low > 0 and m.clipfrac_high > 0, 'the cases clip at both ends')
  _, m = run_loss('ppo', 'ppo dual-clip bites', algo.policy_loss.ppo, b,
    { logprob = lp, old_logprob = rand_tokens(b.ntok, -4, -1), advantages = adv }, { dual_clip = 3 })
  t.truthy(m.dual_clipfrac > 0, 'the dual clip bites in a case')
  run_loss('ppo', 'ppo global denominators', algo.policy_loss.ppo, b, arrays,
    { agg = 'seq-mean-token-mean', global_seqs = 31, coef = 0.5 })
  run_loss('ppo', 'ppo global tokens', algo.policy_loss.ppo, b, arrays, { global_tokens = 123 })
  run_loss('ppo', 'ppo truncated IS', algo.policy_loss.ppo, b, tis, { tis_cap = 2, dual_clip = 3 })
  -- large log-ratios: the ±20 clamp bites (and without it, the values stay finite here)
  local far = A.zeros(b.ntok)
  for i = 0, b.ntok - 1 do far[i] = lp[i] + (i % 3 == 0 and 25 or (i % 3 == 1 and -25 or 0.1)) end
  run_loss('ppo', 'ppo log-ratio clamp', algo.policy_loss.ppo, b,
    { logprob = lp, old_logprob = far, advantages = adv }, { dual_clip = 3 })
  run_loss('ppo', 'ppo no clamp', algo.policy_loss.ppo, b,
    { logprob = lp, old_logprob = old, advantages = adv }, { log_ratio_clamp = false })
  for _, mode in ipairs(MODES) do
    run_loss('reinforce', 'reinforce ' .. mode, algo.policy_loss.reinforce, b, arrays, { agg = mode, norm = 16 })
  end
  run_loss('reinforce', 'reinforce truncated IS global tokens', algo.policy_loss.reinforce, b, tis,
    { tis_cap = 2, global_tokens = 77, coef = 0.5 })
  run_loss('reinforce', 'reinforce without old_logprob', algo.policy_loss.reinforce, b,
    { logprob = lp, advantages = adv }, { agg = 'seq-mean-token-mean' })
  -- the registered losses are these functions (dual_clip: ppo with c = 3)
  run_loss('ppo', 'losses.get(dual_clip)', algo.losses.get('dual_clip'), b, arrays, { clip_high = 0.28, dual_clip = 3 })
  run_loss('reinforce', 'losses.get(reinforce)', algo.losses.get('reinforce'), b, arrays, {})
  run_loss('gspo', 'gspo defaults', algo.policy_loss.gspo, b, arrays, {})
  run_loss('gspo', 'gspo wide clip token-mean', algo.policy_loss.gspo, b, arrays,
    { clip_low = 0.05, clip_high = 0.08, agg = 'token-mean' })
  run_loss('gspo', 'gspo truncated IS', algo.policy_loss.gspo, b, tis, { clip_low = 0.05, clip_high = 0.1 })
end)

t.test('off-policy correction and decoupled PPO cases', function()
  -- proximal = the trainer's old log-probs, behaviour = the engine's: token ratios e^±1.2 (beyond
  -- C = 2 both ways), a few beyond the ±20 clamp; sequence products and geometric means on both
  -- sides of the bounds
  local b = make_batch(12)
  local lp = rand_tokens(b.ntok, -3, -0.1)
  local old, behav, adv = A.zeros(b.ntok), A.zeros(b.ntok), rand_tokens(b.ntok, -2, 2)
  for i = 0, b.ntok - 1 do
    old[i] = lp[i] + uniform(-0.5, 0.5)
    behav[i] = old[i] + uniform(-1.2, 1.2)
  end
  local far, below = A.zeros(b.ntok), A.zeros(b.ntok)
  for i = 0, b.ntok - 1 do
    far[i] = behav[i] + (i % 7 == 0 and 25 or (i % 7 == 3 and -25 or 0))
    below[i] = behav[i] + (i % 5 == 0 and 25 or 0) -- only below the clamp: log ratio < −20
  end
  local function weights(name, bb, prox, beh, opts)
    local a = args_of(bb, { proximal_logprob = prox, behavior_logprob = beh }, opts)
    local w, m = algo.correction.weights(a)
    add('correction', name, bb, { proximal_logprob = list(prox, bb.ntok), behavior_logprob = list(beh, bb.ntok) },
      opts, { weights = list(w, bb.ntok), metrics = m })
    return w, m
  end
  local function check_bites(name, m, key)
    t.truthy(m[key] > 0 and m[key] < 1, name .. ': ' .. key .. ' strictly between 0 and 1 (' .. m[key] .. ')')
  end
  weights('none', b, old, behav, { mode = 'none' })
  local wt, mt = weights('tis C=2', b, old, behav, { mode = 'tis' })
  check_bites('tis', mt, 'clipfrac')
  weights('tis C=1', b, old, behav, { mode = 'tis', clip = 1 })
  weights('tis C=3 far', b, old, far, { mode = 'tis', clip = 3 })
  weights('tis below the clamp', b, old, below, { mode = 'tis' })
  local _, m = weights('tis_seq', b, old, behav, { mode = 'tis_seq', clip = 2 })
  check_bites('tis_seq', m, 'clipfrac')
  _, m = weights('mis_token', b, old, behav, { mode = 'mis_token' })
  check_bites('mis_token', m, 'masked_frac')
  weights('mis_token ratio asymmetric', b, old, far, { mode = 'mis_token', lower = 0.4, upper = 2.5, weight = 'ratio' })
  local wseq
  wseq, m = weights('mis_seq', b, old, behav, { mode = 'mis_seq', lower = 0.2, upper = 5 })
  check_bites('mis_seq', m, 'masked_frac')
  weights('mis_seq ratio far', b, old, far, { mode = 'mis_seq', upper = 1e6, weight = 'ratio' })
  local wgeo
  wgeo, m = weights('mis_geo', b, old, behav, { mode = 'mis_geo', lower = 0.8, upper = 1.25 })
  check_bites('mis_geo', m, 'masked_frac')
  check_bites('mis_geo', m, 'seq_masked_frac')
  weights('mis_geo default bounds ratio', b, old, behav, { mode = 'mis_geo', weight = 'ratio' })
  -- edge cases: no token counts (all masked), a batch of fully masked and empty sequences
  local e = make_batch(4)
  for i = 0, e.ntok - 1 do e.mask[i] = 0 end
  local eo, eb = rand_tokens(e.ntok, -3, -0.1), rand_tokens(e.ntok, -3, -0.1)
  for _, mode in ipairs({ 'tis', 'tis_seq', 'mis_token', 'mis_seq', 'mis_geo' }) do
    local w, em = weights('empty mask ' .. mode, e, eo, eb, { mode = mode })
    t.eq(em.tokens, 0)
    for i = 0, e.ntok - 1 do t.eq(w[i], 0, 'no weight on masked tokens') end
  end
  -- the policy losses with the weights
  local function with_w(w)
    return { logprob = lp, old_logprob = old, advantages = adv, weights = w }
  end
  run_loss('ppo', 'ppo weights tis', algo.policy_loss.ppo, b, with_w(wt), { clip_high = 0.28, dual_clip = 3 })
  run_loss('ppo', 'ppo weights mis_seq seq-mean-token-mean', algo.policy_loss.ppo, b, with_w(wseq),
    { agg = 'seq-mean-token-mean', global_seqs = 17 })
  run_loss('gspo', 'gspo weights mis_geo', algo.policy_loss.gspo, b, with_w(wgeo), { clip_low = 0.05, clip_high = 0.1 })
  -- decoupled PPO (AReaL)
  local dec = { logprob = lp, old_logprob = old, behavior_logprob = behav, advantages = adv }
  run_loss('decoupled_ppo', 'decoupled', algo.policy_loss.decoupled_ppo, b, dec, {})
  _, m = run_loss('decoupled_ppo', 'decoupled cap 2 (mask)', algo.policy_loss.decoupled_ppo, b, dec,
    { behav_imp_weight_cap = 2, clip_high = 0.28 })
  check_bites('decoupled cap', m, 'behav_masked_frac')
  _, m = run_loss('decoupled_ppo', 'decoupled cap 2 truncate', algo.policy_loss.decoupled_ppo, b, dec,
    { behav_imp_weight_cap = 2, behav_cap_mode = 'truncate', dual_clip = 3 })
  check_bites('decoupled truncate', m, 'behav_clipfrac')
  run_loss('decoupled_ppo', 'decoupled seq-mean-token-mean global', algo.policy_loss.decoupled_ppo, b, dec,
    { agg = 'seq-mean-token-mean', global_seqs = 20, behav_imp_weight_cap = 5, coef = 0.5 })
  run_loss('decoupled_ppo', 'decoupled far, C = 1', algo.policy_loss.decoupled_ppo, b,
    { logprob = lp, proximal_logprob = old, behavior_logprob = far, advantages = adv }, { behav_imp_weight_cap = 1 })
  run_loss('decoupled_ppo', 'decoupled with a geometric mask', algo.policy_loss.decoupled_ppo, b,
    { logprob = lp, old_logprob = old, behavior_logprob = behav, advantages = adv, weights = wgeo },
    { behav_imp_weight_cap = 3 })
  local el = rand_tokens(e.ntok, -3, -0.1)
  local loss = run_loss('decoupled_ppo', 'decoupled empty mask', algo.policy_loss.decoupled_ppo, e,
    { logprob = el, old_logprob = eo, behavior_logprob = eb, advantages = rand_tokens(e.ntok, -1, 1) },
    { behav_imp_weight_cap = 2 })
  t.eq(loss, 0)
  run_loss('ppo', 'ppo empty mask weights', algo.policy_loss.ppo, e,
    { logprob = el, old_logprob = eo, advantages = rand_tokens(e.ntok, -1, 1), weights = rand_tokens(e.ntok, 0, 2) },
    { agg = 'seq-mean-token-mean' })
end)

t.test('KL, entropy, value, DPO, SFT cases', function()
  local b = make_batch(10)
  local lp, ref = rand_tokens(b.ntok, -4, -0.1), rand_tokens(b.ntok, -4, -0.1)
  ref[1] = lp[1] + 30   -- past the k3 clamps
  ref[2] = lp[2] - 30
  for _, est in ipairs({ 'k1', 'k2', 'k3' }) do
    for _, mode in ipairs({ 'token-mean', 'seq-mean-token-mean' }) do
      run_loss('kl', 'kl ' .. est .. ' ' .. mode, algo.kl.loss, b, { logprob = lp, ref_logprob = ref },
        { estimator = est, agg = mode, coef = 0.01 })
    end
  end
  local lp2, ref2 = rand_tokens(b.ntok, -4, -0.1), rand_tokens(b.ntok, -4, -0.1)
  run_loss('kl', 'kl k3 unclamped', algo.kl.loss, b, { logprob = lp2, ref_logprob = ref2 },
    { estimator = 'low_var_kl', clamp = false })
  local h = rand_tokens(b.ntok, 0, 3)
  for _, mode in ipairs(MODES) do
    run_loss('entropy', 'entropy ' .. mode, algo.kl.entropy_bonus, b, { entropy = h }, { agg = mode, norm = 20, coef = 0.01 })
  end
  local v, vold, ret = rand_tokens(b.ntok, -1, 1), A.zeros(b.ntok), rand_tokens(b.ntok, -1, 1)
  for i = 0, b.ntok - 1 do vold[i] = v[i] + uniform(-0.6, 0.6) end
  for _, mode in ipairs(MODES) do
    run_loss('value', 'value ' .. mode, algo.value_loss.clipped, b,
      { values = v, old_values = vold, returns = ret }, { agg = mode, norm = 12, clip = 0.2 })
  end
  run_loss('value', 'value coef', algo.value_loss.clipped, b, { values = v, old_values = vold, returns = ret },
    { coef = 0.5, global_tokens = 77 })
  for _, mode in ipairs(MODES) do
    run_loss('sft', 'sft ' .. mode, algo.sft.loss, b, { logprob = lp }, { agg = mode, norm = 9 })
  end
  -- DPO: 6 pairs
  local bd = make_batch(12)
  local dlp, dref = rand_tokens(bd.ntok, -3, -0.1), rand_tokens(bd.ntok, -3, -0.1)
  local refseq = rand_tokens(12, -20, -1)
  local pairs_ = { logprob = dlp, ref_logprob = dref }
  for _, o in ipairs({
    { loss_type = 'sigmoid' }, { loss_type = 'sigmoid', label_smoothing = 0.1, beta = 0.5 },
    { loss_type = 'ipo', beta = 0.1 }, { loss_type = 'ipo', beta = 0.5, length_normalize = true },
    { loss_type = 'hinge', beta = 0.3 }, { loss_type = 'sigmoid', layout = 'halves', global_pairs = 10, coef = 2 },
  }) do
    local name = 'dpo ' .. o.loss_type .. (o.label_smoothing and ' cdpo' or '') .. (o.layout and ' halves' or '')
      .. (o.length_normalize and ' normalised' or '')
    run_loss('dpo', name, algo.dpo.loss, bd, pairs_, o)
  end
  run_loss('dpo', 'dpo ref_seq', algo.dpo.loss, bd, { logprob = dlp, ref_seq = refseq }, { beta = 0.2 })
end)

t.test('the PyTorch reference agrees', function()
  local path = os.tmpname()
  local f = assert(io.open(path, 'w'))
  f:write(table.concat(encode({ cases = cases }, {})))
  f:close()
  local r = proc.run({ '/usr/bin/python3', 'tests/algo/ref_algo.py', path }, { timeout = 300 })
  io.stdout:write(r.stdout, r.stderr)
  os.remove(path)
  t.truthy(r.ok, 'ref_algo.py reports no mismatch')
end)

t.done()
