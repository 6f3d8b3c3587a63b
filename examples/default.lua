-- The default run (what `moonrl` does with no arguments): a tiny Llama-style model learns
-- 2-digit addition ("37+48=" -> "85"), then learns from a verifier to answer exactly, on the CPU.
--
--   1. a synthetic, verifiable task generated from the seed: all 10,000 pairs a+b below 100, of
--      which 200 are held out and never trained on
--   2. an SFT warm-up on imperfect data: 70% of its answers carry a stray '=' ("85=", as if the
--      writer kept going). The model learns to add, and its greedy answers mostly carry the '=',
--      so the held-out accuracy of exact answers ("before") is low
--   3. GRPO with the 'exact' reward from the reward registry (the response must be the number):
--      8 sampled answers per problem, group-normalised advantages, PPO-clip update; one line a step.
--      Only the reward says that the '=' is wrong
--   4. held-out greedy accuracy again ("after"), and the model saved in Hugging Face format
--
-- The tokenizer (examples/default/tokenizer.json, one token per digit) was trained with the
-- Python tokenizers package by examples/default/make_tokenizer.py. Settings and measured results
-- are in README.md ("The default run"). Any key can be changed on the command line:
--   moonrl run examples/default.lua grpo.steps=60 run.seed=3
local moonrl = require('moonrl')
local algo = require('moonrl.algo')
local rewards = require('moonrl.rewards')
local R = require('moonrl.recipe')

local cfg = moonrl.config {
  heldout = moonrl.config.integer(200), -- problems kept out of training, for the accuracy figures
  model = { hidden_size = moonrl.config.integer(128), layers = moonrl.config.integer(2),
            heads = moonrl.config.integer(4), intermediate_size = moonrl.config.integer(384),
            dtype = 'fp32' }, -- fp32 | bf16 | auto (moonrl.model, "precision"; R.start applies it)
  sft = { steps = moonrl.config.integer(1500), batch = moonrl.config.integer(64), lr = 2e-3,
          flawed = 0.7 }, -- share of warm-up answers followed by a stray '=' ("85=")
  grpo = { steps = moonrl.config.integer(30), prompts = moonrl.config.integer(32), samples = moonrl.config.integer(8),
           lr = 3e-4, temperature = 1.0, clip = 0.2, reward = 'exact',
           eval_every = moonrl.config.integer(0) }, -- held-out accuracy every N steps (metric heldout_accuracy; 0: off)
  async = R.async_config(), -- where and when the rollouts run (async.mode, dist.rollout_ranks)
  quiet = false, -- no per-step lines (the test suite)
}
-- 2. The model, and the run's session (run directory, checkpoints, resume: moonrl.session).
local tok = moonrl.tokenizer.load(moonrl.home .. '/examples/default')
local model = moonrl.model.new({ model_type = 'llama', vocab_size = tok.vocab_size,
  hidden_size = cfg.model.hidden_size, intermediate_size = cfg.model.intermediate_size,
  num_hidden_layers = cfg.model.layers, num_attention_heads = cfg.model.heads,
  max_position_embeddings = 32, tie_word_embeddings = true,
  bos_token_id = tok.bos_id, eos_token_id = tok.eos_id }, { seed = cfg.run.seed })
local S = R.start(cfg, { name = 'default', steps = cfg.grpo.steps, steps_key = 'grpo.steps', policy = model,
  tokenizer_dir = moonrl.home .. '/examples/default' })
-- a model this small runs fastest on one thread (its matrices are too small to split)
if cfg.run.threads == 0 then moonrl.C.mrl_parallel_set_threads(1) end

