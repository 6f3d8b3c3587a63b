-- RLOO (Ahmadian et al. 2024, "Back to Basics"): REINFORCE with a leave-one-out baseline. A
-- completion's advantage is its reward minus the mean reward of the other completions of its
-- prompt, and the update is the plain policy gradient (grpo.loss=reinforce: no ratio, no clip).
-- Everything else (rollouts, checkpoints, ranks, async, held-out evaluation, logging) is
-- recipes/grpo.lua's, through moonrl.rl; only the advantages stage is this file's.
--
--   moonrl run examples/rloo.lua model.dir=MODEL eval.every=5     (the default task: data.task=addition)
-- The same algorithm from the registries, without this file: moonrl run grpo grpo.advantage=rloo grpo.loss=reinforce
local rl = require('moonrl.rl')

local rloo = rl.extend('grpo', { name = 'rloo', config = {
  data = { task = 'addition', chat = false }, reward = { name = 'exact' }, train = { lr = 3e-4 },
  grpo = { steps = 30, prompts = 32, samples = 8, max_tokens = 5, advantage = 'rloo', loss = 'reinforce' },
} })

-- A_i = r_i − (Σ_j r_j − r_i) / (G − 1) over the G samples of a prompt (consecutive)
function rloo:advantages(samples)
  local G = self.group
  for first = 1, #samples, G do
    local sum = 0
    for i = first, first + G - 1 do sum = sum + samples[i].score end
    for i = first, first + G - 1 do
      local s = samples[i]
      s.adv = (s.score - (sum - s.score) / (G - 1)) * (s.adv_scale or 1) -- adv_scale: async.stale=downweight
    end
  end
end

return rloo:main()
