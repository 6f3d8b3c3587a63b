-- A learned reward: a Hugging Face sequence-classification checkpoint (LlamaForSequenceClassification,
-- Qwen2ForSequenceClassification, ... with num_labels = 1, i.e. score.weight [1, hidden]) loaded through
-- moonrl.model's value head. The reward of a sample is the score at the last token of
-- prompt .. response, as Transformers reads it for an unpadded sequence.
--
--   local rm = require('rewards.reward_model')
--   rm.register('helpful', '/models/Skywork-Reward-Llama-3.1-8B', { chat = true })
--   moonrl.rewards.get('helpful'){ prompt = 'Hi', response = 'Hello!' }   --> a number
--   local fn = rm.new(dir, opts)  -- the reward function without registering it; fn.model, fn:score(list)
--
-- opts.chat (false): render the pair as a user / assistant conversation with the reward model's own
-- chat template (tokenizer_config.json) instead of concatenating the two texts; opts.scale (1) and
-- opts.bias (0) map the score to scale·score + bias; opts.max_tokens (4096) caps the sequence
-- length (the start of a longer text is cut).
local moonrl = require('moonrl')
local rewards = require('moonrl.rewards')

local M = {}

function M.new(dir, opts)
  opts = opts or {}
  local model = moonrl.model.load(dir)
  if not model.config.value_head then
    error(string.format('reward_model: %s is not a sequence-classification checkpoint (no score head)', dir), 2)
  end
  local tok = moonrl.tokenizer.load(dir)
  local tpl = opts.chat and moonrl.chat.load(dir) or nil
  local scale, bias, cap = opts.scale or 1, opts.bias or 0, opts.max_tokens or 4096
  local self = { model = model, tokenizer = tok }

  local function ids_of(sample)
    local response = rewards.response_of(sample, 'reward_model')
    local prompt = sample.prompt or ''
    local ids
    if tpl then
      ids = tok:encode(tpl:render({ { role = 'user', content = prompt }, { role = 'assistant', content = response } }),
        { add_special = false })
    else
      ids = tok:encode(prompt .. response)
    end
    while #ids > cap do table.remove(ids, 1) end
    return ids
  end

  -- Scores of a list of samples in one forward: a Lua list of numbers.
  function self.score(_, samples)
    local seqs = {}
    for i, s in ipairs(samples) do seqs[i] = ids_of(s) end
    local b = moonrl.model.batch(seqs)
    local _, _, values = model:forward(b, { values = true })
    local out = {}
    for i = 1, #seqs do out[i] = scale * values[b.cu_seqlens[i] - 1] + bias end
    return out
  end

  return setmetatable(self, { __call = function(_, sample) return self:score({ sample })[1] end })
end

-- Load dir and register it in the reward registry under name (replacing an earlier one).
function M.register(name, dir, opts)
  local fn = M.new(dir, opts)
  rewards.register(name, fn, { replace = true, in_process = true }) -- (a model on the GPU cannot run in a forked worker)
  return fn
end

return M
