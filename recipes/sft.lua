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
--   (the step is R.sft_step, the loop R.train_loop: lua/moonrl/recipe.lua)
-- The model is saved in Hugging Face format (with the tokenizer files) to <run dir>/model.
local moonrl = require('moonrl')
local R = require('moonrl.recipe')

local cfg = moonrl.config {
  model = R.model_config(),
  data = R.data_config { prompt = 'prompt', response = 'response', -- JSON keys of the fields
                         chat = false,                              -- wrap the prompt in the model's chat template
                         eval_fraction = 0.05 },                    -- held out for the eval loss
  train = R.train_config { steps = moonrl.config.integer(100), batch = moonrl.config.integer(16), lr = 1e-5,
                           schedule = 'cosine', max_length = moonrl.config.integer(1024) },
  eval_every = moonrl.config.integer(0), -- steps between eval losses (0: only at the end)
  save = true,
}
local S = R.start(cfg, { name = 'sft', steps = cfg.train.steps, steps_key = 'train.steps', chat = cfg.data.chat })
local model = S.policy

-- data: a held-out split for the eval loss, the rest shuffled
local all = moonrl.data.jsonl(cfg.data.path, { fields = { prompt = cfg.data.prompt, response = cfg.data.response },
  on_error = cfg.data.on_error == 'skip' and 'skip' or 'error' })
local n_eval = math.floor(cfg.data.eval_fraction * all:len() + 0.5)
local train_set, eval_set = all:split({ count = math.min(n_eval, all:len() - 1), seed = cfg.run.seed })
local batches = S:dataset('train', train_set:shuffled(cfg.run.seed)):batches(cfg.train.batch, { epochs = math.huge })

local function to_sample(rec)
  local s = { prompt_ids = R.prompt_ids(S.tok, S.tpl, rec.prompt), ids = R.completion_ids(S.tok, rec.response) }
  local over = #s.prompt_ids + #s.ids - cfg.train.max_length
  for _ = 1, over do table.remove(s.ids) end -- truncate the response to max_length
  return s
end

-- mean response NLL of a list of samples: forward only
local function nll(samples)
  local sum, n = 0, 0
  for b in R.micro_batches(samples, cfg.train.micro_batch_tokens) do
    local lp = model:forward(b)
    for t = 0, b.n_tokens - 1 do
      sum, n = sum - b.mask[t] * lp[t], n + b.mask[t]
    end
  end
  return n > 0 and sum / n or 0
end
local eval_samples = {}
for i = 1, eval_set:len() do
  local rec = eval_set:get(i) -- nil: a bad line skipped (data.on_error=skip)
  if rec then eval_samples[#eval_samples + 1] = to_sample(rec) end
end

local history, first, last = R.train_loop(S, {
  batch = function()
    local samples = {}
    for i, rec in ipairs(batches()) do samples[i] = to_sample(rec) end
    return samples
  end,
  update = function(samples)
    return R.sft_step(S, S.opt, samples, { lr = S:lr(), micro_batch_tokens = cfg.train.micro_batch_tokens,
      max_grad_norm = cfg.train.max_grad_norm })
  end,
  metrics = function(m, step)
    m.ppl = math.exp(math.min(m.loss, 50))
    m.data = { skipped = all:stats().skipped }
    if #eval_samples > 0 and ((cfg.eval_every > 0 and step % cfg.eval_every == 0) or step == cfg.train.steps) then
      m.eval_loss = S:phase('eval', nll, eval_samples)
    end
  end,
})

R.finish(S)
return { first_loss = first and history[first].loss, last_loss = last and history[last].loss, dir = S.dir, model = model }
