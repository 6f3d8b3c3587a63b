-- The run's timeline (Chrome trace-event JSON, opens in Perfetto) and
-- TensorBoard scalars.
--
--   moonrl.trace.enable(rank)
--   moonrl.trace.phase('generate', function() ... end)   -- or begin/finish
--   moonrl.trace.write(run_dir .. '/trace.json')
--   moonrl.trace.merge({ text_rank0, text_rank1, ... })   -- one timeline of a job's ranks
--   local tb = moonrl.trace.tensorboard(run_dir .. '/tb')
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
function M.thread_name(name) C.mrl_trace_thread_name(name) end
function M.count() return tonumber(C.mrl_trace_event_count()) end
function M.write(path) moonrl.check(C.mrl_trace_write(path), 2) end

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

-- One trace of several processes' (texts: what M.write wrote in each, with its rank's process
-- track): each one's events shifted onto the earliest one's clock (their otherData.t0_unix_us),
-- so that a job's ranks line up in one timeline in Perfetto. A text that is not such a trace is
-- an error naming it (names[i], default 'trace i').
function M.merge(texts, names)
  local t0s, bodies, first = {}, {}, math.huge
  for i, text in ipairs(texts) do
    local t0 = tonumber(text:match('"t0_unix_us":(%d+)'))
    local a, b = text:find('"traceEvents":[\n', 1, true)
    local z = text:find('\n]}%s*$')
    if not (t0 and b and z) then
      error(string.format('%s: not a moonrl trace (no otherData.t0_unix_us or traceEvents)', names and names[i] or
        ('trace ' .. i)), 2)
    end
    t0s[i], bodies[i] = t0, text:sub(b + 1, z - 1)
    if t0 < first then first = t0 end
  end
  local out = {}
  for i, body in ipairs(bodies) do
    local shift = t0s[i] - first
    if shift ~= 0 then
      body = body:gsub('"ts":([%d%.%-eE+]+)', function(x) return string.format('"ts":%.3f', tonumber(x) + shift) end)
    end
    if body ~= '' then out[#out + 1] = body end
  end
  return string.format('{"displayTimeUnit":"ms","otherData":{"ranks":%d,"t0_unix_us":%.0f},"traceEvents":[\n%s\n]}\n',
    #texts, first == math.huge and 0 or first, table.concat(out, ',\n'))
end

-- Run fn inside a named phase; returns fn's results, and the seconds taken
-- as the last one. The phase is closed even when fn raises.
function M.phase(name, fn, ...)
  C.mrl_trace_begin(name)
  local t0 = moonrl.now()
  local res = { pcall(fn, ...) }
  C.mrl_trace_end(name)
  if not res[1] then error(res[2], 0) end
  res[#res + 1] = moonrl.now() - t0
  return unpack(res, 2, #res)
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
