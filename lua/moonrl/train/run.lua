-- A run: its directory, its metrics, its events, its timeline.
--
--   local run = moonrl.train.run.start(cfg, { name = 'grpo' })
--   run:phase('generate', function() ... end)       -- timed, on the trace
--   run:log(step, { reward = { mean = .4, std = .1 }, kl = 0.01, ... })
--   run:event('rollback', { step = 12, detector = 'grad_spike' })
--   run:finish()
--
-- The directory is cfg.run.dir, or runs/<name>-<YYYYmmdd-HHMMSS> (a suffix is added if it
-- exists). It is created with mkdir(2), never through a shell, and locked (RUN_DIR/.lock, an
-- flock that a killed process releases) for as long as the run lives: a second run in the same
-- directory is refused. A directory that already holds files is refused too, unless it holds a
-- moonrl run that this one resumes (moonrl.train.session). It receives:
--   config.json    the resolved config of the run, and moonrl's version
--   metrics.jsonl  one JSON object per logged step (flattened keys:
--                  "reward/mean"), with "step" and "time" (seconds since start)
--   events.jsonl   skips, rollbacks, restarts, stops, errors: one JSON object a line, never cut
--   tb/            TensorBoard event file with the same scalars
--   trace.json     the timeline of phases (Chrome trace-event JSON, Perfetto)
-- Each log() also prints one readable line with the keys that matter most. A write that fails
-- (a full disk) is an error naming the file, or with cfg.run.checkpoint_errors = 'warn' a
-- warning once, and the run goes on.
local moonrl = require('moonrl')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')
local trace = require('moonrl.train.trace')
local ffi = require('ffi')
local C = moonrl.C
local supervise_beat = moonrl.C.mrl_heartbeat

local M = {}
local Run = {}
Run.__index = Run

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

-- What a directory found at the run's path holds: 'empty', 'run' (a moonrl run: config.json,
-- metrics or checkpoints) or 'other'.
local function contents(dir)
  local names = fs.list(dir)
  local n, run = 0, false
  for _, name in ipairs(names) do
    if name ~= '.lock' then n = n + 1 end
    if name == 'checkpoints' or name == 'metrics.jsonl' or name == 'events.jsonl' then run = true end
  end
  if n == 0 then return 'empty' end
  return run and 'run' or 'other'
end

-- Create (or, to resume, reopen) the run directory and lock it. Returns dir, lock, what it held
-- ('new' or 'run'). opts.reuse: a directory holding a run may be reopened.
function M.open_dir(cfg, name, opts)
  opts = opts or {}
  local dir = cfg.run and cfg.run.dir
  if not dir then
    local base = 'runs/' .. name .. '-' .. os.date('%Y%m%d-%H%M%S')
    dir = base
    fs.mkdirs('runs')
    local n = 1
    -- mkdir is the test: of two runs started in the same second, one gets -2
    while not fs.mkdir(dir) do
      n = n + 1
      dir = base .. '-' .. n
    end
  else
    local ok, err = pcall(fs.mkdirs, dir)
    if not ok then moonrl.usage_error('cannot create run directory ' .. dir .. ': ' .. tostring(err)) end
  end
  local ok, lock = pcall(fs.lock, dir .. '/.lock')
  if not ok then moonrl.usage_error('run directory ' .. tostring(lock)) end
  local held = contents(dir)
  if held == 'other' then
    lock:release()
    moonrl.usage_error(string.format('run directory %s is not empty and holds no moonrl run: choose another run.dir', dir))
  end
  if held == 'run' and not opts.reuse then
    lock:release()
    moonrl.usage_error(string.format('run directory %s already holds a run: pass run.resume=auto to continue it, ' ..
      'or choose another run.dir', dir))
  end
  return dir, lock, held == 'run' and 'run' or 'new'
end

-- opts: name, total_steps, tensorboard (true), rank (0); dir and lock from open_dir (else it is
-- called here); metrics_bytes: cut metrics.jsonl to this length first (a resumed run drops the
-- lines of the steps it will redo).
-- A run file opened for appending; anything but a regular file there (a FIFO, whose open would
-- wait for a reader) is a usage error naming it.
local function append(path)
  local f, err = fs.open_append(path)
  if not f then moonrl.usage_error('run.dir: ' .. tostring(err)) end
  return f
end

