-- env=guess: a number game with feedback. The secret is the record's answer (data.task=guess
-- draws them), or a draw of the episode's generator in 1..100 when it has none; the record's
-- prompt opens the episode. Each turn's last integer is the guess: the environment answers
-- "higher" or "lower" (as a user message), or ends the episode when it is right, with the reward
-- 1 - (turns - 1) / env.max_turns: a win in fewer turns is worth more; no win, no reward (0 when
-- the turns run out). A turn without a number is told so, and costs its turn.
local env = require('moonrl.env')

local M = {}

function M.reset(ep, record)
  local secret = tonumber(record.answer)
  if not secret then secret = 1 + ep.rng:int(100) end
  ep.secret = math.floor(secret)
  return { { role = 'user', content = record.prompt or 'Guess my number between 1 and 100.' } }
end

function M.step(ep, turn)
  local last
  for n in turn.text:gmatch('%-?%d+') do last = n end
  local guess = tonumber(last)
  if not guess then return { { role = 'user', content = 'Answer with a number.' } }, 0, false end
  if guess == ep.secret then return {}, 1 - (turn.n - 1) / ep.max_turns, true end
  -- the turns running out: a reward of 0, so that every episode has one (the limit ends it)
  return { { role = 'user', content = guess < ep.secret and 'higher' or 'lower' } }, 0, false
end

env.register('guess', { reset = M.reset, step = M.step },
  'guess the number (the record\'s answer) with "higher"/"lower" answers; 1 - (turns-1)/max_turns for a win')

return M
