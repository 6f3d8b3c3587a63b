-- A real pretrained model learns to use a sandboxed Python interpreter, offline, on the CPU:
-- SmolLM2-135M-Instruct (the GGUF that ./dev.sh fetches) is asked 3-digit products, which it
-- cannot compute in its head; it may write a ```python block instead, whose output the sandboxed
-- python tool returns (plugins/tools/python.lua: an interpreter an episode), and then answer in
-- \boxed{}. Multi-turn episodes (docs/agents.md) on examples/grpo_smollm2.lua's loop (its warm-up,
-- figures and evaluation):
--
--   1. the task: "What is 347 * 812? Put the final answer in \boxed{}.", a, b in 100..999, task.heldout
--      held out
--   2. a short SFT warm-up on transcripts (moonrl.train.episodes.transcript): most answer at once
--      (the product, which the model can only guess), sft.tool (0.25) of them write the code, read
--      its output and box it:
--        user: What is 347 * 812? ...      assistant: ```python\nprint(347 * 812)\n```
--        user: Output: 281764              assistant: The answer is \boxed{281764}.
--   3. GRPO on episodes of at most two turns (env=python_blocks, below): a turn with a ```python
--      block runs it and gets its output back; a turn without one is the answer, judged by the
--      'math' reward (the last \boxed{})
--   4. held-out accuracy (greedy episodes) before and after
--
--   build/moonrl run examples/agent_smollm2_python.lua            (grpo.steps=30 run.seed=2 ...)
-- Needs the sandbox (user namespaces: `moonrl doctor` says). Figures: bench/RESULTS.md ("Agents").
local moonrl = require('moonrl')
local config = require('moonrl.config')
local env = require('moonrl.env')
local tasks = require('moonrl.tasks')
local rl = require('moonrl.rl')
local episodes = require('moonrl.train.episodes')

local SYSTEM = 'You are a helpful assistant. You can run Python: write code in a ```python block and you will be ' ..
  'given its output. Give the final answer in \\boxed{}.'

tasks.register('mul_python', function(o)
  local c = o.cfg and o.cfg.task or { heldout = 100 }
  local rng = require('moonrl.rng').new(o.seed or 1)
  local train, heldout = {}, {}
  for i = 1, 5000 + c.heldout do
    local a, b = 100 + rng:int(900), 100 + rng:int(900)
    local r = { prompt = string.format('What is %d * %d? Put the final answer in \\boxed{}.', a, b), answer = tostring(a * b),
      meta = { a = a, b = b } }
    if i <= c.heldout then heldout[#heldout + 1] = r else train[#train + 1] = r end
  end
  return { train = train, heldout = heldout }
end, { doc = '3-digit products, answered in \\boxed{} (examples/agent_smollm2_python.lua)', replace = true })

-- The environment: a turn with a ```python block (on the first turn) runs it in the sandboxed
-- interpreter and gets its output back; any other turn is the answer.
env.register('python_blocks', {
  tools = {}, -- (the model is not told of tools by its template: the system prompt says how)
  reset = function(_, record) return { { role = 'user', content = record.prompt } } end,
  step = function(ep, turn)
    local code = turn.text:match('```python\n(.-)```')
    if code and turn.n == 1 then -- (run_tools counts the call, its errors and seconds)
      local out = env.run_tools(ep, { tool_calls = { { name = 'python', arguments = { code = code } } } })[1].content
      return { { role = 'user', content = 'Output: ' .. out:gsub('%s+$', '') } }, nil, false
    end
    return {}, nil, true
  end,
}, { doc = 'examples/agent_smollm2_python.lua: a ```python block runs in the sandbox, any other turn is the answer',
  replace = true })

local ex = rl.extend(moonrl.home .. '/examples/grpo_smollm2.lua', { name = 'agent_smollm2_python', config = {
  data = { task = 'mul_python', system = SYSTEM },
  sft = { steps = config.integer(12, { min = 0 }), tool = config.number(0.25, { min = 0, max = 1 }), ops = rl.NONE },
  env = { name = 'python_blocks', max_turns = 2, max_tokens = 256 },
  grpo = { steps = config.integer(30), max_tokens = config.integer(40) },
} })

-- The warm-up draws from every training problem (its loop, line and optimizer are grpo_smollm2's).
function ex:warmup_problems() return tasks.load(self.cfg.data.task, self.cfg.run.seed).train end

-- One warm-up transcript of problem r: the answer at once, or (sft.tool) the code, its output, the answer.
function ex:warmup_sample(r, rng, eos)
  local msgs = { { role = 'system', content = SYSTEM }, { role = 'user', content = r.prompt } }
  if rng:int(1000) < 1000 * self.cfg.sft.tool then
    msgs[3] = { role = 'assistant', content = string.format('```python\nprint(%d * %d)\n```', r.meta.a, r.meta.b) }
    msgs[4] = { role = 'user', content = 'Output: ' .. r.answer }
  end
  msgs[#msgs + 1] = { role = 'assistant', content = 'The answer is \\boxed{' .. r.answer .. '}.' }
  return episodes.transcript({ tok = self.S.tok, tpl = self.S.tpl, messages = msgs, eos = eos })
end

return ex:main()
