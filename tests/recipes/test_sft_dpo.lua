-- SFT and DPO recipes end to end on a tiny random model in Hugging Face format: SFT's loss falls,
-- DPO's reward accuracy rises on a learnable preference set (the right sum preferred to a wrong one),
-- and both save a model that loads again; both report held-out accuracy every eval.every steps
-- (greedy answers judged by the reward), train on a task (data.task=addition), and reject a bad
-- data or eval setting with one line before any work.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local json = require('moonrl.io.json')
local proc = require('moonrl.io.proc')
local fs = require('moonrl.io.fs')
local U = dofile('tests/recipes/util.lua')

local function records(d)
  local out = {}
  for l in io.lines(d .. '/metrics.jsonl') do
    local r = json.decode(l)
    out[r.step] = r
  end
  return out
end

-- a temporary directory with the tiny model (dir/init) and 200 additions as prompt / response
-- pairs (dir/train.jsonl); returns dir, the model's directory
local function sft_files(tag)
  local dir = U.tmpdir(tag)
  local model_dir = U.tiny_model(dir .. '/init')
  local recs = {}
  for i, p in ipairs(U.additions(200, 7)) do recs[i] = { prompt = p.prompt, response = p.answer } end
  U.write_jsonl(dir .. '/train.jsonl', recs)
  return dir, model_dir
end

t.test('sft: the loss falls and the model is saved in HF format', function()
  local dir, model_dir = sft_files('sft')
  local out = U.run_recipe('recipes/sft.lua', { 'model.dir=' .. model_dir, 'data.path=' .. dir .. '/train.jsonl',
    'train.steps=40', 'train.batch=16', 'train.lr=5e-3', 'train.micro_batch_tokens=64', 'run.dir=' .. dir .. '/run' })
  t.truthy(out.last_loss < 0.7 * out.first_loss, string.format('loss fell: %.3f -> %.3f', out.first_loss, out.last_loss))
  local m = moonrl.model.load(dir .. '/run/model')
  t.eq(m.n_params, out.model.n_params)
  t.truthy(io.open(dir .. '/run/model/tokenizer.json'), 'tokenizer copied')
  local lines = 0
  for _ in io.lines(dir .. '/run/metrics.jsonl') do lines = lines + 1 end
  t.eq(lines, 40)
  require('moonrl.io.fs').remove(dir)
end)

t.test('dpo: reward accuracy rises on a learnable preference set', function()
  local dir = U.tmpdir('dpo')
  local model_dir = U.tiny_model(dir .. '/init')
  local recs = {}
  for i, p in ipairs(U.additions(64, 3)) do
    local wrong = tostring((tonumber(p.answer) + 1 + i % 5) % 19)
    recs[i] = { prompt = p.prompt, chosen = p.answer, rejected = wrong }
  end
  U.write_jsonl(dir .. '/prefs.jsonl', recs)
  local out = U.run_recipe('recipes/dpo.lua', { 'model.dir=' .. model_dir, 'data.path=' .. dir .. '/prefs.jsonl',
    'train.steps=40', 'train.pairs=16', 'train.lr=3e-3', 'dpo.beta=0.5', 'train.micro_batch_tokens=80',
    'run.dir=' .. dir .. '/run' })
  t.truthy(out.last_accuracy >= 0.75, 'final reward accuracy ' .. out.last_accuracy)
  t.truthy(out.first_accuracy <= 0.5, 'first reward accuracy ' .. out.first_accuracy)
  local m = moonrl.model.load(dir .. '/run/model')
  t.eq(m.n_params, out.model.n_params)
  require('moonrl.io.fs').remove(dir)
end)

