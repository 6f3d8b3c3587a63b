-- moonrl.algo on small hand-computed fixtures (worked out in the comments), finite-difference
-- gradient checks of every loss, gradient accumulation with global denominators, a custom objective
-- written with the public helpers only, float32 inputs, and the error messages.
local t = require('moonrl.testing')
local ffi = require('ffi')
local algo = require('moonrl.algo')
local A = algo.agg

local function batch(lengths, mask)
  local cu, nseq, ntok = A.cu_from_lengths(lengths)
  return { cu_seqlens = cu, nseq = nseq, ntok = ntok, mask = A.array(mask) }
end
local function with(b, fields)
  local a = { cu_seqlens = b.cu_seqlens, nseq = b.nseq, mask = b.mask }
  for k, v in pairs(fields) do a[k] = v end
  return a
end
local function near_list(got, want, tol, what)
  for i = 1, #want do t.near(got[i - 1], want[i], tol or 1e-9, (what or 'value') .. '[' .. (i - 1) .. ']') end
end

-- ---------------------------------------------------------------- advantages

t.test('GRPO by hand', function()
  -- groups {1,0,1,0}, {3}, {2,2}:
  --   μ = 0.5, σ (n−1) = sqrt(4·0.25/3) = 0.577350; A = ±0.5/(0.577350 + 1e-6) = ±0.866023904
  --   group of one: μ = 0, σ = 1 → 3/(1 + 1e-6) = 2.999997; all equal: 0/(0 + 1e-6) = 0
  local s = A.array({ 1, 0, 1, 0, 3, 2, 2 })
  local ids = A.array({ 0, 0, 0, 0, 1, 2, 2 }, 'int32_t')
  local a = algo.advantages.grpo{ scores = s, nseq = 7, group = ids }
  near_list(a, { 0.8660239037870368, -0.8660239037870368, 0.8660239037870368, -0.8660239037870368,
    2.9999970000030003, 0, 0 }, 1e-12, 'grpo')
  -- Dr. GRPO: s − μ only (the group of one keeps μ = 0)
  a = algo.advantages.grpo{ scores = s, nseq = 7, group = ids, scale = 'none' }
  near_list(a, { 0.5, -0.5, 0.5, -0.5, 3, 0, 0 }, 1e-12, 'dr grpo')
  -- eps inside the root: 0.5 / sqrt(1/3 + 1e-6)
  a = algo.advantages.grpo{ scores = s, nseq = 4, group = 4, eps_mode = 'sqrt' }
  t.near(a[0], 0.5 / math.sqrt(1 / 3 + 1e-6), 1e-12, 'eps inside sqrt')
  -- contiguous groups by size equal the id form
  local b = algo.advantages.grpo{ scores = s, nseq = 4, group = 2 }
  t.near(b[0], 0.5 / (math.sqrt(0.5) + 1e-6), 1e-12, 'group of 2: σ = sqrt(0.5)')
end)

t.test('RLOO by hand', function()
  -- {1, 0, 0}: 1 − 0 = 1; 0 − (1 + 0)/2 = −0.5 twice; a group of one keeps its score
  local a = algo.advantages.rloo{ scores = A.array({ 1, 0, 0, 4 }), nseq = 4, group = A.array({ 5, 5, 5, 6 }) }
  near_list(a, { 1, -0.5, -0.5, 4 }, 1e-12, 'rloo')
end)

