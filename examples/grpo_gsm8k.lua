-- GRPO on GSM8K-style math word problems with a real model (README: "GRPO on GSM8K").
--
--   moonrl run examples/grpo_gsm8k.lua model.dir=/models/Qwen2.5-0.5B-Instruct data.path=gsm8k_train.jsonl
--
-- data.path: JSONL with {"question": "...", "answer": "... #### 72"} per line (the GSM8K format; the
-- math reward reads the number after "####" in the reference and the last \boxed{} of the response).
-- Prompts go through the model's own chat template with a system prompt asking for \boxed{}.
-- This file only sets the recipe's defaults for the task; the algorithm is recipes/grpo.lua, and
-- every key can still be set on the command line (moonrl run examples/grpo_gsm8k.lua --show-config).
local moonrl = require('moonrl')
local config = require('moonrl.config')

local defaults = config.parse_overrides({
  'data.prompt=question', 'data.answer=answer', 'data.chat=true',
  'data.system=Solve the problem step by step, then give the final number as \\boxed{N}.',
  'reward=math',
  'grpo.prompts=8', 'grpo.samples=8', 'grpo.max_tokens=384', 'grpo.temperature=1.0',
  'grpo.clip_high=0.28', 'grpo.kl_coef=0.0', 'grpo.steps=200',
  'train.lr=1e-6', 'train.warmup=10', 'train.micro_batch_tokens=8192',
})
for _, o in ipairs(config.overrides) do defaults[#defaults + 1] = o end -- the command line wins
config.overrides = defaults
return dofile(moonrl.home .. '/recipes/grpo.lua')
