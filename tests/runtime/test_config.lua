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

-- Ranges are declared once with the key (config.integer(n, { min = 1 }), config.number(x, { above = 0 }),
-- optional(typ, doc, range)) and checked by merge on every number the run gets, before any work.
local ranged = {
  steps = config.integer(100, { min = 0 }), temperature = config.number(1.0, { above = 0 }),
  top_p = config.number(1.0, { above = 0, max = 1 }), fraction = config.number(0.05, { min = 0, below = 1 }),
  zero = config.integer(0, { min = 0, max = 1 }), threads = config.integer(0, { 'auto', min = 0, max = 64 }),
  coef = config.optional('number', 'a coefficient', { min = 0 }), free = 0.5, ids = { 1, 2 },
}
local function merge_ranged(words) return config.merge(ranged, config.parse_overrides(words)) end

t.test('non-finite numbers are usage errors naming the key, wherever a number is parsed', function()
  t.eq(usage_msg(function() merge_ranged({ 'free=1e309' }) end), "config key 'free' expects a finite number, got '1e309'")
  t.eq(usage_msg(function() merge_ranged({ 'free=-1e309' }) end), "config key 'free' expects a finite number, got '-1e309'")
  t.eq(usage_msg(function() merge_ranged({ 'steps=1e309' }) end), "config key 'steps' expects an integer, got '1e309'")
  t.eq(usage_msg(function() merge_ranged({ 'ids=1,1e309' }) end), "config key 'ids' expects a finite number, got '1e309'")
  t.eq(usage_msg(function() merge_ranged({ 'coef=1e309' }) end), "config key 'coef' expects a finite number, got '1e309'")
  -- the sections every recipe gets: the issue's cases
  t.eq(usage_msg(function() merge({ 'run.max_seconds=1e309' }) end),
    "config key 'run.max_seconds' expects a finite number, got '1e309'")
  t.eq(usage_msg(function() merge({ 'run.seed=1e309' }) end), "config key 'run.seed' expects an integer, got '1e309'")
  -- an integer too large to count to is not one
  t.eq(usage_msg(function() merge_ranged({ 'steps=1e300' }) end),
    "config key 'steps' must be an integer of at most 2^53, got 1e+300")
  -- a default that is not finite (a recipe's, or MOONRL_PROGRESS_SECONDS's) is refused too
  t.eq(usage_msg(function() config.merge({ x = math.huge }, {}) end), "config key 'x' must be a finite number, got inf")
end)

t.test('every number is checked against its range, defaults and overrides alike', function()
  local cfg = merge_ranged({ 'steps=0', 'temperature=0.5', 'top_p=1', 'fraction=0', 'zero=1', 'threads=auto', 'coef=0' })
  t.eq(cfg.steps, 0); t.eq(cfg.top_p, 1); t.eq(cfg.threads, 'auto'); t.eq(cfg.coef, 0)
  t.eq(usage_msg(function() merge_ranged({ 'steps=-1' }) end), "config key 'steps' must be >= 0, got -1")
  t.eq(usage_msg(function() merge_ranged({ 'temperature=0' }) end), "config key 'temperature' must be > 0, got 0")
  t.eq(usage_msg(function() merge_ranged({ 'top_p=1.5' }) end), "config key 'top_p' must be in (0, 1], got 1.5")
  t.eq(usage_msg(function() merge_ranged({ 'fraction=1' }) end), "config key 'fraction' must be in [0, 1), got 1")
  t.eq(usage_msg(function() merge_ranged({ 'zero=2' }) end), "config key 'zero' must be 0 or 1, got 2")
  t.eq(usage_msg(function() merge_ranged({ 'threads=65' }) end), "config key 'threads' must be in 0..64, got 65")
  t.eq(usage_msg(function() merge_ranged({ 'coef=-0.5' }) end), "config key 'coef' must be >= 0, got -0.5")
  -- a recipe's default out of its own range
  t.eq(usage_msg(function() config.merge({ n = config.integer(0, { min = 1 }) }, {}) end),
    "config key 'n' must be >= 1, got 0")
  -- the sections every recipe gets
  for _, c in ipairs({ { 'run.keep_checkpoints=-1', "'run.keep_checkpoints' must be >= 0, got -1" },
      { 'run.checkpoint_every=-1', "'run.checkpoint_every' must be >= 0, got -1" },
      { 'run.seed=-1', "'run.seed' must be >= 0, got -1" },
      { 'guard.max_skips=-1', "'guard.max_skips' must be >= 0, got -1" },
      { 'guard.window=0', "'guard.window' must be >= 1, got 0" },
      { 'guard.lr_factor=2', "'guard.lr_factor' must be in (0, 1], got 2" },
      { 'dist.zero=4', "'dist.zero' must be in 0..3, got 4" }, { 'dist.shard_group=-1', "'dist.shard_group' must be >= 0, got -1" },
      { 'dist.bucket_mb=0', "'dist.bucket_mb' must be > 0, got 0" } }) do
    t.eq(usage_msg(function() merge({ c[1] }) end), 'config key ' .. c[2])
  end
end)

t.test('a value over a ranged declaration keeps its type and range (config.over)', function()
  local d = ranged.steps
  local over = config.over(d, 30)
  t.eq(over.value, 30); t.eq(over.type, 'integer'); t.eq(over.range.min, 0)
  local plain_slot = config.over(d, config.integer(5))
  t.eq(plain_slot.value, 5); t.eq(plain_slot.range.min, 0)
  t.eq(config.over(ranged.coef, 0.1).range.min, 0, 'an optional number given a default')
  t.eq(config.over(ranged.threads, 'auto').value, 'auto', 'a word')
  t.eq(config.over(d, 'text'), 'text', 'another type replaces it')
  -- a recipe's run keys over the run section's
  t.eq(usage_msg(function() config.merge({ run = { keep_checkpoints = -3 } }, {}) end),
    "config key 'run.keep_checkpoints' must be >= 0, got -3")
  -- moonrl.rl: a recipe extending another, a plain number over a ranged default
  local rl = require('moonrl.rl')
  local merged = rl.merge({ grpo = { steps = d } }, { grpo = { steps = 7 } })
  t.eq(merged.grpo.steps.value, 7); t.eq(merged.grpo.steps.range.min, 0)
  -- an RL recipe's section: its shared keys (steps, clip ...) get their ranges, a key an extension adds too
  local ext = rl.extend('grpo', { name = 'x', config = { grpo = { steps = 5, clip = 0.3 } } })
  t.eq(ext.config.grpo.steps.range.min, 0); t.eq(ext.config.grpo.clip.range.below, 1)
end)

t.test('--show-config lists each range', function()
  local text = config.format(ranged)
  t.truthy(text:find('steps%s+100  %(integer%)  >= 0'), text)
  t.truthy(text:find('top_p%s+1  %(number%)  in %(0, 1%]'), text)
  t.truthy(text:find('threads%s+0  %(integer or auto%)  in 0%.%.64'), text)
  t.truthy(text:find('coef%s+<optional number>  >= 0  %-%- a coefficient'), text)
  t.truthy(text:find('run.keep_checkpoints%s+2  %(integer%)  >= 0'), text)
end)

t.test('format lists every key', function()
  local text = config.format(declared)
  t.truthy(text:find('algo.clip.high', 1, true), 'nested key listed')
  t.truthy(text:find('run.seed', 1, true), 'run section listed')
end)

t.done()
