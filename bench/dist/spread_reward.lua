-- bench/dist/delta.sh's reward: a score that differs between a prompt's samples whatever the model
-- (a random model's completions are rarely text, let alone right), so that every step updates the
-- weights: the share of the completion's token ids that are even.
local rewards = require('moonrl.rewards')
local M = {}

function M.spread(sample)
  local ids, even = sample.ids or {}, 0
  for _, id in ipairs(ids) do if id % 2 == 0 then even = even + 1 end end
  return #ids > 0 and even / #ids or 0
end

rewards.register('spread', M.spread, 'the share of the completion\'s token ids that are even')
return M
