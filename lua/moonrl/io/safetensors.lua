-- safetensors files from Lua (the C reader / writer in core/io).
--
--   local st = moonrl.io.safetensors.open('model_dir')   -- file or HF model directory
--   for _, name in ipairs(st:names()) do print(name, st:info(name).dtype) end
--   local w = st:read_f32('lm_head.weight')          -- new float[numel] (or pass a dst pointer)
--   local r = st:read_f32_range('lm_head.weight', first, count)  -- a slice: only its bytes are read
--   local wr = moonrl.io.safetensors.writer()
--   wr:add('x', 'BF16', {2, 3}, float_ptr)           -- converted from fp32 on write
--   wr:metadata('format', 'pt'); wr:write('out.safetensors')  -- or wr:write_dir(dir, max_shard_bytes)
--   local s = moonrl.io.safetensors.stream(dir, max_shard_bytes)  -- one tensor at a time:
--   s:declare('x', 'BF16', {2, 3}) ...; s:write('x', float_ptr) ...; s:finish()
local moonrl = require('moonrl')
local ffi = require('ffi')
local C = moonrl.C

local M = {}

local function dtype_of(name, level)
  local d = C.mrl_dtype_parse(tostring(name))
  if d < 0 then error("safetensors: unknown dtype '" .. tostring(name) .. "'", level + 1) end
  return d
end

local Reader = {}
Reader.__index = Reader

function M.open(path)
  local out = ffi.new('mrl_st *[1]')
  moonrl.check(C.mrl_st_open(path, out), 2)
  return setmetatable({ handle = ffi.gc(out[0], C.mrl_st_close) }, Reader)
end

function Reader:count() return tonumber(C.mrl_st_count(self.handle)) end
function Reader:has(name) return C.mrl_st_has(self.handle, name) ~= 0 end

local function info_table(t)
  local shape = {}
  for d = 0, t.ndim - 1 do shape[d + 1] = tonumber(t.shape[d]) end
  return { name = ffi.string(t.name), dtype = ffi.string(C.mrl_dtype_name(t.dtype)), shape = shape,
           numel = tonumber(t.numel), bytes = tonumber(t.bytes), data = t.data, shard = t.shard }
end

-- Names of all tensors, sorted.
function Reader:names()
  local t, out = ffi.new('mrl_st_tensor'), {}
  for i = 0, self:count() - 1 do
    moonrl.check(C.mrl_st_info(self.handle, i, t), 2)
    out[#out + 1] = ffi.string(t.name)
  end
  return out
end

-- {name, dtype = 'BF16', shape = {...}, numel, bytes, data (mapped pointer), shard}
function Reader:info(name)
  local t = ffi.new('mrl_st_tensor')
  moonrl.check(C.mrl_st_find(self.handle, name, t), 2)
  return info_table(t)
end

-- The tensor as fp32 into dst (a float pointer of numel) or a new float array.
function Reader:read_f32(name, dst)
  local t = ffi.new('mrl_st_tensor')
  moonrl.check(C.mrl_st_find(self.handle, name, t), 2)
  dst = dst or ffi.new('float[?]', math.max(1, tonumber(t.numel)))
  moonrl.check(C.mrl_st_read_f32(self.handle, name, dst, t.numel), 2)
  return dst
end

-- Elements [first, first + count) of the tensor (flattened, row-major; first counts from 0) as
-- fp32 into dst (a float pointer of count) or a new float array; only their bytes are read.
function Reader:read_f32_range(name, first, count, dst)
  dst = dst or ffi.new('float[?]', math.max(1, count))
  moonrl.check(C.mrl_st_read_f32_range(self.handle, name, first, count, dst), 2)
  return dst
end

function Reader:metadata(key)
  local v = C.mrl_st_metadata(self.handle, key)
  return v ~= nil and ffi.string(v) or nil
end

local Writer = {}
Writer.__index = Writer

function M.writer()
  local out = ffi.new('mrl_st_writer *[1]')
  moonrl.check(C.mrl_st_writer_create(out), 2)
  return setmetatable({ handle = ffi.gc(out[0], C.mrl_st_writer_free), keep = {} }, Writer)
end

local function shape_array(shape)
  local a = ffi.new('int64_t[8]')
  for i, v in ipairs(shape) do if i <= 8 then a[i - 1] = v end end
  return a, #shape
end

-- fp32 values at src (kept referenced here until the writer is gone), stored as dtype.
function Writer:add(name, dtype, shape, src)
  local a, nd = shape_array(shape)
  moonrl.check(C.mrl_st_writer_add(self.handle, name, dtype_of(dtype, 2), nd, a, src), 2)
  self.keep[#self.keep + 1] = src
end

-- bytes already in dtype.
function Writer:add_raw(name, dtype, shape, data, bytes)
  local a, nd = shape_array(shape)
  moonrl.check(C.mrl_st_writer_add_raw(self.handle, name, dtype_of(dtype, 2), nd, a, data, bytes), 2)
  self.keep[#self.keep + 1] = data
end

function Writer:metadata(key, value)
  moonrl.check(C.mrl_st_writer_set_metadata(self.handle, key, tostring(value)), 2)
end

function Writer:write(path) moonrl.check(C.mrl_st_writer_write(self.handle, path), 2) end
function Writer:write_dir(dir, max_shard_bytes) moonrl.check(C.mrl_st_writer_write_dir(self.handle, dir, max_shard_bytes or 0), 2) end

-- A model directory written one tensor at a time (mrl_st_stream_*): declare every tensor first,
-- then write each once, in any order (declaration order keeps one shard file open); shards of
-- max_shard_bytes (0: none) are filled in declaration order and each is in place as soon as its
-- last tensor is written; finish() writes model.safetensors.index.json.
local Stream = {}
Stream.__index = Stream

function M.stream(dir, max_shard_bytes)
  local out = ffi.new('mrl_st_stream *[1]')
  moonrl.check(C.mrl_st_stream_open(dir, max_shard_bytes or 0, out), 2)
  return setmetatable({ handle = ffi.gc(out[0], C.mrl_st_stream_free), numel = {} }, Stream)
end

function Stream:declare(name, dtype, shape)
  local a, nd = shape_array(shape)
  moonrl.check(C.mrl_st_stream_declare(self.handle, name, dtype_of(dtype, 2), nd, a), 2)
  local n = 1
  for _, v in ipairs(shape) do n = n * v end
  self.numel[name] = n
end

function Stream:metadata(key, value)
  moonrl.check(C.mrl_st_stream_set_metadata(self.handle, key, tostring(value)), 2)
end

-- fp32 values at src (numel of the declared shape; not kept), converted to the declared dtype.
function Stream:write(name, src)
  moonrl.check(C.mrl_st_stream_write(self.handle, name, src, self.numel[name] or 0), 2)
end

-- bytes already in the declared dtype.
function Stream:write_raw(name, data, bytes)
  moonrl.check(C.mrl_st_stream_write_raw(self.handle, name, data, bytes), 2)
end

function Stream:finish() moonrl.check(C.mrl_st_stream_finish(self.handle), 2) end

return M