t.test('broadcast and token rewards by hand', function()
  local b = batch({ 3, 2 }, { 0, 1, 1, 1, 0 })
  local tok = algo.advantages.to_tokens(with(b, { values = A.array({ 2, -1 }) }))
  near_list(tok, { 0, 2, 2, -1, 0 }, 0, 'to_tokens')
  -- the score sits on the last token with m = 1 (sequence 1's last token is masked)
  local r = algo.advantages.token_rewards(with(b, { scores = A.array({ 5, 7 }) }))
  near_list(r, { 0, 0, 5, 7, 0 }, 0, 'token_rewards')
  -- KL penalty k1: −0.1 · (old − ref) on response tokens
  r = algo.advantages.token_rewards(with(b, { scores = A.array({ 5, 7 }), kl_coef = 0.1,
    old_logprob = A.array({ -1, -1, -1, -1, -1 }), ref_logprob = A.array({ -2, -2, -3, -2, -2 }) }))
  near_list(r, { 0, -0.1, 5 - 0.2, 7 - 0.1, 0 }, 1e-12, 'token_rewards with KL')
end)

t.test('REINFORCE++ by hand', function()
  -- mask 0 1 1 1, reward 1 on the last token, γ = 0.5: returns 0.125 (masked), 0.25, 0.5, 1.
  -- Whitened over {0.25, 0.5, 1}: μ = 0.583333, unbiased var = 0.145833 → 1.091089, −0.218218, −0.872872
  -- in token order (0.25 → −0.8729, 0.5 → −0.2182, 1 → 1.0911); the masked token gets 0.
  local b = batch({ 4 }, { 0, 1, 1, 1 })
  local ret = A.zeros(4)
  local a = algo.advantages.reinforce_pp(with(b, { token_rewards = A.array({ 0, 0, 0, 1 }), gamma = 0.5, returns = ret }))
  near_list(ret, { 0.125, 0.25, 0.5, 1 }, 1e-12, 'returns')
  near_list(a, { 0, -0.8728715310169463, -0.21821788275423665, 1.0910894137711826 }, 1e-7, 'advantages')
  -- the running return restarts at a masked token: mask 1 0 1, rewards 1 on both response tokens
  local b2 = batch({ 3 }, { 1, 0, 1 })
  a = algo.advantages.reinforce_pp(with(b2, { token_rewards = A.array({ 1, 0, 1 }), gamma = 1, returns = ret }))
  near_list(ret, { 1, 1, 1 }, 0, 'reset at the mask: 1 (not 2) on token 0')
end)

t.test('GAE by hand', function()
  -- mask 0 1 1, V = (9, 0.5, 0.2), reward 1 on the last token.
  -- γ = λ = 1: t2 δ = 1 − 0.2 = 0.8, A = 0.8; t1 δ = 0.2 − 0.5 = −0.3, A = 0.5; returns 1, 1.
  local b = batch({ 3 }, { 0, 1, 1 })
  local r, v = A.array({ 0, 0, 1 }), A.array({ 9, 0.5, 0.2 })
  local a, ret = algo.advantages.gae(with(b, { token_rewards = r, values = v, whiten = false }))
  near_list(a, { 0, 0.5, 0.8 }, 1e-12, 'A')
  near_list(ret, { 0, 1, 1 }, 1e-12, 'returns')
  -- γ = 0.9, λ = 0.5: t1 δ = 0.9·0.2 − 0.5 = −0.32, A = −0.32 + 0.45·0.8 = 0.04; returns 1, 0.54
  a, ret = algo.advantages.gae(with(b, { token_rewards = r, values = v, whiten = false, gamma = 0.9, lam = 0.5 }))
  near_list(a, { 0, 0.04, 0.8 }, 1e-12, 'A')
  near_list(ret, { 0, 0.54, 1 }, 1e-12, 'returns')
  -- whitened: {0.04, 0.8} → ∓1/sqrt(2) (two values: (x − μ)/σ with n−1 is ±0.7071)
  a = algo.advantages.gae(with(b, { token_rewards = r, values = v, gamma = 0.9, lam = 0.5 }))
  near_list(a, { 0, -math.sqrt(0.5), math.sqrt(0.5) }, 1e-6, 'whitened')
end)

-- ---------------------------------------------------------------- aggregation and losses

t.test('aggregation modes by hand', function()
  -- seq 0: L 1 2 (m 1 1); seq 1: fully masked; seq 2: L 3 4 8 (m 1 1 1)
  --   token-mean (1+2+3+4+8)/5 = 3.6; seq-mean-token-sum (3 + 15)/2 = 9 (seq 1 left out);
  --   seq-mean-token-mean (1.5 + 5)/2 = 3.25; seq-mean-token-sum-norm (norm 10) 18/10 = 1.8
  local b = batch({ 2, 2, 3 }, { 1, 1, 0, 0, 1, 1, 1 })
  local L = A.array({ 1, 2, 100, 100, 3, 4, 8 })
  local a = with(b, { norm = 10 })
  t.near(A.aggregate(L, a, 'token-mean'), 3.6, 1e-12)
  t.near(A.aggregate(L, a, 'seq-mean-token-sum'), 9, 1e-12)
  t.near(A.aggregate(L, a, 'seq-mean-token-mean'), 3.25, 1e-12)
  t.near(A.aggregate(L, a, 'seq-mean-token-sum-norm'), 1.8, 1e-12)
  local c = A.counts(b)
  t.eq(c.tokens, 5)
  t.eq(c.seqs, 2)
  -- global denominators replace the local ones
  t.near(A.aggregate(L, with(b, { global_tokens = 10 }), 'token-mean'), 1.8, 1e-12)
  t.near(A.aggregate(L, with(b, { global_seqs = 4 }), 'seq-mean-token-mean'), 6.5 / 4, 1e-12)
end)

t.test('PPO-clip by hand', function()
  -- one sequence, 5 tokens, clip_low 0.2, clip_high 0.28, dual clip 3, old = 0 so r = exp(lp):
  --   r 1.5,  A  1: max(−1.5, −1.28) = −1.28, clipped high, grad 0
  --   r 1.5,  A −1: max(1.5, 1.28) = 1.5, grad −A·r = 1.5
  --   r 4,    A −1: max(4, 1.28) = 4 > 3 → dual clip 3, grad 0
  --   r 0.5,  A −1: max(0.5, 0.8) = 0.8, clipped low, grad 0
  --   r 1.25, A  1: max(−1.25, −1.25) = −1.25, grad −1.25
  -- token-mean: (−1.28 + 1.5 + 3 + 0.8 − 1.25)/5 = 0.554; grads /5
  local b = batch({ 5 }, { 1, 1, 1, 1, 1 })
  local lp = A.array({ math.log(1.5), math.log(1.5), math.log(4), math.log(0.5), math.log(1.25) })
  local g = A.zeros(5)
  local loss, m = algo.policy_loss.ppo(with(b, { logprob = lp, old_logprob = A.zeros(5),
    advantages = A.array({ 1, -1, -1, -1, 1 }), clip_low = 0.2, clip_high = 0.28, dual_clip = 3, grad = g }))
  t.near(loss, 0.554, 1e-12, 'loss')
  near_list(g, { 0, 0.3, 0, 0, -0.25 }, 1e-12, 'grad')
  t.near(m.clipfrac_high, 0.2, 1e-12)
  t.near(m.clipfrac_low, 0.2, 1e-12)
  t.near(m.dual_clipfrac, 0.2, 1e-12)
  t.near(m.ratio_max, 4, 1e-12)
  t.near(m.ratio_mean, (1.5 + 1.5 + 4 + 0.5 + 1.25) / 5, 1e-12)
  -- truncated IS: weight min(exp(old − rollout), 2): rollout = old − log 3 → weight 2, loss doubles
  local roll = A.array({ -math.log(3), -math.log(3), -math.log(3), -math.log(3), -math.log(3) })
  local loss2, m2 = algo.policy_loss.ppo(with(b, { logprob = lp, old_logprob = A.zeros(5), rollout_logprob = roll,
    advantages = A.array({ 1, -1, -1, -1, 1 }), clip_low = 0.2, clip_high = 0.28, dual_clip = 3 }))
  t.near(loss2, 2 * 0.554, 1e-12, 'TIS-weighted loss')
  t.near(m2.tis_weight_mean, 2, 1e-12)
end)

t.test('GSPO by hand', function()
  -- Δ = 0.1, 0.3 → s = exp(0.2) = 1.2214028 (inside 1 ± 0.28); A = 1: L = −s on both tokens;
  -- seq-mean-token-mean: loss = −s, each token's gradient −s/2 (through its own log-prob only)
  local b = batch({ 2 }, { 1, 1 })
  local g = A.zeros(2)
  local loss = algo.policy_loss.gspo(with(b, { logprob = A.array({ 0.1, 0.3 }), old_logprob = A.zeros(2),
    advantages = A.array({ 1, 1 }), clip_low = 0.2, clip_high = 0.28, grad = g }))
  t.near(loss, -1.2214027581601699, 1e-12)
  near_list(g, { -0.6107013790800849, -0.6107013790800849 }, 1e-12, 'grad')
end)

t.test('off-policy correction weights by hand', function()
  -- sequences: [masked, t1, t2], [t3, t4], [masked, masked]; behaviour log-probs 0, so the token
  -- ratios ρ = π_prox/μ are exp(proximal): t1 3, t2 0.5, t3 2, t4 1 (t2 and t3 exactly at the
  -- bounds [0.5, 2], which keep them); the masked tokens' ratio e^5 never counts.
  local b = batch({ 3, 2, 2 }, { 0, 1, 1, 1, 1, 0, 0 })
  local l2, l3 = math.log(2), math.log(3)
  local function w_of(opts)
    local a = with(b, { proximal_logprob = A.array({ 5, l3, -l2, l2, 0, 5, 5 }), behavior_logprob = A.zeros(7) })
    for k, v in pairs(opts) do a[k] = v end
    return algo.correction.weights(a)
  end
  -- TIS, C = 2: min(ρ, 2) = 2, 0.5, 2, 1; only t1 is truncated (t3 = C is not)
  local w, m = w_of({ mode = 'tis' })
  near_list(w, { 0, 2, 0.5, 2, 1, 0, 0 }, 1e-12, 'tis')
  t.near(m.clipfrac, 0.25, 1e-12)
  t.near(m.ratio_mean, (3 + 0.5 + 2 + 1) / 4, 1e-12)
  t.near(m.ratio_max, 3, 1e-12)
  t.near(m.weight_mean, 5.5 / 4, 1e-12)
  t.near(m.kl_k1, -l3 / 4, 1e-12, 'k1: mean of log μ − log π_prox')
  t.near(m.kl_k3, ((3 - l3 - 1) + (0.5 + l2 - 1) + (2 - l2 - 1) + 0) / 4, 1e-12)
  t.eq(m.tokens, 4)
  t.eq(m.seqs, 2, 'the fully masked sequence does not count')
  -- C = 1: every ratio above 1 is cut to 1
  w, m = w_of({ mode = 'tis', clip = 1 })
  near_list(w, { 0, 1, 0.5, 1, 1, 0, 0 }, 1e-12, 'tis C = 1')
  t.near(m.clipfrac, 0.5, 1e-12)
  -- sequence-level TIS, C = 1.6: products 1.5 and 2 → 1.5, 1.6
  w, m = w_of({ mode = 'tis_seq', clip = 1.6 })
  near_list(w, { 0, 1.5, 1.5, 1.6, 1.6, 0, 0 }, 1e-12, 'tis_seq')
  t.near(m.clipfrac, 0.5, 1e-12)
  t.near(m.seq_ratio_mean, 1.75, 1e-12)
  t.near(m.seq_ratio_max, 2, 1e-12)
  -- token masking [0.5, 2]: t1 (3) dropped, the bounds kept
  w, m = w_of({ mode = 'mis_token', lower = 0.5, upper = 2 })
  near_list(w, { 0, 0, 1, 1, 1, 0, 0 }, 0, 'mis_token')
  t.near(m.masked_frac, 0.25, 1e-12)
  t.near(m.seq_masked_frac, 0.5, 1e-12)
  w = w_of({ mode = 'mis_token', weight = 'ratio' }) -- default bounds [1/2, 2]
  near_list(w, { 0, 0, 0.5, 2, 1, 0, 0 }, 1e-12, 'mis_token ratio')
  -- sequence masking: products 1.5 (kept) and 2 (kept at upper = 2, dropped at upper = 1.9)
  w, m = w_of({ mode = 'mis_seq' })
  near_list(w, { 0, 1, 1, 1, 1, 0, 0 }, 0, 'mis_seq at the bound')
  t.eq(m.masked_frac, 0)
  w, m = w_of({ mode = 'mis_seq', upper = 1.9, weight = 'ratio' })
  near_list(w, { 0, 1.5, 1.5, 0, 0, 0, 0 }, 1e-12, 'mis_seq')
  t.near(m.masked_frac, 0.5, 1e-12)
  t.near(m.seq_masked_frac, 0.5, 1e-12)
  -- geometric: sqrt(1.5) = 1.224745 (kept in [0.8, 1.3]), sqrt(2) = 1.414214 (dropped)
  w, m = w_of({ mode = 'mis_geo', lower = 0.8, upper = 1.3, weight = 'ratio' })
  near_list(w, { 0, math.sqrt(1.5), math.sqrt(1.5), 0, 0, 0, 0 }, 1e-12, 'mis_geo')
  t.near(m.seq_ratio_max, math.sqrt(2), 1e-12)
  -- default geometric bounds [1/1.01, 1.01]: both dropped
  w, m = w_of({ mode = 'mis_geo' })
  t.eq(m.masked_frac, 1)
  -- none: 1 on the tokens that count
  w = w_of({ mode = 'none' })
  near_list(w, { 0, 1, 1, 1, 1, 0, 0 }, 0, 'none')
  -- into a float array
  local out = ffi.new('float[7]')
  local w2 = w_of({ mode = 'tis', out = out })
  t.truthy(w2 == out, 'out is filled and returned')
  t.near(out[2], 0.5, 0)
  -- an empty mask: no weights, zero metrics
  local e = batch({ 2, 1 }, { 0, 0, 0 })
  local ew, em = algo.correction.weights(with(e, { proximal_logprob = A.array({ 1, 2, 3 }), behavior_logprob = A.zeros(3),
    mode = 'mis_seq' }))
  near_list(ew, { 0, 0, 0 }, 0, 'empty')
  t.eq(em.tokens, 0)
  t.eq(em.ratio_mean, 0)
  t.eq(em.seq_masked_frac, 0)
end)

t.test('decoupled PPO by hand', function()
  -- token 1: r = πθ/π_prox = 1.5, A = 1, w = π_prox/μ = 2: −2 · min(1.5, 1.2) = −2.4, clipped, grad 0
  -- token 2: r = 1.1, A = −1, w = 4: 1.1 · 4 = 4.4, grad −A·r·w = 4.4
  --   cap 3 (mask, AReaL): token 2 dropped → token-mean (−2.4 + 0)/2 = −1.2, grads 0, 0
  --   cap 3 truncate: w = 3 → (−2.4 + 3.3)/2 = 0.45, grads 0, 1.65
  local b = batch({ 2 }, { 1, 1 })
  local function run(opts)
    local g = A.zeros(2)
    local a = with(b, { logprob = A.array({ math.log(1.5), math.log(1.1) }), old_logprob = A.zeros(2),
      behavior_logprob = A.array({ -math.log(2), -math.log(4) }), advantages = A.array({ 1, -1 }), grad = g })
    for k, v in pairs(opts) do a[k] = v end
    local loss, m = algo.policy_loss.decoupled_ppo(a)
    return loss, g, m
  end
  local loss, g, m = run({})
  t.near(loss, (-2.4 + 4.4) / 2, 1e-12, 'no cap')
  near_list(g, { 0, 2.2 }, 1e-12, 'no cap grad')
  t.near(m.behav_weight_mean, 3, 1e-12)
  t.near(m.behav_ratio_max, 4, 1e-12)
  t.near(m.clipfrac, 0.5, 1e-12)
  loss, g, m = run({ behav_imp_weight_cap = 3 })
  t.near(loss, -1.2, 1e-12, 'cap (mask)')
  near_list(g, { 0, 0 }, 1e-12, 'cap grad')
  t.near(m.behav_masked_frac, 0.5, 1e-12)
  t.near(m.behav_weight_mean, 1, 1e-12)
  loss, g, m = run({ behav_imp_weight_cap = 3, behav_cap_mode = 'truncate' })
  t.near(loss, 0.45, 1e-12, 'cap (truncate)')
  near_list(g, { 0, 1.65 }, 1e-12, 'truncate grad')
  t.near(m.behav_clipfrac, 0.5, 1e-12)
  -- with the behaviour = the proximal policy it is ppo
  local lp, old, adv = A.array({ 0.1, -0.4 }), A.array({ -0.2, 0.1 }), A.array({ 0.7, -1.3 })
  local g1, g2 = A.zeros(2), A.zeros(2)
  local l1 = algo.policy_loss.decoupled_ppo(with(b, { logprob = lp, proximal_logprob = old, behavior_logprob = old,
    advantages = adv, grad = g1, dual_clip = 3 }))
  local l2 = algo.policy_loss.ppo(with(b, { logprob = lp, old_logprob = old, advantages = adv, grad = g2, dual_clip = 3 }))
  t.near(l1, l2, 1e-15, 'μ = π_prox: ppo')
  near_list(g1, { g2[0], g2[1] }, 1e-15, 'μ = π_prox: ppo grad')
  -- ppo's weights option multiplies the per-token loss and gradient
  local g3 = A.zeros(2)
  local l3 = algo.policy_loss.ppo(with(b, { logprob = lp, old_logprob = old, advantages = adv, grad = g3, dual_clip = 3,
    weights = A.array({ 1, 0 }) }))
  local g4 = A.zeros(2)
  local l4 = algo.policy_loss.ppo(with(batch({ 2 }, { 1, 0 }), { logprob = lp, old_logprob = old, advantages = adv,
    grad = g4, dual_clip = 3, global_tokens = 2 }))
  t.near(l3, l4, 1e-15, 'weight 0 = the token masked, the denominator kept')
  near_list(g3, { g4[0], 0 }, 1e-15, 'weights grad')
end)

t.test('KL estimators by hand', function()
  -- lp = −1, ref = −2, x = ref − lp = −1: k1 = 1, k2 = 0.5, k3 = e^−1 − (−1) − 1 = 0.367879
  -- dk/dlp: k1 1, k2 −x = 1, k3 1 − e^−1 = 0.632121
  local b = batch({ 1 }, { 1 })
  local want = { k1 = { 1, 1 }, k2 = { 0.5, 1 }, k3 = { 0.36787944117144233, 0.6321205588285577 } }
  for est, w in pairs(want) do
    local g = A.zeros(1)
    local loss, m = algo.kl.loss(with(b, { logprob = A.array({ -1 }), ref_logprob = A.array({ -2 }),
      estimator = est, coef = 1, grad = g }))
    t.near(loss, w[1], 1e-12, est)
    t.near(m.kl, w[1], 1e-12, est)
    t.near(g[0], w[2], 1e-12, est .. ' grad')
  end
  -- clamps: x = 30 → x clamped to 20, k3 = e^20 − 21 → clamped to 10, no gradient
  local g = A.zeros(1)
  local loss = algo.kl.loss(with(b, { logprob = A.array({ -31 }), ref_logprob = A.array({ -1 }), coef = 1, grad = g }))
  t.eq(loss, 10)
  t.eq(g[0], 0)
  -- reward penalty (k1, coef 0.5): −0.5 · (lp − ref) = −0.5
  local out = algo.kl.penalty(with(b, { logprob = A.array({ -1 }), ref_logprob = A.array({ -2 }), coef = 0.5 }))
  t.near(out[0], -0.5, 1e-12)
  -- entropy bonus: −coef · mean(H); dloss/dH = −coef/n
  local b2 = batch({ 3 }, { 0, 1, 1 })
  local gh = A.zeros(3)
  local el = algo.kl.entropy_bonus(with(b2, { entropy = A.array({ 9, 1, 2 }), coef = 0.1, grad = gh }))
  t.near(el, -0.15, 1e-12)
  near_list(gh, { 0, -0.05, -0.05 }, 1e-12, 'entropy grad')
end)

t.test('value loss by hand', function()
  -- ε = 0.2:
  --   V 1,   V_old 0.5, R 0: (V−R)² = 1, clip(V) = 0.7 → 0.49; max 1; ½ → 0.5; grad V − R = 1
  --   V 0.9, V_old 0.5, R 1: (V−R)² = 0.01, clip(V) = 0.7 → 0.09 larger; ½ → 0.045; V clipped → grad 0
  -- token-mean: (0.5 + 0.045)/2 = 0.2725; grads /2
  local b = batch({ 2 }, { 1, 1 })
  local g = A.zeros(2)
  local loss, m = algo.value_loss.clipped(with(b, { values = A.array({ 1, 0.9 }), old_values = A.array({ 0.5, 0.5 }),
    returns = A.array({ 0, 1 }), clip = 0.2, grad = g }))
  t.near(loss, 0.2725, 1e-12)
  near_list(g, { 0.5, 0 }, 1e-12, 'grad')
  t.near(m.vf_clipfrac, 0.5, 1e-12)
end)

t.test('DPO by hand', function()
  -- chosen Σ log π = −1 (ref −1.5): Δw = 0.5; rejected Σ log π = −2 (ref −1.8): Δl = −0.2; h = 0.7
  --   sigmoid, β 0.1: z = 0.07, −log σ(0.07) = 0.658760; dloss/dlogπ chosen = −β σ(−z) = −0.048251
  --   cDPO ε 0.1: −0.9 log σ(z) − 0.1 log σ(−z) = 0.665760; grad β(−0.9 σ(−z) + 0.1 σ(z)) = −0.038251
  --   IPO: (0.7 − 1/(2·0.1))² = 18.49; grad 2(0.7 − 5) = −8.6
  --   hinge: 1 − 0.07 = 0.93; grad −β = −0.1
  local b = batch({ 3, 2 }, { 0, 1, 1, 1, 1 })
  local lp = A.array({ -7, -0.25, -0.75, -1.5, -0.5 })
  local ref = A.array({ -7, -1, -0.5, -1, -0.8 })
  local cases = {
    { {}, 0.658759555548697, -0.048250714233361025 },
    { { label_smoothing = 0.1 }, 0.665759555548697, -0.03825071423336103 },
    { { loss_type = 'ipo' }, 18.49, -8.6 },
    { { loss_type = 'hinge' }, 0.93, -0.1 },
  }
  for _, c in ipairs(cases) do
    local g = A.zeros(5)
    local args = with(b, { logprob = lp, ref_logprob = ref, grad = g })
    for k, v in pairs(c[1]) do args[k] = v end
    local loss, m = algo.dpo.loss(args)
    t.near(loss, c[2], 1e-9, c[1].loss_type or 'sigmoid')
    near_list(g, { 0, c[3], c[3], -c[3], -c[3] }, 1e-9, 'dpo grad')
    t.near(m.rewards_chosen, 0.05, 1e-12)
    t.near(m.rewards_rejected, -0.02, 1e-12)
    t.near(m.rewards_margin, 0.07, 1e-12)
    t.eq(m.rewards_accuracy, 1)
  end
end)

t.test('SFT by hand', function()
  -- log π = −1 (prompt, masked), −2, −3: loss 2.5, grads 0, −0.5, −0.5; ppl e^2.5
  local b = batch({ 3 }, { 0, 1, 1 })
  local g = A.zeros(3)
  local loss, m = algo.sft.loss(with(b, { logprob = A.array({ -1, -2, -3 }), grad = g }))
  t.near(loss, 2.5, 1e-12)
  near_list(g, { 0, -0.5, -0.5 }, 1e-12, 'grad')
  t.near(m.ppl, math.exp(2.5), 1e-9)
end)

-- ---------------------------------------------------------------- finite differences

math.randomseed(7)
local function rnd(n, lo, hi)
  local x = A.zeros(n)
  for i = 0, n - 1 do x[i] = lo + (hi - lo) * math.random() end
  return x
end

-- Central differences of loss_of() with respect to x[t], against the analytic grad.
local function fd_check(name, x, n, grad, loss_of)
  local h = 1e-6
  for i = 0, n - 1 do
    local keep = x[i]
    x[i] = keep + h
    local up = loss_of()
    x[i] = keep - h
    local down = loss_of()
    x[i] = keep
    local want = (up - down) / (2 * h)
    if math.abs(grad[i] - want) > 1e-6 + 1e-5 * math.abs(want) then
      error(string.format('%s: d/dx[%d] analytic %.10g, finite difference %.10g', name, i, grad[i], want), 2)
    end
  end
end

local fb = batch({ 6, 0, 5, 3, 7 }, { 0, 0, 1, 1, 1, 1, 0, 1, 1, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1 })
local N = fb.ntok

t.test('finite differences: every loss', function()
  local lp = rnd(N, -3, -0.2)
  local old, ref, adv, roll = A.zeros(N), rnd(N, -3, -0.2), rnd(N, -2, 2), A.zeros(N)
  for i = 0, N - 1 do old[i] = lp[i] + (math.random() - 0.5) * 0.8; roll[i] = old[i] + (math.random() - 0.5) end
  local losses = {
    { 'ppo', algo.policy_loss.ppo, { old_logprob = old, advantages = adv, clip_high = 0.28, dual_clip = 3 } },
    { 'ppo seq-mean-token-sum', algo.policy_loss.ppo, { old_logprob = old, advantages = adv, agg = 'seq-mean-token-sum' } },
    { 'ppo tis', algo.policy_loss.ppo, { old_logprob = old, advantages = adv, rollout_logprob = roll, agg = 'seq-mean-token-sum-norm', norm = 8 } },
    -- GSPO's stop-gradient form is the true gradient when A is constant over a sequence (the GSPO
    -- use: a sequence-level advantage) under seq-mean-token-mean
    { 'gspo', algo.policy_loss.gspo, { old_logprob = old, clip_low = 0.1, clip_high = 0.1,
      advantages = algo.advantages.to_tokens(with(fb, { values = A.array({ 0.5, 1, -1, -0.3, 2 }) })) } },
    { 'ppo weights', algo.policy_loss.ppo, { old_logprob = old, advantages = adv, weights = rnd(N, 0, 2) } },
    { 'decoupled ppo', algo.policy_loss.decoupled_ppo, { old_logprob = old, advantages = adv, behavior_logprob = roll,
      behav_imp_weight_cap = 1.3, clip_high = 0.28, agg = 'seq-mean-token-mean' } },
    { 'decoupled ppo truncate', algo.policy_loss.decoupled_ppo, { old_logprob = old, advantages = adv,
      behavior_logprob = roll, behav_imp_weight_cap = 1.3, behav_cap_mode = 'truncate', dual_clip = 3 } },
    { 'kl k1', algo.kl.loss, { ref_logprob = ref, estimator = 'k1' } },
    { 'kl k2', algo.kl.loss, { ref_logprob = ref, estimator = 'k2', agg = 'seq-mean-token-mean' } },
    { 'kl k3', algo.kl.loss, { ref_logprob = ref, estimator = 'k3', coef = 0.1 } },
    { 'sft', algo.sft.loss, { agg = 'seq-mean-token-mean' } },
  }
  for _, c in ipairs(losses) do
    local args = with(fb, c[3])
    args.logprob = lp
    local g = A.zeros(N)
    args.grad = g
    c[2](args)
    args.grad = nil
    fd_check(c[1], lp, N, g, function() return (c[2](args)) end)
  end
  -- value loss w.r.t. V; entropy w.r.t. H
  local v, vold, ret = rnd(N, -1, 1), rnd(N, -1, 1), rnd(N, -1, 1)
  local va = with(fb, { values = v, old_values = vold, returns = ret, clip = 0.3 })
  local g = A.zeros(N)
  va.grad = g
  algo.value_loss.clipped(va)
  va.grad = nil
  fd_check('value', v, N, g, function() return (algo.value_loss.clipped(va)) end)
  local h = rnd(N, 0, 2)
  local ea = with(fb, { entropy = h, agg = 'seq-mean-token-mean', coef = 0.01 })
  g = A.zeros(N)
  ea.grad = g
  algo.kl.entropy_bonus(ea)
  ea.grad = nil
  fd_check('entropy', h, N, g, function() return (algo.kl.entropy_bonus(ea)) end)
  -- DPO (two pairs, interleaved; the empty sequence is a rejected one)
  for _, kind in ipairs({ 'sigmoid', 'ipo', 'hinge' }) do
    local da = with(batch({ 6, 0, 5, 3 }, { 0, 0, 1, 1, 1, 1, 0, 1, 1, 0, 1, 1, 0, 0 }),
      { logprob = lp, ref_logprob = ref, loss_type = kind, label_smoothing = kind == 'sigmoid' and 0.2 or nil,
        length_normalize = kind == 'ipo' })
    g = A.zeros(N)
    da.grad = g
    algo.dpo.loss(da)
    da.grad = nil
    fd_check('dpo ' .. kind, lp, 14, g, function() return (algo.dpo.loss(da)) end)
  end
end)

