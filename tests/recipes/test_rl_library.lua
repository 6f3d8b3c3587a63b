-- moonrl.rl end to end: algorithms by name from the registries (grpo.advantage=rloo
-- grpo.loss=reinforce), usage errors at start-up, user code with --require and
-- reward=FILE.lua:NAME (on every rank under moonrl launch), a recipe extending another
-- (examples/rloo.lua) with its own defaults in --show-config, and that example learning the
-- default task (data.task=addition) from an SFT warm-up, held-out accuracy reported by eval.every.
local t = require('moonrl.testing')
local json = require('moonrl.io.json')
local proc = require('moonrl.io.proc')
local fs = require('moonrl.io.fs')
local algo = require('moonrl.algo')
local rl = require('moonrl.rl')
local U = dofile('tests/recipes/util.lua')

local exe = assert(rawget(_G, 'MOONRL_EXE'), 'needs the moonrl executable')
local dir = U.tmpdir('rl_library')

local function run(...)
  local argv = { exe, ... }
  local r = proc.run(argv, { timeout = 300 })
  return r
end

local function records(d)
  local out = {}
  for l in io.lines(d .. '/metrics.jsonl') do out[#out + 1] = json.decode(l) end
  return out
end

local words, model_dir = U.grpo_setup(dir .. '/tiny', 40)

-- a reward the tiny random model earns in part from its first step (tests/recipes/grpo_sevens.lua)
require('moonrl.rewards').register('sevens_lib', function(s)
  local _, n = s.response:gsub('7', '')
  return n / math.max(#s.response, 1)
end, { replace = true })

t.test('grpo.advantage=rloo grpo.loss=reinforce: RLOO from the registries', function()
  local out = U.run_recipe('recipes/grpo.lua', U.words(words, dir .. '/reg', { 'grpo.steps=2', 'grpo.advantage=rloo',
    'grpo.loss=reinforce', 'reward=sevens_lib' }))
  local recs = records(out.dir)
  t.eq(#recs, 2)
  t.eq(recs[1].clip_frac, 0, 'REINFORCE has no clip')
  t.truthy(recs[1].grad_norm > 0, 'an update')
  for _, a in ipairs({ 'dr_grpo', 'reinforce_pp' }) do
    out = U.run_recipe('recipes/grpo.lua', U.words(words, dir .. '/reg_' .. a, { 'grpo.steps=1', 'grpo.advantage=' .. a,
      'grpo.loss=dual_clip', 'reward=sevens_lib' }))
    t.eq(#records(out.dir), 1, a)
  end
end)

t.test('unknown names: one line, exit 2, before the model loads, no run directory', function()
  local cases = {
    { 'grpo.advantage=foo', "config key 'grpo.advantage': unknown advantage estimator 'foo' (known: dr_grpo, gae, grpo, reinforce_pp, rloo)" },
    { 'grpo.loss=foo', "config key 'grpo.loss': unknown policy loss 'foo' (known: decoupled_ppo, dual_clip, gspo, ppo, reinforce)" },
    { 'grpo.kl_estimator=k9', "config key 'grpo.kl_estimator': unknown KL estimator 'k9'" },
    { 'grpo.agg=tokenmean', "config key 'grpo.agg': unknown aggregation 'tokenmean'" },
    { 'grpo.advantage=gae', "the estimator 'gae' needs values, which the recipe 'grpo' does not compute" },
    { 'reward=nope', "reward: unknown reward 'nope' (known: " },
    { 'data.task=nope', "config key 'data.task': unknown task 'nope' (known: addition" },
  }
  for i, c in ipairs(cases) do
    local d = dir .. '/bad' .. i
    -- model.dir does not exist: the name is checked first
    U.expect_usage(t, { exe, 'run', 'grpo', 'model.dir=' .. dir .. '/nomodel', 'data.path=' .. dir .. '/none.jsonl',
      'run.dir=' .. d, c[1] }, c[2], d)
  end
  local r = run('run', 'rlvr', 'model.dir=x', 'data.path=y', 'rlvr.loss=clip')
  t.truthy(r.exit_status == 2 and r.stderr:find("config key 'rlvr.loss': unknown policy loss 'clip'", 1, true), r.stderr)
  r = run('run', 'ppo', 'model.dir=x', 'data.path=y', 'ppo.advantage=rlooo')
  t.truthy(r.exit_status == 2 and r.stderr:find("config key 'ppo.advantage'", 1, true), r.stderr)
  r = run('run', 'grpo', 'model.dir=x')
  t.truthy(r.exit_status == 2 and r.stderr:find('pass data.path=... or data.task=NAME', 1, true), r.stderr)
end)

t.test('--require: a missing file, a syntax error, an error while it runs name the file and line', function()
  local bad = dir .. '/bad_syntax.lua'
  fs.write(bad, 'local x = 1\nlocal y =\n')
  local boom = dir .. '/boom.lua'
  fs.write(boom, 'local a = 1\nerror("boom")\n')
  for _, c in ipairs({ { dir .. '/missing.lua', 'missing%.lua: no such file' }, { bad, 'bad_syntax.lua:%d+: unexpected symbol' },
      { boom, 'boom%.lua:2: boom' } }) do
    local r = run('run', 'grpo', '--require', c[1], 'model.dir=x', 'data.path=y')
    t.eq(r.exit_status, 2, c[1])
    t.truthy(r.stderr:find(c[2]), r.stderr)
    t.eq(select(2, r.stderr:gsub('\n', '')), 1, 'one line')
  end
end)

t.test('examples/rloo.lua: its advantages stage is the registry\'s rloo; --show-config shows its defaults', function()
  local rloo = rl.load('examples/rloo.lua')
  t.eq(rloo.name, 'rloo')
  t.eq(rloo.parent.name, 'grpo')
  local samples, scores = {}, {}
  for i = 1, 12 do samples[i] = { score = (i * 7 % 5) / 4 }; scores[i] = samples[i].score end
  setmetatable({ group = 4 }, { __index = rloo }):advantages(samples)
  local want = algo.advantages.rloo({ scores = algo.agg.array(scores), nseq = 12, group = 4 })
  for i = 1, 12 do t.near(samples[i].adv, want[i - 1], 1e-12, 'sample ' .. i) end
  local r = run('run', 'examples/rloo.lua', '--show-config')
  t.eq(r.exit_status, 0)
  for _, p in ipairs({ 'grpo.loss%s+"reinforce"', 'data.task%s+"addition"', 'reward.name%s+"exact"', 'train.lr%s+0.0003',
      'grpo.steps%s+30  %(integer%)', 'eval.every%s+0' }) do
    t.truthy(r.stdout:find(p), p)
  end
  -- a recipe extending an extension: configs merge down the chain, integers stay integers
  local child = rl.extend(rloo, { config = { grpo = { steps = 7 } } })
  t.eq(child.config.grpo.steps.value, 7)
  t.eq(child.config.grpo.steps.type, 'integer')
  t.eq(child.config.grpo.loss, 'reinforce')
  t.eq(child.name, 'rloo')
end)

-- The default task: an SFT warm-up by the default example (its answers mostly carry a stray
-- '='), then RL with the exact reward fixes them; the held-out set is the same 200 problems.
local sft = dir .. '/sft'
local warm = run('sft.steps=1000', 'grpo.steps=0', 'quiet=true', 'run.dir=' .. sft)
assert(warm.ok, warm.stderr)
local before
for line in io.lines(sft .. '/events.jsonl') do
  local e = json.decode(line)
  if e.event == 'heldout_accuracy' then before = e.after end
end
local task = { 'model.dir=' .. sft .. '/model', 'run.threads=1', 'eval.every=10' }

t.test('the RLOO example learns the default task; held-out accuracy in the step line and metrics', function()
  local d = dir .. '/rloo'
  local r = run('run', 'examples/rloo.lua', 'grpo.steps=20', 'run.dir=' .. d, unpack(task))
  t.truthy(r.ok, r.stderr)
  local recs = records(d)
  t.eq(#recs, 20)
  t.eq(recs[10]['eval/prompts'], 200)
  local after = recs[20]['eval/accuracy']
  print(string.format('  rloo: held-out %.1f%% -> %.1f%% (step 10: %.1f%%)', 100 * before, 100 * after,
    100 * recs[10]['eval/accuracy']))
  t.truthy(after > before + 0.5, string.format('held-out accuracy rises: %.3f -> %.3f', before, after))
  t.truthy(r.stdout:find('held-out acc', 1, true), 'in the step line')
end)

t.test('a custom reward with --require (and as reward=FILE.lua:NAME) trains GRPO on the task', function()
  local d = dir .. '/partial'
  local r = run('run', 'grpo', '--require', 'tests/recipes/partial_reward.lua', 'reward=partial', 'data.task=addition',
    'data.chat=false', 'grpo.max_tokens=5', 'grpo.prompts=32', 'train.lr=3e-4', 'grpo.steps=20', 'run.dir=' .. d,
    unpack(task))
  t.truthy(r.ok, r.stderr)
  local recs = records(d)
  t.truthy(recs[20]['eval/accuracy'] > before + 0.3, string.format('held-out accuracy rises: %.3f -> %.3f', before,
    recs[20]['eval/accuracy']))
  t.truthy(recs[1]['reward/mean'] > 0.3 and recs[1]['reward/mean'] < 1, 'partial credit from the first step')
  d = dir .. '/partial_file'
  r = run('run', 'examples/rloo.lua', 'reward=tests/recipes/partial_reward.lua:partial', 'grpo.steps=2', 'run.dir=' .. d,
    unpack(task))
  t.truthy(r.ok, r.stderr)
  t.eq(#records(d), 2)
end)

t.test('moonrl launch -n 2 --require: every rank loads the file', function()
  if not U.which('mpirun') then print('  (skipped: no mpirun)') return end
  local d = dir .. '/ranks'
  local r = run('launch', '-n', '2', '--mpirun', '--mca btl vader,self', '--require', 'tests/recipes/partial_reward.lua',
    'grpo', 'reward=partial', 'model.dir=' .. model_dir, 'data.task=addition', 'data.chat=false', 'grpo.prompts=4',
    'grpo.samples=4', 'grpo.max_tokens=4', 'grpo.steps=2', 'run.threads=1', 'run.dir=' .. d)
  t.truthy(r.ok, r.stdout .. r.stderr)
  t.eq(#records(d), 2)
end)

t.test('rl.NONE removes a key of the parent config; aliases set their target and show in --show-config', function()
  local config = require('moonrl.config')
  local m = rl.merge({ a = { b = 1, c = config.integer(2) }, d = { e = 3 } }, { a = { b = rl.NONE }, d = rl.NONE })
  t.eq(m.a.b, nil, 'a.b removed')
  t.eq(m.a.c.value, 2, 'a.c kept')
  t.eq(m.d, nil, 'a whole section removed')
  local r = rl.recipe { name = 'aliased', section = 'x', config = { x = { steps = config.integer(1), lr = 0.5 } },
    aliases = { ['x.rate'] = 'x.lr', ['x.every'] = 'eval.every' } }
  t.eq(r.config.x.rate.type, 'number', 'declared with its target\'s type')
  t.eq(r.config.x.every.type, 'integer')
  local child = rl.extend(r, { config = { x = { lr = 0.25 } }, aliases = { ['x.old_steps'] = 'x.steps' } })
  t.eq(child.aliases['x.rate'], 'x.lr', 'a child keeps its parent\'s aliases')
  t.eq(child.aliases['x.old_steps'], 'x.steps')
  t.raises(function() rl.recipe { name = 'bad', config = {}, aliases = { ['x.y'] = 'no.such' } } end,
    "the alias 'x.y' names 'no.such', which the config has not")
  local out = proc.run({ exe, 'run', 'examples/default.lua', '--show-config' }, { timeout = 60 })
  t.truthy(out.stdout:find('grpo.eval_every%s+<optional integer>  >= 0  %-%- the old name of eval.every'), out.stdout) -- (its target's range)
  t.truthy(not out.stdout:find('model.dir', 1, true) and not out.stdout:find('data.path', 1, true),
    'the default example builds its model and draws its problems: no model.dir, no data.path')
end)

fs.remove(dir)
t.done()
