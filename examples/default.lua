-- The default run (what `moonrl` does with no arguments): a tiny Llama-style model learns
-- 2-digit addition ("37+48=" -> "85"), then learns from a verifier to answer exactly, on the CPU.
--
--   1. a synthetic, verifiable task generated from the seed (moonrl.tasks' addition): all 10,000
--      pairs a+b below 100, of which `heldout` (200) are held out and never trained on
--   2. an SFT warm-up on imperfect data: 70% of its answers carry a stray '=' ("85=", as if the
--      writer kept going). The model learns to add, and its greedy answers mostly carry the '=',
--      so the held-out accuracy of exact answers ("before") is low
--   3. GRPO with the 'exact' reward from the reward registry (the response must be the number):
--      8 sampled answers per problem, group-normalised advantages, PPO-clip update; one line a step.
--      Only the reward says that the '=' is wrong
--   4. held-out greedy accuracy again ("after"), and the model saved in Hugging Face format
--
-- GRPO is moonrl.rl's loop (lua/moonrl/rl.lua: rollout -> advantages -> update -> evaluate ->
-- log -> checkpoint, async modes and rollout ranks included); this file adds what is its own: the
-- model it builds, the prompts it draws, the warm-up before the loop and the figures around it.
-- The tokenizer (examples/default/tokenizer.json, one token per digit) was trained with the
-- Python tokenizers package by examples/default/make_tokenizer.py. Its settings are in
-- docs/recipes.md ("The default run"), its measured results in bench/RESULTS.md ("The default run"). Any key can be changed on the command line:
--   moonrl run examples/default.lua grpo.steps=60 run.seed=3
local moonrl = require('moonrl')
local config = require('moonrl.config')
local rl = require('moonrl.rl')
local models = require('moonrl.train.models')
local prompts = require('moonrl.train.prompts')
local train = require('moonrl.train.step')

local TOKENIZER = moonrl.home .. '/examples/default'

local default = rl.recipe {
  name = 'default', section = 'grpo', phase = 'grpo',
  own_heldout = true, -- the task's held-out split (eval_records below)
  config = {
    heldout = config.integer(200, { min = 1 }), -- problems kept out of training, for the accuracy figures
    model = { dir = rl.NONE, tokenizer = rl.NONE, -- a model of its own, built here from the seed:
              hidden_size = config.integer(128, { min = 1 }), layers = config.integer(2, { min = 1 }),
              heads = config.integer(4, { min = 1 }), intermediate_size = config.integer(384, { min = 1 }) }, -- (model.dtype: fp32 | bf16 | auto)
    data = rl.NONE, reward_model = rl.NONE, -- the prompts are drawn from the task (prompts below)
    sft = { steps = config.integer(1500, { min = 0 }), batch = config.integer(64, { min = 1 }),
            lr = config.number(2e-3, { min = 0 }), flawed = config.number(0.7, { min = 0, max = 1 }) }, -- share of warm-up answers followed by a stray '=' ("85=")
    grpo = { steps = config.integer(30), prompts = config.integer(32), samples = config.integer(8),
             temperature = 1.0, max_tokens = config.integer(5), advantage = 'grpo', loss = 'ppo', clip_low = 0.2 },
    reward = { name = 'exact' },
    train = { lr = 3e-4 }, -- GRPO's AdamW, made fresh after the warm-up
    engine = { kv_cache_mb = config.integer(64) },
    run = { threads = 'auto' }, -- 1 thread or all cores, whichever runs this model faster here (moonrl.train.threads)
    quiet = false, -- no per-step lines (the test suite)
  },
  -- the keys of this example before it ran on moonrl.rl
  aliases = { ['grpo.lr'] = 'train.lr', ['grpo.clip'] = 'grpo.clip_low', ['grpo.reward'] = 'reward.name',
              ['grpo.eval_every'] = 'eval.every' },
}

-- The model: Llama-style with tied embeddings, initialised from the seed, and its tokenizer (the
-- recipes extending this one set their own, and the positions their sequences need).
default.tokenizer_dir, default.positions = TOKENIZER, 32
function default:start_options()
  local cfg, o = self.cfg, rl.Recipe.start_options(self)
  local tok = moonrl.tokenizer.load(self.tokenizer_dir)
  o.tokenizer, o.tokenizer_dir = tok, self.tokenizer_dir
  o.policy = moonrl.model.new({ model_type = 'llama', vocab_size = tok.vocab_size,
    hidden_size = cfg.model.hidden_size, intermediate_size = cfg.model.intermediate_size,
    num_hidden_layers = cfg.model.layers, num_attention_heads = cfg.model.heads,
    max_position_embeddings = self.positions, tie_word_embeddings = true,
    bos_token_id = tok.bos_id, eos_token_id = tok.eos_id }, { seed = cfg.run.seed })
  o.optimizer = false -- the warm-up's AdamW first, then GRPO's (setup)
  o.lora = false -- model.lora: adapters for GRPO only, over the warmed-up model (setup)
  return o
