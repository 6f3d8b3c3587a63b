-- The update step (moonrl.train.step) alone, in one process: a step is the same whatever the
-- micro-batch budget, and a sample's loss_mask takes tokens out of every loss and denominator.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local models = require('moonrl.train.models')
local train = require('moonrl.train.step')
local tiny = dofile('tests/lib/models.lua')

local CFG = tiny.config('qwen2')

-- two groups sharing their prompt tables, a lone sample and an empty response; lengths differ,
-- sample 6's response made the longest (its tail is the loss mask's)
local function samples()
  local s = dofile('tests/lib/samples.lua').groups()
  s[6].ids = { 12, 2, 7, 7, 7, 7 }
  return s
end

-- One step from the same initial weights with a token budget; the weights after it and the metrics.
local function one_step(budget, o)
  local model = moonrl.model.new(CFG, { seed = 7 })
  local ref = o.kl and models.clone(moonrl.model.new(CFG, { seed = 8 })) or nil
  local opt = models.adamw(model, { lr = 1e-2 })
  local m
  if o.sft then
    m = train.sft_step(nil, opt, samples(), { lr = 1e-2, micro_batch_tokens = budget })
  else
    m = train.policy_step({ model = model, opt = opt, samples = samples(), lr = 1e-2, micro_batch_tokens = budget,
      agg = o.agg, ref = ref, kl_coef = o.kl and 0.05 or nil, entropy_coef = 0.01 })
  end
  local p, n = model:params()
  local g = model:grads()
  local copy, grads = {}, {}
  for i = 0, n - 1 do copy[i], grads[i] = p[i], g[i] end
  return copy, n, m, grads
end

-- budgets: one sequence a micro-batch (the longest sample is 11 tokens), about two, all at once
local BUDGETS = { 1, 20, 100000 }
for _, o in ipairs({ { agg = 'token-mean' }, { agg = 'seq-mean-token-mean', kl = true }, { sft = true } }) do
  local what = o.sft and 'sft step' or ('policy step, ' .. o.agg .. (o.kl and ', KL to a reference' or ''))
  t.test(what .. ': the same weights with micro-batches of one sequence, two and all', function()
    local base, n, bm, bg = one_step(BUDGETS[#BUDGETS], o)
    local gmax = 0
    for k = 0, n - 1 do gmax = math.max(gmax, math.abs(bg[k])) end
    for i = 1, #BUDGETS - 1 do
      local p, _, m, g = one_step(BUDGETS[i], o)
      local worst, near_eps, gworst = 0, 0, 0
      for k = 0, n - 1 do
        -- (a gradient within 1e-6 of 0: AdamW's first step, lr * g / (|g| + eps) with eps 1e-8,
        -- turns its rounding into up to lr)
        local d = math.abs(p[k] - base[k])
        if math.abs(bg[k]) > 1e-6 then worst = math.max(worst, d) else near_eps = math.max(near_eps, d) end
        gworst = math.max(gworst, math.abs(g[k] - bg[k]))
      end
      -- the gradient sums run in another order: the same up to rounding; AdamW's first step
      -- magnifies that only where a gradient is near eps, by at most lr
      t.truthy(gworst < 1e-5 * gmax, string.format('budget %d: gradients differ by up to %.3g (largest %.3g)',
        BUDGETS[i], gworst, gmax))
      t.truthy(worst < 1e-3 * 1e-2, string.format('budget %d: weights differ by up to %.3g', BUDGETS[i], worst))
      t.truthy(near_eps <= 1e-2, string.format('budget %d: weights of gradients near 0 differ by up to %.3g', BUDGETS[i],
        near_eps))
      t.near(m.loss, bm.loss, 1e-5, 'loss')
      t.near(m.grad_norm, bm.grad_norm, 1e-5, 'grad norm')
      t.eq(m.tokens, bm.tokens)
    end
  end)
end

t.test('loss_mask: masked response tokens count for nothing (a sample cut there is the same step)', function()
  local function run(list)
    local model = moonrl.model.new(CFG, { seed = 7 })
    local opt = models.adamw(model, { lr = 1e-2 })
    local m = train.policy_step({ model = model, opt = opt, samples = list, lr = 1e-2, agg = 'token-mean' })
    local p, n = model:params()
    local g = model:grads()
    local copy = { grads = {} }
    for i = 0, n - 1 do copy[i], copy.grads[i] = p[i], g[i] end
    return copy, n, m
  end
  -- the last three tokens of the long sample masked, against the sample without them (causal
  -- attention: its first tokens' log-probs do not see the later ones)
  local masked, cut = samples(), samples()
  masked[6].loss_mask = { 1, 1, 1, 0, 0, 0 }
  cut[6].ids = { 12, 2, 7 }
  local a, n, ma = run(masked)
  local b, _, mb = run(cut)
  local worst = 0
  for k = 0, n - 1 do -- (but where a gradient is within 1e-6 of 0: AdamW turns its rounding into up to lr)
    if math.abs(b.grads[k]) > 1e-6 then worst = math.max(worst, math.abs(a[k] - b[k])) end
  end
  t.truthy(worst < 1e-6, 'weights differ by up to ' .. worst)
  t.eq(ma.tokens, mb.tokens, 'the masked tokens are not counted')
  t.near(ma.loss, mb.loss, 1e-6, 'loss')
  -- and a mask that keeps everything is no mask
  local ones = samples()
  ones[6].loss_mask = { 1, 1, 1, 1, 1, 1 }
  local c = run(ones)
  local d = run(samples())
  for k = 0, n - 1 do t.eq(c[k], d[k], 'an all-ones mask changes nothing') end
  -- a mask that does not fit its response is an error naming the field, before any work
  for _, bad in ipairs({ { { 1, 1 }, '2 entries for a response of 6 tokens' }, { { 1, 1, 1, 0.5, 0, 0 }, 'entry 4 is 0.5' },
      { 'x', 'a string for a response of 6 tokens' } }) do
    local s = samples()
    s[6].loss_mask = bad[1]
    t.raises(function() run(s) end, "sample field 'loss_mask': " .. bad[2])
  end
end)

t.done()