function M.start(cfg, opts)
  opts = opts or {}
  local name = opts.name or 'run'
  local dir, lock = opts.dir, opts.lock
  if not dir and not opts.silent then dir, lock = M.open_dir(cfg, name) end
  local self = setmetatable({ dir = dir, lock = lock, name = name, rank = opts.rank or 0, t0 = moonrl.now(), step_t0 = moonrl.now(),
                              world_size = opts.world_size or 1, phases = {}, mem_phases = {}, cfg = cfg,
                              total = opts.total_steps, write_errors = 0,
                              on_error = cfg.run and cfg.run.checkpoint_errors or 'stop' }, Run)
  -- the ranks but 0 of a job of several: the same calls, nothing written or printed (rank 0
  -- writes the run's files once)
  if opts.silent then -- (it traces its phases for the job's merged timeline: Run:finish)
    self.silent = true
    trace.enable(opts.rank or 0)
    trace.thread_name('main')
    if dir then trace.stream(trace.rank_file(dir, self.rank)) end -- left behind if this rank is killed
    return self
  end
  local v = moonrl.version()
  local meta = json.object({ 'recipe', name, 'moonrl', v.version, 'git', v.git, 'backends', v.backends,
                             'world_size', opts.world_size or 1, 'config', cfg })
  self:guarded_write(dir .. '/config.json', function() fs.write(dir .. '/config.json', json.encode(meta, { indent = 2 }) .. '\n') end)
  local mpath = dir .. '/metrics.jsonl'
  -- (a FIFO left there is an error naming it: opening one would wait for a reader)
  self.metrics = append(mpath)
  self.events = append(dir .. '/events.jsonl')
  local st = fs.stat(mpath)
  if st and opts.metrics_bytes and st.size > opts.metrics_bytes then fs.truncate(mpath, opts.metrics_bytes) end
  -- (a checkpoint records the count: a resume checks that its cut keeps as many)
  self.metrics_lines = require('moonrl.train.checkpoint').count_lines(mpath)
  if opts.tensorboard ~= false then self.tb = trace.tensorboard(dir .. '/tb') end
  trace.enable(opts.rank or 0)
  trace.thread_name('main')
  trace.stream(trace.rank_file(dir, self.rank))
  return self
end

-- Run fn (which writes path); a failure is an error, or a warning with checkpoint_errors=warn.
-- Returns true when the write went through.
function Run:guarded_write(path, fn)
  local ok, err = pcall(fn)
  if ok then return true end
  self.write_errors = self.write_errors + 1
  local msg = string.format('cannot write %s: %s', path, moonrl.error_text(err))
  if self.on_error ~= 'warn' then moonrl.run_error(msg) end
  if self.write_errors <= 3 then moonrl.log('warn', '%s (run.checkpoint_errors=warn: going on)', msg) end
  return false
end

-- Write one line to an open file of the run, checking that it reached the kernel.
local function write_line(f, path, text)
  local ok, err = f:write(text, '\n')
  if ok then ok, err = f:flush() end
  if not ok then error(path .. ': ' .. tostring(err), 0) end
end

-- Time fn as a phase of the current step (seconds summed per phase name). A supervisor hears
-- a heartbeat as each phase begins and ends; the fault injection gets its chance to fire.
-- ---- memory: what moonrl's allocations hold per category, and peaks per step and phase -------

local MB = 2 ^ 20
local mem_stats = ffi.new('mrl_mem_stats')
local CATEGORIES = { 'params', 'grads', 'optim', 'activations', 'kv_cache', 'other' }

-- Peaks of a top-level phase (a phase inside another is measured with it): moonrl's accounted
-- bytes (mrl_mem: params, grads, optimizer state, activations, KV cache) and the resident set.
local function mem_begin(self)
  self.mem_depth = (self.mem_depth or 0) + 1
  if self.mem_depth > 1 then return end
  C.mrl_mem_get_stats(mem_stats)
  self.mem_step_peak = math.max(self.mem_step_peak or 0, tonumber(mem_stats.total_peak))
  self.rss_step_peak = math.max(self.rss_step_peak or 0, tonumber(C.mrl_mem_rss_peak()))
  C.mrl_mem_reset_peak()
  C.mrl_mem_reset_rss_peak()
end

local function mem_end(self, name)
  self.mem_depth = self.mem_depth - 1
  if self.mem_depth > 0 then return end
  C.mrl_mem_get_stats(mem_stats)
  local peak, rss = tonumber(mem_stats.total_peak), tonumber(C.mrl_mem_rss_peak())
  self.mem_step_peak = math.max(self.mem_step_peak or 0, peak)
  self.rss_step_peak = math.max(self.rss_step_peak or 0, rss)
  local p = self.mem_phases[name] or {}
  p.peak_mb, p.rss_peak_mb = math.max(p.peak_mb or 0, peak / MB), math.max(p.rss_peak_mb or 0, rss / MB)
  self.mem_phases[name] = p
end

-- The step's memory metrics (memory/...: MiB), and the peaks start again.
local function mem_metrics(self, flat)
  C.mrl_mem_get_stats(mem_stats)
  for i, c in ipairs(CATEGORIES) do flat['memory/' .. c .. '_mb'] = tonumber(mem_stats.current[i - 1]) / MB end
  flat['memory/peak_mb'] = math.max(self.mem_step_peak or 0, tonumber(mem_stats.total_peak)) / MB
  flat['memory/rss_mb'] = tonumber(C.mrl_mem_rss()) / MB
  flat['memory/rss_peak_mb'] = math.max(self.rss_step_peak or 0, tonumber(C.mrl_mem_rss_peak())) / MB
  C.mrl_mem_get_device_stats(mem_stats) -- a GPU's memory (all zero without one): memory/gpu/...
  if mem_stats.total_peak > 0 then
    for i, c in ipairs(CATEGORIES) do flat['memory/gpu/' .. c .. '_mb'] = tonumber(mem_stats.current[i - 1]) / MB end
    flat['memory/gpu/peak_mb'] = tonumber(mem_stats.total_peak) / MB
  end
  for name, p in pairs(self.mem_phases) do
    flat['memory/phase/' .. name .. '/peak_mb'] = p.peak_mb
    flat['memory/phase/' .. name .. '/rss_peak_mb'] = p.rss_peak_mb
  end
  self.mem_phases, self.mem_step_peak, self.rss_step_peak = {}, 0, 0
  if (self.mem_depth or 0) == 0 then
    C.mrl_mem_reset_peak()
    C.mrl_mem_reset_rss_peak()
  end
end

function Run:phase(name, fn, ...)
  supervise_beat('phase ' .. name .. ' step ' .. tostring(self.step or '?'))
  if self.on_phase then self.on_phase(name) end
  mem_begin(self)
  -- (counted with select: fn's results may hold nils, which # does not see past)
  local res = (function(...) return { n = select('#', ...), ... } end)(pcall(trace.phase, name, fn, ...))
  mem_end(self, name)
  if not res[1] then error(res[2], 0) end
  local secs = res[res.n]
  self.phases[name] = (self.phases[name] or 0) + secs
  supervise_beat('done ' .. name .. ' step ' .. tostring(self.step or '?'))
  return unpack(res, 2, res.n - 1)
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
  { 'eval_loss', 'eval loss' }, { 'eval/accuracy', 'held-out acc' },
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
  for _, kv in ipairs({ { 'guard/skipped', 'skipped' }, { 'guard/rollback', 'rollback' },
      { 'reward/dropped_groups', 'dropped groups' } }) do
    local v = flat[kv[1]]
    if v and v ~= 0 then parts[#parts + 1] = kv[2] .. ' ' .. tostring(v) end
  end
  local ph = {}
  local names = {}
  for n in pairs(self.phases) do names[#names + 1] = n end
  table.sort(names)
  for _, n in ipairs(names) do ph[#ph + 1] = string.format('%s %.2f', n, self.phases[n]) end
  if flat['memory/rss_peak_mb'] then parts[#parts + 1] = string.format('mem %.0f MB', flat['memory/rss_peak_mb']) end
  if flat['memory/gpu/peak_mb'] then -- where a GPU's memory went (MiB now; the peak of the step)
    local g = {}
    for _, kv in ipairs({ { 'params', 'params' }, { 'grads', 'grads' }, { 'optim', 'optim' },
      { 'activations', 'act' }, { 'kv_cache', 'kv' } }) do
      g[#g + 1] = string.format('%s %.0f', kv[2], flat['memory/gpu/' .. kv[1] .. '_mb'])
    end
    parts[#parts + 1] = string.format('gpu %.0f MB (%s)', flat['memory/gpu/peak_mb'], table.concat(g, ' '))
  end
  parts[#parts + 1] = string.format('%.2fs%s', seconds, #ph > 0 and (' (' .. table.concat(ph, ', ') .. ')') or '')
  return table.concat(parts, ' | ')
end

-- Log one step: metrics (nested tables allowed) plus the phase times since
-- the previous log. Prints one line, appends to metrics.jsonl and TensorBoard.
-- opts.quiet: no line; opts.rank_max(x): x's maximum over the job's ranks.
function Run:log(step, metrics, opts)
  local now = moonrl.now()
  local seconds = now - self.step_t0
  local flat = flatten(metrics or {}, nil, {})
  for n, s in pairs(self.phases) do flat['time/' .. n] = s end
  flat['time/step'] = seconds
  -- (rollouts on servers: the share of the step their weight sync took)
  if flat['engine/sync_seconds'] and seconds > 0 then flat['engine/sync_share'] = flat['engine/sync_seconds'] / seconds end
  mem_metrics(self, flat)
  -- the largest resident peak of the step over the ranks: opts.rank_max is the job's max-reduction,
  -- which every rank takes here, the silent ones too (moonrl.train.session); alone, this process's
  local peak = flat['memory/rss_peak_mb']
  flat['memory/max_rank_peak_mb'] = opts and opts.rank_max and opts.rank_max(peak) or peak
  local keys = {}
  for k in pairs(flat) do keys[#keys + 1] = k end
  table.sort(keys)
  if self.silent then self.phases, self.step_t0 = {}, now; return flat end
  local record = json.object({ 'step', step, 'time', now - self.t0 })
  for _, k in ipairs(keys) do record[k] = flat[k] end
  local mpath = self.dir .. '/metrics.jsonl'
  if self:guarded_write(mpath, function() write_line(self.metrics, mpath, json.encode(record)) end) then
    self.metrics_lines = self.metrics_lines + 1
  end
  if self.tb then
    self:guarded_write(self.dir .. '/tb', function()
      for _, k in ipairs(keys) do
        if type(flat[k]) == 'number' then self.tb:scalar(k, flat[k], step) end
      end
      self.tb:flush()
    end)
  end
  if not (opts and opts.quiet) then print(self:line(step, flat, seconds)) end
  self.phases = {}
  self.step_t0 = now
  return flat
end

-- The size of metrics.jsonl now (what a checkpoint records, to cut it back on resume).
function Run:metrics_bytes()
  if self.silent then return 0 end
  self.metrics:flush()
  local st = fs.stat(self.dir .. '/metrics.jsonl')
  return st and st.size or 0
end

-- One event: a line of events.jsonl (kind, time, pid and the fields), an instant on the trace,
-- and a warning on stderr unless opts.quiet.
function Run:event(kind, fields, opts)
  if self.silent then return end
  local record = json.object({ 'event', kind, 'time', os.time(), 'pid', tonumber(moonrl.C.mrl_process_id()) })
  local keys = {}
  for k in pairs(fields or {}) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do record[k] = fields[k] end
  local text = json.encode(record, { tostring = tostring })
  local path = self.dir .. '/events.jsonl'
  if self.events then self:guarded_write(path, function() write_line(self.events, path, text) end) end
  trace.begin('event ' .. kind)
  trace.finish('event ' .. kind)
  if not (opts and opts.quiet) then moonrl.log('warn', '%s: %s', kind, text) end
end

-- Close the files and write the timeline. Safe to call twice. opts.job: the job's communicator
-- (dist.current(), every rank calling this together at a clean end): the ranks' timelines are
-- merged into one trace.json, one process track per rank, and the ranks' streams
-- (trace-rank-R.json, trace.stream) removed. Without it, a process alone writes trace.json, and
-- each rank of a job that ends alone (a failure) its whole trace-rank-R.json, as a killed rank
-- leaves its stream: `moonrl trace merge RUN_DIR` joins them.
function Run:finish(opts)
  if self.finished then return end
  self.finished = true
  if not self.silent then
    self.metrics:close()
    self.events:close()
    if self.tb then pcall(self.tb.close, self.tb) end
  end
  local job = opts and opts.job
  if job and job.size > 1 then
    local ok, text = pcall(trace.text)
    local all = job:gather_strings(ok and text or '')
    if not self.silent then
      local texts = {}
      for _, t in ipairs(all) do if t ~= '' then texts[#texts + 1] = t end end
      local path = self.dir .. '/trace.json'
      if self:guarded_write(path, function() fs.write(path, (trace.merge(texts))) end) then
        for r = 0, job.size - 1 do os.remove(trace.rank_file(self.dir, r)) end
      end
    end
  elseif not self.silent and self.world_size <= 1 then
    if self:guarded_write(self.dir .. '/trace.json', function() trace.write(self.dir .. '/trace.json') end) then
      os.remove(trace.rank_file(self.dir, self.rank))
    end
  elseif self.dir then
    pcall(trace.write, trace.rank_file(self.dir, self.rank))
  end
  trace.disable()
  if self.lock then self.lock:release() end
end

return M
