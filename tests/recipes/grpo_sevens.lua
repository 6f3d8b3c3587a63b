-- recipes/grpo.lua with a reward that a tiny random model earns in part from its first step
-- (the share of '7' in the response), so that every step moves the weights.
local moonrl = require('moonrl')
require('moonrl.rewards').register('sevens', function(s)
  local _, n = s.response:gsub('7', '')
  return n / math.max(#s.response, 1)
end, { replace = true })
return dofile(moonrl.home .. '/recipes/grpo.lua')
