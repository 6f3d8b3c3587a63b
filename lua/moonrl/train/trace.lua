-- The run's timeline (Chrome trace-event JSON, opens in Perfetto) and
-- TensorBoard scalars.
--
--   moonrl.train.trace.enable(rank)
--   moonrl.train.trace.stream(moonrl.train.trace.rank_file(run_dir, rank))  -- each event on disk as it happens
--   moonrl.train.trace.phase('generate', function() ... end)   -- or begin/finish
--   moonrl.train.trace.write(run_dir .. '/trace.json')
--   moonrl.train.trace.merge({ text_rank0, text_rank1, ... })   -- one timeline of a job's ranks
--   moonrl.train.trace.read_events(text, name)                  -- a trace's events, a cut file's too
--   local tb = moonrl.train.trace.tensorboard(run_dir .. '/tb')
--   tb:scalars({ reward = 0.4, kl = 0.01 }, step)
local moonrl = require('moonrl')
local ffi = require('ffi')
local C = moonrl.C

local M = {}

function M.enable(rank) C.mrl_trace_enable(rank or 0) end
function M.disable() C.mrl_trace_disable() end
function M.begin(name) C.mrl_trace_begin(name) end
function M.finish(name) C.mrl_trace_end(name) end
function M.counter(name, value) C.mrl_trace_counter(name, value) end
-- A span already over (start: moonrl.now()'s clock, dur seconds), for spans that overlap.
function M.complete(name, start, dur) C.mrl_trace_complete(name, start, dur) end
function M.thread_name(name) C.mrl_trace_thread_name(name) end
function M.count() return tonumber(C.mrl_trace_event_count()) end
function M.write(path) moonrl.check(C.mrl_trace_write(path), 2) end

-- The file a rank streams its events to, and leaves behind when it does not end with the job
-- (killed, or failing alone): `moonrl trace merge RUN_DIR` joins them into trace.json.
function M.rank_file(dir, rank) return string.format('%s/trace-rank-%d.json', dir, rank or 0) end

-- Append every event to path as it is recorded (mrl_trace_stream). A file that cannot be
-- created is a warning, not a failed run: the trace is still kept in memory. Returns true when
-- streaming.
function M.stream(path)
  if C.mrl_trace_stream(path) == 0 then return true end
  moonrl.log('warn', 'trace: %s', moonrl.last_error())
  return false
end

-- What M.write would write, as a string.
function M.text()
  local tmp = os.tmpname()
  local ok, err = pcall(M.write, tmp)
  local f = ok and io.open(tmp, 'rb')
  local text = f and f:read('*a')
  if f then f:close() end
  os.remove(tmp)
  if not ok then error(err, 0) end
  return text
end

local json = require('moonrl.io.json')
local COMPACT = { item_sep = ',', key_sep = ':' }

-- A trace's events, from what M.write or M.merge wrote or from a stream a killed process left
-- (mrl_trace_stream: no closing "]}", its last line perhaps cut mid-event). Both write one
-- event a line, so each line is decoded alone: a line that is not a whole event (a cut tail, a
-- corrupt line) is dropped and counted, never the whole file. Returns
--   { other = the otherData table (rank or ranks, t0_unix_us), events = { decoded events },
--     dropped = n, first_dropped = line number or nil, complete = ended with "]}",
--     open = { 'name (pid P tid T)', ... }: phases begun and never ended (where it died) }
-- A text that does not begin as a trace is an error naming it (name, default 'trace').
function M.read_events(text, name)
  name = name or 'trace'
  local _, b = text:find('"traceEvents":[\n', 1, true)
  local ok, head = pcall(json.decode, b and (text:sub(1, b) .. ']}') or '', name)
  local other = ok and type(head) == 'table' and head.otherData
  if not (b and type(other) == 'table' and tonumber(other.t0_unix_us)) then
    error(string.format('%s: not a moonrl trace (it does not begin with {"displayTimeUnit":..,"otherData":' ..
      '{.."t0_unix_us":..},"traceEvents":[)', name), 2)
  end
  local out = { other = other, events = {}, dropped = 0, complete = false, open = {} }
  local stacks, line_no = {}, 1
  for line in text:sub(b + 1):gmatch('([^\n]*)\n?') do
    line_no = line_no + 1
    if line == ']}' then out.complete = true; break end
    if line ~= '' then
      local body = line:gsub(',$', '')
      local dok, e = pcall(json.decode, body, name)
      if dok and json.is_object(e) and type(e.ph) == 'string' and (e.ph == 'M' or type(e.ts) == 'number') then
        out.events[#out.events + 1] = e
        local key = tostring(e.pid) .. ' ' .. tostring(e.tid)
        if e.ph == 'B' then
          stacks[key] = stacks[key] or {}
          table.insert(stacks[key], e.name)
        elseif e.ph == 'E' and stacks[key] then
          table.remove(stacks[key])
        end
      else
        out.dropped = out.dropped + 1
        out.first_dropped = out.first_dropped or line_no
      end
    end
  end
  local keys = {}
  for k in pairs(stacks) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local pid, tid = k:match('^(%S+) (%S+)$')
    for _, n in ipairs(stacks[k]) do out.open[#out.open + 1] = string.format('%s (pid %s tid %s)', n, pid, tid) end
  end
  return out
end

-- One trace of several processes' (texts: what M.write wrote in each, with its rank's process
-- track, or what a killed rank's stream left): each one's events shifted onto the earliest
-- one's clock (their otherData.t0_unix_us), so that a job's ranks line up in one timeline in
-- Perfetto. A text that is not such a trace is an error naming it (names[i], default 'trace
-- i'). opts.merged_from: file names recorded in the result's otherData. Returns the text and,
-- per input, what M.read_events found (its events dropped, its phases left open).
function M.merge(texts, names, opts)
  local traces, first = {}, math.huge
  for i, text in ipairs(texts) do
    local ok, r = pcall(M.read_events, text, names and names[i] or ('trace ' .. i))
    if not ok then error(r, 2) end
    traces[i] = r
    first = math.min(first, tonumber(r.other.t0_unix_us))
  end
  local lines = {}
  for _, r in ipairs(traces) do
    local shift = tonumber(r.other.t0_unix_us) - first
    for _, e in ipairs(r.events) do
      -- rounded to the ns: the shortest text of such a double has at most 3 decimals
      if shift ~= 0 and type(e.ts) == 'number' then e.ts = math.floor((e.ts + shift) * 1000 + 0.5) / 1000 end
      lines[#lines + 1] = json.encode(e, COMPACT)
    end
    r.events = #r.events -- the count is what callers want; the tables are no longer needed
  end
  local other = json.object({ 'ranks', #texts, 't0_unix_us', first == math.huge and 0 or first })
  if opts and opts.merged_from then other.merged_from = json.array(opts.merged_from) end
  return string.format('{"displayTimeUnit":"ms","otherData":%s,"traceEvents":[\n%s\n]}\n',
    json.encode(other, COMPACT), table.concat(lines, ',\n')), traces
end

-- Run fn inside a named phase; returns fn's results, and the seconds taken
-- as the last one. The phase is closed even when fn raises.
function M.phase(name, fn, ...)
  C.mrl_trace_begin(name)
  local t0 = moonrl.now()
  -- (counted with select: fn's results may hold nils, which # does not see past)
  local res = (function(...) return { n = select('#', ...), ... } end)(pcall(fn, ...))
  C.mrl_trace_end(name)
  if not res[1] then error(res[2], 0) end
  res.n = res.n + 1
  res[res.n] = moonrl.now() - t0
  return unpack(res, 2, res.n)
end

local TB = {}
TB.__index = TB

function M.tensorboard(dir)
  local out = ffi.new('mrl_tb_writer *[1]')
  moonrl.check(C.mrl_tb_open(dir, out), 2)
  return setmetatable({ handle = ffi.gc(out[0], C.mrl_tb_close), path = ffi.string(C.mrl_tb_path(out[0])) }, TB)
end

function TB:scalar(tag, value, step)
  moonrl.check(C.mrl_tb_scalar(self.handle, tag, value, step), 2)
end

-- Every numeric entry of a (possibly nested) table, tags joined with '/'.
function TB:scalars(values, step, prefix)
  local keys = {}
  for k in pairs(values) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  for _, k in ipairs(keys) do
    local v, tag = values[k], prefix and (prefix .. '/' .. tostring(k)) or tostring(k)
    if type(v) == 'number' then self:scalar(tag, v, step)
    elseif type(v) == 'table' then self:scalars(v, step, tag) end
  end
end

function TB:flush() moonrl.check(C.mrl_tb_flush(self.handle), 2) end

function TB:close()
  if self.handle then
    C.mrl_tb_close(ffi.gc(self.handle, nil))
    self.handle = nil
  end
end

return M
