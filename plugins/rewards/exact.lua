-- Exact-answer reward: 1 when the response, stripped of surrounding whitespace, is the reference
-- answer (compared as numbers when both are numbers, else as strings), 0 otherwise.
--
--   local exact = require('rewards.exact')
--   exact.reward{ response = ' 85 ', answer = 85 }       --> 1
--   local r = exact.new{ correct_score = 1, wrong_score = -1 }
local rewards = require('moonrl.rewards')

local M = {}

local function strip(s) return (s:gsub('^%s+', ''):gsub('%s+$', '')) end

function M.new(opts)
  opts = opts or {}
  local correct, wrong = opts.correct_score or 1, opts.wrong_score or 0
  return function(sample)
    local got = strip(rewards.response_of(sample, 'reward exact'))
    local want = sample.answer
    if want == nil then error('reward exact: sample.answer is missing', 2) end
    want = strip(tostring(want))
    local a, b = tonumber(got), tonumber(want)
    if a and b and got:match('^[%d%.%-+eE]+$') then return a == b and correct or wrong end
    return got == want and correct or wrong
  end
end

M.reward = M.new()
-- loaded (by moonrl.rewards.get through moonrl.registry.plugin, or a require), it registers its built-in reward
rewards.register('exact', M.reward, { builtin = true })

return M
