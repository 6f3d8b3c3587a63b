-- The layers of the C code, checked on its #include lines: the base
-- (core/base) includes nothing above it, and the kernels (kernels/)
-- include only the base and themselves. What reports on or dispatches over
-- backends (core/runtime: devices, op tables, version) sits above the
-- kernels, and kernels.h includes nothing of the engine.
local t = require('moonrl.testing')
local fs = require('moonrl.io.fs')

-- every "quoted" include of the C files under dir: { {file, included}, ... }
local function includes(dir, out)
  out = out or {}
  for _, name in ipairs(fs.list(dir)) do
    local path = dir .. '/' .. name
    if fs.is_dir(path) then
      includes(path, out)
    elseif name:match('%.[ch]$') or name:match('%.cuh?$') then
      for inc in assert(fs.read(path)):gmatch('\n%s*#%s*include%s+"([^"]+)"') do out[#out + 1] = { path, inc } end
    end
  end
  return out
end

-- the public headers of the base and the leaf type headers the kernels use
local base_public = { ['moonrl/status.h'] = true, ['moonrl/log.h'] = true, ['moonrl/mem.h'] = true,
                      ['moonrl/parallel.h'] = true }
local leaf_types = { ['moonrl/dtype.h'] = true, ['moonrl/sampling.h'] = true }

local function bad_includes(dir, allowed)
  local bad = {}
  for _, e in ipairs(includes(dir)) do
    if not allowed(e[2]) then bad[#bad + 1] = e[1] .. ': ' .. e[2] end
  end
  return table.concat(bad, ', ')
end

t.test('the base includes only itself', function()
  t.eq(bad_includes('core/base', function(inc)
    return inc:match('^base/') or base_public[inc]
  end), '', 'includes above the base')
end)

t.test('the kernels include only the base and themselves', function()
  t.eq(bad_includes('kernels', function(inc)
    return inc:match('^base/') or base_public[inc] or leaf_types[inc] or inc == 'kernels.h' or inc:match('^cpu/')
        or not inc:find('/') -- a header beside the file (isa.h, ops.cuh, cuda_backend.h)
  end), '', 'kernels including from above them')
end)

t.done()
