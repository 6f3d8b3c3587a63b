-- Config declaration, command-line overrides, type checking, suggestions.
local t = require('moonrl.testing')
local config = require('moonrl.config')

local declared = {
  lr = 1e-5,
  steps = config.integer(100),
  name = 'run',
  greedy = false,
  stop_ids = { 1, 2 },
  model = { dir = config.optional('string'), hidden = config.integer(64) },
  algo = { clip = { low = 0.2, high = 0.28 } },
}

local function merge(words)
  return config.merge(declared, config.parse_overrides(words))
end

local function usage_msg(fn)
  local ok, err = pcall(fn)
  t.eq(ok, false, 'raised')
  t.truthy(require('moonrl').is_usage_error(err), 'a usage error')
  return err.message
end

t.test('defaults come through', function()
  local cfg = merge({})
  t.eq(cfg.lr, 1e-5)
  t.eq(cfg.steps, 100)
  t.eq(cfg.model.dir, nil)
  t.eq(cfg.model.hidden, 64)
  t.eq(cfg.run.seed, 1)
  t.eq(#cfg.stop_ids, 2)
end)

t.test('typed overrides', function()
  local cfg = merge({ 'lr=3e-6', 'steps=7', 'name=abc=d', 'greedy=yes', 'model.dir=/m', 'algo.clip.high=0.3',
    'stop_ids=5,6,7', 'run.seed=9' })
  t.eq(cfg.lr, 3e-6)
  t.eq(cfg.steps, 7)
  t.eq(cfg.name, 'abc=d')
  t.eq(cfg.greedy, true)
  t.eq(cfg.model.dir, '/m')
  t.eq(cfg.algo.clip.high, 0.3)
  t.eq(cfg.algo.clip.low, 0.2)
  t.eq(cfg.stop_ids[3], 7)
  t.eq(cfg.run.seed, 9)
end)

t.test('the declared table is not modified', function()
  merge({ 'lr=1' })
  t.eq(declared.lr, 1e-5)
end)

t.test('unknown key names the key and the closest known ones', function()
  local msg = usage_msg(function() merge({ 'lrr=1' }) end)
  t.eq(msg, "unknown config key 'lrr' (did you mean lr?)")
  msg = usage_msg(function() merge({ 'algo.clip.hgh=1' }) end)
  t.truthy(msg:find("unknown config key 'algo.clip.hgh'", 1, true), msg)
  t.truthy(msg:find('algo.clip.high', 1, true), msg)
  msg = usage_msg(function() merge({ 'zzzzzzzzzz=1' }) end)
  t.eq(msg, "unknown config key 'zzzzzzzzzz'")
end)

t.test('wrong types are errors naming the key', function()
  t.eq(usage_msg(function() merge({ 'lr=fast' }) end), "config key 'lr' expects a number, got 'fast'")
  t.eq(usage_msg(function() merge({ 'steps=1.5' }) end), "config key 'steps' expects an integer, got '1.5'")
  t.eq(usage_msg(function() merge({ 'greedy=maybe' }) end),
    "config key 'greedy' expects a boolean (true/false), got 'maybe'")
  t.eq(usage_msg(function() merge({ 'stop_ids=1,x' }) end), "config key 'stop_ids' expects a number, got 'x'")
end)

t.test('sections and malformed words', function()
  t.truthy(usage_msg(function() merge({ 'model=x' }) end):find("'model' is a section", 1, true))
  t.eq(usage_msg(function() merge({ 'noequals' }) end), "expected key=value, got 'noequals'")
  t.eq(usage_msg(function() merge({ 'a..b=1' }) end), "expected key=value, got 'a..b=1'")
end)

t.test('required keys', function()
  local d = { data = config.required('string') }
  local ok, err = pcall(config.merge, d, {})
  t.eq(ok, false)
  t.eq(err.message, "config key 'data' (string) is required: pass data=...")
  t.eq(config.merge(d, { { key = 'data', value = 'x.jsonl' } }).data, 'x.jsonl')
end)

t.test('a section with a name key takes a bare value; run.threads is bounded', function()
  local d = { reward = { name = 'math', on_error = 'drop' } }
  local cfg = config.merge(d, { { key = 'reward', value = 'exact' }, { key = 'reward.on_error', value = 'zero' } })
  t.eq(cfg.reward.name, 'exact')
  t.eq(cfg.reward.on_error, 'zero')
  local run = config.merge({}, { { key = 'run.threads', value = '100000' } }).run
  t.truthy(usage_msg(function() config.apply_run(run) end):find("'run.threads' must be between 0 (all cores) and 1024", 1, true))
end)

t.test('format lists every key', function()
  local text = config.format(declared)
  t.truthy(text:find('algo.clip.high', 1, true), 'nested key listed')
  t.truthy(text:find('run.seed', 1, true), 'run section listed')
end)

t.done()
