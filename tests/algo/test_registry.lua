-- The registries recipes find their parts in by name (moonrl.registry): advantage estimators,
-- policy losses, KL estimators, rewards (FILE.lua:NAME too), tasks; each built-in estimator and
-- loss checked against an independent implementation written here from RL_REFERENCE's formulas
-- (tests/algo/test_algo_ref.lua checks the array math against PyTorch).
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local algo = require('moonrl.algo')
local registry = require('moonrl.registry')
local batch = require('moonrl.batch')
local A = algo.agg

math.randomseed(17)

t.test('a registry: register, get, check, names, doc, replace', function()
  local r = registry.new('widget')
  r.register('b', function() return 2 end, 'the b')
  r.register('a', function() return 1 end, { doc = 'the a', needs = { 'values' } })
  t.eq(table.concat(r.names(), ','), 'a,b')
  t.eq(r.get('a')(), 1)
  t.eq(r.doc('b'), 'the b')
  t.eq(r.entry('a').needs[1], 'values')
  t.raises(function() r.get('c') end, "unknown widget 'c' (known: a, b)")
  t.raises(function() r.register('a', function() end) end, "widget 'a' is already registered")
  t.raises(function() r.register('d', 42) end, "widget 'd' must be a function")
  r.register('a', function() return 3 end, { replace = true })
  t.eq(r.get('a')(), 3)
  local ok, err = pcall(r.check, 'zz', 'sec.key')
  t.truthy(not ok and moonrl.is_usage_error(err), 'check raises a usage error')
  t.eq(err.message, "config key 'sec.key': unknown widget 'zz' (known: a, b)")
  t.truthy(r.describe():find('the b', 1, true), 'describe lists the docs')
end)

t.test('the built-in names', function()
  t.eq(table.concat(algo.estimators.names(), ','), 'dr_grpo,gae,grpo,reinforce_pp,rloo')
  t.eq(table.concat(algo.losses.names(), ','), 'decoupled_ppo,dual_clip,gspo,ppo,reinforce')
  for _, k in ipairs({ 'k1', 'k2', 'k3', 'kl', 'mse', 'low_var_kl' }) do t.truthy(algo.kl_estimators.has(k), k) end
  t.truthy(algo.advantages.register == algo.estimators.register, 'advantages.register is the registry')
  t.eq(algo.estimators.entry('gae').needs[1], 'values')
end)

-- samples of G per prompt with random scores, and random response lengths
local function samples_of(nprompts, G)
  local out = {}
  for p = 1, nprompts do
    local prompt = { 1, 3 + p }
    for _ = 1, G do
      local ids = {}
      for k = 1, math.random(1, 5) do ids[k] = 3 + k end
      out[#out + 1] = { prompt_ids = prompt, ids = ids, group = p,
        score = math.random() < 0.3 and 1 or (math.random() < 0.5 and 0 or math.random()) }
    end
  end
  return out
end

