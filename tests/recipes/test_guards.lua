-- Guards, reward failures and bad data, each caused on purpose: a NaN gradient, a gradient
-- spike, a KL above its limit, an entropy below its floor (skip, or roll back to the last
-- checkpoint); a reward that raises, returns garbage or never returns; JSONL lines that are
-- broken, lack a field or hold an over-long prompt.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local fault = require('moonrl.train.fault')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')
local U = dofile('tests/recipes/util.lua')

local dir = U.tmpdir('guards')
-- a reward with a spread in every group, so that every step has a gradient
require('moonrl.rewards').register('length', function(s) return #s.response end, { replace = true })
local BASE, _, data = U.grpo_setup(dir, 40, { 'reward=length' })
local recs = {}
for l in io.lines(data) do recs[#recs + 1] = json.decode(l) end
local n_run = 0
local function grpo(extra, faults)
  n_run = n_run + 1
  local w = U.words(BASE, dir .. '/run' .. n_run, extra)
  fault.faults = fault.parse(faults or '')
  local ok, out = pcall(U.run_recipe, 'recipes/grpo.lua', w)
  fault.faults = {}
  require('moonrl').run_exit_hooks(ok, out) -- what the command line does when a recipe ends
  if not ok then error(out, 0) end
  return out
end

local function lines(path)
  local out = {}
  for l in (fs.read(path) or ''):gmatch('[^\n]+') do out[#out + 1] = json.decode(l) end
  return out
end
local function events(run_dir, kind)
  local out = {}
  for _, e in ipairs(lines(run_dir .. '/events.jsonl')) do if e.event == kind then out[#out + 1] = e end end
  return out
end
local function same_file(a, b) return fs.read(a) ~= nil and fs.read(a) == fs.read(b) end
local function ckpt(run_dir, step) return string.format('%s/checkpoints/step-%06d', run_dir, step) end

t.test('a NaN gradient: the update is skipped, the weights and the optimizer untouched', function()
  local out = grpo({ 'grpo.steps=4', 'run.checkpoint_every=1', 'run.keep_checkpoints=0' }, 'nan:step=3')
  local ev = events(out.dir, 'skip')
  t.eq(#ev, 1, 'one skip event')
  t.eq(ev[1].detector, 'nonfinite_grad_norm')
  t.eq(ev[1].step, 3)
  local m = lines(out.dir .. '/metrics.jsonl')
  t.eq(m[3]['guard/skipped'], 1, 'the step line counts the skip')
  t.eq(m[2]['guard/skipped'], 0)
  t.truthy(same_file(ckpt(out.dir, 2) .. '/model.safetensors', ckpt(out.dir, 3) .. '/model.safetensors'), 'weights untouched')
  t.truthy(same_file(ckpt(out.dir, 2) .. '/optimizer.safetensors', ckpt(out.dir, 3) .. '/optimizer.safetensors'),
    'optimizer state untouched')
  t.truthy(not same_file(ckpt(out.dir, 3) .. '/model.safetensors', ckpt(out.dir, 4) .. '/model.safetensors'),
    'step 4 trains again')
  -- a checkpoint is a model directory: it loads, with its tokenizer
  t.eq(moonrl.model.load(ckpt(out.dir, 2)).config.vocab_size, 15)
  t.eq(moonrl.tokenizer.load(ckpt(out.dir, 2)).vocab_size, 15)
end)

t.test('NaN at every step: the run stops after guard.max_skips, its model finite', function()
  local ok, err = pcall(grpo, { 'grpo.steps=6', 'guard.max_skips=3' }, 'nan')
  t.truthy(not ok and require('moonrl.train.guard').is_guard_stop(err), 'a guard stop')
  t.truthy(tostring(err):find('4 updates in a row skipped', 1, true), tostring(err))
  t.truthy(tostring(err):find('nonfinite_grad_norm', 1, true), 'names the detector')
end)

t.test('a gradient spike is skipped; a KL above its limit too; an entropy below its floor too', function()
  local out = grpo({ 'grpo.steps=8', 'guard.grad_spike=3', 'grpo.kl_coef=0.01', 'guard.kl_max=5' },
    'spike:step=7:factor=1000;kl:step=3:value=9')
  local ev = events(out.dir, 'skip')
  t.eq(#ev, 2, 'two skips')
  t.eq(ev[1].detector, 'kl_max')
  t.eq(ev[1].step, 3)
  t.eq(ev[1].value, 9)
  t.eq(ev[2].detector, 'grad_spike')
  t.eq(ev[2].step, 7)
  t.truthy(ev[2].value > ev[2].limit, 'value above the limit')
  out = grpo({ 'grpo.steps=2', 'guard.entropy_min=100', 'guard.max_skips=0' })
  ev = events(out.dir, 'skip')
  t.eq(#ev, 2)
  t.eq(ev[1].detector, 'entropy_min')
end)

t.test('rollback: back to the last checkpoint with a smaller learning rate, each step logged once', function()
  local out = grpo({ 'grpo.steps=8', 'guard.grad_spike=3', 'guard.action=rollback', 'guard.lr_factor=0.5',
    'run.checkpoint_every=2' }, 'spike:step=7:factor=1000:times=1')
  local ev = events(out.dir, 'rollback')
  t.eq(#ev, 1, 'one rollback')
  t.eq(ev[1].step, 7)
  t.eq(ev[1].to_step, 6)
  t.eq(ev[1].lr_scale, 0.5)
  local m = lines(out.dir .. '/metrics.jsonl')
  t.eq(#m, 8, 'each step once')
  for i, r in ipairs(m) do t.eq(r.step, i, 'step order') end
  t.eq(m[8]['guard/lr_scale'], 0.5, 'the smaller rate is in force')
  t.eq(m[8].lr, 0.5e-3)
  t.eq(m[6]['guard/lr_scale'], nil)
end)

t.test('rollbacks beyond guard.max_rollbacks stop the run naming the detector, step and value', function()
  local ok, err = pcall(grpo, { 'grpo.steps=8', 'guard.grad_spike=3', 'guard.action=rollback', 'guard.skip_batch=false',
    'guard.max_rollbacks=1', 'run.checkpoint_every=2' }, 'spike:step=7:factor=1000')
  t.truthy(not ok and require('moonrl.train.guard').is_guard_stop(err), tostring(err))
  local msg = tostring(err)
  t.truthy(msg:find('grad_spike at step 7', 1, true) and msg:find('guard.max_rollbacks=1', 1, true), msg)
end)

t.test('rewards that fail: the group is dropped and counted; a reward that never returns times out', function()
  local rewards = require('moonrl.rewards')
  rewards.register('flaky', function(s)
    if s.prompt:find('^3%+') then error('flaky verifier') end
    if s.prompt:find('^4%+') then return 'yes' end
    if s.prompt:find('^5%+') then return 0 / 0 end
    if s.prompt:find('^6%+') then while true do end end
    return #s.response
  end, { replace = true })
  local t0 = moonrl.now()
  local out = grpo({ 'grpo.steps=6', 'reward=flaky', 'reward.timeout=0.2' })
  local m = lines(out.dir .. '/metrics.jsonl')
  local errors, dropped = 0, 0
  for _, r in ipairs(m) do errors, dropped = errors + r['reward/errors'], dropped + r['reward/dropped_groups'] end
  t.truthy(errors > 0 and dropped > 0, string.format('errors %d, groups dropped %d', errors, dropped))
  t.truthy(moonrl.now() - t0 < 60, 'the hanging reward was cut off')
  local ev = events(out.dir, 'reward_error')
  local seen = {}
  for _, e in ipairs(ev) do
    for _, key in ipairs({ 'flaky verifier', 'returned yes', 'returned nan', 'reward.timeout' }) do
      if e.message:find(key, 1, true) then seen[key] = true end
    end
  end
  for _, key in ipairs({ 'flaky verifier', 'returned yes', 'returned nan', 'reward.timeout' }) do
    t.truthy(seen[key], 'an event for: ' .. key)
  end
  local ok, err = pcall(grpo, { 'grpo.steps=6', 'reward=flaky', 'reward.timeout=0.2', 'reward.on_error=stop' })
  t.truthy(not ok and tostring(err):find("reward 'flaky'", 1, true), tostring(err))
  out = grpo({ 'grpo.steps=3', 'reward=flaky', 'reward.timeout=0.2', 'reward.on_error=zero' })
  m = lines(out.dir .. '/metrics.jsonl')
  t.eq(m[1]['reward/dropped_groups'], 0, 'zero: nothing dropped')
end)

t.test('bad records: skipped and counted with data.on_error=skip, else an error naming file and line', function()
  local f = assert(io.open(dir .. '/bad.jsonl', 'w'))
  for i = 1, 30 do
    if i == 3 then f:write('{"question": "1+1=", "answer": \n')            -- broken JSON
    elseif i == 5 then f:write('{"answer": "2"}\n')                        -- missing field
    elseif i == 7 then f:write(json.encode({ question = string.rep('1+', 40) .. '1=', answer = '41' }), '\n') -- too long
    else f:write(json.encode(recs[i]), '\n') end
  end
  f:close()
  -- 9 steps of 3 prompts: the 27 good records once, so each bad one is met once or not yet
  local out = grpo({ 'grpo.steps=9', 'grpo.prompts=3', 'data.path=' .. dir .. '/bad.jsonl', 'data.on_error=skip' })
  local m = lines(out.dir .. '/metrics.jsonl')
  local skipped = m[#m]['data/skipped']
  local ev = events(out.dir, 'data_skipped')
  t.eq(#ev, skipped, 'an event for each record skipped')
  t.truthy(skipped >= 2 and skipped <= 3, 'the bad records skipped, counted: ' .. skipped)
  local why = {}
  for _, e in ipairs(ev) do why[#why + 1] = e.message end
  why = table.concat(why, '\n')
  t.truthy(why:find('bad.jsonl:7: prompt of', 1, true) or why:find('bad.jsonl:3: invalid JSON', 1, true), why)
  out = grpo({ 'grpo.steps=20', 'grpo.prompts=3', 'data.path=' .. dir .. '/bad.jsonl', 'data.on_error=skip' })
  why = {}
  for _, e in ipairs(events(out.dir, 'data_skipped')) do why[#why + 1] = e.message end
  why = table.concat(why, '\n')
  for _, want in ipairs({ 'bad.jsonl:3: invalid JSON', "bad.jsonl:5: missing field 'question'",
      'bad.jsonl:7: prompt of 83 tokens leaves no room' }) do
    t.truthy(why:find(want, 1, true), want .. ' in\n' .. why)
  end
  local ok, err = pcall(grpo, { 'grpo.steps=8', 'data.path=' .. dir .. '/bad.jsonl' })
  t.truthy(not ok and tostring(err):find('bad.jsonl:[357]: '), tostring(err))
  local ok2, err2 = pcall(grpo, { 'grpo.steps=8', 'data.path=' .. dir .. '/bad.jsonl', 'data.on_error=maybe' })
  t.truthy(not ok2 and tostring(err2):find('data.on_error', 1, true), tostring(err2))
end)

fs.remove(dir)
t.done()
