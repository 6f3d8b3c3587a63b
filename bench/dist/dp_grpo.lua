-- moonrl's side of bench/dist/dp_grpo.sh: recipes/grpo.lua as it is, with the reward of
-- bench/grpo/grpo_step.lua (the share of the characters '7' in the completion) registered first as
-- 'sevens'. Every key=value of the command line goes to the recipe:
--   moonrl run bench/dist/dp_grpo.lua model.dir=... data.path=... reward=sevens ...
--   moonrl launch -n 2 bench/dist/dp_grpo.lua ... run.threads=1
local moonrl = require('moonrl')
require('moonrl.rewards').register('sevens', function(s)
  local _, n = s.response:gsub('7', '')
  return n / math.max(#s.response, 1)
end)
return dofile(moonrl.home .. '/recipes/grpo.lua')
