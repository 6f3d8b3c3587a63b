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
    'run.seed=1', 'run.dir=' .. dir })
  print(string.format('held-out accuracy %.1f%% -> %.1f%%', 100 * out.before, 100 * out.after))
  t.truthy(out.before < 0.3, 'the warm-up leaves the accuracy low')
  t.truthy(out.after >= out.before + 0.5, 'GRPO raises it by at least 50 points')
  local m = moonrl.model.load(dir .. '/model')
  t.eq(m.config.vocab_size, 15)
  t.truthy(io.open(dir .. '/model/tokenizer.json'), 'tokenizer saved with the model')
  require('moonrl.fs').remove(dir)
end)

-- model.dtype=bf16 (fp32 master weights, bf16 products): the same run learns as much (measured:
-- seed 1, the full run, 0.0% -> 99.0% in bf16 against 96.0% in fp32).
t.test('default run in bf16: GRPO raises held-out accuracy by a clear margin', function()
  if not moonrl.model.bf16_products() then print('skipped: no fast bf16 products on this CPU'); return end
  local dir = U.tmpdir('default_bf16')
  local out = U.run_recipe('examples/default.lua', { 'sft.steps=1000', 'grpo.steps=20', 'quiet=true',
    'run.seed=1', 'run.dir=' .. dir, 'model.dtype=bf16' })
  print(string.format('bf16: held-out accuracy %.1f%% -> %.1f%%', 100 * out.before, 100 * out.after))
  t.truthy(out.before < 0.3, 'the warm-up leaves the accuracy low')
  t.truthy(out.after >= out.before + 0.5, 'GRPO raises it by at least 50 points')
  require('moonrl.fs').remove(dir)
end)

t.test('model.dtype: a bad value is a usage error naming the key', function()
  t.raises(function()
    U.run_recipe('examples/default.lua', { 'model.dtype=fp16', 'quiet=true', 'run.dir=' .. U.tmpdir('default_bad_dtype') })
  end, "config key 'model.dtype' must be one of fp32, bf16, auto, got 'fp16'")
end)

t.done()
