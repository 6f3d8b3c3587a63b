-- Weight publication between two ranks on one host: the broadcast a trainer does after each
-- update (moonrl.rollout: World:broadcast of the parameter buffer) against one memcpy of the same
-- bytes in the same process (the limit of a same-host update), for the default model's size,
-- ~5M and ~100M parameters.
--   mpirun -n 2 --oversubscribe --bind-to none --mca btl vader,self build/moonrl run bench/weight_publish.lua [reps=5]
--   (--mca btl tcp,self for the TCP transport)
local ffi = require('ffi')
local moonrl = require('moonrl')
local w = require('moonrl.dist').world(600)
assert(w.size == 2, 'run it on 2 ranks')

local sizes = { { 'default (0.4M)', 420000 }, { '5M', 5000000 }, { '100M', 100000000 } }
local cfg = moonrl.config { reps = moonrl.config.integer(5) }
local reps = cfg.reps

local function median(t)
  table.sort(t)
  return t[math.ceil(#t / 2)]
end

if w.rank == 0 then
  print(string.format('%-16s %10s %14s %14s %10s', 'model', 'MB', 'broadcast s', 'memcpy s', 'ratio'))
end
for _, sz in ipairs(sizes) do
  local n = sz[2]
  local buf = ffi.new('float[?]', n)
  local copy = ffi.new('float[?]', n)
  for i = 0, n - 1, 1024 do buf[i] = i end
  ffi.copy(copy, buf, 4 * n) -- touch every page once
  local tb, tm = {}, {}
  for r = 1, reps + 1 do
    w:barrier()
    local t0 = moonrl.now()
    w:broadcast(buf, 4 * n, 0)
    w:barrier() -- the receiver has it all
    local t1 = moonrl.now()
    ffi.copy(copy, buf, 4 * n)
    local t2 = moonrl.now()
    if r > 1 then tb[#tb + 1], tm[#tm + 1] = t1 - t0, t2 - t1 end
  end
  local b, m = median(tb), median(tm)
  if w.rank == 0 then
    print(string.format('%-16s %10.1f %14.4f %14.4f %10.2f', sz[1], 4 * n / 1e6, b, m, b / m))
  end
end
