-- The samples the update-step tests share (moonrl.batch's sample contract): two groups of three
-- whose samples share one prompt table each, as batch.flatten gives a group (so packing can share
-- the prompt's rows), an empty response among them, and a lone sample; responses of different
-- lengths, each with its advantage.
--
--   local samples = dofile('tests/lib/samples.lua').groups()
local M = {}

function M.groups()
  local pa, pb, pc = { 1, 5, 6, 7, 13 }, { 1, 9, 3 }, { 1, 4 }
  return {
    { prompt_ids = pa, ids = { 3, 4, 2 }, adv = 0.7 },
    { prompt_ids = pa, ids = { 8 }, adv = -1.2 },
    { prompt_ids = pa, ids = { 9, 9, 9, 9, 2 }, adv = 0.5 },
    { prompt_ids = pb, ids = { 10, 11 }, adv = 1.0 },
    { prompt_ids = pb, ids = {}, adv = 0.0 },
    { prompt_ids = pb, ids = { 12, 2 }, adv = -0.3 },
    { prompt_ids = pc, ids = { 5, 6, 2 }, adv = 0.9 },
  }
end

return M
