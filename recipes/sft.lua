-- SFT: supervised fine-tuning on prompt/response pairs, the loss on the response tokens only.
--
--   moonrl run sft model.dir=/models/Qwen2.5-0.5B-Instruct data.path=train.jsonl
--
-- for each step:
--   batch    <- next records of the shuffled dataset
--   tokens   <- prompt (chat template when data.chat) .. response .. eos
--   for each micro-batch: forward -> log πθ of every token; loss = token-mean(−log πθ) over the
--     response tokens of the WHOLE batch (global denominator); backward
--   clip the gradient norm; AdamW step with the scheduled learning rate
-- The model is saved in Hugging Face format (with the tokenizer files) to <run dir>/model.
local moonrl = require('moonrl')
local ffi = require('ffi')
local algo = require('moonrl.algo')
local R = require('moonrl.recipe')

local cfg = moonrl.config {
  model = { dir = moonrl.config.required('string', 'Hugging Face model directory'),
            tokenizer = moonrl.config.optional('string', 'tokenizer directory (default model.dir)') },
  data = { path = moonrl.config.required('string', 'JSONL with one example a line'),
           prompt = 'prompt', response = 'response', -- JSON keys of the fields
           chat = false,                              -- wrap the prompt in the model's chat template
           eval_fraction = 0.05 },                    -- held out for the eval loss
  train = { steps = moonrl.config.integer(100), batch = moonrl.config.integer(16), lr = 1e-5,
            schedule = 'cosine', warmup = moonrl.config.integer(0), weight_decay = 0.0, max_grad_norm = 1.0,
            micro_batch_tokens = moonrl.config.integer(4096), max_length = moonrl.config.integer(1024) },
  eval_every = moonrl.config.integer(0), -- steps between eval losses (0: only at the end)
  save = true,
}
local run = moonrl.run.start(cfg, { name = 'sft', total_steps = cfg.train.steps })
local model, tok, tpl, tok_dir = R.load(cfg.model.dir, { tokenizer = cfg.model.tokenizer, chat = cfg.data.chat })
local opt = R.adamw(model, { lr = cfg.train.lr, weight_decay = cfg.train.weight_decay })
local lr_at = moonrl.optim.schedule({ kind = cfg.train.schedule, warmup = cfg.train.warmup,
  total = cfg.train.steps, lr = cfg.train.lr })

-- data: a held-out split for the eval loss, the rest shuffled
local all = moonrl.data.jsonl(cfg.data.path, { fields = { prompt = cfg.data.prompt, response = cfg.data.response } })
local n_eval = math.floor(cfg.data.eval_fraction * all:len() + 0.5)
local train_set, eval_set = all:split({ count = math.min(n_eval, all:len() - 1), seed = cfg.run.seed })
local batches = train_set:shuffled(cfg.run.seed):batches(cfg.train.batch, { epochs = math.huge })

local function to_sample(rec)
  local s = { prompt_ids = R.prompt_ids(tok, tpl, rec.prompt), ids = R.completion_ids(tok, rec.response) }
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
for i = 1, eval_set:len() do eval_samples[i] = to_sample(eval_set:get(i)) end

local first_loss, last_loss
for step = 1, cfg.train.steps do
  local samples = {}
  for i, rec in ipairs(batches()) do samples[i] = to_sample(rec) end
  local t0 = moonrl.now()
  local m = run:phase('train', function()
    local tokens = 0
    for _, s in ipairs(samples) do tokens = tokens + #s.ids end
    local loss = 0
    model:zero_grad()
    for b in R.micro_batches(samples, cfg.train.micro_batch_tokens) do
      local lp = model:forward(b)
      local grad = ffi.new('float[?]', b.n_tokens)
      loss = loss + algo.sft.loss({ logprob = lp, mask = b.mask, cu_seqlens = b.cu_seqlens, nseq = b.n_seqs,
        grad = grad, global_tokens = tokens })
      model:backward(grad)
    end
    local gnorm = opt:clip_grad_norm(cfg.train.max_grad_norm)
    local lr = lr_at(step)
    opt:step(lr)
    return { loss = loss, grad_norm = gnorm, lr = lr, tokens = tokens }
  end)
  first_loss, last_loss = first_loss or m.loss, m.loss
  m.ppl = math.exp(math.min(m.loss, 50))
  m.tokens_per_s = { train = R.rate(m.tokens, moonrl.now() - t0) }
  if #eval_samples > 0 and ((cfg.eval_every > 0 and step % cfg.eval_every == 0) or step == cfg.train.steps) then
    m.eval_loss = run:phase('eval', nll, eval_samples)
  end
  run:log(step, m)
  if R.check_stop(cfg, run) then break end
end

local dir = cfg.save and R.save(run, model, tok_dir) or nil
run:finish()
print('run directory: ' .. run.dir .. (dir and ('; model saved to ' .. dir) or ''))
return { first_loss = first_loss, last_loss = last_loss, dir = run.dir, model = model }
