-- moonrl status: where a run is, from its directory: usable on a running job from another
-- terminal (it only reads files), and on a finished one.
--   moonrl status RUN_DIR [--json] [--watch [SECONDS]]
-- It reads RUN_DIR/status/rank-<R>.json (each rank's heartbeat, written by moonrl.train.session: the
-- loop, step, rate, ETA, phase in progress, its place in a dist.tp / dist.cp mesh; see moonrl.io.progress), the tail of metrics.jsonl (the
-- last logged step), the tail of events.jsonl (checkpoints, skips, rollbacks, restarts) and
-- checkpoints/. A run whose heartbeat says running but whose process is gone (on this host) is
-- shown as not running. Exit status 0, or 2 when RUN_DIR is missing or holds no moonrl run.
local ffi = require('ffi')
local moonrl = require('moonrl')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')
local progress = require('moonrl.io.progress')
pcall(ffi.cdef, 'int kill(int pid, int sig);')

local M = {}

local USAGE = [=[
usage: moonrl status RUN_DIR [--json] [--watch [SECONDS]]
  the run's state, loop, step, rate and ETA, the phase in progress and for how long, the last
  logged metrics, each rank's heartbeat and memory, the latest checkpoint and the events so far;
  --json: the same as one JSON object; --watch: again every SECONDS (default 2) until it ends]=]

-- A run file opened for reading, or nil when there is none; anything but a regular file there (a
-- FIFO, whose open would wait for a writer; a device) is a usage error naming it, never a wait.
local function open(path)
  if not fs.exists(path) then return nil end
  local f, err = fs.open(path)
  if not f then moonrl.usage_error('status: ' .. err) end
  return f
end

local function read(path)
  local f = open(path)
  if not f then return nil end
  local text = f:read('*a')
  f:close()
  return text
end

