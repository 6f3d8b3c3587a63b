-- DPO on a preference dataset with a real model (docs/recipes.md, "The other examples").
--
--   moonrl run examples/dpo_preferences.lua model.dir=/models/Qwen2.5-0.5B-Instruct data.path=prefs.jsonl
--
-- data.path: JSONL with {"prompt": "...", "chosen": "...", "rejected": "..."} per line (plain strings;
-- the prompt goes through the model's chat template, each completion gets the end-of-turn token).
-- The reference log-probs are computed once, with the frozen initial policy, before training.
-- This file only sets the recipe's defaults; the algorithm is recipes/dpo.lua and every key can still
-- be set on the command line (moonrl run examples/dpo_preferences.lua --show-config).
local moonrl = require('moonrl')
local config = require('moonrl.config')

local defaults = config.parse_overrides({
  'data.chat=true', 'dpo.beta=0.1', 'dpo.loss_type=sigmoid',
  'train.pairs=8', 'train.steps=200', 'train.lr=5e-7', 'train.warmup=10', 'train.max_length=1024',
})
for _, o in ipairs(config.overrides) do defaults[#defaults + 1] = o end -- the command line wins
config.overrides = defaults
return dofile(moonrl.home .. '/recipes/dpo.lua')
