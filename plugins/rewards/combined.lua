-- A weighted sum of rewards, as a plugin module:
--
--   local both = require('rewards.combined').new{
--     { reward = 'math', weight = 1.0 },
--     { reward = require('rewards.format').new{ strict = false }, weight = 0.2 },
--   }
--   local total, parts = both(sample)      -- parts.math, parts[2]: each part's unweighted value
--
-- Names are looked up in moonrl.rewards when new() is called, so a typo fails at once.
local rewards = require('moonrl.rewards')

local M = {}

function M.new(spec) return rewards.combine(spec) end

return M