t.test('sft: held-out accuracy every eval.every steps, the reference response as the answer, rises', function()
  local dir = U.tmpdir('sft_eval')
  local model_dir = U.tiny_model(dir .. '/init', { hidden_size = 64, intermediate_size = 128, layers = 2 })
  local recs = {}
  for i, p in ipairs(U.additions(400, 7)) do recs[i] = { prompt = p.prompt, response = p.answer } end
  U.write_jsonl(dir .. '/train.jsonl', recs)
  U.run_recipe('recipes/sft.lua', { 'model.dir=' .. model_dir, 'data.path=' .. dir .. '/train.jsonl',
    'train.steps=80', 'train.batch=32', 'train.lr=5e-3', 'train.micro_batch_tokens=256', 'eval.every=10',
    'data.eval_fraction=0.1', 'run.dir=' .. dir .. '/run', 'run.threads=1', 'quiet=true' })
  local m = records(dir .. '/run')
  t.eq(m[10]['eval/prompts'], 40, 'the held-out split: 10% of 400')
  t.eq(m[11]['eval/accuracy'], nil, 'only every eval.every steps')
  t.truthy(m[80].eval_loss < m[10].eval_loss, 'the eval loss falls')
  print(string.format('  sft held-out accuracy: step 10 %.3f -> step 80 %.3f', m[10]['eval/accuracy'], m[80]['eval/accuracy']))
  t.truthy(m[80]['eval/accuracy'] >= m[10]['eval/accuracy'] + 0.2, 'held-out accuracy rises')
  fs.remove(dir)
end)

t.test('sft: the held-out split is data.eval_fraction of the records, at most data.eval_max', function()
  local dir, model_dir = sft_files('sft_eval_max')
  for _, c in ipairs({ { 'data.eval_max=1000', 100 }, { 'data.eval_max=7', 7 } }) do
    U.run_recipe('recipes/sft.lua', { 'model.dir=' .. model_dir, 'data.path=' .. dir .. '/train.jsonl', 'train.steps=1',
      'train.batch=2', 'eval.every=1', 'data.eval_fraction=0.5', c[1], 'run.dir=' .. dir .. '/run' .. c[2], 'quiet=true' })
    t.eq(records(dir .. '/run' .. c[2])[1]['eval/prompts'], c[2], c[1])
  end
  fs.remove(dir)
end)

t.test('data.task=addition: sft trains on its answers, dpo prefers them to the rejected ones; its held-out split evaluated', function()
  local dir = U.tmpdir('task')
  local model_dir = U.tiny_model(dir .. '/init', { hidden_size = 64, intermediate_size = 128, layers = 2 })
  local out = U.run_recipe('recipes/sft.lua', { 'model.dir=' .. model_dir, 'data.task=addition', 'train.steps=6',
    'train.batch=16', 'train.lr=3e-3', 'eval.every=3', 'eval.prompts=25', 'run.dir=' .. dir .. '/sft', 'run.threads=1', 'quiet=true' })
  local m = records(dir .. '/sft')
  t.eq(m[3]['eval/prompts'], 25)
  t.truthy(m[6].eval_loss ~= nil and out.last_loss < out.first_loss, 'trained on the task')
  out = U.run_recipe('recipes/dpo.lua', { 'model.dir=' .. model_dir, 'data.task=addition', 'train.steps=20', 'train.pairs=16',
    'train.lr=3e-3', 'dpo.beta=0.5', 'eval.every=10', 'eval.prompts=30', 'run.dir=' .. dir .. '/dpo', 'run.threads=1', 'quiet=true' })
  m = records(dir .. '/dpo')
  t.eq(m[10]['eval/prompts'], 30)
  t.truthy(m[20]['eval/accuracy'] ~= nil and m[20]['eval/reward'] ~= nil, 'held-out accuracy and reward')
  t.truthy(out.last_accuracy >= 0.9, 'the answer preferred to its flawed copy: reward accuracy ' .. out.last_accuracy)
  -- eval.data in DPO's own format: the chosen answer is the reference
  local prefs = {}
  for i, p in ipairs(U.additions(12, 5)) do prefs[i] = { prompt = p.prompt, chosen = p.answer, rejected = p.answer .. '=' } end
  U.write_jsonl(dir .. '/prefs.jsonl', prefs)
  U.run_recipe('recipes/dpo.lua', { 'model.dir=' .. model_dir, 'data.path=' .. dir .. '/prefs.jsonl', 'train.steps=2',
    'train.pairs=4', 'eval.every=2', 'eval.data=' .. dir .. '/prefs.jsonl', 'run.dir=' .. dir .. '/dpo_data', 'run.threads=1',
    'quiet=true' })
  t.eq(records(dir .. '/dpo_data')[2]['eval/prompts'], 12)
  fs.remove(dir)
end)

