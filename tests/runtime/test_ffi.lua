-- Every function declared to Lua (generated from the headers) resolves in
-- the library, the declarations agree with what C does, and they are the
-- API only: the core's internal headers (core/base/*.h, the subsystems'
-- *_internal.h and other headers outside core/include/moonrl) declare
-- nothing Lua sees.
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

-- The functions the internal headers declare, name -> header: a line that
-- starts a declaration (a return type, then mrl_name and '(').
local function internal_functions()
  local fs = require('moonrl.io.fs')
  local found = {}
  local function scan(dir)
    for _, name in ipairs(fs.list(dir)) do
      local path = dir .. '/' .. name
      if fs.is_dir(path) then
        if path ~= 'core/include' then scan(path) end
      elseif name:match('%.h$') or name:match('%.cuh$') then
        for line in assert(fs.read(path)):gmatch('[^\n]+') do
          local fn = line:match('^[%w_][%w_ %*]*[%s%*](mrl_[%w_]+)%s*%(')
          if fn and not line:match('^static') and not line:match('^return') then found[fn] = path end
        end
      end
    end
  end
  scan('core'); scan('kernels')
  return found
end

t.test('every declared function is API: none comes from an internal header', function()
  local internal = internal_functions()
  -- the scan sees the internals the core calls everywhere (else it proves nothing)
  for _, name in ipairs({ 'mrl_set_error', 'mrl_logf', 'mrl_parallel_for', 'mrl_mem_account',
                          'mrl_sample_rows', 'mrl_buffer_alloc', 'mrl_kernels_for', 'mrl_job_submit' }) do
    t.truthy(internal[name], name .. ' is declared in an internal header')
  end
  local leaked = {}
  for _, name in ipairs(moonrl.ffi_functions) do
    if internal[name] then leaked[#leaked + 1] = name .. ' (' .. internal[name] .. ')' end
  end
  t.eq(table.concat(leaked, ', '), '', 'internal functions declared to Lua')
  -- an inline function of core/base/rng.h: no symbol, no declaration
  t.eq(pcall(function() return C.mrl_splitmix64 end), false, 'mrl_splitmix64 is not declared')
end)

t.test('enums and structs come from the headers', function()
  t.eq(tonumber(C.MRL_ERR_FORMAT), 4)
  t.eq(tonumber(C.MRL_MEM_KV_CACHE), 4)
  t.eq(ffi.sizeof('mrl_mem_stats'), 8 * 14)
end)

t.test('status and error round trip', function()
  -- a C call that fails sets the message (mrl_set_error itself: tests/runtime/test_runtime.c)
  local msg_c = "device 'disk gone': expected cpu, cuda or cuda:N"
  t.eq(C.mrl_device_parse('disk gone', ffi.new('mrl_device[1]')), C.MRL_ERR_INVALID)
  t.eq(moonrl.last_error(), msg_c)
  local msg = t.raises(function() moonrl.check(C.MRL_ERR_INVALID) end, msg_c, 'the message, as a Lua error')
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
