-- DPO: direct preference optimisation on prompt / chosen / rejected triples.
--
--   moonrl run dpo model.dir=/models/Qwen2.5-0.5B-Instruct data.path=prefs.jsonl
--
-- once:  log π_ref(y | x) = Σ_t log π_ref of every chosen and rejected completion, computed with the
--        frozen initial policy (then the reference is not needed any more)
-- for each step:
--   batch of pairs; packed as chosen_1, rejected_1, chosen_2, rejected_2, ...
--   for each micro-batch: forward -> log πθ per token; Δ = Σ log πθ − log π_ref per completion;
--     loss = −log σ(β (Δ_w − Δ_l)) averaged over the pairs of the WHOLE batch; backward
--   clip the gradient norm; AdamW step (train.supervised_step)
-- Logged: loss, reward accuracy (share of pairs with Δ_w > Δ_l), margins, chosen/rejected rewards;
-- every eval.every steps the held-out accuracy of greedy answers, judged by the reward (eval/accuracy).
-- data.task=NAME: a task's records, its answer chosen over its rejected one (moonrl.tasks).
-- The loop and its stages are moonrl.rl's supervised recipe.
local ffi = require('ffi')
local moonrl = require('moonrl')
local rl = require('moonrl.rl')
local config = require('moonrl.config')
local algo = require('moonrl.algo')
local rng = require('moonrl.rng')
local prompts = require('moonrl.train.prompts')
local train = require('moonrl.train.step')
local E = require('moonrl.train.evaluation')

local dpo = rl.supervised {
  name = 'dpo',
  config = {
    data = { prompt = 'prompt', chosen = 'chosen', rejected = 'rejected' },
    dpo = { beta = config.number(0.1, { above = 0 }), loss_type = 'sigmoid',
            label_smoothing = config.number(0.0, { min = 0, max = 0.5 }) }, -- cDPO's ε: [0, 0.5]
    train = { pairs = config.integer(8, { min = 1 }), lr = 5e-7, schedule = 'linear' },
  },
}

-- the pairs (opened before the run starts: a missing file leaves nothing behind); a task's
-- answer is the chosen one
function dpo:open_data()
  local cfg = self.cfg
  local task = cfg.data.task and require('moonrl.tasks').load(cfg.data.task, cfg.run.seed)
  if task and not (task.train[1] or {}).rejected then
    moonrl.usage_error(string.format("data.task=%s: its records have no rejected answers (a preference task gives " ..
      'prompt, answer and rejected)', cfg.data.task))
  end
  self.task = task
  self.ds = task and prompts.task_records(cfg, 'train') or prompts.open_data(cfg, { prompt = cfg.data.prompt,
    chosen = cfg.data.chosen, rejected = cfg.data.rejected })
end

