-- Kill a run many times and check that it still ends bit-identical to an uninterrupted one
-- (the suite's tests/recipes/test_resume.lua, with the kill count as an argument).
--
--   build/moonrl run bench/checkpoint/kill_stress.lua kills=200 recipe=grpo steps=40 seed=1
--
-- recipe: grpo, sft, dpo or ppo, on a tiny random model and a small synthetic dataset; every
-- kill is SIGKILL at a random phase of a step, a random byte of a checkpoint write or a random
-- time (tests/recipes/killer.lua). Prints each attempt and the verdict; exits non-zero when the
-- final weights or the per-step metrics differ.
local moonrl = require('moonrl')
local fs = require('moonrl.io.fs')
local U = dofile(moonrl.home .. '/tests/recipes/util.lua')
local K = dofile(moonrl.home .. '/tests/recipes/killer.lua')

local cfg = moonrl.config {
  recipe = 'grpo', kills = moonrl.config.integer(50), steps = moonrl.config.integer(20),
  seed = moonrl.config.integer(1), quiet = false,
}
local dir = U.tmpdir('kill-stress')
local model_dir = U.tiny_model(dir .. '/init')
local recs, sft, prefs = {}, {}, {}
for i, p in ipairs(U.additions(200, cfg.seed)) do
  recs[i] = { question = p.prompt, answer = p.answer }
  sft[i] = { prompt = p.prompt, response = p.answer }
  prefs[i] = { prompt = p.prompt, chosen = p.answer, rejected = p.answer .. '1' }
end
local n = cfg.steps
local RL = { 'model.dir=' .. model_dir, 'data.path=' .. U.write_jsonl(dir .. '/rl.jsonl', recs), 'data.prompt=question',
  'data.chat=false', 'reward=exact', 'train.lr=1e-3', 'train.micro_batch_tokens=64', 'run.threads=1' }
local SETUPS = {
  grpo = { recipe = 'recipes/grpo.lua', words = { 'grpo.steps=' .. n, 'grpo.prompts=4', 'grpo.samples=4',
    'grpo.max_tokens=4', 'grpo.kl_coef=0.01' }, rl = true },
  ppo = { recipe = 'recipes/ppo.lua', words = { 'ppo.steps=' .. n, 'ppo.prompts=4', 'ppo.samples=2', 'ppo.max_tokens=4' },
    rl = true, models = { 'model', 'critic' }, phases = { 'step', 'generate', 'logprobs', 'train', 'critic', 'end' } },
  sft = { recipe = 'recipes/sft.lua', words = { 'model.dir=' .. model_dir, 'data.path=' .. U.write_jsonl(dir .. '/sft.jsonl', sft),
    'train.steps=' .. n, 'train.batch=8', 'train.lr=1e-3', 'eval_every=4', 'run.threads=1' }, phases = { 'step', 'train', 'end' } },
  dpo = { recipe = 'recipes/dpo.lua', words = { 'model.dir=' .. model_dir, 'data.path=' .. U.write_jsonl(dir .. '/prefs.jsonl', prefs),
    'train.steps=' .. n, 'train.pairs=4', 'train.lr=1e-3', 'run.threads=1' }, phases = { 'step', 'train', 'end' } },
}
local s = SETUPS[cfg.recipe] or moonrl.usage_error('recipe must be grpo, ppo, sft or dpo')
local words = {}
if s.rl then for _, w in ipairs(RL) do words[#words + 1] = w end end
for _, w in ipairs(s.words) do words[#words + 1] = w end
local t0 = moonrl.now()
local rep = K.campaign({ recipe = fs.join(moonrl.home, s.recipe), words = words, steps = n, kills = cfg.kills,
  seed = cfg.seed, dir = dir, models = s.models, phases = s.phases, log = not cfg.quiet })
local ok = true
for m, same in pairs(rep.same) do
  print(string.format('%s/model.safetensors: %s', m, same and 'equal byte for byte' or 'DIFFERENT'))
  ok = ok and same
end
local bad = 0
for i = 1, math.max(#rep.metrics, #rep.metrics_ref) do if rep.metrics[i] ~= rep.metrics_ref[i] then bad = bad + 1 end end
print(string.format('metrics: %d lines (uninterrupted %d), %d differ', #rep.metrics, #rep.metrics_ref, bad))
print(string.format('%s, %d steps: %d kills (%d at phases, %d inside checkpoint writes, %d by timer) in %d attempts, %.0f s',
  cfg.recipe, n, rep.kills, rep.kinds.phase, rep.kinds.checkpoint, rep.kinds.timer, rep.attempts, moonrl.now() - t0))
fs.remove(dir)
if not ok or bad > 0 or #rep.metrics ~= n then error('the killed run differs from the uninterrupted one', 0) end
