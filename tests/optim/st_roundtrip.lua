-- Helper of ref_safetensors.py (not a test by itself): read every tensor
-- of the safetensors file or directory $ST_SRC as fp32 through the C reader
-- and write them back with the C writer as F32, BF16 and F16 (single
-- files) and sharded BF16 (directory), under $ST_OUT.
local moonrl = require('moonrl')
local src, out = os.getenv('ST_SRC'), os.getenv('ST_OUT')

local st = moonrl.safetensors.open(src)
local tensors = {}
for _, name in ipairs(st:names()) do
  tensors[#tensors + 1] = { name = name, shape = st:info(name).shape, data = st:read_f32(name) }
end

local function writer(dtype)
  local w = moonrl.safetensors.writer()
  for _, t in ipairs(tensors) do w:add(t.name, dtype, t.shape, t.data) end
  local format = st:metadata('format')
  if format then w:metadata('format', format) end
  return w
end

for _, dtype in ipairs({ 'F32', 'BF16', 'F16' }) do writer(dtype):write(out .. '/c_' .. dtype .. '.safetensors') end
writer('BF16'):write_dir(out .. '/c_sharded', 600)
print('st_roundtrip: ' .. #tensors .. ' tensors')
