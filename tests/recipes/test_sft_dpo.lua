-- SFT and DPO recipes end to end on a tiny random model in Hugging Face format: SFT's loss falls,
-- DPO's reward accuracy rises on a learnable preference set (the right sum preferred to a wrong one),
-- and both save a model that loads again.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local U = dofile('tests/recipes/util.lua')

t.test('sft: the loss falls and the model is saved in HF format', function()
  local dir = U.tmpdir('sft')
  local model_dir = U.tiny_model(dir .. '/init')
  local recs = {}
  for i, p in ipairs(U.additions(200, 7)) do recs[i] = { prompt = p.prompt, response = p.answer } end
  U.write_jsonl(dir .. '/train.jsonl', recs)
  local out = U.run_recipe('recipes/sft.lua', { 'model.dir=' .. model_dir, 'data.path=' .. dir .. '/train.jsonl',
    'train.steps=40', 'train.batch=16', 'train.lr=5e-3', 'train.micro_batch_tokens=64', 'run.dir=' .. dir .. '/run' })
  t.truthy(out.last_loss < 0.7 * out.first_loss, string.format('loss fell: %.3f -> %.3f', out.first_loss, out.last_loss))
  local m = moonrl.model.load(dir .. '/run/model')
  t.eq(m.n_params, out.model.n_params)
  t.truthy(io.open(dir .. '/run/model/tokenizer.json'), 'tokenizer copied')
  local lines = 0
  for _ in io.lines(dir .. '/run/metrics.jsonl') do lines = lines + 1 end
  t.eq(lines, 40)
  require('moonrl.fs').remove(dir)
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
  require('moonrl.fs').remove(dir)
end)

t.done()
