-- The hot loops of moonrl.algo are compiled by LuaJIT (Snabb style): run every estimator and loss on
-- a batch large enough to make its loops hot, with a jit.attach hook on trace events, and assert
-- that traces were completed in each module and that no trace that started in lua/moonrl/algo/
-- was aborted (NYI or otherwise). (A caller's own hot loop that runs into the argument checks, which
-- are jit.off, would abort there; the test's callers are not hot.)
local t = require('moonrl.testing')
local jutil = require('jit.util')
local vmdef = require('jit.vmdef')
local ffi = require('ffi')
local algo = require('moonrl.algo')
local A = algo.agg

local function where(func, pc)
  local ok, info = pcall(jutil.funcinfo, func, pc)
  if not ok or not info then return '?' end
  return (info.source or '?') .. ':' .. tostring(info.currentline or info.linedefined or '?')
end
local function in_algo(loc) return loc:find('moonrl/algo/', 1, true) ~= nil end

local started, completed, aborts = {}, {}, {}
local function on_trace(what, tr, func, pc, otr, oex)
  if what == 'start' then
    started[tr] = where(func, pc)
  elseif what == 'stop' then
    local loc = started[tr]
    if loc and in_algo(loc) and jutil.traceinfo(tr).linktype == 'loop' then
      local file = loc:match('algo/([%w_]+)%.lua')
      completed[file] = (completed[file] or 0) + 1
    end
  elseif what == 'abort' then
    local loc, start = where(func, pc), started[tr] or '?'
    -- Aborts that are about where a trace ends, not about what it can compile, are allowed:
    --   'leaving loop in root trace'  the loop ended while it was recorded (hot count fired near its
    --                                 end); it is recorded again on its next run
    --   'loop unroll limit reached'   a trace leaving one loop ran into the next loop; that loop gets
    --                                 its own root trace instead
    --   'inner loop in root trace'    a root trace that started in an outer loop met an inner loop; the
    --                                 inner loop gets its own root trace (which run becomes hot first
    --                                 varies from process to process)
    --   'JIT compilation disabled for function', 'blacklisted'  a loop's exit trace ran on into the
    --                                 argument checks of the next call, interpreted by design
    --                                 (jit.off: agg.lua's checks, correction.lua's check_options)
    -- Everything else — NYI above all — fails the test. That each module's loops did compile is
    -- checked separately (completed loop traces).
    local err = vmdef.traceerr[otr]
    local benign = err == 'leaving loop in root trace' or err == 'loop unroll limit reached'
      or err == 'inner loop in root trace'
      or ((err == 'JIT compilation disabled for function' or err == 'blacklisted')
        and (loc:find('algo/agg.lua', 1, true) or loc:find('algo/correction.lua', 1, true)))
    if in_algo(start) and not benign then
      local msg = vmdef.traceerr[otr] or tostring(otr)
      if oex ~= nil then
        local ok, m = pcall(string.format, msg, type(oex) == 'function' and where(oex) or oex)
        if ok then msg = m end
      end
      aborts[#aborts + 1] = string.format('trace %d (started at %s) aborted at %s: %s', tr, start, loc, msg)
    end
  end
end

-- A batch of 48 sequences of 20..200 tokens (prompt masked, some masked tokens in responses).
math.randomseed(3)
local lengths, masks = {}, {}
for i = 1, 48 do
  local p, r = math.random(4, 20), math.random(16, 180)
  lengths[i] = p + r
  for _ = 1, p do masks[#masks + 1] = 0 end
  for _ = 1, r do masks[#masks + 1] = math.random() < 0.05 and 0 or 1 end
end
local cu, nseq, ntok = A.cu_from_lengths(lengths)
local mask = A.array(masks)
local function rnd(lo, hi)
  local x = A.zeros(ntok)
  for i = 0, ntok - 1 do x[i] = lo + (hi - lo) * math.random() end
  return x
end
local function args(f)
  local a = { cu_seqlens = cu, nseq = nseq, mask = mask }
  for k, v in pairs(f) do a[k] = v end
  return a
end
local lp, old, ref, adv, roll = rnd(-3, -0.1), rnd(-3, -0.1), rnd(-3, -0.1), rnd(-1, 1), rnd(-3, -0.1)
local values, h = rnd(-1, 1), rnd(0, 2)
local scores = A.zeros(nseq)
for i = 0, nseq - 1 do scores[i] = math.random() end
local grad = A.zeros(ntok)
local wts = ffi.new('float[?]', ntok)
local work_modes = {}
for _, mode in ipairs(algo.correction.MODES) do
  work_modes[#work_modes + 1] = function()
    algo.correction.weights(args{ mode = mode, proximal_logprob = old, behavior_logprob = roll, out = wts,
      lower = 0.3, upper = 3, weight = mode == 'mis_seq' and 'ratio' or nil })
  end
end

local work = {
  function() for _, f in ipairs(work_modes) do f() end end,
  function() algo.advantages.grpo{ scores = scores, nseq = nseq, group = 8 } end,
  function() algo.advantages.rloo{ scores = scores, nseq = nseq, group = 8 } end,
  function() algo.advantages.to_tokens(args{ values = scores }) end,
  function()
    local r = algo.advantages.token_rewards(args{ scores = scores, old_logprob = old, ref_logprob = ref, kl_coef = 0.05 })
    algo.advantages.reinforce_pp(args{ token_rewards = r, gamma = 0.99 })
    algo.advantages.gae(args{ token_rewards = r, values = values, gamma = 0.99, lam = 0.95 })
  end,
  function() algo.policy_loss.ppo(args{ logprob = lp, old_logprob = old, advantages = adv, grad = grad, dual_clip = 3 }) end,
  function() algo.policy_loss.ppo(args{ logprob = lp, old_logprob = old, advantages = adv, rollout_logprob = roll,
    agg = 'seq-mean-token-mean', grad = grad }) end,
  function() algo.policy_loss.gspo(args{ logprob = lp, old_logprob = old, advantages = adv, grad = grad }) end,
  function() algo.policy_loss.ppo(args{ logprob = lp, old_logprob = old, advantages = adv, weights = wts, grad = grad }) end,
  function() algo.policy_loss.decoupled_ppo(args{ logprob = lp, old_logprob = old, behavior_logprob = roll,
    advantages = adv, behav_imp_weight_cap = 2, grad = grad }) end,
  function() algo.policy_loss.decoupled_ppo(args{ logprob = lp, old_logprob = old, behavior_logprob = roll,
    advantages = adv, weights = wts, grad = grad }) end,
  function() algo.kl.loss(args{ logprob = lp, ref_logprob = ref, grad = grad }) end,
  function() algo.kl.loss(args{ logprob = lp, ref_logprob = ref, estimator = 'k2', grad = grad }) end,
  function() algo.kl.entropy_bonus(args{ entropy = h, grad = grad }) end,
  function() algo.value_loss.clipped(args{ values = values, old_values = rnd(-1, 1), returns = rnd(-1, 1), grad = grad }) end,
  function() algo.dpo.loss(args{ logprob = lp, ref_logprob = ref, grad = grad }) end,
  function() algo.sft.loss(args{ logprob = lp, grad = grad, agg = 'seq-mean-token-sum' }) end,
}

t.test('hot loops compile without trace aborts', function()
  jit.flush()
  jit.attach(on_trace, 'trace')
  local ok, err = pcall(function()
    for _ = 1, 3 do
      for _, w in ipairs(work) do w() end
    end
  end)
  jit.attach(on_trace)
  assert(ok, err)
  t.eq(table.concat(aborts, '\n'), '', 'trace aborts in moonrl/algo')
  for _, m in ipairs({ 'agg', 'advantages', 'policy_loss', 'correction', 'kl', 'dpo', 'value_loss' }) do
    t.truthy((completed[m] or 0) > 0, 'a loop trace completed in algo/' .. m .. '.lua')
  end
end)

t.test('the hook catches an NYI abort in a loop', function()
  -- a loop in a chunk named like an algo file, with a construct LuaJIT 2.1 does not compile
  local f = assert(loadstring([[
    local s = 0
    for i = 1, 500 do s = s + #string.rep('x', i % 3) + (select('#', string.byte('abc', 1, -1))) end
    local u = 0
    for i = 1, 500 do u = u + #tostring(i) end
    local t = {}
    for i = 1, 500 do t[i] = setmetatable({}, { __index = function() return i end }).x end
    return s
  ]], '@lua/moonrl/algo/selftest.lua'))
  aborts = {}
  jit.flush()
  jit.attach(on_trace, 'trace')
  f()
  jit.attach(on_trace)
  t.truthy(#aborts > 0, 'an abort was reported')
  t.truthy(table.concat(aborts, '\n'):find('NYI', 1, true), 'it names the NYI: ' .. table.concat(aborts, '; '))
end)

t.done()
