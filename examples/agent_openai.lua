-- The calculator task of examples/agent_calculator.lua (its model, warm-up and figures) with the
-- episodes played by a Python program through moonrl's OpenAI-compatible server in training mode
-- (agent.command: moonrl.train.agents, docs/agents.md): examples/agent_openai.py, written with the
-- official `openai` client, runs once an episode, agent.concurrency at a time, and every completion
-- it asks for is sampled by the policy being trained and recorded with its exact tokens. The
-- held-out figures before and after are greedy episodes played by the program too.
--
--   pip install openai
--   moonrl run examples/agent_openai.lua                     (agent.concurrency=32 run.seed=3 ...)
local moonrl = require('moonrl')
local rl = require('moonrl.rl')

local ex = rl.extend(moonrl.home .. '/examples/agent_calculator.lua', { name = 'agent_openai', config = {
  env = { name = rl.NONE },
  agent = { command = 'python3 ' .. moonrl.home .. '/examples/agent_openai.py', concurrency = 32, workers = 4 },
} })

return ex:main()