-- The last `bytes` of a file as complete lines (the first, cut, dropped).
local function tail_lines(path, bytes)
  local f = open(path)
  if not f then return {} end
  local size = f:seek('end')
  local from = math.max(0, size - bytes)
  f:seek('set', from)
  local text = f:read('*a') or ''
  f:close()
  local lines = {}
  for line in text:gmatch('[^\n]+') do lines[#lines + 1] = line end
  if from > 0 then table.remove(lines, 1) end
  return lines
end

local function decode_lines(lines)
  local out = {}
  for _, l in ipairs(lines) do
    local ok, v = pcall(json.decode, l, 'line')
    if ok and type(v) == 'table' then out[#out + 1] = v end
  end
  return out
end

local function alive(pid)
  if ffi.C.kill(pid, 0) == 0 then return true end
  return ffi.errno() ~= 3 -- ESRCH: no such process (EPERM: it is there)
end

local function ago(t, now)
  if type(t) ~= 'number' then return '?' end
  local s = now - t
  if s < 60 then return string.format('%.1f s ago', math.max(s, 0)) end
  return progress.duration(s) .. ' ago'
end

local function fmt(x)
  if type(x) ~= 'number' then return tostring(x) end
  local a = math.abs(x)
  if a ~= 0 and (a < 1e-3 or a >= 1e5) then return string.format('%.3e', x) end
  return string.format('%.4g', x)
end

-- The fields of a heartbeat file (moonrl.io.progress's status_writer) and their types: a file
-- that is not a JSON object, or holds a field of another type, is garbage, and an error naming the
-- file and field, not something to render (once: an internal error in string.format).
local HEARTBEAT = { rank = 'count', pid = 'count', world_size = 'count', attempt = 'count', step = 'count',
  global_step = 'count', total = 'count', started = 'number', time = 'number', loop_since = 'number',
  phase_since = 'number', rate = 'number', eta = 'number', loss = 'number', host = 'string', state = 'string',
  recipe = 'string', loop = 'string', phase = 'string', message = 'string', rss_mb = 'number', rss_peak_mb = 'number',
  mesh = 'string' }
local WANT = { count = 'an integer >= 0', number = 'a finite number', string = 'a string' }

local function finite(v) return type(v) == 'number' and v == v and math.abs(v) < math.huge end

local function heartbeat(path)
  local text, err = fs.read(path) -- (a FIFO is refused, not waited on)
  if not text then moonrl.usage_error('status: ' .. err) end
  local ok, r = pcall(json.decode, text, path)
  if not ok then moonrl.usage_error('status: ' .. moonrl.error_text(r)) end
  if not json.is_object(r) then moonrl.usage_error(string.format('status: %s: not a JSON object (a heartbeat)', path)) end
  for _, k in ipairs(json.keys(r)) do
    local v, want = r[k], HEARTBEAT[k]
    local fits = want == nil or (want == 'string' and type(v) == 'string') or (want == 'number' and finite(v)) or
      (want == 'count' and finite(v) and v >= 0 and v == math.floor(v))
    if not fits then
      moonrl.usage_error(string.format("status: %s: field '%s' must be %s, got %s", path, k, WANT[want],
        type(v) == 'string' and string.format('%q', v) or type(v) == 'table' and 'a ' .. type(v) or tostring(v)))
    end
  end
  return r
end

local METRIC_KEYS = { 'loss', 'reward/mean', 'accuracy', 'heldout_accuracy', 'kl', 'entropy', 'clip_frac', 'grad_norm',
  'lr', 'response_length/mean', 'tokens_per_s/generate', 'tokens_per_s/train', 'time/step' }

-- Everything the command shows, as one table (--json prints it).
function M.collect(dir)
  local st = fs.stat(dir)
  if not st then moonrl.usage_error('status: no such run directory: ' .. dir) end
  if not st.is_dir then moonrl.usage_error('status: ' .. dir .. ' is not a directory') end
  local has = {}
  for _, name in ipairs(fs.list(dir)) do has[name] = true end
  if not (has['config.json'] or has['metrics.jsonl'] or has['events.jsonl'] or has['status'] or has['checkpoints']) then
    moonrl.usage_error('status: ' .. dir .. ' is not a moonrl run directory (no config.json, metrics.jsonl, ' ..
      'events.jsonl, status/ or checkpoints/)')
  end
  local now = progress.wall()
  local info = json.object({ 'dir', dir, 'now', now })
  local okc, config = pcall(json.decode, read(dir .. '/config.json') or '', 'config.json')
  info.recipe = okc and type(config) == 'table' and config.recipe or nil
  -- the ranks' heartbeats
  local ranks = json.array()
  if has['status'] then
    for _, name in ipairs(fs.list(dir .. '/status')) do
      if name:match('^rank%-%d+%.json$') then ranks[#ranks + 1] = heartbeat(dir .. '/status/' .. name) end
    end
    table.sort(ranks, function(a, b) return (a.rank or 0) < (b.rank or 0) end)
  end
  local host = progress.hostname()
  for _, r in ipairs(ranks) do
    if r.state == 'running' and r.host == host and type(r.pid) == 'number' and not alive(r.pid) then
      r.state, r.gone = 'gone', true
    end
  end
  info.ranks = ranks
  local lead = ranks[1]
  info.recipe = info.recipe or (lead and lead.recipe)
  -- the last logged steps
  local metrics = decode_lines(tail_lines(dir .. '/metrics.jsonl', 65536))
  local last = metrics[#metrics]
  if last then
    local mst = fs.stat(dir .. '/metrics.jsonl')
    info.metrics = last
    info.metrics_written = mst and mst.mtime
    if #metrics >= 2 and not (lead and lead.rate) then -- a rate from the log (no heartbeat file)
      local first = metrics[math.max(1, #metrics - 20)]
      local function num(v) return finite(v) and v or 0 end -- (a line written by something else: no rate)
      local dt = num(last.time) - num(first.time)
      if dt > 0 then info.log_rate = (num(last.step) - num(first.step)) / dt end
    end
  end
  -- events
  local events = decode_lines(tail_lines(dir .. '/events.jsonl', 262144))
  local counts = json.object()
  local notable
  for _, e in ipairs(events) do
    local k = tostring(e.event)
    counts[k] = (counts[k] or 0) + 1
    if k ~= 'checkpoint' and k ~= 'data_parallel' and k ~= 'heldout_accuracy' then notable = e end
  end
  info.events, info.last_event = counts, notable
  -- the state: the heartbeat's, else what the events say
  local state = lead and lead.state
  if not state then
    local e = events[#events]
    state = e and (e.event == 'finish' and 'finished' or e.event == 'error' and 'error' or e.event == 'stop' and 'stopped')
      or 'unknown'
  end
  info.state = state
  -- the latest checkpoint
  if has['checkpoints'] then
    local names = require('moonrl.train.checkpoint').list(dir .. '/checkpoints')
    if #names > 0 then
      local cst = fs.stat(dir .. '/checkpoints/' .. names[#names] .. '/manifest.json')
      info.checkpoint = json.object({ 'name', names[#names], 'time', cst and cst.mtime or json.null })
    end
  end
  return info
end

function M.render(info)
  local out = {}
  local function line(...) out[#out + 1] = string.format(...) end
  local now = info.now
  local lead = info.ranks[1]
  local head = string.format('run %s: %s', info.dir, info.recipe and ('recipe ' .. info.recipe) or 'recipe ?')
  if lead then
    local s = lead.state
    if s == 'running' then
      head = head .. string.format(', running (pid %d on %s, heartbeat %s)', lead.pid or -1, tostring(lead.host),
        ago(lead.time, now))
    elseif s == 'gone' then
      head = head .. string.format(', NOT RUNNING: process %d on %s is gone without a word (killed?); last heartbeat %s',
        lead.pid or -1, tostring(lead.host), ago(lead.time, now))
    else
      head = head .. string.format(', %s %s%s', s, ago(lead.time, now), lead.message and (': ' .. lead.message) or '')
    end
    if (lead.attempt or 0) > 0 then head = head .. string.format(', attempt %d', lead.attempt) end
  else
    head = head .. ', ' .. info.state .. ' (no heartbeat file: a run of an older moonrl, or not started yet)'
  end
  line('%s', head)
  if lead and lead.loop then
    local parts = { string.format('%s: step %d/%s', lead.loop == 'main' and 'loop' or lead.loop, lead.step or 0,
      tostring(lead.total or '?')) }
    if lead.total and lead.total > 0 then parts[1] = parts[1] .. string.format(' (%d%%)', math.floor(100 * (lead.step or 0) / lead.total)) end
    if lead.rate then parts[#parts + 1] = string.format('%.3g step/s', lead.rate) end
    if lead.state == 'running' and lead.eta then parts[#parts + 1] = 'ETA ' .. progress.duration(lead.eta) end
    if lead.loss then parts[#parts + 1] = 'loss ' .. fmt(lead.loss) end
    if lead.started then parts[#parts + 1] = 'started ' .. ago(lead.started, now) end
    line('%s', table.concat(parts, ', '))
  elseif info.log_rate then
    line('rate: %.3g step/s (from metrics.jsonl)', info.log_rate)
  end
  if lead and lead.state == 'running' then
    local loop = lead.loop and string.format('%s for %s', lead.loop, progress.duration(now - (lead.loop_since or now)))
      or 'starting'
    if lead.phase then
      line('phase: %s > %s for %.1f s (step %d)', loop, lead.phase, now - (lead.phase_since or now), lead.step or 0)
    else
      line('phase: %s (step %d; no timed phase in progress)', loop, lead.step or 0)
    end
  end
  local m = info.metrics
  if m then
    local parts = {}
    for _, k in ipairs(METRIC_KEYS) do
      if type(m[k]) == 'number' then parts[#parts + 1] = k .. ' ' .. fmt(m[k]) end
    end
    if #parts == 0 then
      for _, k in ipairs(json.keys(m)) do
        if k ~= 'step' and k ~= 'time' and type(m[k]) == 'number' and #parts < 8 then parts[#parts + 1] = k .. ' ' .. fmt(m[k]) end
      end
    end
    line('last metrics (step %s, written %s): %s', tostring(m.step), ago(info.metrics_written, now),
      #parts > 0 and table.concat(parts, ' | ') or '(none)')
  end
  if #info.ranks > 1 or (lead and (lead.world_size or 1) > 1) then
    local parts = {}
    for _, r in ipairs(info.ranks) do
      parts[#parts + 1] = string.format('%d%s: %s step %s%s, %s', r.rank or -1, r.mesh and (' (' .. r.mesh .. ')') or '',
        r.state or '?', tostring(r.global_step or r.step or 0), r.phase and (' ' .. r.phase) or '', ago(r.time, now))
    end
    line('ranks (%d of %d): %s', #info.ranks, lead and lead.world_size or #info.ranks, table.concat(parts, ' | '))
  end
  -- each rank's resident memory at its last heartbeat and its peak (a heartbeat of an older
  -- moonrl has neither)
  local mem = {}
  for _, r in ipairs(info.ranks) do
    if r.rss_mb or r.rss_peak_mb then
      mem[#mem + 1] = string.format('%d: %s MB (peak %s MB)', r.rank or -1, r.rss_mb and string.format('%.0f', r.rss_mb) or '?',
        r.rss_peak_mb and string.format('%.0f', r.rss_peak_mb) or '?')
    end
  end
  if #mem > 0 then line('memory (resident, per rank): %s', table.concat(mem, ' | ')) end
  if info.checkpoint then
    line('checkpoint: %s (written %s)', info.checkpoint.name, ago(info.checkpoint.time ~= json.null and info.checkpoint.time or nil, now))
  end
  local ev = {}
  for _, k in ipairs(json.keys(info.events)) do ev[#ev + 1] = k .. ' ' .. info.events[k] end
  if #ev > 0 then
    local e = info.last_event
    local last = ''
    if e then
      local detail = e.message or e.cause or e.detector or e.checkpoint
      last = string.format('; last: %s%s%s (%s)', tostring(e.event), type(e.step) == 'number' and (' at step ' .. e.step) or '',
        detail and (': ' .. tostring(detail)) or '', ago(e.time, now))
    end
    line('events: %s%s', table.concat(ev, ', '), last)
  end
  return table.concat(out, '\n')
end

function M.main(args)
  local dir, as_json, watch
  local i = 1
  while i <= #args do
    local a = args[i]
    if a == '--json' then as_json = true
    elseif a == '--watch' or a == '-w' then
      watch = 2
      if tonumber(args[i + 1]) then watch = tonumber(args[i + 1]); i = i + 1 end
      if not (watch > 0 and watch < math.huge) then moonrl.usage_error('status: --watch expects seconds > 0') end
    elseif a == '-h' or a == '--help' then print(USAGE) return 0
    elseif a:sub(1, 1) == '-' then moonrl.usage_error(string.format("status: unknown option '%s'\n%s", a, USAGE))
    elseif dir then moonrl.usage_error('status: one run directory at a time\n' .. USAGE)
    else dir = a end
    i = i + 1
  end
  if not dir then moonrl.usage_error(USAGE) end
  while true do
    local info = M.collect(dir)
    local text = as_json and json.encode(info, { tostring = tostring }) or M.render(info)
    if watch and not as_json and progress.isatty(1) then io.write('\27[H\27[2J') end
    print(text)
    io.flush()
    if not watch or info.state ~= 'running' then return 0 end
    local ok = pcall(moonrl.sleep, watch)
    if not ok then return 0 end -- Ctrl-C ends the watch
  end
end

return M
