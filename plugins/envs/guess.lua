-- env=guess: a number game with feedback. The secret is the record's answer (data.task=guess
-- draws them), or a draw of the episode's generator in lo..hi (1..100) when it has none; the
-- record's prompt opens the episode. Each turn's last integer is the guess: the environment
-- answers "higher" or "lower" (as a user message), or ends the episode when it is right, with the
-- reward 1 - (turns - 1) / env.max_turns: a win in fewer turns is worth more; the turns running
-- out, 0. A turn without a number is told so, and costs its turn.
--
--   local guess = require('envs.guess')
--   env.register('guess_symbols', guess.new{ higher = '>', lower = '<', retry = '?', lo = 1, hi = 50 })
--     -- the same game in other words (examples/agent_guess.lua: a tokenizer of digits and symbols)
local env = require('moonrl.env')

local M = {}

function M.new(o)
  o = o or {}
  local higher, lower, retry = o.higher or 'higher', o.lower or 'lower', o.retry or 'Answer with a number.'
  local lo, hi = o.lo or 1, o.hi or 100
  return {
    reset = function(ep, record)
      local secret = tonumber(record.answer)
      if not secret then secret = lo + ep.rng:int(hi - lo + 1) end
      ep.secret = math.floor(secret)
      return { { role = 'user', content = record.prompt or string.format('Guess my number between %d and %d.', lo, hi) } }
    end,
    step = function(ep, turn)
      local last
      for n in turn.text:gmatch('%-?%d+') do last = n end
      local guess = tonumber(last)
      if not guess then return { { role = 'user', content = retry } }, 0, false end
      if guess == ep.secret then return {}, 1 - (turn.n - 1) / ep.max_turns, true end
      -- 0 until a win, so that every episode has a reward (a lost one ends at env.max_turns)
      return { { role = 'user', content = guess < ep.secret and higher or lower } }, 0, false
    end,
  }
end

env.register('guess', M.new(),
  'guess the number (the record\'s answer) with "higher"/"lower" answers; 1 - (turns-1)/max_turns for a win')

return M
