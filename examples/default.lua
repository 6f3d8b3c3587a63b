-- The embedded default example (what `moonrl` runs with no arguments).
-- For now it shows the foundation at work: the C core computes through the
-- FFI, the event loop runs a subprocess with a timeout, and the memory layer
-- accounts what was allocated. Later issues replace it with the default RL run.
local moonrl = require('moonrl')
local ffi = require('ffi')
local C = moonrl.C

local cfg = moonrl.config {
  n = moonrl.config.integer(1000000), -- length of the vector summed in C
}

local v = moonrl.version()
print(string.format('moonrl %s (git %s), backends: %s, %d threads', v.version, v.git, v.backends, v.threads))
print('cpu features: ' .. v.cpu_features)

-- a vector allocated through the memory layer, filled from Lua, summed in C
local bytes = cfg.n * 4
local x = ffi.cast('float *', C.mrl_mem_alloc(bytes, C.MRL_MEM_ACTIVATIONS))
if x == nil then error(moonrl.last_error()) end
for i = 0, cfg.n - 1 do x[i] = 1 / (i + 1) end
local sum = moonrl.ops.sum(x, cfg.n)
print(string.format('sum of 1/k for k = 1..%d, computed in C on %d threads: %.6f (ln n + gamma = %.6f)',
  cfg.n, v.threads, sum, math.log(cfg.n) + 0.5772156649))
local mem = moonrl.memory()
print(string.format('memory layer: %d bytes live under activations (peak %d)', mem.activations, mem.activations_peak))
C.mrl_mem_free(x)

local r = moonrl.proc.run({ 'sh', '-c', 'echo hello from a subprocess' }, { timeout = 5 })
print(string.format('event loop: subprocess said %q in %.3f s', r.stdout:gsub('\n$', ''), r.seconds))
