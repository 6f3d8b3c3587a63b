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
--   clip the gradient norm; AdamW step
--   (the step is train.supervised_step, the loop train.train_loop: lua/moonrl/train/step.lua)
-- Logged: loss, reward accuracy (share of pairs with Δ_w > Δ_l), margins, chosen/rejected rewards;
-- every eval.every steps the held-out accuracy of greedy answers, judged by the reward (eval/accuracy).
-- data.task=NAME: a task's records, its answer chosen over its rejected one (moonrl.tasks).
local moonrl = require('moonrl')
local ffi = require('ffi')
local algo = require('moonrl.algo')
local batch = require('moonrl.batch')
local models = require('moonrl.train.models')
local rng_mod = require('moonrl.rng')
local prompts = require('moonrl.train.prompts')
local sections = require('moonrl.train.sections')
local session = require('moonrl.train.session')
local train = require('moonrl.train.step')
local E = require('moonrl.train.evaluation')

local cfg = moonrl.config {
  model = sections.model_config(),
  data = sections.task_data_config { prompt = 'prompt', chosen = 'chosen', rejected = 'rejected', chat = false },
  dpo = { beta = 0.1, loss_type = 'sigmoid', label_smoothing = 0.0 },
  train = sections.train_config { steps = moonrl.config.integer(100), pairs = moonrl.config.integer(8), lr = 5e-7,
                           schedule = 'linear', max_length = moonrl.config.integer(1024) },
  -- every eval.every steps: greedy answers to held-out prompts (eval.data with the data fields,
  -- its reference the chosen answer; eval.task; data.task's split) judged by the reward
  eval = sections.eval_config(),
  reward = sections.reward_config('exact'),
  engine = sections.engine_config { kv_cache_mb = moonrl.config.integer(128) }, -- made only when eval.every > 0
  moe = { expert_parallel = false }, -- a qwen3_moe policy: its experts split over the ranks (README)
  save = true,
  quiet = false, -- no step lines
}
sections.check_data(cfg)
sections.check_reward(cfg)
E.check(cfg)
local task = cfg.data.task and require('moonrl.tasks').load(cfg.data.task, cfg.run.seed)
if task and not (task.train[1] or {}).rejected then
  moonrl.usage_error(string.format("data.task=%s: its records have no rejected answers (a preference task gives " ..
    'prompt, answer and rejected)', cfg.data.task))
end
-- the pairs (opened before the run starts: a missing file leaves nothing behind); a task's
-- answer is the chosen one
local ds = task and prompts.task_records(cfg, 'train') or prompts.open_data(cfg, { prompt = cfg.data.prompt, chosen = cfg.data.chosen,
  rejected = cfg.data.rejected })
local S = session.start(cfg, { name = 'dpo', steps = cfg.train.steps, steps_key = 'train.steps', chat = cfg.data.chat,
  engine = E.wanted(cfg), check_policy = function(p) models.check_expert_parallel(p, cfg.moe.expert_parallel) end,
  free_keys = sections.EVAL_KEYS })
local model = S.policy
models.expert_parallel(S, cfg.moe.expert_parallel)

-- every pair as two samples (chosen, rejected) with the prompt's ids
local pairs_list = {}
for i = 1, ds:len() do
  local rec = ds:get(i) -- nil: a bad line skipped (data.on_error=skip)
  if rec and task then rec.chosen = rec.answer end
  if rec then
    local p = prompts.prompt_ids(S.tok, S.tpl, rec.prompt)
    local c, r = prompts.completion_ids(S.tok, rec.chosen), prompts.completion_ids(S.tok, rec.rejected)
    local room = cfg.train.max_length - #p
    while #c > room do table.remove(c) end
    while #r > room do table.remove(r) end
    pairs_list[#pairs_list + 1] = { { prompt_ids = p, ids = c }, { prompt_ids = p, ids = r } }
  end
end
if #pairs_list == 0 then moonrl.usage_error((cfg.data.path or cfg.data.task) .. ': no usable preference pairs') end
local heldout = E.wanted(cfg) and E.records(S, cfg, nil, { answer = cfg.data.chosen }) or {}

-- the reference log-probs, once, with the frozen initial policy (this same model before any step:
-- a resumed run computes them again before its loop restores the checkpoint)
S:phase('reference', function()
  local flat = {}
  for _, pr in ipairs(pairs_list) do flat[#flat + 1] = pr[1]; flat[#flat + 1] = pr[2] end
  local lps = train.logprobs(model, flat, cfg.train.micro_batch_tokens, { world = S.world })
  for i, s in ipairs(flat) do
    local sum = 0
    for _, x in ipairs(lps[i]) do sum = sum + x end
    s.ref = sum
  end
end)

-- pair order: a new seeded shuffle every epoch; the run state is the epoch's seed and the position
local rng = S:rng('pairs', cfg.run.seed)
S.extra.epoch_seed, S.extra.pos = 0, 0
local order, order_seed = {}, nil
local function epoch_order()
  if order_seed ~= S.extra.epoch_seed then -- Fisher-Yates from the epoch's own generator
    for i = 1, #pairs_list do order[i] = i end
    rng_mod.shuffle(order, rng_mod.from_state(S.extra.epoch_seed))
    order_seed = S.extra.epoch_seed
  end
  return order
end
local function next_pairs(n)
  local out = {}
  for _ = 1, n do
    if S.extra.pos == 0 or S.extra.pos > #pairs_list then
      S.extra.epoch_seed, S.extra.pos = rng:int(2147483646) + 1, 1
    end
    out[#out + 1] = pairs_list[epoch_order()[S.extra.pos]]
    S.extra.pos = S.extra.pos + 1
  end
  return out
end

-- one step: this rank's share of the pairs, packed as chosen_1, rejected_1, chosen_2, ... in
-- micro-batches of whole pairs; chosen and rejected share their prompt's rows (batch.pack), and the
-- loss sees one segment a completion (b.sample_cu)
local function update(batch)
  local samples = {}
  for _, pr in ipairs(S:shard(batch)) do samples[#samples + 1] = pr[1]; samples[#samples + 1] = pr[2] end
  return train.supervised_step(S, S.opt, { lr = S:lr(), max_grad_norm = cfg.train.max_grad_norm,
    batches = S:micro_batches(samples, cfg.train.micro_batch_tokens, { unit = 2, share_prompts = true, mine = true }),
    loss = function(b, lp, first, last)
      local nseq = last - first + 1
      local ref_seq = ffi.new('double[?]', nseq)
      for k = first, last do ref_seq[k - first] = samples[k].ref end
      local grad = ffi.new('float[?]', b.n_tokens)
      local loss, dm = algo.dpo.loss({ logprob = lp, ref_seq = ref_seq, mask = b.mask, cu_seqlens = b.sample_cu,
        nseq = nseq, grad = grad, beta = cfg.dpo.beta, loss_type = cfg.dpo.loss_type,
        label_smoothing = cfg.dpo.label_smoothing, global_pairs = #batch })
      local share = (nseq / 2) / #batch -- the metrics are means over the whole batch's pairs
      local parts = { tokens = b.n_tokens }
      for _, key in ipairs({ 'rewards_accuracy', 'rewards_margin', 'rewards_chosen', 'rewards_rejected' }) do
        parts[key] = dm[key] * share
      end
      return loss, grad, parts
    end })
end

local history, first, last = train.train_loop(S, { quiet = cfg.quiet,
  batch = function() return next_pairs(cfg.train.pairs) end,
  update = update,
  metrics = function(m, step)
    m.accuracy = m.rewards_accuracy
    m.data = { skipped = ds:stats().skipped }
    if #heldout > 0 and E.due(cfg, step) then m.eval = S:phase('eval', E.accuracy, S, cfg, heldout) end
  end,
})

S:finish()
return { first_accuracy = first and history[first].rewards_accuracy, last_accuracy = last and history[last].rewards_accuracy,
  dir = S.dir, model = model }
