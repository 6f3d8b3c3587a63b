-- GGUF files (llama.cpp's format; moonrl/gguf.h): metadata and tensors, dequantized to fp32.
--
--   local g = require('moonrl.gguf').open('model.gguf')
--   g.metadata['general.architecture']      -- numbers, strings, booleans; arrays as Lua lists
--   g.tensors[i] = { name, type ('Q4_K', ...), shape = {ne0, ne1, ...} (ne0 fastest), numel, bytes }
--   local buf, n = g:read('blk.0.attn_q.weight')  -- float cdata of n, dequantized
--   g:close()                                  -- (also at garbage collection)
-- Errors (a corrupt, truncated or unsupported file) name the file and what is wrong.
local ffi = require('ffi')
local moonrl = require('moonrl')
local C = moonrl.C

local M = {}
local G = {}
G.__index = G

local num, str, len = ffi.new('double[1]'), ffi.new('const char *[1]'), ffi.new('int64_t[1]')

local function value(h, i)
  local t = C.mrl_gguf_kv_type(h, i)
  if t == C.MRL_GGUF_STRING then
    moonrl.check(C.mrl_gguf_kv_string(h, i, -1, str, len))
    return ffi.string(str[0], len[0])
  end
  if t ~= C.MRL_GGUF_ARRAY then
    moonrl.check(C.mrl_gguf_kv_number(h, i, -1, num))
    if t == C.MRL_GGUF_BOOL then return num[0] ~= 0 end
    return num[0]
  end
  local et, n, out = C.mrl_gguf_kv_array_type(h, i), tonumber(C.mrl_gguf_kv_array_len(h, i)), {}
  for j = 0, n - 1 do
    if et == C.MRL_GGUF_STRING then
      moonrl.check(C.mrl_gguf_kv_string(h, i, j, str, len))
      out[j + 1] = ffi.string(str[0], len[0])
    else
      moonrl.check(C.mrl_gguf_kv_number(h, i, j, num))
      out[j + 1] = et == C.MRL_GGUF_BOOL and num[0] ~= 0 or num[0]
    end
  end
  return out
end

function M.open(path)
  local h = ffi.new('mrl_gguf *[1]')
  moonrl.check(C.mrl_gguf_open(path, h), 2)
  local g = setmetatable({ handle = ffi.gc(h[0], C.mrl_gguf_close), path = path, metadata = {}, tensors = {},
    version = C.mrl_gguf_version(h[0]) }, G)
  for i = 0, tonumber(C.mrl_gguf_kv_count(g.handle)) - 1 do
    g.metadata[ffi.string(C.mrl_gguf_kv_key(g.handle, i))] = value(g.handle, i)
  end
  local info = ffi.new('mrl_gguf_tensor')
  for i = 0, tonumber(C.mrl_gguf_tensor_count(g.handle)) - 1 do
    moonrl.check(C.mrl_gguf_tensor_info(g.handle, i, info))
    local shape = {}
    for d = 0, info.ndim - 1 do shape[d + 1] = tonumber(info.shape[d]) end
    g.tensors[i + 1] = { name = ffi.string(info.name), type = ffi.string(info.type_name), shape = shape,
      numel = tonumber(info.numel), bytes = tonumber(info.bytes), index = i }
  end
  return g
end

-- Tensor `name` dequantized: a float cdata and its element count.
function G:read(name)
  local i = C.mrl_gguf_find_tensor(self.handle, name)
  if i < 0 then error(string.format('%s: no tensor %s', self.path, name), 2) end
  local t = self.tensors[tonumber(i) + 1]
  local buf = ffi.new('float[?]', t.numel)
  moonrl.check(C.mrl_gguf_read_f32(self.handle, i, buf, t.numel), 2)
  return buf, t.numel
end

function G:close()
  if self.handle ~= nil then
    C.mrl_gguf_close(ffi.gc(self.handle, nil))
    self.handle = nil
  end
end

return M