end

-- 1. The task: every { prompt = '37+48=', answer = '85' }, shuffled by the run's draw generator
-- (its state is part of every checkpoint), `heldout` of them put aside.
function default:setup()
  rl.Recipe.setup(self)
  local S, cfg = self.S, self.cfg
  self.rng = S:rng('draw', cfg.run.seed)
  self.train, self.heldout = self:problems()
  for i, p in ipairs(self.heldout) do p.prompt_index = i - 1 end
  -- 2. the warm-up, and the held-out accuracy it leaves
  self:warmup()
  local f = self.figure
  self.before = S:memo('before', function() return f.of(self:heldout_metrics()) end)
  print(string.format('held-out %s after the SFT warm-up (%d steps): %s', f.name, cfg.sft.steps, f.text(self.before)))
  -- 3. GRPO (moonrl.rl's loop) with a fresh AdamW: its state is what the GRPO phase checkpoints
  -- (model.lora.rank > 0: of LoRA adapters over the warmed-up model)
  S:start_lora()
  S.opt = S:optimizer('policy', models.adamw(S.policy, { lr = cfg.train.lr, weight_decay = cfg.train.weight_decay }))
end

-- The problems, training and held out, with their token ids.
function default:problems()
  local S, cfg = self.S, self.cfg
  local task = require('moonrl.tasks').get('addition')({ seed = cfg.run.seed, rng = self.rng, heldout = cfg.heldout })
  for _, set in ipairs({ task.heldout, task.train }) do
    for _, p in ipairs(set) do
      p.prompt_ids = prompts.prompt_ids(S.tok, nil, p.prompt)            -- <|bos|> 3 7 + 4 8 =
      p.answer_ids = prompts.completion_ids(S.tok, p.answer)             -- 8 5 <|eos|>
      p.flawed_ids = prompts.completion_ids(S.tok, p.answer .. '=')      -- 8 5 = <|eos|>
    end
  end
  return task.train, task.heldout
end

-- One warm-up example of problem p: its answer, flawed (a stray '=') with probability sft.flawed.
function default:warmup_sample(p)
  local flawed = self.rng:int(1000) < 1000 * self.cfg.sft.flawed
  return { prompt_ids = p.prompt_ids, ids = flawed and p.flawed_ids or p.answer_ids }
end

-- The held-out figure printed before and after GRPO: the greedy accuracy (an example extending this
-- one may print another: examples/agent_guess.lua, the turns to win).
default.figure = { name = 'accuracy', of = function(m) return m.accuracy end,
  text = function(v) return string.format('%.1f%%', 100 * v) end }

-- n training problems at random (with replacement)
function default:draw(n)
  local out = {}
  for i = 1, n do out[i] = self.train[self.rng:int(#self.train) + 1] end
  return out
end

-- The SFT warm-up: cross-entropy on the answer tokens, lr decaying linearly (each step a safe
-- point: Ctrl-C stops there with a checkpoint).
function default:warmup()
  local S, c, t = self.S, self.cfg.sft, self.cfg.train
  local opt = S:optimizer('policy', models.adamw(S.policy, { lr = c.lr, weight_decay = 0.0 }))
  train.train_loop(S, { steps = c.steps, phase = 'sft', log = false,
    batch = function()
      local samples = {}
      for i, p in ipairs(self:draw(c.batch)) do samples[i] = self:warmup_sample(p) end
      return samples
    end,
    update = function(samples, step)
      return train.sft_step(S, opt, samples, { lr = c.lr * (1 - (step - 1) / c.steps),
        micro_batch_tokens = t.micro_batch_tokens, max_grad_norm = t.max_grad_norm })
    end })
end

-- The rollout's prompts: drawn from the training problems (1: a group of its own, async.stream_unit=group).
function default:prompts() return self:draw(self.S:rollout_count(self.c.prompts)) end

-- The held-out problems (greedy answers judged by the reward: eval.every, before and after);
-- eval.data or eval.task, when given, instead.
function default:eval_records()
  if self.cfg.eval.data or self.cfg.eval.task then return rl.Recipe.eval_records(self) end
  return self.heldout
end

-- eval.every's accuracy also under the name it had before (moonrl status and bench/ read it)
function default:log(m)
  if m.eval then m.heldout_accuracy = m.eval.accuracy end
  return rl.Recipe.log(self, m)
end

-- 4. The held-out accuracy after GRPO, and the model in Hugging Face format.
function default:finish()
  local S = self.S
  local f = self.figure
  local after = f.of(self:heldout_metrics())
  print(string.format('held-out %s (greedy, %d problems): %s before GRPO -> %s after', f.name, #self:eval_records(),
    f.text(self.before), f.text(after)))
  S:event('heldout_' .. f.name:gsub(' ', '_'), { before = self.before, after = after }, { quiet = true })
  local out = rl.Recipe.finish(self)
  out.before, out.after = self.before, after
  return out
end

return default:main()
