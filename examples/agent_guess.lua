-- A tiny model plays a number game on the CPU and learns to win it in fewer turns: the secret is a
-- number in 1..50, each wrong guess is answered '<' (the secret is lower) or '>' (higher), and a
-- win at turn k is worth 1 - (k - 1) / env.max_turns. Multi-turn episodes (moonrl.env,
-- docs/agents.md) on the default example's loop (examples/default.lua: its model, warm-up and
-- figures):
--
--   1. the task: secrets drawn in 1..50; the held-out set is every secret once
--   2. an SFT warm-up on transcripts of a player who guesses at random among the numbers the
--      answers so far allow (the game's tokens under a loss mask of 0):
--        <|bos|>?   25<|eos|>   <   12<|eos|>   >   19<|eos|>
--        prompt     guess       game guess      game guess (right)
--      which wins in about 6 turns
--   3. GRPO on the episodes (env=guess_symbols: plugins/envs/guess.lua's game in symbols, at most
--      env.max_turns = 10 turns): a group's episodes share their secret, and those that win sooner
--      get the larger advantage
--   4. the held-out mean turns again (greedy episodes; a game lost counts its 10 turns)
--
--   moonrl run examples/agent_guess.lua                      (grpo.steps=60 run.seed=3 ...)
-- Measured results: bench/RESULTS.md ("Agents").
local moonrl = require('moonrl')
local config = require('moonrl.config')
local env = require('moonrl.env')
local rl = require('moonrl.rl')
local prompts = require('moonrl.train.prompts')
local guess = require('envs.guess')

local LO, HI = 1, 50
env.register('guess_symbols', guess.new({ higher = '>', lower = '<', retry = '?', lo = LO, hi = HI }),
  { doc = 'examples/agent_guess.lua: the number game in 1..50, answered with < and >', replace = true }) -- (loaded twice: the same)

local ex = rl.extend(moonrl.home .. '/examples/default.lua', { name = 'agent_guess', config = {
  heldout = config.integer(HI - LO + 1, { min = 1 }), -- every secret once
  sft = { flawed = rl.NONE, steps = config.integer(2000, { min = 0 }) },
  grpo = { steps = config.integer(40), max_tokens = config.integer(3) },
  env = { name = 'guess_symbols', max_turns = 10, template = 'plain', max_tokens = 60 },
} })
ex.tokenizer_dir, ex.positions = moonrl.home .. '/examples/agent', 64

-- The figure before and after: the held-out greedy games' mean turns (a game lost: max_turns).
ex.figure = { name = 'mean turns', of = function(m) return m.turns end,
  text = function(v) return string.format('%.2f', v) end }

-- The problems: the secret is the answer, the prompt '?' (a new game).
function ex:problems()
  local S, cfg = self.S, self.cfg
  local prompt_ids = prompts.prompt_ids(S.tok, nil, '?')
  local heldout, train = {}, {}
  for k = 1, cfg.heldout do
    heldout[k] = { prompt = '?', answer = tostring(LO + (k - 1) % (HI - LO + 1)), prompt_ids = prompt_ids }
  end
  for k = 1, 20000 do
    train[k] = { prompt = '?', answer = tostring(LO + self.rng:int(HI - LO + 1)), prompt_ids = prompt_ids }
  end
  return train, heldout
end

-- One warm-up game: guesses drawn among the numbers the answers allow, until the secret or
-- env.max_turns; the game's answers masked out of the loss.
function ex:warmup_sample(p)
  local tok, secret = self.S.tok, tonumber(p.answer)
  local lo, hi, ids, mask = LO, HI, {}, {}
  local function add(text, m, eos)
    local t = eos and prompts.completion_ids(tok, text) or tok:encode(text, { add_special = false })
    for _, id in ipairs(t) do ids[#ids + 1], mask[#mask + 1] = id, m end
  end
  for turn = 1, self.cfg.env.max_turns do
    local g = lo + self.rng:int(hi - lo + 1)
    add(tostring(g), 1, true)
    if g == secret or turn == self.cfg.env.max_turns then break end
    if g < secret then lo = g + 1; add('>', 0) else hi = g - 1; add('<', 0) end
  end
  return { prompt_ids = p.prompt_ids, ids = ids, loss_mask = mask }
end

return ex:main()
