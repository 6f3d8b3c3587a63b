-- Shared-prompt packing (recipe.pack with share_prompts, mrl_batch.prefix): the layout it builds,
-- and that log-probs and a whole policy step (loss, metrics, gradients, updated weights) are
-- those of packing every sample whole.
local t = require('moonrl.testing')
local ffi = require('ffi')
local moonrl = require('moonrl')
local batch = require('moonrl.batch')
local models = require('moonrl.train.models')
local train = require('moonrl.train.step')
local tiny = dofile('tests/lib/models.lua')

-- two groups of 3 samples (prompts pa = { 1, 5, 6, 7, 13 } and pb = { 1, 9, 3 }, one table each),
-- an empty response among them, and a lone sample (pc = { 1, 4 })
local samples = dofile('tests/lib/samples.lua').groups

t.test('pack: the layout of shared prompts', function()
  local s = samples()
  local whole, shared = batch.pack(s), batch.pack(s, 1, #s, { share_prompts = true })
  t.eq(whole.n_seqs, 7)
  t.eq(whole.n_tokens, 3 * 5 + 9 + 3 * 3 + 4 + 2 + 3)
  -- pa[1..4] once, 3 children "13 + response"; pb[1..2] once, 3 children; pc whole
  t.eq(shared.n_seqs, 9)
  t.eq(shared.n_tokens, 4 + (1 + 3) + (1 + 1) + (1 + 5) + 2 + (1 + 2) + 1 + (1 + 2) + (2 + 3))
  local want_prefix = { -1, 0, 0, 0, -1, 4, 4, 4, -1 }
  for i = 1, 9 do t.eq(shared.prefix[i - 1], want_prefix[i], 'prefix of sequence ' .. i) end
  for i = 1, #s do
    t.eq(shared.len[i], whole.len[i])
    -- the output before each response token is the token before it, and its target is the token
    local a, b = whole.first[i], shared.first[i]
    for k = 0, shared.len[i] - 1 do
      t.eq(shared.tokens[b + k], whole.tokens[a + k])
      t.eq(shared.targets[b + k], whole.targets[a + k])
      t.eq(shared.mask[b + k], 1)
    end
  end
  -- one segment a sample: each shared prompt goes with its group's first sample
  local want_cu = { 0, 4 + 4, 8 + 2, 10 + 6, 16 + 2 + 3, 21 + 1, 22 + 3, 25 + 5 }
  for k = 0, #s do t.eq(shared.sample_cu[k], want_cu[k + 1], 'sample_cu[' .. k .. ']') end
  t.truthy(whole.sample_cu == whole.cu_seqlens, 'without shared prompts the segments are the sequences')
  local ones = 0
  for k = 0, shared.n_tokens - 1 do ones = ones + shared.mask[k] end
  t.eq(ones, 3 + 1 + 5 + 2 + 0 + 2 + 3)
  -- without the option (or with groups of one) nothing is shared
  local lone = batch.pack({ s[1], s[4], s[7] }, 1, 3, { share_prompts = true })
  t.eq(lone.n_tokens, 5 + 3 + 3 + 2 + 2 + 3)
end)

t.test('pack: log-probs and a policy step with shared prompts equal those of whole samples', function()
  local cfg = tiny.config('qwen2')
  local results = {}
  for _, share in ipairs({ false, true }) do
    local model = moonrl.model.new(cfg, { seed = 3 })
    local s = samples()
    local lps = train.logprobs(model, s, 4096, { share_prompts = share })
    local opt = models.adamw(model, { lr = 1e-2 })
    local m = train.policy_step({ model = model, opt = opt, samples = s, lr = 1e-2, share_prompts = share,
      agg = 'seq-mean-token-mean', entropy_coef = 0.01 })
    local g, n = model:grads()
    local p = model:params()
    results[share] = { lps = lps, m = m, grads = g, params = p, n = n, model = model }
  end
  local a, b = results[false], results[true]
  local worst = 0
  for i, list in ipairs(a.lps) do
    t.eq(#b.lps[i], #list)
    for k, v in ipairs(list) do worst = math.max(worst, math.abs(b.lps[i][k] - v)) end
  end
  t.truthy(worst < 2e-6, 'log-probs agree: max |diff| ' .. worst)
  t.near(b.m.loss, a.m.loss, 1e-6, 'loss')
  t.near(b.m.entropy, a.m.entropy, 1e-6, 'entropy')
  t.near(b.m.grad_norm, a.m.grad_norm, 1e-5 * a.m.grad_norm, 'grad norm')
  t.eq(b.m.tokens, a.m.tokens)
  local gmax, gdiff, pdiff = 0, 0, 0
  for k = 0, a.n - 1 do
    gmax = math.max(gmax, math.abs(a.grads[k]))
    gdiff = math.max(gdiff, math.abs(a.grads[k] - b.grads[k]))
    pdiff = math.max(pdiff, math.abs(a.params[k] - b.params[k]))
  end
  t.truthy(gmax > 0, 'the step has gradients')
  t.truthy(gdiff <= 2e-5 * gmax, 'gradients agree: max |diff| ' .. gdiff .. ' of max ' .. gmax)
  -- Adam's first step moves each weight by about lr * sign(g): where g is ~0 the sign may flip
  -- with rounding, so the weights are compared to a share of lr
  t.truthy(pdiff < 0.05 * 1e-2, 'updated weights agree: max |diff| ' .. pdiff)
end)

t.test('pack: value estimates (a critic) with shared prompts equal those of whole samples', function()
  local critic = tiny.model('llama', nil, { seed = 5, value_head = true })
  for _, v in ipairs(critic:views()) do -- a nonzero value head
    if v.name == 'score.weight' then
      for k = 0, v.numel - 1 do critic:params()[v.offset + k] = 0.05 * math.sin(k + 1) end
    end
  end
  local s = samples()
  local lw, vw = train.logprobs(critic, s, 4096, { values = true, share_prompts = false })
  local ls, vs = train.logprobs(critic, s, 4096, { values = true })
  local worst = 0
  for i = 1, #s do
    t.eq(#vs[i], #vw[i])
    for k = 1, #vw[i] do worst = math.max(worst, math.abs(vs[i][k] - vw[i][k]), math.abs(ls[i][k] - lw[i][k])) end
  end
  t.truthy(worst < 2e-6, 'values and log-probs agree: max |diff| ' .. worst)
end)

t.test('pack: the DPO loss over pairs sharing their prompt equals that of whole samples', function()
  local algo = require('moonrl.algo')
  local cfg = tiny.config('llama', { num_hidden_layers = 1 })
  local p1, p2 = { 1, 7, 8, 9, 13 }, { 1, 3, 14 }
  local pairs = { { prompt_ids = p1, ids = { 4, 5, 2 }, ref = -9.5 }, { prompt_ids = p1, ids = { 6, 2 }, ref = -6.25 },
                  { prompt_ids = p2, ids = { 10, 11, 12, 2 }, ref = -11.0 }, { prompt_ids = p2, ids = { 2 }, ref = -3.0 } }
  local out = {}
  for _, share in ipairs({ false, true }) do
    local model = moonrl.model.new(cfg, { seed = 9 })
    local b = batch.pack(pairs, 1, #pairs, { share_prompts = share })
    local ref = ffi.new('double[?]', #pairs)
    for k = 1, #pairs do ref[k - 1] = pairs[k].ref end
    local lp = model:forward(b)
    local grad = ffi.new('float[?]', b.n_tokens)
    model:zero_grad()
    local loss, dm = algo.dpo.loss({ logprob = lp, ref_seq = ref, mask = b.mask, cu_seqlens = b.sample_cu, nseq = #b.len,
      grad = grad, beta = 0.1, global_pairs = 2 })
    model:backward(grad)
    local g, n = model:grads()
    local copy = ffi.new('float[?]', n)
    ffi.copy(copy, g, 4 * n)
    out[share] = { loss = loss, acc = dm.rewards_accuracy, g = copy, n = n, tokens = b.n_tokens }
  end
  t.truthy(out[true].tokens < out[false].tokens, 'the prompts are packed once')
  t.near(out[true].loss, out[false].loss, 1e-6, 'loss')
  t.eq(out[true].acc, out[false].acc)
  local gmax, gdiff = 0, 0
  for k = 0, out[false].n - 1 do
    gmax = math.max(gmax, math.abs(out[false].g[k]))
    gdiff = math.max(gdiff, math.abs(out[false].g[k] - out[true].g[k]))
  end
  t.truthy(gmax > 0 and gdiff <= 2e-5 * gmax, 'gradients agree: max |diff| ' .. gdiff .. ' of max ' .. gmax)
end)

t.test('pack: a bad prefix array is an error naming the sequence', function()
  local model = tiny.model('llama')
  local b = moonrl.model.batch({ { 1, 2, 3 }, { 4, 5 } }, { prefix = { false, 2 } })
  t.raises(function() model:forward(b) end, 'prefix[1] = 1')
end)

t.done()