-- every pair as two samples (chosen, rejected) with the prompt's ids; their reference log-probs
function dpo:setup()
  local S, cfg = self.S, self.cfg
  self.pairs = {}
  for i = 1, self.ds:len() do
    local rec = self.ds:get(i) -- nil: a bad line skipped (data.on_error=skip)
    if rec and self.task then rec.chosen = rec.answer end
    if rec then
      local p = prompts.prompt_ids(S.tok, S.tpl, rec.prompt)
      local c, r = prompts.completion_ids(S.tok, rec.chosen), prompts.completion_ids(S.tok, rec.rejected)
      local room = cfg.train.max_length - #p
      while #c > room do table.remove(c) end
      while #r > room do table.remove(r) end
      self.pairs[#self.pairs + 1] = { { prompt_ids = p, ids = c }, { prompt_ids = p, ids = r } }
    end
  end
  if #self.pairs == 0 then moonrl.usage_error((cfg.data.path or cfg.data.task) .. ': no usable preference pairs') end
  self.heldout = E.wanted(cfg) and E.records(S, cfg, nil, { answer = cfg.data.chosen }) or {}
  S:phase('reference', self.reference_logprobs, self)
  -- pair order: a new seeded shuffle every epoch; the run state is the epoch's seed and the position
  self.rng = S:rng('pairs', cfg.run.seed)
  S.extra.epoch_seed, S.extra.pos = 0, 0
  self.order = {}
end

-- The reference log-probs, once, with the frozen initial policy (this same model before any step:
-- a resumed run computes them again before its loop restores the checkpoint).
function dpo:reference_logprobs()
  local flat = {}
  for _, pr in ipairs(self.pairs) do flat[#flat + 1] = pr[1]; flat[#flat + 1] = pr[2] end
  local lps = train.logprobs(self.S.policy, flat, self.cfg.train.micro_batch_tokens, { world = self.S.world })
  for i, s in ipairs(flat) do
    local sum = 0
    for _, x in ipairs(lps[i]) do sum = sum + x end
    s.ref = sum
  end
end

-- The epoch's order of the pairs: Fisher-Yates from the epoch's own generator.
function dpo:epoch_order()
  local S = self.S
  if self.order_seed ~= S.extra.epoch_seed then
    for i = 1, #self.pairs do self.order[i] = i end
    rng.shuffle(self.order, rng.from_state(S.extra.epoch_seed))
    self.order_seed = S.extra.epoch_seed
  end
  return self.order
end

function dpo:batch()
  local S, out = self.S, {}
  for _ = 1, self.cfg.train.pairs do
    if S.extra.pos == 0 or S.extra.pos > #self.pairs then
      S.extra.epoch_seed, S.extra.pos = self.rng:int(2147483646) + 1, 1
    end
    out[#out + 1] = self.pairs[self:epoch_order()[S.extra.pos]]
    S.extra.pos = S.extra.pos + 1
  end
  return out
end

-- one step: this rank's share of the pairs, packed as chosen_1, rejected_1, chosen_2, ... in
-- micro-batches of whole pairs; chosen and rejected share their prompt's rows (batch.pack), and the
-- loss sees one segment a completion (b.sample_cu)
function dpo:update(pairs)
  local S, cfg = self.S, self.cfg
  local samples = {}
  for _, pr in ipairs(S:shard(pairs)) do samples[#samples + 1] = pr[1]; samples[#samples + 1] = pr[2] end
  return train.supervised_step(S, S.opt, { lr = S:lr(), max_grad_norm = cfg.train.max_grad_norm,
    batches = S:micro_batches(samples, cfg.train.micro_batch_tokens, { unit = 2, share_prompts = true, mine = true }),
    loss = function(b, lp, first, last)
      local nseq = last - first + 1
      local ref_seq = ffi.new('double[?]', nseq)
      for k = first, last do ref_seq[k - first] = samples[k].ref end
      local grad = ffi.new('float[?]', b.n_tokens)
      local loss, dm = algo.dpo.loss({ logprob = lp, ref_seq = ref_seq, mask = b.mask, cu_seqlens = b.sample_cu,
        nseq = nseq, grad = grad, beta = cfg.dpo.beta, loss_type = cfg.dpo.loss_type,
        label_smoothing = cfg.dpo.label_smoothing, global_pairs = #pairs })
      local share = (nseq / 2) / #pairs -- the metrics are means over the whole batch's pairs
      local parts = { tokens = b.n_tokens }
      for _, key in ipairs({ 'rewards_accuracy', 'rewards_margin', 'rewards_chosen', 'rewards_rejected' }) do
        parts[key] = dm[key] * share
      end
      return loss, grad, parts
    end })
end

function dpo:metrics(m)
  m.accuracy = m.rewards_accuracy
  m.data = { skipped = self.ds:stats().skipped }
end

function dpo:finish()
  local out = rl.Supervised.finish(self)
  out.first_accuracy = out.first and out.history[out.first].rewards_accuracy
  out.last_accuracy = out.last and out.history[out.last].rewards_accuracy
  return out
end

return dpo:main()
