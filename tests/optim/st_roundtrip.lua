-- Helper of ref_safetensors.py (not a test by itself): read every tensor
-- of the safetensors file or directory $ST_SRC as fp32 through the C reader
-- and write them back with the C writer as F32, BF16 and F16 (single
-- files) and sharded (directory), under $ST_OUT.
local moonrl = require('moonrl')
local ffi = require('ffi')
local C = moonrl.C
local src, out = os.getenv("ST_SRC"), os.getenv("ST_OUT")

local st = ffi.new('mrl_st *[1]')
moonrl.check(C.mrl_st_open(src, st))
st = ffi.gc(st[0], C.mrl_st_close)
local tensors, keep = {}, {}
local info = ffi.new('mrl_st_tensor')
for i = 0, tonumber(C.mrl_st_count(st)) - 1 do
  moonrl.check(C.mrl_st_info(st, i, info))
  local n = tonumber(info.numel)
  local buf = ffi.new('float[?]', math.max(n, 1))
  local name = ffi.string(info.name)
  moonrl.check(C.mrl_st_read_f32(st, name, buf, n))
  local shape = ffi.new('int64_t[8]')
  for d = 0, info.ndim - 1 do shape[d] = info.shape[d] end
  tensors[#tensors + 1] = { name = name, ndim = info.ndim, shape = shape, data = buf }
end
local meta = C.mrl_st_metadata(st, 'format')

local function writer(dtype)
  local w = ffi.new('mrl_st_writer *[1]')
  moonrl.check(C.mrl_st_writer_create(w))
  w = ffi.gc(w[0], C.mrl_st_writer_free)
  for _, t in ipairs(tensors) do
    moonrl.check(C.mrl_st_writer_add(w, t.name, dtype, t.ndim, t.shape, t.data))
  end
  if meta ~= nil then moonrl.check(C.mrl_st_writer_set_metadata(w, 'format', meta)) end
  return w
end

for name, dtype in pairs({ F32 = C.MRL_DTYPE_F32, BF16 = C.MRL_DTYPE_BF16, F16 = C.MRL_DTYPE_F16 }) do
  moonrl.check(C.mrl_st_writer_write(writer(dtype), out .. '/c_' .. name .. '.safetensors'))
end
moonrl.check(C.mrl_st_writer_write_dir(writer(C.MRL_DTYPE_BF16), out .. '/c_sharded', 600))
print('st_roundtrip: ' .. #tensors .. ' tensors')