-- ---------------------------------------------------------------- gradient accumulation

t.test('micro-batches with global denominators sum to the whole batch', function()
  -- the whole batch: fb (5 sequences); micro-batches: sequences 0-1 and 2-4
  local lp, old, adv = rnd(N, -3, -0.2), rnd(N, -3, -0.2), rnd(N, -1, 1)
  local function slice(x, from, n)
    return ffi.cast('double *', x) + from
  end
  local c0 = A.cu_from_lengths({ 6, 0 })
  local c1 = A.cu_from_lengths({ 5, 3, 7 })
  local micro = {
    { cu_seqlens = c0, nseq = 2, from = 0 },
    { cu_seqlens = c1, nseq = 3, from = 6 },
  }
  local total = A.counts(fb)
  for _, mode in ipairs({ 'token-mean', 'seq-mean-token-sum', 'seq-mean-token-mean', 'seq-mean-token-sum-norm' }) do
    local gfull = A.zeros(N)
    local full = algo.policy_loss.ppo(with(fb, { logprob = lp, old_logprob = old, advantages = adv, agg = mode,
      norm = 7, grad = gfull }))
    local gmicro = A.zeros(N)
    local sum = 0
    for _, mb in ipairs(micro) do
      local l = algo.policy_loss.ppo({ cu_seqlens = mb.cu_seqlens, nseq = mb.nseq, mask = slice(fb.mask, mb.from),
        logprob = slice(lp, mb.from), old_logprob = slice(old, mb.from), advantages = slice(adv, mb.from),
        grad = slice(gmicro, mb.from), agg = mode, norm = 7,
        global_tokens = total.tokens, global_seqs = total.seqs })
      sum = sum + l
    end
    t.near(sum, full, 1e-12, mode .. ' loss')
    for i = 0, N - 1 do t.near(gmicro[i], gfull[i], 1e-12, mode .. ' grad') end
  end
end)

