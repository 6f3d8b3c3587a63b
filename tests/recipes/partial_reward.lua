-- A custom reward for the addition task, loaded with `moonrl run R --require tests/recipes/partial_reward.lua`
-- (tests/recipes/test_rl_library.lua): partial credit, a point for each right digit of the sum,
-- the whole halved when the answer has the wrong length (a stray '=' costs half).
local rewards = require('moonrl.rewards')
local M = {}

function M.partial(sample)
  local want, got, right = tostring(sample.answer), sample.response, 0
  for i = 1, #want do if got:sub(i, i) == want:sub(i, i) then right = right + 1 end end
  return right / #want * (#got == #want and 1 or 0.5)
end

rewards.register('partial', M.partial, 'a point per right digit, halved for a wrong length')
return M
