-- GRPO on GSM8K-style math word problems with a real model (docs/recipes.md, "The other examples").
--
--   moonrl run examples/grpo_gsm8k.lua model.dir=/models/Qwen2.5-0.5B-Instruct data.path=gsm8k_train.jsonl
--
-- data.path: JSONL with {"question": "...", "answer": "... #### 72"} per line (the GSM8K format; the
-- math reward reads the number after "####" in the reference and the last \boxed{} of the response).
-- Prompts go through the model's own chat template with a system prompt asking for \boxed{}.
-- This file only sets the recipe's defaults for the task (moonrl.rl: rl.extend); the algorithm is
-- recipes/grpo.lua, and every key can still be set on the command line
-- (moonrl run examples/grpo_gsm8k.lua --show-config shows these defaults).
local rl = require('moonrl.rl')

local gsm8k = rl.extend('grpo', { config = {
  data = { prompt = 'question', answer = 'answer', chat = true,
           system = 'Solve the problem step by step, then give the final number as \\boxed{N}.' },
  reward = { name = 'math' },
  grpo = { prompts = 8, samples = 8, max_tokens = 384, temperature = 1.0, clip_high = 0.28, kl_coef = 0.0, steps = 200 },
  train = { lr = 1e-6, warmup = 10, micro_batch_tokens = 8192 },
} })
return gsm8k:main()
