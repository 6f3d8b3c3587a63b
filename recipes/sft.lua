-- SFT: supervised fine-tuning on prompt/response pairs, the loss on the response tokens only.
--
--   moonrl run sft model.dir=/models/Qwen2.5-0.5B-Instruct data.path=train.jsonl
--
-- for each step:
--   batch    <- next records of the shuffled dataset
--   tokens   <- prompt (chat template when data.chat) .. response .. eos
--   for each micro-batch of this rank's share: forward -> log πθ of every token; loss =
--     token-mean(−log πθ) over the response tokens of the WHOLE batch (global denominator); backward
--   clip the gradient norm; AdamW step with the scheduled learning rate
--   (the step is train.sft_step, the loop train.train_loop: lua/moonrl/train/step.lua)
-- every eval.every steps: the eval loss on the held-out split, and greedy answers to its prompts
-- judged by the reward (default exact) against the reference responses: eval/accuracy
-- The model is saved in Hugging Face format (with the tokenizer files) to <run dir>/model.
-- data.task=NAME trains on a task's answers instead of data.path (moonrl.tasks), its held-out
-- split the evaluation's.
local moonrl = require('moonrl')
local batch = require('moonrl.batch')
local models = require('moonrl.train.models')
local prompts = require('moonrl.train.prompts')
local sections = require('moonrl.train.sections')
local session = require('moonrl.train.session')
local train = require('moonrl.train.step')
local E = require('moonrl.train.evaluation')

local cfg = moonrl.config {
  model = sections.model_config(),
  data = sections.task_data_config { prompt = 'prompt', response = 'response', -- JSON keys of the fields
                              chat = false,                              -- wrap the prompt in the model's chat template
                              eval_fraction = 0.05 },                    -- held out (data.path; a task has its own)
  train = sections.train_config { steps = moonrl.config.integer(100), batch = moonrl.config.integer(16), lr = 1e-5,
                           schedule = 'cosine', max_length = moonrl.config.integer(1024) },
  -- every eval.every steps: the eval loss on the held-out split and the held-out accuracy, greedy
  -- answers judged by the reward against the reference responses (0: the eval loss at the end only)
  eval = sections.eval_config(),
  eval_every = moonrl.config.optional('integer', 'the old name of eval.every'),
  reward = sections.reward_config('exact'), -- the judge of held-out answers (reward=math for worked solutions)
  engine = sections.engine_config { kv_cache_mb = moonrl.config.integer(128) }, -- made only when eval.every > 0
  moe = { expert_parallel = false }, -- a qwen3_moe policy: its experts split over the ranks (README)
  save = true,
  quiet = false, -- no step lines
}
if cfg.eval_every then cfg.eval.every = cfg.eval_every end
sections.check_data(cfg)
sections.check_reward(cfg)
E.check(cfg, { own = cfg.data.eval_fraction > 0 }) -- (data.task: the task's held-out split)
-- data (opened before the run starts: a missing file leaves nothing behind): a held-out split
-- (the task's own with data.task) for the eval loss and accuracy, the rest shuffled
local all, train_set, eval_set
if cfg.data.task then
  all, eval_set = prompts.task_records(cfg, 'train'), prompts.task_records(cfg, 'heldout')
  train_set = all
else
  all = prompts.open_data(cfg, { prompt = cfg.data.prompt, response = cfg.data.response })
  local n_eval = math.floor(cfg.data.eval_fraction * all:len() + 0.5)
  train_set, eval_set = all:split({ count = math.min(n_eval, all:len() - 1), seed = cfg.run.seed })
end
local free = { 'eval_every' }
for _, k in ipairs(sections.EVAL_KEYS) do free[#free + 1] = k end
local S = session.start(cfg, { name = 'sft', steps = cfg.train.steps, steps_key = 'train.steps', chat = cfg.data.chat,
  engine = E.wanted(cfg), check_policy = function(p) models.check_expert_parallel(p, cfg.moe.expert_parallel) end,
  free_keys = free })
local model = S.policy
models.expert_parallel(S, cfg.moe.expert_parallel)
local batches = S:dataset('train', train_set:shuffled(cfg.run.seed)):batches(cfg.train.batch, { epochs = math.huge })
local function response(rec) return cfg.data.task and rec.answer or rec.response end

local function to_sample(rec)
  local s = { prompt_ids = prompts.prompt_ids(S.tok, S.tpl, rec.prompt), ids = prompts.completion_ids(S.tok, response(rec)) }
  local over = #s.prompt_ids + #s.ids - cfg.train.max_length
  for _ = 1, over do table.remove(s.ids) end -- truncate the response to max_length
  return s
end

-- mean response NLL of a list of samples: forward only
local function nll(samples)
  local sum, n = 0, 0
  for b in batch.micro_batches(samples, cfg.train.micro_batch_tokens) do
    local lp = model:forward(b)
    for t = 0, b.n_tokens - 1 do
      sum, n = sum - b.mask[t] * lp[t], n + b.mask[t]
    end
  end
  return n > 0 and sum / n or 0
end
local eval_samples, own_heldout = {}, {}
for i = 1, eval_set:len() do
  local rec = eval_set:get(i) -- nil: a bad line skipped (data.on_error=skip)
  if rec then
    eval_samples[#eval_samples + 1] = to_sample(rec)
    own_heldout[#own_heldout + 1] = { prompt = rec.prompt, answer = response(rec),
      prompt_ids = eval_samples[#eval_samples].prompt_ids }
  end
end
-- the held-out answers: eval.data (prompt and response fields), eval.task, else the split's
local heldout = E.wanted(cfg) and E.records(S, cfg, own_heldout, { answer = cfg.data.response }) or {}

local history, first, last = train.train_loop(S, { quiet = cfg.quiet,
  batch = function()
    local samples = {}
    for i, rec in ipairs(batches()) do samples[i] = to_sample(rec) end
    return samples
  end,
  update = function(samples)
    return train.sft_step(S, S.opt, samples, { lr = S:lr(), micro_batch_tokens = cfg.train.micro_batch_tokens,
      max_grad_norm = cfg.train.max_grad_norm })
  end,
  metrics = function(m, step)
    m.ppl = math.exp(math.min(m.loss, 50))
    m.data = { skipped = all:stats().skipped }
    if #eval_samples > 0 and (E.due(cfg, step) or step == cfg.train.steps) then
      m.eval_loss = S:phase('eval', nll, eval_samples)
    end
    if #heldout > 0 and E.due(cfg, step) then m.eval = S:phase('eval', E.accuracy, S, cfg, heldout) end
  end,
})

S:finish()
return { first_loss = first and history[first].loss, last_loss = last and history[last].loss, dir = S.dir, model = model }
