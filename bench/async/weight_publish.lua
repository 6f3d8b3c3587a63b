-- Weight publication between two ranks on one host: the broadcast a trainer does after each
-- update (moonrl.train.rollout: World:broadcast of the parameter buffer) and the shared-memory weight
-- store (moonrl/weight_store.h: rank 0 publishes into it, rank 1 holds the new version in place),
-- against one memcpy of the same bytes in the same process (the limit of a same-host update), for
-- the default model's size, ~5M and ~100M parameters.
--   mpirun -n 2 --oversubscribe --bind-to none --allow-run-as-root --mca btl vader,self \
--     build/moonrl run bench/async/weight_publish.lua [reps=5]
--   (--mca btl tcp,self for the TCP transport of the broadcast; the store is shared memory either way)
-- Columns: seconds (median of reps, after one warm-up) and their ratio to the memcpy.
--   memcpy      one ffi.copy of the buffer on rank 0, rank 1 asleep (one thread, both cores free)
--   broadcast   from the barrier before it until the barrier after it (rank 1 has every byte)
--   shm         from the barrier before rank 0's publish until rank 1 holds that version (its
--               acquire returned; a barrier after it): the copy into a free slot + the reader's wake
--   publish 1t / publish Nt   rank 0's publish alone with 1 thread and with the default thread
--               count (mrl_parallel_set_threads), rank 1 asleep as for the memcpy: what splitting
--               the copy over the threads gains
--   create      rank 0's store creation (all R + 2 = 3 slots allocated in /dev/shm and mapped)
local ffi = require('ffi')
local moonrl = require('moonrl')
local C = moonrl.C
local w = require('moonrl.train.dist').world(600)
assert(w.size == 2, 'run it on 2 ranks')

local sizes = { { 'default (0.4M)', 420000 }, { '5M', 5000000 }, { '100M', 100000000 } }
local cfg = moonrl.config { reps = moonrl.config.integer(5) }
local reps = cfg.reps

local function median(t)
  table.sort(t)
  return t[math.ceil(#t / 2)]
end

-- from the barrier before the broadcast until the barrier after it
local function broadcast_column(n, buf)
  local tb = {}
  for r = 0, reps do
    w:barrier()
    local t0 = moonrl.now()
    w:broadcast(buf, 4 * n, 0)
    w:barrier() -- the receiver has it all
    if r > 0 then tb[#tb + 1] = moonrl.now() - t0 end
  end
  return median(tb)
end

local handle = ffi.new('mrl_weight_store *[1]')
local held, held_version = ffi.new('const float *[1]'), ffi.new('int64_t[1]')

-- rank 0 creates the store, rank 1 opens it, rank 0 unlinks the name
local function open_store(n, k)
  local name = w:broadcast_string(w.rank == 0 and string.format('/moonrl-wp-%d-%d', C.mrl_process_id(), k) or '')
  local t0 = moonrl.now()
  if w.rank == 0 then moonrl.check(C.mrl_weight_store_create(name, n, 1, handle)) end
  local create_s = moonrl.now() - t0
  w:barrier() -- created
  if w.rank == 1 then moonrl.check(C.mrl_weight_store_open(name, n, 0, handle)) end
  w:barrier() -- every reader has opened: the name can go
  if w.rank == 0 then moonrl.check(C.mrl_weight_store_unlink(handle[0])) end
  return handle[0], create_s
end

-- from the barrier before rank 0's publish of version r until rank 1 holds it
local function shm_column(n, buf, store)
  local ts = {}
  for r = 0, reps do
    buf[n - 1] = r
    w:barrier()
    local t0 = moonrl.now()
    if w.rank == 0 then
      moonrl.check(C.mrl_weight_store_publish(store, buf, r, 0))
    else
      moonrl.check(C.mrl_weight_store_acquire(store, 0, r, 60, held, held_version, nil))
    end
    w:barrier()
    if r > 0 then ts[#ts + 1] = moonrl.now() - t0 end
    if w.rank == 1 then assert(held_version[0] == r and held[0][n - 1] == r, 'rank 1 holds what rank 0 published') end
  end
  return median(ts)
end

-- rank 0 alone, both cores its own: one memcpy, publish with 1 thread, publish with the default
-- threads. Rank 1 sleeps through it (about 3x rank 0's expected time, from one copy of its own)
-- rather than spin in a barrier on one of the two cores.
local function solo_columns(n, buf, copy, store)
  local tm, t1, tn = {}, {}, {}
  if w.rank == 0 then
    local version = reps
    for r = 0, reps do
      local t0 = moonrl.now()
      ffi.copy(copy, buf, 4 * n)
      if r > 0 then tm[#tm + 1] = moonrl.now() - t0 end
    end
    for _, case in ipairs { { 1, t1 }, { 0, tn } } do
      C.mrl_parallel_set_threads(case[1])
      for r = 0, reps do
        version = version + 1
        local t0 = moonrl.now()
        moonrl.check(C.mrl_weight_store_publish(store, buf, version, 0))
        if r > 0 then case[2][#case[2] + 1] = moonrl.now() - t0 end
      end
    end
    C.mrl_parallel_set_threads(0)
  else
    local t0 = moonrl.now()
    ffi.copy(copy, buf, 4 * n)
    moonrl.sleep(0.05 + 3 * 3 * (reps + 1) * (moonrl.now() - t0))
  end
  w:barrier()
  if w.rank == 0 then return median(tm), median(t1), median(tn) end
end

if w.rank == 0 then
  print(string.format('%-16s %7s %10s %12s %7s %10s %7s %12s %12s %9s', 'model', 'MB', 'memcpy s', 'broadcast s',
    'ratio', 'shm s', 'ratio', 'publish 1t s', string.format('publish %dt s', C.mrl_parallel_threads()), 'create s'))
end
for k, sz in ipairs(sizes) do
  local n = sz[2]
  local buf = ffi.new('float[?]', n)
  local copy = ffi.new('float[?]', n)
  for i = 0, n - 1, 1024 do buf[i] = i end
  ffi.copy(copy, buf, 4 * n) -- touch every page once
  local store, create_s = open_store(n, k)
  local b = broadcast_column(n, buf)
  local s = shm_column(n, buf, store)
  local m, p1, pn = solo_columns(n, buf, copy, store)
  C.mrl_weight_store_free(store)
  if w.rank == 0 then
    print(string.format('%-16s %7.1f %10.5f %12.5f %7.2f %10.5f %7.2f %12.5f %12.5f %9.3f', sz[1], 4 * n / 1e6, m,
      b, b / m, s, s / m, p1, pn, create_s))
  end
end
