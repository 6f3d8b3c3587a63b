-- A run: its directory, its metrics, its timeline.
--
--   local run = moonrl.run.start(cfg, { name = 'grpo' })
--   run:phase('generate', function() ... end)       -- timed, on the trace
--   run:log(step, { reward = { mean = .4, std = .1 }, kl = 0.01, ... })
--   run:finish()
--
-- The directory is cfg.run.dir, or runs/<name>-<YYYYmmdd-HHMMSS> (a suffix
-- is added if it exists). It receives:
--   config.json    the resolved config of the run, and moonrl's version
--   metrics.jsonl  one JSON object per logged step (flattened keys:
--                  "reward/mean"), with "step" and "time" (seconds since start)
--   tb/            TensorBoard event file with the same scalars
--   trace.json     the timeline of phases (Chrome trace-event JSON, Perfetto)
-- Each log() also prints one readable line with the keys that matter most.
local moonrl = require('moonrl')
local json = require('moonrl.json')
local trace = require('moonrl.trace')

local M = {}
local Run = {}
Run.__index = Run

local function exists(path)
  local ok = os.rename(path, path)
  return ok ~= nil
end

local function mkdirs(path)
  local ok = os.execute('mkdir -p "' .. path:gsub('"', '\\"') .. '"')
  if ok ~= 0 and ok ~= true then moonrl.usage_error('cannot create run directory ' .. path) end
end

-- Flatten nested tables of numbers into { ['a/b'] = x }.
local function flatten(t, prefix, out)
  for k, v in pairs(t) do
    local key = prefix and (prefix .. '/' .. tostring(k)) or tostring(k)
    if type(v) == 'table' then flatten(v, key, out)
    elseif type(v) == 'number' or type(v) == 'boolean' or type(v) == 'string' then out[key] = v end
  end
  return out
end
M.flatten = flatten

function M.start(cfg, opts)
  opts = opts or {}
  local name = opts.name or 'run'
  local dir = cfg.run and cfg.run.dir
  if not dir then
    local base = 'runs/' .. name .. '-' .. os.date('%Y%m%d-%H%M%S')
    dir = base
    local n = 1
    while exists(dir) do
      n = n + 1
      dir = base .. '-' .. n
    end
  end
  mkdirs(dir)
  local self = setmetatable({ dir = dir, name = name, t0 = moonrl.now(), step_t0 = moonrl.now(),
                              phases = {}, cfg = cfg, total = opts.total_steps }, Run)
  local v = moonrl.version()
  local meta = json.object({ 'recipe', name, 'moonrl', v.version, 'git', v.git, 'backends', v.backends,
                             'config', cfg })
  local f = assert(io.open(dir .. '/config.json', 'w'))
  f:write(json.encode(meta, { indent = 2 }), '\n')
  f:close()
  self.metrics = assert(io.open(dir .. '/metrics.jsonl', 'a'))
  if opts.tensorboard ~= false then self.tb = trace.tensorboard(dir .. '/tb') end
  trace.enable(opts.rank or 0)
  trace.thread_name('main')
  return self
end

-- Time fn as a phase of the current step (seconds summed per phase name).
function Run:phase(name, fn, ...)
  local res = { trace.phase(name, fn, ...) }
  local secs = table.remove(res)
  self.phases[name] = (self.phases[name] or 0) + secs
  return unpack(res)
end

local function fmt(x)
  if type(x) ~= 'number' then return tostring(x) end
  local a = math.abs(x)
  if a ~= 0 and (a < 1e-3 or a >= 1e5) then return string.format('%.2e', x) end
  return string.format('%.4g', x)
end

-- The readable line: the usual RL keys when present, in a fixed order.
local LINE_KEYS = {
  { 'loss', 'loss' }, { 'reward/mean', 'reward' }, { 'reward/std', '±' }, { 'accuracy', 'acc' },
  { 'response_length/mean', 'len' }, { 'kl', 'kl' }, { 'entropy', 'ent' }, { 'clip_frac', 'clip' },
  { 'grad_norm', 'gnorm' }, { 'lr', 'lr' },
}

function Run:line(step, flat, seconds)
  local parts = { string.format('step %d%s', step, self.total and ('/' .. self.total) or '') }
  for _, kv in ipairs(LINE_KEYS) do
    local v = flat[kv[1]]
    if v ~= nil then
      if kv[2] == '±' then parts[#parts] = parts[#parts] .. '±' .. fmt(v)
      else parts[#parts + 1] = kv[2] .. ' ' .. fmt(v) end
    end
  end
  if flat['tokens_per_s/generate'] then parts[#parts + 1] = 'gen ' .. fmt(flat['tokens_per_s/generate']) .. ' tok/s' end
  if flat['tokens_per_s/train'] then parts[#parts + 1] = 'train ' .. fmt(flat['tokens_per_s/train']) .. ' tok/s' end
  local ph = {}
  local names = {}
  for n in pairs(self.phases) do names[#names + 1] = n end
  table.sort(names)
  for _, n in ipairs(names) do ph[#ph + 1] = string.format('%s %.2f', n, self.phases[n]) end
  parts[#parts + 1] = string.format('%.2fs%s', seconds, #ph > 0 and (' (' .. table.concat(ph, ', ') .. ')') or '')
  return table.concat(parts, ' | ')
end

-- Log one step: metrics (nested tables allowed) plus the phase times since
-- the previous log. Prints one line, appends to metrics.jsonl and TensorBoard.
function Run:log(step, metrics, opts)
  local now = moonrl.now()
  local seconds = now - self.step_t0
  local flat = flatten(metrics or {}, nil, {})
  for n, s in pairs(self.phases) do flat['time/' .. n] = s end
  flat['time/step'] = seconds
  local keys = {}
  for k in pairs(flat) do keys[#keys + 1] = k end
  table.sort(keys)
  local record = json.object({ 'step', step, 'time', now - self.t0 })
  for _, k in ipairs(keys) do record[k] = flat[k] end
  self.metrics:write(json.encode(record), '\n')
  self.metrics:flush()
  if self.tb then
    for _, k in ipairs(keys) do
      if type(flat[k]) == 'number' then self.tb:scalar(k, flat[k], step) end
    end
    self.tb:flush()
  end
  if not (opts and opts.quiet) then print(self:line(step, flat, seconds)) end
  self.phases = {}
  self.step_t0 = now
  return flat
end

-- Close the files and write the timeline. Safe to call twice.
function Run:finish()
  if self.finished then return end
  self.finished = true
  self.metrics:close()
  if self.tb then self.tb:close() end
  trace.write(self.dir .. '/trace.json')
  trace.disable()
end

return M
