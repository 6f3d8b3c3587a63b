-- Config values out of their range, at start-up: every number a recipe gets is checked against the
-- range its key declares (moonrl.config; the shared sections in moonrl.train.sections, the run, guard
-- and dist sections in moonrl.config, each recipe's own section), and a step's counts against the
-- memory, before the model loads: one line naming the key, exit 2, no run directory. These values
-- once failed only after generation with messages that named no key, were taken silently, never
-- ended, or ran to gigabytes before "not enough memory".
local t = require('moonrl.testing')
local fs = require('moonrl.io.fs')
local proc = require('moonrl.io.proc')
local U = dofile('tests/recipes/util.lua')

local exe = assert(rawget(_G, 'MOONRL_EXE'), 'needs the moonrl executable')
local dir = U.tmpdir('config_ranges')

-- recipe, words, what the one line says
local CASES = {
  { 'grpo', 'grpo.temperature=0', "config key 'grpo.temperature' must be > 0, got 0" },
  { 'grpo', 'grpo.samples=0', "config key 'grpo.samples' must be >= 1, got 0" },
  { 'grpo', 'grpo.max_tokens=0', "config key 'grpo.max_tokens' must be >= 1, got 0" },
  { 'grpo', 'grpo.steps=1e309', "config key 'grpo.steps' expects an integer, got '1e309'" },
  { 'grpo', 'grpo.prompts=1e9', "config key 'grpo.prompts': a step would hold 8000000000 sequences of up to 256 tokens" },
  { 'grpo', 'run.max_seconds=1e309', "config key 'run.max_seconds' expects a finite number, got '1e309'" },
  { 'grpo', 'run.seed=1e309', "config key 'run.seed' expects an integer, got '1e309'" },
  { 'grpo', 'run.keep_checkpoints=-1', "config key 'run.keep_checkpoints' must be >= 0, got -1" },
  { 'grpo', 'run.checkpoint_every=-1', "config key 'run.checkpoint_every' must be >= 0, got -1" },
  { 'sft', 'run.memory_budget_mb=-1', "config key 'run.memory_budget_mb' must be in [0, 1e9], got -1" },
  { 'sft', 'run.max_shard_gb=0', "config key 'run.max_shard_gb' must be > 0, got 0" },
  { 'grpo', 'guard.max_skips=-1', "config key 'guard.max_skips' must be >= 0, got -1" },
  { 'grpo', 'reward.timeout=-1', "config key 'reward.timeout' must be >= 0, got -1" },
  { 'grpo', 'reward.workers=0', "config key 'reward.workers' must be >= 1, got 0" },
  { 'grpo', 'async.mode=async async.max_staleness=1e6', "config key 'grpo.prompts': a step would hold" },
  { 'grpo', 'engine.max_seqs=1e9', "config key 'engine.max_seqs' must be in 1..1048576, got 1000000000" },
  { 'rlvr', 'rlvr.top_p=0', "config key 'rlvr.top_p' must be in (0, 1], got 0" },
  { 'ppo', 'ppo.gamma=1.5', "config key 'ppo.gamma' must be in [0, 1], got 1.5" },
  { 'sft', 'train.max_length=0', "config key 'train.max_length' must be >= 2, got 0" },
  { 'sft', 'data.eval_fraction=1.5', "config key 'data.eval_fraction' must be in [0, 1), got 1.5" },
  { 'sft', 'data.eval_fraction=-0.1', "config key 'data.eval_fraction' must be in [0, 1), got -0.1" },
  { 'sft', 'train.batch=1e12', "config key 'train.batch': a step would hold 1000000000000 sequences" },
  { 'dpo', 'dpo.beta=0', "config key 'dpo.beta' must be > 0, got 0" },
  { 'dpo', 'train.pairs=0', "config key 'train.pairs' must be >= 1, got 0" },
  -- the default example: its section has the shared keys' ranges, an old key name its target's
  { 'default', 'grpo.prompts=0', "config key 'grpo.prompts' must be >= 1, got 0" },
  { 'default', 'grpo.clip=1', "config key 'grpo.clip' must be in [0, 1), got 1" },
  { 'default', 'heldout=0', "config key 'heldout' must be >= 1, got 0" },
}

t.test('each value out of range or not finite: one line naming the key, exit 2, no run directory', function()
  for i, c in ipairs(CASES) do
    local d = dir .. '/run' .. i
    local argv = { exe }
    if c[1] ~= 'default' then
      for _, w in ipairs({ 'run', c[1], 'model.dir=' .. dir .. '/nomodel', 'data.path=' .. dir .. '/none.jsonl' }) do
        argv[#argv + 1] = w
      end
    end
    argv[#argv + 1] = 'run.dir=' .. d
    for w in c[2]:gmatch('%S+') do argv[#argv + 1] = w end
    U.expect_usage(t, argv, c[3], d)
  end
end)

t.test('--show-config gives each key its range', function()
  local r = proc.run({ exe, 'run', 'grpo', '--show-config' }, { timeout = 60 })
  t.eq(r.exit_status, 0)
  for _, want in ipairs({ 'grpo%.temperature%s+1  %(number%)  > 0', 'grpo%.prompts%s+8  %(integer%)  >= 1',
      'run%.keep_checkpoints%s+2  %(integer%)  >= 0', 'guard%.lr_factor%s+1  %(number%)  in %(0, 1%]',
      'reward%.timeout%s+30  %(number%)  >= 0' }) do
    t.truthy(r.stdout:find(want), want)
  end
end)

fs.remove(dir)
t.done()
