-- The embedded default run (examples/default.lua), shortened and seeded: SFT warm-up on 2-digit
-- additions whose answers mostly carry a stray '=', then GRPO with the 'exact' reward; the
-- held-out greedy accuracy must rise by a clear margin. Also: the data and tokenizer paths resolve
-- from moonrl.home, and the saved model loads again.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local U = dofile('tests/recipes/util.lua')

t.test('default run: GRPO raises held-out accuracy by a clear margin', function()
  local dir = U.tmpdir('default')
  local out = U.run_recipe('examples/default.lua', { 'sft.steps=1000', 'grpo.steps=20', 'quiet=true',
    'run.seed=1', 'run.threads=1', 'run.dir=' .. dir })
  print(string.format('held-out accuracy %.1f%% -> %.1f%%', 100 * out.before, 100 * out.after))
  t.truthy(out.before < 0.3, 'the warm-up leaves the accuracy low')
  t.truthy(out.after >= out.before + 0.5, 'GRPO raises it by at least 50 points')
  local m = moonrl.model.load(dir .. '/model')
  t.eq(m.config.vocab_size, 15)
  t.truthy(io.open(dir .. '/model/tokenizer.json'), 'tokenizer saved with the model')
  require('moonrl.io.fs').remove(dir)
end)

-- model.dtype=bf16 (fp32 master weights, bf16 products): the same run learns as much (measured:
-- seed 1, the full run, 0.0% -> 99.0% in bf16 against 96.0% in fp32).
t.test('default run in bf16: GRPO raises held-out accuracy by a clear margin', function()
  if not moonrl.model.bf16_products() then print('skipped: no fast bf16 products on this CPU'); return end
  local dir = U.tmpdir('default_bf16')
  local out = U.run_recipe('examples/default.lua', { 'sft.steps=1000', 'grpo.steps=20', 'quiet=true',
    'run.seed=1', 'run.threads=1', 'run.dir=' .. dir, 'model.dtype=bf16' })
  print(string.format('bf16: held-out accuracy %.1f%% -> %.1f%%', 100 * out.before, 100 * out.after))
  t.truthy(out.before < 0.3, 'the warm-up leaves the accuracy low')
  t.truthy(out.after >= out.before + 0.5, 'GRPO raises it by at least 50 points')
  require('moonrl.io.fs').remove(dir)
end)

t.test('model.dtype: a bad value is a usage error naming the key', function()
  t.raises(function()
    U.run_recipe('examples/default.lua', { 'model.dtype=fp16', 'quiet=true', 'run.dir=' .. U.tmpdir('default_bad_dtype') })
  end, "config key 'model.dtype' must be one of fp32, bf16, auto, got 'fp16'")
end)

t.test('engine.kv_cache_dtype: a bad value is a usage error naming the key', function()
  t.raises(function()
    U.run_recipe('examples/default.lua', { 'engine.kv_cache_dtype=fp16', 'quiet=true',
      'run.dir=' .. U.tmpdir('default_bad_kv_dtype') })
  end, "config key 'engine.kv_cache_dtype' must be one of auto, fp32, bf16, got 'fp16'")
end)

-- The example on moonrl.rl: its keys from before (grpo.lr, grpo.clip, grpo.reward,
-- grpo.eval_every) set the library's (train.lr, grpo.clip_low, reward, eval.every), and the
-- held-out accuracy of eval.every is also logged as heldout_accuracy.
t.test('default run: the keys it had before moonrl.rl still work', function()
  local json = require('moonrl.io.json')
  local dir = U.tmpdir('default_aliases')
  local out = U.run_recipe('examples/default.lua', { 'sft.steps=10', 'grpo.steps=2', 'grpo.prompts=4', 'heldout=10',
    'quiet=true', 'run.threads=1', 'run.dir=' .. dir, 'grpo.lr=1e-4', 'grpo.clip=0.3', 'grpo.reward=exact',
    'grpo.eval_every=1' })
  local cfg = json.decode(require('moonrl.io.fs').read(dir .. '/config.json')).config
  t.eq(cfg.train.lr, 1e-4, 'grpo.lr -> train.lr')
  t.eq(cfg.grpo.clip_low, 0.3, 'grpo.clip -> grpo.clip_low')
  t.eq(cfg.reward.name, 'exact', 'grpo.reward -> reward')
  t.eq(cfg.eval.every, 1, 'grpo.eval_every -> eval.every')
  local n = 0
  for line in io.lines(dir .. '/metrics.jsonl') do
    local m = json.decode(line)
    n = n + 1
    t.eq(m.lr, 1e-4, 'the GRPO update ran at train.lr')
    t.truthy(m['eval/accuracy'] ~= nil, 'held-out accuracy every step')
    t.eq(m.heldout_accuracy, m['eval/accuracy'], 'under its old name too')
  end
  t.eq(n, 2)
  t.truthy(out.before and out.after, 'the before and after figures')
  require('moonrl.io.fs').remove(dir)
end)

t.done()
