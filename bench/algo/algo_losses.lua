-- Time moonrl.algo's PPO-clip loss + gradient, GRPO advantages and GAE over a packed batch; prints
-- one JSON line of seconds per call. Run by bench/algo/algo_losses.py (which times PyTorch beside it).
--   moonrl run bench/algo/algo_losses.lua nseq=256 len=1024
local moonrl = require('moonrl')
local algo = require('moonrl.algo')
local A = algo.agg
local cfg = moonrl.config { nseq = moonrl.config.integer(256), len = moonrl.config.integer(1024) }
local nseq, len = cfg.nseq, cfg.len
local lengths = {}
for i = 1, nseq do lengths[i] = len end
local cu, _, ntok = A.cu_from_lengths(lengths)
local function rnd(lo, hi)
  local x = A.zeros(ntok, 'float')
  for i = 0, ntok - 1 do x[i] = lo + (hi - lo) * math.random() end
  return x
end
local mask = A.zeros(ntok, 'float')
for i = 0, ntok - 1 do mask[i] = (i % len) >= len / 4 and 1 or 0 end   -- first quarter: prompt
local lp, old, adv, values = rnd(-3, -0.1), rnd(-3, -0.1), rnd(-1, 1), rnd(-1, 1)
local grad = A.zeros(ntok, 'float')
local scores = A.zeros(nseq)
for i = 0, nseq - 1 do scores[i] = math.random() end
local function time(fn, reps)
  fn()
  local t0 = moonrl.now()
  for _ = 1, reps do fn() end
  return (moonrl.now() - t0) / reps
end
local b = { cu_seqlens = cu, nseq = nseq, mask = mask }
local ppo = time(function()
  algo.policy_loss.ppo{ cu_seqlens = cu, nseq = nseq, mask = mask, logprob = lp, old_logprob = old,
    advantages = adv, grad = grad, clip_high = 0.28, dual_clip = 3 }
end, 10)
local grpo = time(function()
  local a = algo.advantages.grpo{ scores = scores, nseq = nseq, group = 8 }
  algo.advantages.to_tokens{ values = a, cu_seqlens = cu, nseq = nseq, mask = mask, out = grad }
end, 10)
local r = algo.advantages.token_rewards{ scores = scores, cu_seqlens = cu, nseq = nseq, mask = mask }
local gae = time(function()
  algo.advantages.gae{ token_rewards = r, values = values, cu_seqlens = cu, nseq = nseq, mask = mask, gamma = 0.99, lam = 0.95 }
end, 10)
io.stdout:write(string.format('{"ntok": %d, "ppo": %.9g, "grpo": %.9g, "gae": %.9g}\n', ntok, ppo, grpo, gae))