t.test('correction metrics over micro-batches equal the whole batch', function()
  local prox, behav = rnd(fb.ntok, -3, -0.2), A.zeros(fb.ntok)
  for i = 0, fb.ntok - 1 do behav[i] = prox[i] + (math.random() - 0.5) * 2 end
  local c0 = A.cu_from_lengths({ 6, 0 })
  local c1 = A.cu_from_lengths({ 5, 3, 7 })
  local P = function(x, from) return ffi.cast('double *', x) + from end
  for _, mode in ipairs({ 'tis', 'tis_seq', 'mis_token', 'mis_seq', 'mis_geo' }) do
    local _, whole = algo.correction.weights(with(fb, { proximal_logprob = prox, behavior_logprob = behav, mode = mode,
      lower = 0.7, upper = 1.5 }))
    local acc = algo.correction.accumulator()
    for _, mb in ipairs({ { c0, 2, 0 }, { c1, 3, 6 } }) do
      local _, m = algo.correction.weights({ cu_seqlens = mb[1], nseq = mb[2], mask = P(fb.mask, mb[3]),
        proximal_logprob = P(prox, mb[3]), behavior_logprob = P(behav, mb[3]), mode = mode, lower = 0.7, upper = 1.5 })
      algo.correction.accumulate(acc, m)
    end
    local sum = algo.correction.summary(algo.correction.reduce(acc, nil))
    for k, v in pairs(whole) do t.near(sum[k], v, 1e-12, mode .. ' ' .. k) end
  end
end)

