-- AdamW step throughput of moonrl (run by bench/optim/optim_bench.py, which
-- times torch.optim.AdamW on the same size beside it). Settings from the
-- environment: BENCH_N parameters, BENCH_STEPS timed steps. Prints one line:
-- "moonrl_adamw seconds_per_step=S".
local moonrl = require('moonrl')
local ffi = require('ffi')
local n = tonumber(os.getenv('BENCH_N') or 16777216)
local steps = tonumber(os.getenv('BENCH_STEPS') or 20)
local C = moonrl.C
local p = ffi.cast('float *', C.mrl_mem_alloc(4 * n, C.MRL_MEM_PARAMS))
local g = ffi.cast('float *', C.mrl_mem_alloc(4 * n, C.MRL_MEM_GRADS))
for i = 0, n - 1, 1024 do p[i] = 0.01 * (i % 97); g[i] = 1e-3 * (i % 89) end
local opt = moonrl.optim.adamw{ params = p, grads = g, n = n, lr = 1e-3, weight_decay = 0.01 }
opt:step(); opt:step() -- warm up (page faults, threads)
local best = math.huge
for _ = 1, 3 do
  local t0 = moonrl.now()
  for _ = 1, steps do opt:step() end
  best = math.min(best, (moonrl.now() - t0) / steps)
end
print(string.format('moonrl_adamw seconds_per_step=%.6g', best))
C.mrl_mem_free(p); C.mrl_mem_free(g)
