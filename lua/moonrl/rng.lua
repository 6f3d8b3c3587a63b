-- moonrl.rng: the random generator of the Lua side, the same numbers on every machine. Everything
-- Lua draws at random goes through it: a session's named generators (S:rng, saved in
-- checkpoints), the tasks' shuffles, DPO's pair order, the examples. (The C side has its own, one
-- header: the model's initialisation, sampling, the data's permutations.)
--
--   local rng = require('moonrl.rng')
--   local r = rng.new(seed)          -- from a seed
--   local j = r:int(n)               -- in [0, n)
--   local s = r.state                -- all of its state, a number: rng.from_state(s) continues it
--   rng.shuffle(list, r)             -- Fisher-Yates in place
--
-- The generator is Lehmer's (MINSTD, multiplier 48271, modulus 2^31 - 1): small, exact in doubles,
-- and its state one JSON number.
local M = {}

local Rng = {}
Rng.__index = Rng
M.Rng = Rng

function Rng:int(n)
  self.state = (self.state * 48271) % 2147483647
  return self.state % n
end

function M.new(seed) return setmetatable({ state = (seed * 69069 + 1) % 2147483648 }, Rng) end

function M.from_state(state) return setmetatable({ state = state }, Rng) end

-- Shuffle a list in place (Fisher-Yates, from the last element down) with generator r.
function M.shuffle(list, r)
  for i = #list, 2, -1 do
    local j = r:int(i) + 1
    list[i], list[j] = list[j], list[i]
  end
  return list
end

return M