-- ---------------------------------------------------------------- a new objective in Lua only

t.test('a custom objective from the public helpers (CISPO-style)', function()
  -- L_t = −sg(min(r_t, 1 + ε)) · A_t · log π_t: the clipped ratio weights a REINFORCE term and
  -- passes no gradient itself, so dL_t/dlogπ_t = −min(r_t, 1 + ε) · A_t.
  local function cispo_token(a, t)
    local w = math.min(math.exp(a.logprob[t] - a.old_logprob[t]), 1 + (a.eps or 0.2))
    return -w * a.advantages[t] * a.logprob[t], -w * a.advantages[t]
  end
  local function cispo(args)
    return A.token_loss(args, 'cispo', 'token-mean', cispo_token, args)
  end
  -- by hand: one token r = 2 → weight 1.2, A = 1, lp = log 2 ≈ 0.693147 (old = 0): L = −0.831777, grad −1.2
  local b = batch({ 1 }, { 1 })
  local g = A.zeros(1)
  local loss = cispo(with(b, { logprob = A.array({ math.log(2) }), old_logprob = A.zeros(1),
    advantages = A.array({ 1 }), grad = g }))
  t.near(loss, -1.2 * math.log(2), 1e-12)
  t.near(g[0], -1.2, 1e-12)
  -- combined with a KL term into one gradient (each term ADDS into grad)
  local lp, old, adv, ref = rnd(N, -3, -0.2), rnd(N, -3, -0.2), rnd(N, -1, 1), rnd(N, -3, -0.2)
  g = A.zeros(N)
  local args = with(fb, { logprob = lp, old_logprob = old, advantages = adv, ref_logprob = ref, grad = g })
  local l1 = cispo(args)
  local l2 = algo.kl.loss(args)
  t.truthy(l1 ~= 0 and l2 ~= 0, 'both terms contribute')
  local gk = A.zeros(N)
  algo.kl.loss(with(fb, { logprob = lp, ref_logprob = ref, grad = gk }))
  local g1 = A.zeros(N)
  cispo(with(fb, { logprob = lp, old_logprob = old, advantages = adv, grad = g1 }))
  for i = 0, N - 1 do t.near(g[i], g1[i] + gk[i], 1e-12, 'gradients add') end
end)

