-- Bit-exact resume after SIGKILL: a short seeded run of each recipe is killed again and again
-- (at phases of its steps, inside checkpoint writes, at random times) and resumed with
-- run.resume=auto each time; its final model.safetensors must equal, byte for byte, that of
-- the same run never interrupted, and metrics.jsonl must hold each step once with the same
-- values (timings aside). bench/checkpoint/kill_stress.lua does the same with any number of kills.
local t = require('moonrl.testing')
local fs = require('moonrl.io.fs')
local U = dofile('tests/recipes/util.lua')
local K = dofile('tests/recipes/killer.lua')

local dir = U.tmpdir('resume')
local model_dir = U.tiny_model(dir .. '/init')
local recs, sft, prefs = {}, {}, {}
for i, p in ipairs(U.additions(60, 5)) do
  recs[i] = { question = p.prompt, answer = p.answer }
  sft[i] = { prompt = p.prompt, response = p.answer }
  prefs[i] = { prompt = p.prompt, chosen = p.answer, rejected = p.answer .. '1' }
end
local rl_data = U.write_jsonl(dir .. '/rl.jsonl', recs)
local sft_data = U.write_jsonl(dir .. '/sft.jsonl', sft)
local pref_data = U.write_jsonl(dir .. '/prefs.jsonl', prefs)

local function check(name, rep, steps, kills)
  for _, line in ipairs(rep.log) do print('  ' .. line) end
  print(string.format('  %s: %d kills (%d at phases, %d in checkpoint writes, %d by timer) in %d attempts', name,
    rep.kills, rep.kinds.phase, rep.kinds.checkpoint, rep.kinds.timer, rep.attempts))
  t.truthy(rep.kills >= kills, string.format('%s: at least %d kills (got %d)', name, kills, rep.kills))
  for m, same in pairs(rep.same) do t.truthy(same, name .. ': ' .. m .. '/model.safetensors equal byte for byte') end
  t.eq(#rep.metrics, steps, name .. ': one metrics line per step')
  t.eq(#rep.metrics_ref, steps, name .. ': one metrics line per step (uninterrupted)')
  for i = 1, steps do t.eq(rep.metrics[i], rep.metrics_ref[i], name .. ': metrics of step ' .. i) end
end

local RL = { 'model.dir=' .. model_dir, 'data.path=' .. rl_data, 'data.prompt=question', 'data.chat=false',
  'reward=exact', 'train.lr=1e-3', 'train.micro_batch_tokens=64', 'run.threads=1' }
local function with(list, extra)
  local w = {}
  for _, x in ipairs(list) do w[#w + 1] = x end
  for _, x in ipairs(extra) do w[#w + 1] = x end
  return w
end

t.test('grpo: 20 kills, bit-identical final weights and metrics', function()
  local rep = K.campaign({ recipe = 'recipes/grpo.lua', steps = 12, kills = 20, seed = 11, dir = dir .. '/grpo',
    words = with(RL, { 'grpo.steps=12', 'grpo.prompts=4', 'grpo.samples=4', 'grpo.max_tokens=4', 'grpo.kl_coef=0.01' }) })
  check('grpo', rep, 12, 20)
end)

t.test('grpo with LoRA (its dropout; bf16, the base stored in bf16): 8 kills, bit-identical final adapters and metrics', function()
  local rep = K.campaign({ recipe = 'recipes/grpo.lua', steps = 8, kills = 8, seed = 15, dir = dir .. '/grpo_lora',
    file = 'adapter_model.safetensors', words = with(RL, { 'grpo.steps=8', 'grpo.prompts=4', 'grpo.samples=4',
      'grpo.max_tokens=4', 'grpo.kl_coef=0.01', 'model.lora.rank=4', 'model.lora.dropout=0.1', 'model.dtype=bf16',
      'reward=tests/recipes/partial_reward.lua:partial' }) })
  check('grpo lora', rep, 8, 8)
end)

t.test('sft: 20 kills, bit-identical final weights and metrics', function()
  local rep = K.campaign({ recipe = 'recipes/sft.lua', steps = 12, kills = 20, seed = 12, dir = dir .. '/sft',
    phases = { 'step', 'train', 'end' },
    words = { 'model.dir=' .. model_dir, 'data.path=' .. sft_data, 'train.steps=12', 'train.batch=8', 'train.lr=1e-3',
      'eval_every=4', 'run.threads=1' } })
  check('sft', rep, 12, 20)
end)

t.test('dpo: 6 kills, bit-identical final weights and metrics', function()
  local rep = K.campaign({ recipe = 'recipes/dpo.lua', steps = 8, kills = 6, seed = 13, dir = dir .. '/dpo',
    phases = { 'step', 'train', 'end' },
    words = { 'model.dir=' .. model_dir, 'data.path=' .. pref_data, 'train.steps=8', 'train.pairs=4', 'train.lr=1e-3',
      'run.threads=1' } })
  check('dpo', rep, 8, 6)
end)

t.test('ppo: 6 kills, bit-identical policy and critic and metrics', function()
  local rep = K.campaign({ recipe = 'recipes/ppo.lua', steps = 6, kills = 6, seed = 14, dir = dir .. '/ppo',
    models = { 'model', 'critic' }, phases = { 'step', 'generate', 'logprobs', 'train', 'critic', 'end' },
    words = with(RL, { 'ppo.steps=6', 'ppo.prompts=4', 'ppo.samples=2', 'ppo.max_tokens=4' }) })
  check('ppo', rep, 6, 6)
end)

fs.remove(dir)
t.done()
