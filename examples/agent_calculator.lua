-- A tiny model learns to use a calculator, on the CPU: 3-digit products ("347*812=" -> "281764")
-- are beyond its reach, but a call to the calculator tool gets them right, and the model only
-- has to copy the result. Multi-turn episodes (moonrl.env, docs/agents.md) on the default
-- example's loop (examples/default.lua: its model, warm-up and figures):
--
--   1. the task: products a*b with 100 <= a, b < 1000, `heldout` (200) of them held out
--   2. an SFT warm-up on transcripts of both ways to answer: mostly the product written at once
--      (which the model cannot compute: it learns to guess its digits), and a share sft.calls
--      (0.15) of episodes that call the calculator and copy what it returns:
--        <|bos|>347*812=   347*812?<|eos|>   281764=   281764<|eos|>
--        prompt            the call          the tool  the answer (copied)
--      (the tool's tokens under a loss mask of 0). Greedy, the model answers at once: the
--      held-out accuracy it leaves is low
--   3. GRPO on episodes of at most two turns (env=calculator_copy, below): the first turn is a
--      call when it is the question's expression and '?', and the calculator tool's result comes
--      back; the last turn is the answer, judged by the 'exact' reward. Only the reward says that
--      calling is the way
--   4. the held-out accuracy again (greedy episodes), and the model saved
--
--   moonrl run examples/agent_calculator.lua                   (grpo.steps=40 run.seed=3 ...)
-- Measured results: bench/RESULTS.md ("Agents").
local moonrl = require('moonrl')
local config = require('moonrl.config')
local env = require('moonrl.env')
local tools = require('moonrl.tools')
local rl = require('moonrl.rl')
local prompts = require('moonrl.train.prompts')

-- The environment: a call is the question's expression followed by '?' on the first turn; the
-- calculator (moonrl.tools' built-in) answers it, its result followed by '='. Any other turn is
-- the answer, and ends the episode (reward=exact judges it).
env.register('calculator_copy', {
  reset = function(_, record) return { { role = 'user', content = record.prompt } } end,
  step = function(ep, turn)
    local expr = turn.text:match('^(%d+%*%d+)%?$')
    if expr and turn.n == 1 then
      local result = tools.call({ name = 'calculator', arguments = { expression = expr } }, ep)
      return { { role = 'tool', content = result .. '=' } }, nil, false
    end
    return {}, nil, true
  end,
}, { doc = 'examples/agent_calculator.lua: "a*b?" calls the calculator, any other turn is the answer',
  replace = true }) -- (replace: the file may load twice in a process, as examples/agent_openai.lua extends it)

local ex = rl.extend(moonrl.home .. '/examples/default.lua', { name = 'agent_calculator', config = {
  sft = { flawed = rl.NONE, calls = config.number(0.15, { min = 0, max = 1 }), -- warm-up episodes that call
          steps = config.integer(2000, { min = 0 }) },
  grpo = { steps = config.integer(40), max_tokens = config.integer(9) },
  env = { name = 'calculator_copy', max_turns = 2, template = 'plain', max_tokens = 32 },
} })
ex.tokenizer_dir, ex.positions = moonrl.home .. '/examples/agent', 48

-- The problems: every a*b drawn from the run's draw generator; the ids of the prompt, the direct
-- answer, the call, the tool's answer and the copied answer.
function ex:problems()
  local S, cfg, tok = self.S, self.cfg, self.S.tok
  local all = {}
  for _ = 1, 20000 + cfg.heldout do
    local a, b = 100 + self.rng:int(900), 100 + self.rng:int(900)
    all[#all + 1] = { prompt = a .. '*' .. b .. '=', answer = tostring(a * b) }
  end
  for _, p in ipairs(all) do
    p.prompt_ids = prompts.prompt_ids(tok, nil, p.prompt)                        -- <|bos|> 3 4 7 * 8 1 2 =
    p.answer_ids = prompts.completion_ids(tok, p.answer)                         -- 2 8 1 7 6 4 <|eos|>
    p.call_ids = prompts.completion_ids(tok, p.prompt:sub(1, -2) .. '?')         -- 3 4 7 * 8 1 2 ? <|eos|>
    p.tool_ids = tok:encode(p.answer .. '=', { add_special = false })            -- 2 8 1 7 6 4 =
  end
  local heldout, train = {}, {}
  for i, p in ipairs(all) do
    if i <= cfg.heldout then heldout[#heldout + 1] = p else train[#train + 1] = p end
  end
  return train, heldout
end

-- One warm-up transcript: the answer at once, or (sft.calls) the call, the tool's answer and the
-- copy, the tool's tokens masked out of the loss.
function ex:warmup_sample(p)
  if self.rng:int(1000) >= 1000 * self.cfg.sft.calls then return { prompt_ids = p.prompt_ids, ids = p.answer_ids } end
  local ids, mask = {}, {}
  for _, part in ipairs({ { p.call_ids, 1 }, { p.tool_ids, 0 }, { p.answer_ids, 1 } }) do
    for _, id in ipairs(part[1]) do ids[#ids + 1], mask[#mask + 1] = id, part[2] end
  end
  return { prompt_ids = p.prompt_ids, ids = ids, loss_mask = mask }
end

return ex:main()
