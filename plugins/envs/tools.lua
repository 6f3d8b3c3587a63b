-- env=tools: a question answered with tools. The record's prompt opens the episode (after
-- data.system); each turn with tool calls gets their results back (moonrl.env.run_tools: one
-- tool message a call, an error message for each malformed one) and the model goes on; the first
-- turn without a call is the answer, which the config's reward (reward.name) judges as it judges
-- a single-turn response. The tools offered: env.tools (default calculator). veRL's ToolAgentLoop
-- and SkyRL's tool environments work so.
local env = require('moonrl.env')

env.register('tools', {
  tools = { 'calculator' },
  reset = function(_, record) return { { role = 'user', content = record.prompt } } end,
  step = function(ep, turn)
    if #turn.tool_calls + #turn.tool_errors > 0 then return env.run_tools(ep, turn), nil, false end
    return {}, nil, true
  end,
}, 'the prompt answered with tools (env.tools); the answer, a turn without calls, judged by reward.name')

return env