local function ctx_of(samples, G, cfg)
  return { scores = batch.scores(samples), nseq = #samples, group = G, cfg = cfg or {} }
end

t.test('grpo, dr_grpo, rloo estimators against independent per-group formulas', function()
  local G = 4
  local s = samples_of(5, G)
  s[1].score, s[2].score, s[3].score, s[4].score = 1, 1, 1, 1 -- an all-equal group
  local grpo = algo.estimators.get('grpo')(s, ctx_of(s, G, { scale = 'group' }))
  local dr = algo.estimators.get('dr_grpo')(s, ctx_of(s, G))
  local rloo = algo.estimators.get('rloo')(s, ctx_of(s, G))
  for g = 0, #s / G - 1 do
    local sum, ss = 0, 0
    for j = 1, G do sum = sum + s[g * G + j].score end
    local mean = sum / G
    for j = 1, G do ss = ss + (s[g * G + j].score - mean) ^ 2 end
    local std = math.sqrt(ss / (G - 1)) -- the n - 1 divisor (veRL)
    for j = 1, G do
      local i, r = g * G + j, s[g * G + j].score
      t.near(grpo[i - 1], (r - mean) / (std + 1e-6), 1e-12, 'grpo ' .. i)
      t.near(dr[i - 1], r - mean, 1e-12, 'dr_grpo ' .. i)
      t.near(rloo[i - 1], r - (sum - r) / (G - 1), 1e-12, 'rloo ' .. i)
    end
  end
end)

t.test('reinforce_pp and gae estimators against per-sample loops', function()
  local s = samples_of(3, 2)
  local values, old, ref = {}, {}, {}
  for i, x in ipairs(s) do
    values[i], old[i], ref[i] = {}, {}, {}
    for k = 1, #x.ids do values[i][k], old[i][k], ref[i][k] = math.random() - 0.5, -math.random(), -math.random() end
  end
  -- REINFORCE++ (γ = 0.9): G_t = r_t + γ G_{t+1}, the score on the last token; whitened over all tokens
  local adv = algo.estimators.get('reinforce_pp')(s, ctx_of(s, 2, { gamma = 0.9 }))
  local all, n, sum = {}, 0, 0
  for i, x in ipairs(s) do
    all[i] = {}
    local g = 0
    for k = #x.ids, 1, -1 do
      g = (k == #x.ids and x.score or 0) + 0.9 * g
      all[i][k] = g
      n, sum = n + 1, sum + g
    end
  end
  local mean, var = sum / n, 0
  for i = 1, #s do for k = 1, #all[i] do var = var + (all[i][k] - mean) ^ 2 end end
  var = var / (n - 1)
  for i = 1, #s do
    for k = 1, #all[i] do t.near(adv[i][k], (all[i][k] - mean) / math.sqrt(var + 1e-8), 1e-5, 'reinforce_pp') end
  end
  -- GAE (γ = 1, λ = 0.95, KL penalty 0.1·(old − ref) per token): returns = A + V before whitening
  local ctx = ctx_of(s, 2, { gamma = 1, lam = 0.95, kl_coef = 0.1 })
  ctx.values, ctx.old_logprobs, ctx.ref_logprobs = values, old, ref
  local gadv, extra = algo.estimators.get('gae')(s, ctx)
  local raw, rn, rs = {}, 0, 0
  for i, x in ipairs(s) do
    raw[i] = {}
    local a, vnext = 0, 0
    for k = #x.ids, 1, -1 do
      local r = -0.1 * (old[i][k] - ref[i][k]) + (k == #x.ids and x.score or 0)
      a = r + vnext - values[i][k] + 0.95 * a
      vnext = values[i][k]
      raw[i][k] = a
      rn, rs = rn + 1, rs + a
      t.near(extra.returns[i][k], a + values[i][k], 1e-5, 'gae returns')
    end
  end
  local gm, gv = rs / rn, 0
  for i = 1, #s do for k = 1, #raw[i] do gv = gv + (raw[i][k] - gm) ^ 2 end end
  gv = gv / (rn - 1)
  for i = 1, #s do
    for k = 1, #raw[i] do t.near(gadv[i][k], (raw[i][k] - gm) / math.sqrt(gv + 1e-8), 1e-5, 'gae advantages') end
  end
end)

-- a packed batch of token arrays
local function batch(lengths)
  local cu, nseq, ntok = A.cu_from_lengths(lengths)
  local mask, lp, old, adv = A.zeros(ntok), A.zeros(ntok), A.zeros(ntok), A.zeros(ntok)
  for k = 0, ntok - 1 do
    mask[k] = k % 5 == 0 and 0 or 1
    lp[k], old[k], adv[k] = -math.random() * 2, -math.random() * 2, math.random() * 4 - 2
  end
  return { cu_seqlens = cu, nseq = nseq, mask = mask, logprob = lp, old_logprob = old, advantages = adv }, ntok
end

t.test('reinforce: L = −A·log π, gradient −A·m/Σm (token-mean), no ratio and no clip', function()
  local b, ntok = batch({ 4, 6, 3 })
  b.grad = A.zeros(ntok)
  local loss, m = algo.losses.get('reinforce')(b)
  local want, n = 0, 0
  for k = 0, ntok - 1 do want, n = want + b.mask[k] * -b.advantages[k] * b.logprob[k], n + b.mask[k] end
  t.near(loss, want / n, 1e-12, 'loss')
  for k = 0, ntok - 1 do t.near(b.grad[k], -b.advantages[k] * b.mask[k] / n, 1e-12, 'gradient ' .. k) end
  t.eq(m.clipfrac, 0)
  -- far off-policy: PPO clips, REINFORCE does not care about the ratio
  local g2 = A.zeros(ntok)
  local far = setmetatable({ old_logprob = A.zeros(ntok), grad = g2 }, { __index = b })
  algo.losses.get('reinforce')(far)
  for k = 0, ntok - 1 do t.near(g2[k], b.grad[k], 1e-12, 'the gradient ignores log π_old') end
end)

t.test('dual_clip is ppo with c = 3; ppo and gspo are policy_loss\'s', function()
  local b, ntok = batch({ 5, 5, 2, 7 })
  local g1, g2 = A.zeros(ntok), A.zeros(ntok)
  local l1 = algo.losses.get('dual_clip')(setmetatable({ grad = g1 }, { __index = b }))
  local l2 = algo.policy_loss.ppo(setmetatable({ grad = g2, dual_clip = 3 }, { __index = b }))
  t.near(l1, l2, 1e-15, 'loss')
  for k = 0, ntok - 1 do t.near(g1[k], g2[k], 1e-15, 'gradient') end
  t.truthy(algo.losses.get('ppo') == algo.policy_loss.ppo and algo.losses.get('gspo') == algo.policy_loss.gspo, 'same functions')
end)

t.test('a registered KL estimator is what kl.loss and kl.penalty take', function()
  local b, ntok = batch({ 3, 4 })
  b.ref_logprob = b.old_logprob
  algo.kl.register('k1_twice', function(lp, ref) return 2 * (lp - ref), 2 end, 'twice k1')
  local l1 = algo.kl.loss(setmetatable({ estimator = 'k1_twice', coef = 1 }, { __index = b }))
  local l2 = algo.kl.loss(setmetatable({ estimator = 'k1', coef = 1 }, { __index = b }))
  t.near(l1, 2 * l2, 1e-12, 'kl.loss')
  local _, k = algo.kl.penalty(setmetatable({ estimator = 'k1_twice', coef = 1 }, { __index = b }))
  local _, k1 = algo.kl.penalty(setmetatable({ estimator = 'k1', coef = 1 }, { __index = b }))
  t.near(k, 2 * k1, 1e-12, 'kl.penalty')
  t.raises(function() algo.kl.loss(setmetatable({ estimator = 'k9' }, { __index = b })) end, "unknown KL estimator 'k9'")
end)

t.test('rewards: a doc line; FILE.lua:NAME from a returned table or a registration', function()
  local rewards = require('moonrl.rewards')
  local dir = os.tmpname()
  os.remove(dir)
  require('moonrl.io.fs').mkdirs(dir)
  local f = assert(io.open(dir .. '/my_rewards.lua', 'w'))
  f:write("local helper = require('my_helper')\n",
    "require('moonrl.rewards').register('reg_len', function(s) return #s.response end, 'the length')\n",
    "return { half = function(s) return helper(s) end }\n")
  f:close()
  f = assert(io.open(dir .. '/my_helper.lua', 'w')) -- a neighbour module, found through package.path
  f:write('return function(s) return 0.5 end\n')
  f:close()
  t.eq(rewards.get(dir .. '/my_rewards.lua:half')({ response = 'x' }), 0.5)
  t.eq(rewards.get(dir .. '/my_rewards.lua:reg_len')({ response = 'abc' }), 3)
  t.eq(rewards.doc('reg_len'), 'the length')
  t.truthy(rewards.doc('exact') ~= '', 'built-ins have docs')
  t.raises(function() rewards.get(dir .. '/my_rewards.lua:nope') end, "defines no reward 'nope'")
  local ok, err = pcall(rewards.get, dir .. '/missing.lua:x')
  t.truthy(not ok and moonrl.is_usage_error(err) and err.message:find('no such file', 1, true), 'a missing file')
  require('moonrl.io.fs').remove(dir)
end)

t.test('tasks: addition holds out the default example\'s 200 problems, the same for a seed', function()
  local tasks = require('moonrl.tasks')
  local a, b, c = tasks.load('addition', 1), tasks.load('addition', 1), tasks.load('addition', 2)
  t.eq(#a.train + #a.heldout, 10000)
  t.eq(#a.heldout, 200)
  t.truthy(a == b, 'built once per seed')
  local held = {}
  for _, r in ipairs(a.heldout) do held[r.prompt] = true end
  for _, r in ipairs(a.train) do t.truthy(not held[r.prompt], 'train and held-out are disjoint') end
  local x, y = a.heldout[1].prompt:match('^(%d+)%+(%d+)=$')
  t.eq(a.heldout[1].answer, tostring(tonumber(x) + tonumber(y)))
  t.truthy(c.heldout[1].prompt ~= a.heldout[1].prompt or c.heldout[2].prompt ~= a.heldout[2].prompt, 'another seed')
  t.raises(function() tasks.load('nope', 1) end, "unknown task 'nope' (known: addition")
  -- the data view over a task's records: batches and state as a JSONL view's
  local view = require('moonrl.data').records(a.train, { name = 'task' }):shuffled(3)
  local first = view:batches(4)()
  t.eq(#first, 4)
  t.truthy(first[1].prompt and first[1].line, 'records are copies with line numbers')
end)

t.done()
