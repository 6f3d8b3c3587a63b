-- The run directory: config, metrics JSONL, TensorBoard, trace, the printed line.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local json = require('moonrl.io.json')

t.test('a run writes its directory', function()
  local dir = os.tmpname()
  os.remove(dir)
  local cfg = moonrl.config.merge({ lr = 0.5 }, { { key = 'run.dir', value = dir } })
  local run = require('moonrl.train.run').start(cfg, { name = 'unit', total_steps = 2 })
  t.eq(run.dir, dir)
  for step = 1, 2 do
    run:phase('generate', function() moonrl.sleep(0.01) end)
    run:phase('train', function() end)
    -- results with a nil among them (PPO's log-probs phase without a reference) come back as given
    local a, b, c, d = run:phase('logprobs', function() return 1, nil, 3 end)
    t.truthy(a == 1 and b == nil and c == 3 and d == nil, 'nil results kept in place')
    local flat = run:log(step, { reward = { mean = 0.25 * step, std = 0.5 }, kl = 1e-4, lr = 0.5 }, { quiet = true })
    t.truthy(flat['time/generate'] >= 0.01, 'phase time recorded')
  end
  local line = run:line(3, { ['reward/mean'] = 0.5, ['reward/std'] = 0.1, lr = 1e-6 }, 1.5)
  t.eq(line, 'step 3/2 | reward 0.5±0.1 | lr 1.00e-06 | 1.50s')
  run:finish()
  run:finish()
  local cfg_json = json.read_file(dir .. '/config.json')
  t.eq(cfg_json.recipe, 'unit')
  t.eq(cfg_json.config.lr, 0.5)
  local lines = {}
  for l in io.lines(dir .. '/metrics.jsonl') do lines[#lines + 1] = json.decode(l) end
  t.eq(#lines, 2)
  t.eq(lines[2].step, 2)
  t.eq(lines[2]['reward/mean'], 0.5)
  t.truthy(lines[1]['time/generate'] > 0, 'phase time in the record')
  local trace = json.read_file(dir .. '/trace.json')
  t.truthy(#trace.traceEvents >= 8, 'phases on the timeline')
  t.truthy(table.concat(require('moonrl.io.fs').list(dir .. '/tb'), ' '):find('events.out.tfevents', 1, true),
    'tensorboard file')
  require('moonrl.io.fs').remove(dir)
end)

t.done()