t.test('sft, dpo: a bad data or eval setting is one line, exit 2, before the model loads, no run directory', function()
  local exe = assert(rawget(_G, 'MOONRL_EXE'), 'needs the moonrl executable')
  local dir = U.tmpdir('sft_usage')
  local cases = {
    { 'sft', 'data.task=nope', "config key 'data.task': unknown task 'nope' (known: addition" },
    { 'sft', 'eval.task=nope', "config key 'eval.task': unknown task 'nope'" },
    { 'sft', 'reward=nope', "reward: unknown reward 'nope'" },
    { 'sft', 'eval.every=-1', "config key 'eval.every' must be >= 0" },
    { 'sft', 'data.eval_fraction=0 eval.every=5', 'eval.every: no held-out set' },
    { 'sft', 'data.eval_max=-1', "config key 'data.eval_max' must be >= 0, got -1" },
    { 'sft', 'data.max_record_bytes=0', "config key 'data.max_record_bytes' must be in 1..2147483647, got 0" },
    { 'dpo', 'data.max_record_bytes=3e9', "config key 'data.max_record_bytes' must be in 1..2147483647, got 3000000000" },
    { 'dpo', 'eval.every=5', 'eval.every: no held-out set' },
    { 'sft', '', "config key 'data.path' (string) is required: pass data.path=... or data.task=NAME" },
    { 'dpo', '', "config key 'data.path' (string) is required" },
    { 'sft', 'train.steps=1', 'data.path: ' .. dir .. '/none.jsonl: cannot open' },
    { 'dpo', 'train.steps=1', 'data.path: ' .. dir .. '/none.jsonl: cannot open' },
    { 'dpo', 'eval.every=1 eval.data=' .. dir .. '/no_eval.jsonl', "config key 'eval.data': " .. dir .. '/no_eval.jsonl: no such file' },
  }
  for i, c in ipairs(cases) do
    local d = dir .. '/bad' .. i
    local argv = { exe, 'run', c[1], 'model.dir=' .. dir .. '/nomodel', 'run.dir=' .. d }
    for w in c[2]:gmatch('%S+') do argv[#argv + 1] = w end
    if not c[2]:find('data.task') and c[2] ~= '' then argv[#argv + 1] = 'data.path=' .. dir .. '/none.jsonl' end
    U.expect_usage(t, argv, c[3], d)
  end
  fs.remove(dir)
end)

t.test('sft and dpo are recipes like the RL ones: extended by name, a stage overridden, the old key an alias', function()
  local rl = require('moonrl.rl')
  local dir = U.tmpdir('sft_extend')
  local model_dir = U.tiny_model(dir .. '/init')
  local recs = {}
  for i, p in ipairs(U.additions(40, 5)) do recs[i] = { prompt = p.prompt, response = p.answer } end
  U.write_jsonl(dir .. '/train.jsonl', recs)
  for _, name in ipairs({ 'sft', 'dpo' }) do t.truthy(rl.is_recipe(rl.load(name)), name .. ' is a moonrl.rl recipe') end
  local my = rl.extend('sft', { name = 'my_sft', config = { train = { batch = 4 } } })
  t.eq(my.config.train.batch.value, 4, 'the extension\'s config over sft\'s')
  function my:metrics(m, step)
    self.parent.metrics(self, m, step)
    m.hooked = step
  end
  local config = require('moonrl.config')
  config.overrides = config.parse_overrides({ 'model.dir=' .. model_dir, 'data.path=' .. dir .. '/train.jsonl',
    'train.steps=4', 'eval_every=2', 'run.dir=' .. dir .. '/run', 'quiet=true' })
  config.consumed = false
  local out = my:main()
  t.eq(out.last, 4)
  local recs_out = U.records(dir .. '/run')
  t.eq(#recs_out, 4)
  for i, r in ipairs(recs_out) do t.eq(r.hooked, i, 'the overridden stage ran at step ' .. i) end
  -- eval_every=2, the old name of eval.every: the evaluation at step 2 (and the eval loss at the end)
  t.truthy(recs_out[2].eval_loss and recs_out[2]['eval/accuracy'], 'evaluated at step 2')
  t.truthy(not recs_out[1].eval_loss and not recs_out[3].eval_loss, 'not at steps 1 and 3')
  fs.remove(dir)
end)

t.done()
