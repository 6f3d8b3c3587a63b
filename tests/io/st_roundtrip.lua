-- Helper of ref_safetensors.py (not a test by itself): read every tensor
-- of the safetensors file or directory $ST_SRC through the C reader and
-- write them back under $ST_OUT with the C writer: the float tensors as
-- fp32 converted to F32, BF16 and F16 (single files) and sharded BF16
-- (directory); every tensor as its raw bytes in its own dtype (c_raw).
local moonrl = require('moonrl')
local src, out = os.getenv('ST_SRC'), os.getenv('ST_OUT')

local st = require('moonrl.io.safetensors').open(src)
local floats, all = {}, {}
for _, name in ipairs(st:names()) do
  local info = st:info(name)
  all[#all + 1] = info
  if info.dtype == 'F32' or info.dtype == 'BF16' or info.dtype == 'F16' then
    floats[#floats + 1] = { name = name, shape = info.shape, data = st:read_f32(name) }
  end
end
local format = st:metadata('format')

local function writer()
  local w = require('moonrl.io.safetensors').writer()
  if format then w:metadata('format', format) end
  return w
end

local function floats_as(dtype)
  local w = writer()
  for _, t in ipairs(floats) do w:add(t.name, dtype, t.shape, t.data) end
  return w
end

for _, dtype in ipairs({ 'F32', 'BF16', 'F16' }) do floats_as(dtype):write(out .. '/c_' .. dtype .. '.safetensors') end
floats_as('BF16'):write_dir(out .. '/c_sharded', 600)
local raw = writer()
for _, t in ipairs(all) do raw:add_raw(t.name, t.dtype, t.shape, t.data, t.bytes) end
raw:write(out .. '/c_raw.safetensors')
print('st_roundtrip: ' .. #all .. ' tensors')
