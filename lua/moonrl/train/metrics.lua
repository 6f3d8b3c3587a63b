-- moonrl.train.metrics: the figures every recipe logs about its samples.
--
--   local metrics = require('moonrl.train.metrics')
--   m.reward, m.accuracy = metrics.reward_metrics(scores, n)
--   m.response_length = metrics.length_metrics(samples)
--   local mean, std, max = metrics.stats(list)
local M = {}

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

-- Throughput helper: tokens / seconds (0 when no time passed).
function M.rate(tokens, seconds) return seconds > 0 and tokens / seconds or 0 end

return M