-- ---------------------------------------------------------------- types and errors

t.test('float32 inputs and gradients', function()
  local lp, old, adv = rnd(N, -3, -0.2), rnd(N, -3, -0.2), rnd(N, -1, 1)
  local function f32(x)
    local y = ffi.new('float[?]', N)
    for i = 0, N - 1 do y[i] = x[i]; x[i] = y[i] end -- both hold the same float32 values
    return y
  end
  local lpf, oldf, advf = f32(lp), f32(old), f32(adv)
  local maskf = ffi.new('uint8_t[?]', N)
  for i = 0, N - 1 do maskf[i] = fb.mask[i] end
  local gd, gf = A.zeros(N), ffi.new('float[?]', N)
  local ld = algo.policy_loss.ppo(with(fb, { logprob = lp, old_logprob = old, advantages = adv, grad = gd }))
  local lf = algo.policy_loss.ppo({ cu_seqlens = fb.cu_seqlens, nseq = fb.nseq, mask = maskf,
    logprob = lpf, old_logprob = oldf, advantages = advf, grad = gf })
  t.near(lf, ld, 1e-12)
  for i = 0, N - 1 do t.near(gf[i], gd[i], 1e-6, 'float grad') end
end)

t.test('errors name the function and the argument', function()
  local b = batch({ 2 }, { 1, 1 })
  t.raises(function() algo.policy_loss.ppo(with(b, { logprob = A.zeros(2), advantages = A.zeros(2) })) end,
    'policy_loss.ppo: argument old_logprob is required')
  t.raises(function() algo.policy_loss.ppo(with(b, { logprob = A.zeros(1), old_logprob = A.zeros(2), advantages = A.zeros(2) })) end,
    'policy_loss.ppo: argument logprob has 1 elements, needs 2')
  t.raises(function() algo.sft.loss(with(b, { logprob = {} })) end, 'argument logprob must be a cdata array, got table')
  t.raises(function() algo.sft.loss(with(b, { logprob = A.zeros(2), agg = 'token-sum' })) end,
    "unknown aggregation mode 'token-sum' (known: seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm, token-mean)")
  t.raises(function() algo.sft.loss(with(b, { logprob = A.zeros(2), agg = 'seq-mean-token-sum-norm' })) end, 'needs args.norm')
  t.raises(function() algo.kl.loss(with(b, { logprob = A.zeros(2), ref_logprob = A.zeros(2), estimator = 'k4' })) end,
    "unknown KL estimator 'k4'")
  t.raises(function() algo.advantages.grpo{ scores = A.zeros(5), nseq = 5, group = 2 } end,
    'group size 2 must be a positive integer dividing nseq = 5')
  t.raises(function() algo.advantages.grpo{ scores = A.zeros(4), nseq = 4, group = 2, scale = 'std' } end,
    "scale must be 'group', 'batch' or 'none'")
  t.raises(function() algo.dpo.loss(with(batch({ 1 }, { 1 }), { logprob = A.zeros(1), ref_logprob = A.zeros(1) })) end,
    'nseq must be even')
  t.raises(function() algo.policy_loss.ppo(with(b, { logprob = A.zeros(2), old_logprob = A.zeros(2),
    advantages = A.zeros(2), dual_clip = 0.5 })) end, 'dual_clip must be a number > 1')
  local cw = with(b, { proximal_logprob = A.zeros(2), behavior_logprob = A.zeros(2) })
  cw.mode = 'tis_token'
  t.raises(function() algo.correction.weights(cw) end,
    "correction.weights: unknown mode 'tis_token' (known: mis_geo, mis_seq, mis_token, none, tis, tis_seq)")
  cw.mode, cw.clip = 'tis', 0
  t.raises(function() algo.correction.weights(cw) end, 'clip must be a number > 0, got 0')
  cw.mode, cw.clip, cw.lower, cw.upper = 'mis_seq', nil, 3, 2
  t.raises(function() algo.correction.weights(cw) end, 'bounds must satisfy 0 <= lower <= upper')
  cw.lower, cw.upper, cw.weight = nil, nil, 'ones'
  t.raises(function() algo.correction.weights(cw) end, "weight must be 'mask' or 'ratio'")
  t.raises(function() algo.correction.weights(with(b, { proximal_logprob = A.zeros(2) })) end,
    'correction.weights: argument behavior_logprob is required')
  local dp = with(b, { logprob = A.zeros(2), old_logprob = A.zeros(2), advantages = A.zeros(2) })
  t.raises(function() algo.policy_loss.decoupled_ppo(dp) end, 'policy_loss.decoupled_ppo: argument behavior_logprob is required')
  dp.behavior_logprob, dp.behav_imp_weight_cap = A.zeros(2), -1
  t.raises(function() algo.policy_loss.decoupled_ppo(dp) end, 'behav_imp_weight_cap must be a number > 0')
  dp.behav_imp_weight_cap, dp.rollout_logprob = nil, A.zeros(2)
  t.raises(function() algo.policy_loss.decoupled_ppo(dp) end, 'as behavior_logprob')
  local bad = { cu_seqlens = A.array({ 0, 3, 2 }, 'int32_t'), nseq = 2, mask = A.zeros(3) }
  t.raises(function() A.counts(bad) end, 'cu_seqlens must not decrease')
  t.raises(function() A.counts({ cu_seqlens = A.array({ 1, 3 }, 'int32_t'), nseq = 1, mask = A.zeros(3) }) end,
    'cu_seqlens[0] must be 0')
  -- an empty batch is fine: zero loss
  local e = { cu_seqlens = A.array({ 0 }, 'int32_t'), nseq = 0, mask = A.zeros(0) }
  t.eq((algo.sft.loss(with(e, { logprob = A.zeros(0) }))), 0)
end)

t.done()
