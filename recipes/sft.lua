-- SFT: supervised fine-tuning on prompt/response pairs, the loss on the response tokens only.
--
--   moonrl run sft model.dir=/models/Qwen2.5-0.5B-Instruct data.path=train.jsonl
--
-- for each step:
--   batch    <- next records of the shuffled dataset
--   tokens   <- prompt (chat template when data.chat) .. response .. eos
--   for each micro-batch of this rank's share: forward -> log πθ of every token; loss =
--     token-mean(−log πθ) over the response tokens of the WHOLE batch (global denominator); backward
--   clip the gradient norm; AdamW step with the scheduled learning rate (train.sft_step)
-- train.mtp_weight > 0 (a deepseek_v3 model with its MTP layer): the loss adds that weight times the
-- MTP layer's mean -log πθ of the next-but-one response tokens (DeepSeek-V3's MTP objective)
-- every eval.every steps: the eval loss on the held-out split, and greedy answers to its prompts
-- judged by the reward (default exact) against the reference responses: eval/accuracy
-- The model is saved in Hugging Face format (with the tokenizer files) to <run dir>/model.
-- data.task=NAME trains on a task's answers instead of data.path (moonrl.tasks), its held-out
-- split the evaluation's. The loop and its stages are moonrl.rl's supervised recipe.
local rl = require('moonrl.rl')
local config = require('moonrl.config')
local prompts = require('moonrl.train.prompts')
local train = require('moonrl.train.step')
local E = require('moonrl.train.evaluation')

local sft = rl.supervised {
  name = 'sft',
  config = {
    data = { prompt = 'prompt', response = 'response', -- JSON keys of the fields
             eval_fraction = config.number(0.05, { min = 0, below = 1 }), -- held out (data.path; a task has its own),
             eval_max = config.integer(1000, { min = 0 }) },                -- at most this many records
    train = { batch = config.integer(16, { min = 1 }), schedule = 'cosine',
              mtp_weight = config.number(0, { min = 0 }) }, -- the MTP layer's loss weight (deepseek_v3; 0: not trained)
  },
  aliases = { eval_every = 'eval.every' },
}

-- data (opened before the run starts: a missing file leaves nothing behind): a held-out split
-- (the task's own with data.task) for the eval loss and accuracy, the rest shuffled
function sft:open_data()
  local cfg = self.cfg
  if cfg.data.task then
    self.all, self.eval_set = prompts.task_records(cfg, 'train'), prompts.task_records(cfg, 'heldout')
    self.train_set = self.all
  else
    self.all = prompts.open_data(cfg, { prompt = cfg.data.prompt, response = cfg.data.response })
    -- (the held-out records are read and tokenized at the start, and each evaluation runs them all)
    local n_eval = math.min(math.floor(cfg.data.eval_fraction * self.all:len() + 0.5), cfg.data.eval_max)
    self.train_set, self.eval_set = self.all:split({ count = math.min(n_eval, self.all:len() - 1), seed = cfg.run.seed })
  end
end

function sft:check()
  self:check_sections(self.cfg.data.eval_fraction > 0) -- (data.task: the task's split)
end

function sft:response(rec) return self.cfg.data.task and rec.answer or rec.response end

-- A record as a sample: the prompt's ids and the response's, cut to train.max_length.
function sft:sample(rec)
  local S = self.S
  local s = { prompt_ids = prompts.prompt_ids(S.tok, S.tpl, rec.prompt), ids = prompts.completion_ids(S.tok, self:response(rec)) }
  local over = #s.prompt_ids + #s.ids - self.cfg.train.max_length
  for _ = 1, over do table.remove(s.ids) end
  return s
end

-- the held-out split as samples (the eval loss) and as records to answer: eval.data (prompt and
-- response fields), eval.task, else the split's
function sft:setup()
  local S, cfg = self.S, self.cfg
  if cfg.train.mtp_weight > 0 then S.policy:set_mtp_loss(cfg.train.mtp_weight) end -- (DeepSeek-V3's MTP objective)
  self.batches = S:dataset('train', self.train_set:shuffled(cfg.run.seed)):batches(cfg.train.batch, { epochs = math.huge })
  self.eval_samples = {}
  local own = {}
  for i = 1, self.eval_set:len() do
    local rec = self.eval_set:get(i) -- nil: a bad line skipped (data.on_error=skip)
    if rec then
      local s = self:sample(rec)
      self.eval_samples[#self.eval_samples + 1] = s
      own[#own + 1] = { prompt = rec.prompt, answer = self:response(rec), prompt_ids = s.prompt_ids }
    end
  end
  self.heldout = E.wanted(cfg) and E.records(S, cfg, own, { answer = cfg.data.response }) or {}
end

function sft:batch()
  local samples = {}
  for i, rec in ipairs(self.batches()) do samples[i] = self:sample(rec) end
  return samples
end

function sft:update(samples)
  local S, t = self.S, self.cfg.train
  return train.sft_step(S, S.opt, samples, { lr = S:lr(), micro_batch_tokens = t.micro_batch_tokens,
    max_grad_norm = t.max_grad_norm })
end

-- mean response NLL of a list of samples: forward only
function sft:nll(samples)
  local sum, n = 0, 0
  for _, lps in ipairs(train.logprobs(self.S.policy, samples, self.cfg.train.micro_batch_tokens, { share_prompts = false })) do
    for _, lp in ipairs(lps) do sum, n = sum - lp, n + 1 end
  end
  return n > 0 and sum / n or 0
end

function sft:metrics(m, step)
  local cfg = self.cfg
  m.ppl = math.exp(math.min(m.loss, 50))
  if cfg.train.mtp_weight > 0 then m.mtp_loss = self.S.policy:mtp_loss() end -- (the step's last micro-batch's)
  m.data = { skipped = self.all:stats().skipped }
  if #self.eval_samples > 0 and (E.due(cfg, step) or step == cfg.train.steps) then
    m.eval_loss = self.S:phase('eval', self.nll, self, self.eval_samples)
  end
end

function sft:finish()
  local out = rl.Supervised.finish(self)
  out.first_loss = out.first and out.history[out.first].loss
  out.last_loss = out.last and out.history[out.last].loss
  return out
end

return sft:main()
