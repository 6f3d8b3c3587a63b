-- Every function declared to Lua (generated from the headers) resolves in
-- the library, and the declarations agree with what C does.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local ffi = require('ffi')
local C = moonrl.C

t.test('every declared function resolves', function()
  t.truthy(#moonrl.ffi_functions > 40, 'declaration list is populated')
  local missing = {}
  for _, name in ipairs(moonrl.ffi_functions) do
    local ok = pcall(function() return C[name] end)
    if not ok then missing[#missing + 1] = name end
  end
  t.eq(table.concat(missing, ', '), '', 'functions declared but not in the library')
end)

t.test('enums and structs come from the headers', function()
  t.eq(tonumber(C.MRL_ERR_FORMAT), 4)
  t.eq(tonumber(C.MRL_MEM_KV_CACHE), 4)
  t.eq(ffi.sizeof('mrl_mem_stats'), 8 * 14)
end)

t.test('status and error round trip', function()
  t.eq(C.mrl_set_error(C.MRL_ERR_IO, 'disk %s', 'gone'), C.MRL_ERR_IO)
  t.eq(moonrl.last_error(), 'disk gone')
  local msg = t.raises(function() moonrl.check(C.MRL_ERR_IO) end, 'disk gone')
  t.truthy(msg:find('test_ffi.lua'), 'error points at the calling line')
end)

t.test('version info', function()
  local v = moonrl.version()
  t.truthy(v.version:match('^%d+%.%d+%.%d+$'), 'semantic version')
  t.truthy(v.backends:find('cpu'), 'cpu backend')
end)

t.test('memory accounting from Lua', function()
  local before = moonrl.memory()
  local p = C.mrl_mem_alloc(4096, C.MRL_MEM_GRADS)
  local during = moonrl.memory()
  C.mrl_mem_free(p)
  t.eq(during.grads - before.grads, 4096)
  t.eq(moonrl.memory().grads, before.grads)
end)

t.test('parallel sum through the FFI', function()
  local n = 100000
  local x = ffi.new('float[?]', n)
  for i = 0, n - 1 do x[i] = 0.5 end
  t.eq(require('moonrl.train.ops').sum(x, n), n * 0.5)
end)

t.done()
