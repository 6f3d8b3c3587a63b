-- The run's timeline (Chrome trace-event JSON, opens in Perfetto) and
-- TensorBoard scalars.
--
--   moonrl.trace.enable(rank)
--   moonrl.trace.phase('generate', function() ... end)   -- or begin/finish
--   moonrl.trace.write(run_dir .. '/trace.json')
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
