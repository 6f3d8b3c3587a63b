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

t.done()
