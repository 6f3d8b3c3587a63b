-- The reward registry: named reward functions, reward(sample) -> number, where
--   sample = { prompt = string, response = string, answer = string|number|nil, meta = table|nil }
--
--   local rewards = require('moonrl.rewards')
--   rewards.register('my_reward', function(sample) return #sample.response < 100 and 1 or 0 end)
--   local fn = rewards.get('math')                 -- a built-in, loaded from plugins/rewards/ on first use
--   local scores, mean = rewards.score_batch('math', samples)   -- double array [#samples]
--   local both = rewards.combine({ { reward = 'math', weight = 1 }, { reward = 'format', weight = 0.1 } })
--
--   rewards.register('short', fn, 'one point under 100 characters')   -- a doc line (or {doc=, replace=})
--   rewards.get('my_rewards.lua:partial')          -- FILE.lua:NAME: the file is run once (its directory
--     on package.path) and NAME is what it returned under that key, or what it registered; as
--     `reward=my_rewards.lua:partial` on the command line (TRL's reward import path). A file given
--     with `moonrl run R --require my_rewards.lua` registers its rewards before the recipe starts.
--
-- Under a time limit (score_batch's opts.timeout, a run's reward.timeout) the samples are scored in
-- forked workers (moonrl.io.workers), each killed when late: what a reward changes in Lua state
-- stays in its worker. register(name, fn, { in_process = true }) keeps a reward in this process.
--
-- Built-ins (plugins/rewards/*.lua, loaded on first use): math (\boxed{} or GSM8K "####" answers
-- compared by value), gsm8k (the same), format (<think>...</think><answer>...</answer>), countdown
-- (arithmetic expression over given numbers), exact (the stripped response equals the answer),
-- code (the response's program run against its tests in the sandbox). Each plugin module also
-- has new{...} for configured variants; register those under a name of your own.
--
-- The library does not require the plugins (they sit above it): get(name) of a built-in asks
-- moonrl.registry.plugin('reward', name) for its module, and the module, loading, registers its
-- rewards with register(name, fn, { builtin = true }).
local ffi = require('ffi')

-- moonrl.registry, required when first needed (as moonrl is: this module loads without the C library)
local function registries() return require('moonrl.registry') end

local M = {}

local registry = {}
local builtins = {} -- name -> fn, as the plugins register them; get() moves one into registry at first use
local in_process = setmetatable({}, { __mode = 'k' }) -- fn -> true: scored in the trainer, never in a worker
local batched = setmetatable({}, { __mode = 'k' }) -- fn -> true: fn(samples) scores them all at once

local function callable(fn)
  if type(fn) == 'function' then return true end
  local mt = getmetatable(fn)
  return type(mt) == 'table' and type(mt.__call) == 'function'
end

-- the built-in rewards: name -> doc line (their plugins load on first use)
local BUILTIN = {
  math = 'the last \\boxed{} (or GSM8K "####") number equals the answer\'s',
  gsm8k = 'the same as math',
  format = '<think>...</think><answer>...</answer>',
  countdown = 'an arithmetic expression over the given numbers reaching the target',
  exact = 'the stripped response equals the answer',
  code = 'the response\'s program passes its tests in the sandbox (stdin/stdout or assertions)',
}
local docs = {}
for name, doc in pairs(BUILTIN) do docs[name] = doc end

-- Register fn under name. opts: a doc line, or { doc = ..., replace = true }; an existing name is an
-- error unless replace is true. { builtin = true }: a built-in's plugin registering it as it loads
-- (what get(name) gives unless a registration replaced it). { in_process = true }: a reward that
-- must run in the trainer's own process (a learned reward on the GPU: a forked worker cannot use
-- the device), one sample after another, rather than in forked workers under reward.timeout.
-- { batch = true }: fn(samples) scores the whole list at once and returns a list of numbers (and,
-- second, a table of numbers for the step's metrics, reward/<name>/...): a reward that runs
-- programs in the sandbox in parallel and keeps its own deadlines (reward.timeout does not apply).
function M.register(name, fn, opts)
  if type(opts) == 'string' then opts = { doc = opts } end
  if type(name) ~= 'string' or name == '' then
    error('rewards.register: name must be a non-empty string, got ' .. tostring(name), 2)
  end
  if not callable(fn) then
    error(string.format("rewards.register: reward '%s' must be a function, got %s", name, type(fn)), 2)
  end
  if opts and opts.in_process then in_process[fn] = true end
  if opts and opts.batch then batched[fn] = true end
  if opts and opts.builtin then
    if not BUILTIN[name] then error(string.format("rewards.register: '%s' is not a built-in reward", name), 2) end
    builtins[name] = fn
    return
  end
  if (registry[name] or BUILTIN[name]) and not (opts and opts.replace) then
    error(string.format("rewards.register: reward '%s' is already registered (pass {replace = true})", name), 2)
  end
  registry[name] = fn
  if opts and opts.doc then docs[name] = opts.doc end
end

-- The doc line of a reward ('' when it has none).
function M.doc(name) return docs[name] or '' end

-- Sorted names of all rewards, registered and built in.
function M.names()
  local seen, out = {}, {}
  for k in pairs(registry) do seen[k] = true end
  for k in pairs(BUILTIN) do seen[k] = true end
  for k in pairs(seen) do out[#out + 1] = k end
  table.sort(out)
  return out
end

-- The reward function registered as name; an unknown name is an error listing the known ones.
function M.get(name)
  local fn = registry[name]
  if fn then return fn end
  if BUILTIN[name] then
    registries().plugin('reward', name) -- registers its built-ins as it loads; its source joins the run's manifest
    fn = builtins[name]
    if not fn then error(string.format("the plugin of reward '%s' did not register it", name), 2) end
    registry[name] = fn
    return fn
  end
  local file, key = registries().split_file_name(name)
  if file then -- FILE.lua:NAME
    local mod = registries().require_file(file, 'reward file')
    fn = type(mod) == 'table' and mod[key] or registry[key]
    if not callable(fn) then
      error(string.format("%s defines no reward '%s' (return a table with a function %s, or register it)", file, key,
        key), 2)
    end
    registry[name] = fn
    return fn
  end
  error(string.format("unknown reward '%s' (known: %s)", tostring(name), table.concat(M.names(), ', ')), 2)
end

local function resolve(r, level)
  if type(r) == 'string' then return M.get(r), r end
  if callable(r) then return r, 'function' end
  error('a reward must be a name or a function, got ' .. type(r), level + 1)
end

local function finite(v) return type(v) == 'number' and v == v and v ~= math.huge and v ~= -math.huge end

-- Call fn(sample) in this process with a time limit (seconds; 0 or nil: none), for a reward
-- registered in_process. Returns ok, value or message. LuaJIT runs compiled code without looking
-- at hooks, so the JIT is off (and its traces flushed) while such rewards run: a loop that never
-- ends is then interrupted (a C call that never returns is not).
local function call_limited(fn, sample, seconds)
  if not seconds or seconds <= 0 then return pcall(fn, sample) end
  local now = require('moonrl').now
  local deadline = now() + seconds
  local timed_out = false
  debug.sethook(function()
    if now() > deadline then
      timed_out = true
      debug.sethook()
      error('timed out', 2)
    end
  end, '', 1000)
  local ok, v = pcall(fn, sample)
  debug.sethook()
  if timed_out then return false, string.format('no result within %g s (reward.timeout)', seconds) end
  return ok, v
end

-- Each sample's outcome: a list of { ok, value or message }. Under a time limit the samples are
-- scored side by side in forked workers (moonrl.io.workers: opts.workers at once), each killed
-- when late, so that a step of rewards that hang costs one timeout, not one a sample; a reward
-- registered in_process runs here, one sample after another.
local function outcomes(fn, samples, opts)
  local n, seconds, got = #samples, opts.timeout, {}
  if batched[fn] then -- (one call for them all; its own deadlines)
    local ok, values, stats = pcall(fn, samples)
    for i = 1, n do
      if not ok then got[i] = { false, values }
      elseif type(values) ~= 'table' then got[i] = { false, 'a batch reward returned ' .. type(values) .. ', not a list' }
      else got[i] = { true, values[i] } end
    end
    return got, ok and type(stats) == 'table' and stats or nil
  end
  if seconds and seconds > 0 and not in_process[fn] then
    local results = require('moonrl.io.workers').map(n, function(i) return fn(samples[i]) end,
      { workers = opts.workers, timeout = seconds })
    for i, r in ipairs(results) do
      if r.ok then got[i] = { true, r.value }
      elseif r.timed_out then got[i] = { false, string.format('no result within %g s (reward.timeout)', seconds) }
      else got[i] = { false, r.message } end
    end
    return got
  end
  if seconds and seconds > 0 then jit.off(); jit.flush() end
  for i = 1, n do got[i] = { call_limited(fn, samples[i], seconds) } end
  if seconds and seconds > 0 then jit.on() end
  return got
end

-- Score a list of samples: returns a double array [n] (or fills out), the mean, and the list of
-- failures ({ index =, message = }). A reward that raises, or returns anything but a finite
-- number, fails that sample: opts.on_error = 'stop' (the default) makes it an error naming the
-- reward and the sample; 'zero' scores it 0; 'drop' scores it 0 too and leaves the caller to drop
-- it (its failures list says which). opts.timeout: seconds each sample may take (0: no limit);
-- opts.workers: samples scored at once under it (16). A batch reward's metrics table comes fourth.
function M.score_batch(reward, samples, out, opts)
  local fn, name = resolve(reward, 2)
  opts = opts or {}
  local on_error = opts.on_error or 'stop'
  local n = #samples
  out = out or ffi.new('double[?]', math.max(n, 1))
  local sum, failures = 0, {}
  local got, stats = outcomes(fn, samples, opts)
  for i = 1, n do
    local ok, v = got[i][1], got[i][2]
    local msg
    if not ok then msg = string.format("reward '%s' failed on sample %d: %s", name, i, tostring(v))
    elseif not finite(v) then
      msg = string.format("reward '%s' returned %s for sample %d (expected a finite number)", name, tostring(v), i)
    end
    if msg then
      if on_error == 'stop' then error(msg, 2) end
      failures[#failures + 1] = { index = i, message = msg }
      v = 0
    end
    out[i - 1] = v
    sum = sum + v
  end
  return out, n > 0 and sum / n or 0, failures, stats
end

-- A weighted sum of rewards: spec = { {reward = name|fn, weight = w}, ... } (weight 1 when absent).
-- The returned function gives the total and, second, a table of each part's unweighted value by
-- name (or position, for functions).
function M.combine(spec)
  if type(spec) ~= 'table' or #spec == 0 then error('rewards.combine: expected a non-empty list of {reward=, weight=}', 2) end
  local parts = {}
  for i, p in ipairs(spec) do
    if type(p) ~= 'table' then error(string.format('rewards.combine: entry %d must be a table {reward=, weight=}', i), 2) end
    local fn, name = resolve(p.reward or p[1], 2)
    local w = p.weight or p[2] or 1
    if type(w) ~= 'number' or w ~= w then error(string.format('rewards.combine: entry %d: weight must be a number', i), 2) end
    parts[i] = { fn = fn, w = w, key = name == 'function' and i or name }
  end
  return function(sample)
    local total, detail = 0, {}
    for _, p in ipairs(parts) do
      local v = p.fn(sample)
      detail[p.key] = v
      total = total + p.w * v
    end
    return total, detail
  end
end

-- Read sample.response (and check the sample is a table); for reward plugins.
function M.response_of(sample, who)
  if type(sample) ~= 'table' then error(who .. ': sample must be a table {prompt=, response=, answer=, meta=}', 3) end
  local r = sample.response
  if type(r) ~= 'string' then error(who .. ': sample.response must be a string, got ' .. type(r), 3) end
  return r
end

return M
