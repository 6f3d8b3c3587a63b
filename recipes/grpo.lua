-- GRPO: group relative policy optimisation with rewards from the reward registry.
--
--   moonrl run grpo model.dir=/models/Qwen2.5-0.5B-Instruct data.path=gsm8k.jsonl reward=math
--   moonrl run grpo grpo.advantage=rloo grpo.loss=reinforce ...        (RLOO)
--   moonrl run grpo grpo.advantage=dr_grpo ...                          (Dr. GRPO)
--
-- the rollout of a batch (run here, a step or more ahead, or on rollout ranks: async.mode,
-- dist.rollout_ranks; see moonrl.train.rollout):
--   prompts  <- next records of the shuffled dataset (data.path) or task (data.task)
--   generate grpo.samples completions per prompt with the engine (it reads the policy's weights)
--   rewards  <- the registry's reward (reward=NAME, or reward=FILE.lua:NAME) of every completion
-- for each step, on its batch:
--   A_i      <- the estimator grpo.advantage (moonrl.algo.estimators; grpo: (r_i − mean of its
--               group) / (std of its group + ε), one value per completion)
--   log π_ref <- the frozen initial policy (only when grpo.kl_coef > 0)
--   for each of grpo.epochs passes: micro-batches -> forward, the loss grpo.loss
--     (moonrl.algo.losses; ppo: PPO-clip) on A (+ β·KL to the reference with grpo.kl_estimator,
--     − entropy bonus) with the batch's global denominators -> backward; clip; AdamW step
--   every eval.every steps: held-out accuracy (eval.data, eval.task)
-- One line and one metrics.jsonl record per step; the model saved in HF format at the end.
-- The loop and its stages are moonrl.rl's (lua/moonrl/rl.lua): this file is GRPO's config.
local rl = require('moonrl.rl')
local config = require('moonrl.config')

local grpo = rl.recipe {
  name = 'grpo',
  config = {
    grpo = { steps = config.integer(100), prompts = config.integer(8), samples = config.integer(8),
             temperature = 1.0, top_p = 1.0, top_k = config.integer(0), max_tokens = config.integer(256),
             advantage = 'grpo', scale = 'group', -- an estimator in moonrl.algo.estimators; scale: grpo's std
             loss = 'ppo', clip_low = 0.2, clip_high = 0.2, agg = 'token-mean', -- a loss in moonrl.algo.losses
             kl_coef = 0.0, kl_estimator = 'k3', entropy_coef = 0.0, epochs = config.integer(1) },
  },
}
return grpo:main()