-- 1. The task (moonrl.tasks' addition, data.task=addition of the RL recipes): every pair (a, b) of
-- numbers below 100 as { prompt = '37+48=', answer = '85' }; a shuffle with the run's draw
-- generator puts `heldout` of them aside.
local rng = S:rng('draw', cfg.run.seed) -- its state is part of every checkpoint
local task = require('moonrl.tasks').get('addition')({ seed = cfg.run.seed, rng = rng, heldout = cfg.heldout })
local heldout, train = task.heldout, task.train
for _, set in ipairs({ heldout, train }) do
  for _, p in ipairs(set) do
    p.prompt_ids = tok:encode(p.prompt)                                 -- <|bos|> 3 7 + 4 8 =
    p.answer_ids = tok:encode(p.answer, { add_special = false })
    p.answer_ids[#p.answer_ids + 1] = tok.eos_id                        -- 8 5 <|eos|>
    p.flawed_ids = tok:encode(p.answer .. '=', { add_special = false })
    p.flawed_ids[#p.flawed_ids + 1] = tok.eos_id                        -- 8 5 = <|eos|>
  end
end
local function draw(n) -- n training problems at random
  local out = {}
  for i = 1, n do out[i] = train[rng:int(#train) + 1] end
  return out
end

-- The generation engine reads the model's weights in place.
local engine = moonrl.engine.new(model, { kv_cache_bytes = 64 * 1024 * 1024, block_size = 16,
  max_batch_tokens = 2048, max_seqs = 256, seed = cfg.run.seed })
local gen = { max_tokens = 5, eos_ids = { tok.eos_id }, tokenizer = tok }

local function accuracy(set) -- greedy decoding on the held-out problems
  local out = engine:generate(R.requests(set, 1), { temperature = 0, max_tokens = gen.max_tokens,
    eos_ids = gen.eos_ids, tokenizer = tok })
  local right = 0
  for i, p in ipairs(set) do
    if out[i][1].text == p.answer then right = right + 1 end
  end
  return right / #set
end

-- 3. SFT warm-up: cross-entropy on the answer tokens (each step a safe point: Ctrl-C stops there
-- with a checkpoint).
local sft_opt = S:optimizer('policy', R.adamw(model, { lr = cfg.sft.lr, weight_decay = 0.0 }))
for step in S:steps(cfg.sft.steps, 'sft') do
  local batch = draw(cfg.sft.batch)
  local samples = {}
  for i, p in ipairs(batch) do
    local flawed = rng:int(1000) < 1000 * cfg.sft.flawed
    samples[i] = { prompt_ids = p.prompt_ids, ids = flawed and p.flawed_ids or p.answer_ids }
  end
  local tokens = 0 -- the loss is the mean over the answer tokens of the whole batch
  for _, s in ipairs(samples) do tokens = tokens + #s.ids end
  model:zero_grad()
  local loss = 0
  for b in S:micro_batches(samples, 4096) do -- this process's share (all of it, alone)
    local lp = model:forward(b)
    local grad = require('ffi').new('float[?]', b.n_tokens)
    loss = loss + algo.sft.loss({ logprob = lp, mask = b.mask, cu_seqlens = b.cu_seqlens, nseq = b.n_seqs, grad = grad,
      global_tokens = tokens })
    model:backward(grad)
  end
  R.apply_update(S, sft_opt, cfg.sft.lr * (1 - (step - 1) / cfg.sft.steps), -- linear decay
    { loss = S:sum(loss), grad_norm = sft_opt:clip_grad_norm(1.0) })
end
local before = S:memo('before', function() return accuracy(heldout) end)
print(string.format('held-out accuracy after the SFT warm-up (%d steps): %.1f%%', cfg.sft.steps, 100 * before))

-- 4. GRPO: generate -> reward -> group advantages -> PPO-clip update.
local opt = S:optimizer('policy', R.adamw(model, { lr = cfg.grpo.lr, weight_decay = 0.0 })) -- a fresh AdamW for RL
S.run.step_t0 = moonrl.now()
S:rollout(function(step) -- one batch: problems, sampled answers, rewards
  local prompts = draw(S:rollout_count(cfg.grpo.prompts)) -- (1: a group of its own, async.stream_unit=group)
  local results = S:phase('generate', function()
    return engine:generate(R.requests(prompts, cfg.grpo.samples), { temperature = cfg.grpo.temperature,
      max_tokens = gen.max_tokens, eos_ids = gen.eos_ids, tokenizer = tok, step = step })
  end)
  local samples = R.flatten(prompts, results)
  local scores = S:phase('reward', function() return rewards.score_batch(cfg.grpo.reward, samples) end)
  for i, s in ipairs(samples) do s.score = scores[i - 1] end
  return samples
end, { engine = engine })
for step in S:steps(cfg.grpo.steps, 'grpo') do
  local samples, info = S:next_batch() -- generated now, or ahead (async.mode), or by rollout ranks
  local gen_s = info.gen_seconds
  local scores = R.scores(samples)
  local adv = algo.advantages.grpo({ scores = scores, nseq = #samples, group = cfg.grpo.samples })
  for i, s in ipairs(samples) do s.adv = adv[i - 1] * (s.adv_scale or 1) end
  local t0 = moonrl.now()
  local m = S:phase('train', function()
    return R.policy_step(S:off_policy { session = S, model = model, opt = opt, samples = samples, lr = cfg.grpo.lr,
      clip_low = cfg.grpo.clip, temperature = cfg.grpo.temperature })
  end)
  local mean, std = R.stats(scores, #samples)
  m.reward = { mean = mean, std = std }
  m.accuracy = mean
  m.response_length = R.length_metrics(samples)
  m.async = S:async_metrics(info)
  if cfg.grpo.eval_every > 0 and step % cfg.grpo.eval_every == 0 then
    m.heldout_accuracy = S:phase('eval', accuracy, heldout)
  end
  m.tokens_per_s = { generate = R.rate(m.tokens, gen_s), train = R.rate(m.tokens, moonrl.now() - t0) }
  S:log(m, { quiet = cfg.quiet })
end
local after = accuracy(heldout)

-- 5. Results and the model in Hugging Face format.
print(string.format('held-out accuracy (greedy, %d problems): %.1f%% before GRPO -> %.1f%% after',
  #heldout, 100 * before, 100 * after))
S:event('heldout_accuracy', { before = before, after = after }, { quiet = true })
local dirs = S:finish()
print('run directory: ' .. S.dir .. ' (metrics.jsonl, events.jsonl, tb/, trace.json, checkpoints/; model in ' ..
  dirs.policy .. ')')
return { before = before, after = after, dir = S.dir }
