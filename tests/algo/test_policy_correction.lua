-- recipe.policy_step with the off-policy corrections (o.correction, o.loss = 'decoupled_ppo') on a
-- tiny model: the samples' rollout_logprobs are the behaviour log-probs, the current (or old)
-- log-probs the proximal ones; weights scale the step's loss and gradients as the formulas say,
-- over several micro-batches, and the metrics land in m.is.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local models = require('moonrl.train.models')
local train = require('moonrl.train.step')
local tiny = dofile('tests/lib/models.lua')

local cfg = tiny.config('qwen2')
-- the shared sample set's two groups (tests/lib/samples.lua), without its lone sample
local function samples()
  local s = dofile('tests/lib/samples.lua').groups()
  s[7] = nil
  return s
end
local NTOK = 3 + 1 + 5 + 2 + 0 + 2

-- One policy step on a fresh model (same seed each time); shift(i, k) is added to the model's own
-- log-prob of sample i's token k to give its rollout_logprobs (nil: no rollout_logprobs).
-- Returns the metrics and a copy of the gradients (unclipped: max_grad_norm is huge).
local function step(o, shift)
  local model = moonrl.model.new(cfg, { seed = 3 })
  local s = samples()
  if shift then
    local lps = train.logprobs(model, s, 4096)
    for i, list in ipairs(lps) do
      local r = {}
      for k, v in ipairs(list) do r[k] = v + shift(i, k) end
      s[i].rollout_logprobs = r
    end
  end
  local opt = models.adamw(model, { lr = 1e-3 })
  local args = { model = model, opt = opt, samples = s, lr = 1e-3, micro_batch_tokens = 14, max_grad_norm = 1e9 }
  for k, v in pairs(o) do args[k] = v end
  local m = train.policy_step(args)
  local g, n = model:grads()
  local copy = {}
  for k = 0, n - 1 do copy[k] = g[k] end
  return m, copy, n
end

local function scaled(name, g, g0, n, f)
  local gmax, worst = 0, 0
  for k = 0, n - 1 do
    gmax = math.max(gmax, math.abs(g0[k]))
    worst = math.max(worst, math.abs(g[k] - f * g0[k]))
  end
  t.truthy(gmax > 0, name .. ': the baseline has gradients')
  t.truthy(worst <= 1e-4 * gmax * math.max(f, 1), name .. ': gradients ×' .. f .. ' (max |diff| ' .. worst .. ')')
end

local log3 = math.log(3)
local base_m, base_g, N = step({})

t.test('TIS: ratio 3 truncated at C = 2 doubles the step', function()
  local m, g = step({ correction = { mode = 'tis', clip = 2 } }, function() return -log3 end)
  t.near(m.loss, 2 * base_m.loss, 1e-5 * math.abs(base_m.loss), 'loss')
  scaled('tis', g, base_g, N, 2)
  t.near(m.is.ratio_mean, 3, 1e-5)
  t.near(m.is.ratio_max, 3, 1e-5)
  t.near(m.is.weight_mean, 2, 1e-6)
  t.near(m.is.clipfrac, 1, 0)
  t.eq(m.is.tokens, NTOK, 'over every micro-batch')
  t.eq(m.is.seqs, 5)
  t.near(m.is.kl_k1, -log3, 1e-5)
  -- C = 1: the weights are 1, the step is the plain one
  m, g = step({ correction = { mode = 'tis', clip = 1 } }, function() return -log3 end)
  t.near(m.loss, base_m.loss, 1e-5 * math.abs(base_m.loss), 'C = 1 loss')
  scaled('tis C = 1', g, base_g, N, 1)
end)

t.test('MIS: tokens and sequences outside the bounds are dropped', function()
  -- every ratio 3, outside [0.5, 2]: nothing is left
  local m, g = step({ correction = { mode = 'mis_token' } }, function() return -log3 end)
  t.eq(m.loss, 0)
  t.eq(m.grad_norm, 0)
  t.near(m.is.masked_frac, 1, 0)
  t.near(m.is.seq_masked_frac, 1, 0)
  -- no rollout_logprobs: ratio 1, the plain step; the metrics say so
  m, g = step({ correction = { mode = 'mis_seq' } })
  t.near(m.loss, base_m.loss, 1e-6 * math.abs(base_m.loss), 'no rollout log-probs')
  scaled('no rollout log-probs', g, base_g, N, 1)
  t.eq(m.is.masked_frac, 0)
  t.near(m.is.ratio_mean, 1, 0)
  -- a sequence product of 1.1^len: dropped at upper 1.2 when len >= 2 (samples 1, 3, 4, 6), kept for
  -- sample 2 (1 token); geometric mean 1.1 everywhere (kept in [0.9, 1.2])
  local l11 = math.log(1.1)
  m = step({ correction = { mode = 'mis_seq', upper = 1.2 } }, function() return -l11 end)
  t.near(m.is.masked_frac, (NTOK - 1) / NTOK, 1e-12)
  t.near(m.is.seq_masked_frac, 4 / 5, 1e-12)
  t.truthy(m.loss ~= 0, 'sample 2 remains')
  m, g = step({ correction = { mode = 'mis_geo', lower = 0.9, upper = 1.2 } }, function() return -l11 end)
  t.eq(m.is.masked_frac, 0)
  scaled('mis_geo kept', g, base_g, N, 1)
  t.near(m.is.seq_ratio_max, 1.1, 1e-5)
end)

t.test("decoupled PPO: the behaviour weight π_prox/μ, AReaL's cap", function()
  -- μ = π_prox: plain PPO
  local m, g = step({ loss = 'decoupled_ppo' }, function() return 0 end)
  t.near(m.loss, base_m.loss, 1e-6 * math.abs(base_m.loss), 'μ = π_prox')
  scaled('μ = π_prox', g, base_g, N, 1)
  t.truthy(m.is and m.is.behav, 'metrics under m.is.behav')
  t.near(m.is.behav.weight_mean, 1, 1e-6)
  -- w = 1.5
  local l15 = math.log(1.5)
  m, g = step({ loss = 'decoupled_ppo' }, function() return -l15 end)
  t.near(m.loss, 1.5 * base_m.loss, 1e-5 * math.abs(base_m.loss), 'w = 1.5')
  scaled('w = 1.5', g, base_g, N, 1.5)
  t.near(m.is.behav.ratio_max, 1.5, 1e-5)
  -- cap 1.2: every token dropped (AReaL), or truncated to 1.2
  m = step({ loss = 'decoupled_ppo', behav_imp_weight_cap = 1.2 }, function() return -l15 end)
  t.eq(m.loss, 0)
  t.near(m.is.behav.masked_frac, 1, 0)
  m, g = step({ loss = 'decoupled_ppo', behav_imp_weight_cap = 1.2, behav_cap_mode = 'truncate' },
    function() return -l15 end)
  scaled('truncated at 1.2', g, base_g, N, 1.2)
  t.near(m.is.behav.clipfrac, 1, 0)
  -- with a correction as well: its weights multiply (geometric mean 1.5 outside [0.9, 1.2]: all dropped)
  m = step({ loss = 'decoupled_ppo', correction = { mode = 'mis_geo', lower = 0.9, upper = 1.2 } },
    function() return -l15 end)
  t.eq(m.loss, 0)
  t.near(m.is.masked_frac, 1, 0)
  t.near(m.is.behav.weight_mean, 1.5, 1e-5)
end)

t.done()
