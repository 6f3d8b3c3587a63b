-- moonrl.io.safetensors from Lua: write, read back, errors name the file.
local t = require('moonrl.testing')
local ffi = require('ffi')
local sf = require('moonrl.io.safetensors')

t.test('write and read back', function()
  local path = os.tmpname()
  local x = ffi.new('float[6]', { 1, 2, 3, 4, 5, 6.5 })
  local w = sf.writer()
  w:add('b.x', 'BF16', { 2, 3 }, x)
  w:add('a.x', 'F32', { 6 }, x)
  w:metadata('format', 'pt')
  w:write(path)
  local st = sf.open(path)
  t.eq(st:count(), 2)
  t.eq(table.concat(st:names(), ','), 'a.x,b.x')
  local info = st:info('b.x')
  t.eq(info.dtype, 'BF16'); t.eq(info.shape[2], 3); t.eq(info.bytes, 12)
  local y = st:read_f32('b.x')
  t.eq(y[5], 6.5)
  t.eq(st:metadata('format'), 'pt'); t.eq(st:metadata('none'), nil)
  t.truthy(st:has('a.x') and not st:has('c'))
  t.raises(function() st:info('c') end, "no tensor named 'c'")
  t.raises(function() w:add('c', 'Q8', { 1 }, x) end, "unknown dtype 'Q8'")
  os.remove(path)
end)

t.test('read_f32_range: a slice of the tensor, errors name the range', function()
  local path = os.tmpname()
  local n = 40
  local x = ffi.new('float[?]', n)
  for i = 0, n - 1 do x[i] = i * 0.5 - 3 end
  local w = sf.writer()
  w:add('m', 'BF16', { 4, 10 }, x)
  w:write(path)
  local st = sf.open(path)
  local full = st:read_f32('m')
  local r = st:read_f32_range('m', 8, 5) -- across the first row's end
  for i = 0, 4 do t.eq(r[i], full[8 + i]) end
  local dst = ffi.new('float[3]')
  t.eq(st:read_f32_range('m', 37, 3, dst), dst)
  t.eq(dst[2], full[39])
  t.raises(function() st:read_f32_range('m', 38, 3) end, "tensor 'm': range first=38 count=3 is outside its 40 elements")
  t.raises(function() st:read_f32_range('m', -1, 1) end, 'first=-1 count=1')
  os.remove(path)
end)

t.test('stream: declared, written one at a time, read back through the index', function()
  local dir = os.tmpname()
  os.remove(dir)
  local x = ffi.new('float[12]')
  local s = sf.stream(dir, 60)
  s:metadata('format', 'pt')
  for i = 1, 3 do s:declare('layer' .. i, 'F32', { 3, 4 }) end -- 48 bytes each: a shard each,
  s:declare('ids', 'I32', { 2 }) -- and 8 more in the third
  for i = 1, 3 do
    for j = 0, 11 do x[j] = i * 100 + j end -- the same buffer each time
    s:write('layer' .. i, x)
  end
  t.raises(function() s:finish() end, "tensor 'ids' was declared but not written")
  s:write_raw('ids', ffi.new('int32_t[2]', { 7, 8 }), 8)
  t.raises(function() s:write('layer1', x) end, "'layer1' written twice")
  s:finish()
  local st = sf.open(dir)
  t.eq(st:count(), 4)
  t.eq(st:read_f32('layer2')[11], 211)
  t.eq(st:metadata('format'), 'pt')
  local f = io.open(dir .. '/model-00003-of-00003.safetensors')
  t.truthy(f ~= nil)
  if f then f:close() end
  os.execute("rm -rf '" .. dir .. "'")
end)

t.test('errors name the file', function()
  t.raises(function() sf.open('/nonexistent/m.safetensors') end, '/nonexistent/m.safetensors')
end)

t.done()
