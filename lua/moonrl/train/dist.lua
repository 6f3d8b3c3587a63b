-- moonrl.train.dist: the ranks of one job (core/dist, see dist.h), as recipes and the shared pieces
-- use them. World size 1 (no launcher) costs nothing: every call below returns at once.
--
--   local dist = require('moonrl.train.dist')
--   local w = dist.world()                -- w.rank, w.size, w.local_rank; w.size == 1 alone
--   w:sum({ loss = 1.5, n = 3 })          -- every number summed over the ranks (rank order)
--   w:max(x), w:any(flag)
--   w:broadcast_string(s)                 -- rank 0's string on every rank
--   w:gather_strings(s)                   -- every rank's string, in rank order
--   w:share(n)                            -- this rank's items of n: first, last (1-based)
--   w:allreduce(ptr, n, 'f32', 'sum')     -- in place over a cdata array
--   local dp = dist.data_parallel(w, opt, model, { zero = 1, bucket_mb = 25 })
--     -- an optimizer with opt's interface whose gradients are summed over the ranks (bucket by
--     -- bucket while the backward runs) and, with zero = 1, whose state is sharded (ZeRO-1); with
--     -- zero = 2 the gradients are too (ZeRO-2: each backward's ranges reduce-scattered into the
--     -- rank's shard as they become final, no whole gradient buffer anywhere)
local ffi = require('ffi')
local moonrl = require('moonrl')
local C = moonrl.C

local M = {}

local DTYPES = { f32 = C.MRL_DIST_F32, f64 = C.MRL_DIST_F64, i64 = C.MRL_DIST_I64, u8 = C.MRL_DIST_U8 }
local OPS = { sum = C.MRL_DIST_SUM, mean = C.MRL_DIST_MEAN, max = C.MRL_DIST_MAX, min = C.MRL_DIST_MIN }

local World = {}
World.__index = World

-- A timeout or a broken communicator ends the run with its report (no traceback: the message
-- says which rank, operation and step); other failures are errors as usual.
local function check(st)
  if st == 0 then return end
  if st == C.MRL_ERR_TIMEOUT then -- also every operation after one: the communicator is broken
    moonrl.run_error(ffi.string(C.mrl_last_error()))
  end
  moonrl.check(st, 3)
end


local the_world
M.groups = {} -- communicators made by World:split
-- The job's communicator, made once per process (timeout: seconds a collective may wait; the
-- config's dist.timeout sets it again when a recipe starts).
function M.world(timeout)
  if the_world then
    if timeout then the_world:set_timeout(timeout) end
    return the_world
  end
  local out = ffi.new('mrl_dist *[1]')
  if C.mrl_dist_init(timeout or 600, out) ~= 0 then
    moonrl.run_error('cannot join the ranks of the job: ' .. ffi.string(C.mrl_last_error()))
  end
  local h = out[0]
  the_world = setmetatable({ handle = h, rank = tonumber(C.mrl_dist_rank(h)), size = tonumber(C.mrl_dist_size(h)),
    local_rank = tonumber(C.mrl_dist_local_rank(h)), local_size = tonumber(C.mrl_dist_local_size(h)),
    backend = ffi.string(C.mrl_dist_backend(h)), scratch = ffi.new('double[64]'), timeout = timeout or 600 }, World)
  C.mrl_log_set_rank(the_world.rank, the_world.size)
  -- rank 0 speaks for the job: what recipes print (step lines, results) appears once; errors
  -- and warnings go to stderr from every rank, each line tagged with its rank
  if the_world.rank > 0 then _G.print = function() end end
  return the_world
end

-- A world of one process (what rank 0 uses for work it does alone).
M.SOLO = setmetatable({ rank = 0, size = 1, local_rank = 0, local_size = 1, backend = 'none' }, World)

-- The world if one was made (nil otherwise: nothing to finalize).
function M.current() return the_world end

-- At exit: MPI_Finalize after a run that ended well; after a failure the process just exits
-- (a rank waiting for the others would hang; the launcher ends the job on the non-zero status).
function M.shutdown(ok)
  local w = the_world
  if not w or w.size == 1 then return end
  the_world = nil
  if ok and C.mrl_dist_broken(w.handle) == 0 then
    for _, h in ipairs(M.groups) do C.mrl_dist_free(h) end
    C.mrl_dist_finalize(w.handle)
  end
  M.groups = {}
end

-- The ranks that pass the same color >= 0, as a World of their own (nil for color < 0). Every
-- rank calls it. name: how its timeout reports call it.
function World:split(color, name)
  local out = ffi.new('mrl_dist *[1]')
  check(C.mrl_dist_split(self.handle, color, name, out))
  if out[0] == nil then return nil end
  local h = out[0]
  M.groups[#M.groups + 1] = h -- freed explicitly before MPI_Finalize (M.shutdown), never by the GC after it
  return setmetatable({ handle = h, rank = tonumber(C.mrl_dist_rank(h)), size = tonumber(C.mrl_dist_size(h)),
    local_rank = self.local_rank, local_size = self.local_size, backend = self.backend,
    scratch = ffi.new('double[64]'), name = name }, World)
end

function World:set_timeout(seconds)
  self.timeout = seconds -- (an NCCL communicator made later takes it too)
  C.mrl_dist_set_timeout(self.handle, seconds)
  if self.nccl then C.mrl_nccl_set_timeout(self.nccl, seconds) end
end
function World:set_step(step) C.mrl_dist_set_step(self.handle, step) end

function World:barrier()
  if self.size > 1 then check(C.mrl_dist_barrier(self.handle)) end
end

function World:allreduce(ptr, n, dtype, op)
  if self.size > 1 and n > 0 then
    check(C.mrl_dist_allreduce(self.handle, ptr, n, DTYPES[dtype or 'f32'], OPS[op or 'sum']))
  end
end

-- ---- GPU buffers (a model on mrl_model_set_device): NCCL, or through the host ----
-- transport 'nccl': an NCCL communicator between the ranks' GPUs (core/dist/nccl.c), made on
-- first use for GPU `device` (the rank's own); 'host': each buffer copied to host memory, summed
-- or sent with the communicator (MPI), copied back (slower, but needs no NCCL: tests, a GPU
-- without peer links); 'auto': nccl, or host where NCCL does not start (the reason is kept in
-- self.nccl_error). Returns the transport in use.
function World:gpu_transport(transport, device)
  if self.gpu_via then return self.gpu_via end
  if transport ~= 'host' then
    local out = ffi.new('mrl_nccl *[1]')
    if C.mrl_nccl_create(self.handle, device or 0, self.timeout or 600, out) == 0 then
      self.nccl = ffi.gc(out[0], C.mrl_nccl_free)
      self.gpu_via = 'nccl'
      return 'nccl'
    end
    self.nccl_error = moonrl.last_error()
    if transport == 'nccl' then
      moonrl.run_error('dist.gpu_transport=nccl: the NCCL communicator did not start: ' .. self.nccl_error)
    end
  end
  self.gpu_via = 'host'
  return 'host'
end

-- A host buffer of at least n floats for a GPU buffer's trip through the host, kept for the next.
local function host_staging(w, n)
  if (w.gpu_host_n or 0) < n then w.gpu_host, w.gpu_host_n = ffi.new('float[?]', n), n end
  return w.gpu_host
end

-- Make a GPU buffer of n floats whole, each rank's shard (mrl_dist_shard over the world) being
-- in place: NCCL broadcasts every rank's shard in place, in one group (the shards may differ in
-- size, which NCCL's all-gather does not take); through the host, the shard goes into a host
-- copy, which is all-gathered and copied back.
function World:gpu_allgather_shards(ptr, n)
  if self.size == 1 or n == 0 then return end
  if self.gpu_via == 'nccl' then
    local off, bytes = ffi.new('int64_t[?]', self.size), ffi.new('int64_t[?]', self.size)
    for r = 0, self.size - 1 do
      local first, last = self:share(n, r)
      off[r], bytes[r] = 4 * (first - 1), 4 * math.max(0, last - first + 1)
    end
    return check(C.mrl_nccl_allgather_pieces(self.nccl, ptr, off, bytes))
  end
  local first, last = self:share(n)
  local host = host_staging(self, n)
  if last >= first then moonrl.check(C.mrl_device_memcpy(host + first - 1, ptr + first - 1, 4 * (last - first + 1))) end
  check(C.mrl_dist_allgather_shards(self.handle, host, n, C.MRL_DIST_F32))
  moonrl.check(C.mrl_device_memcpy(ptr, host, 4 * n))
end

-- Sum n floats of a GPU buffer over the ranks, in place.
function World:gpu_allreduce(ptr, n)
  if self.size == 1 or n == 0 then return end
  if self.gpu_via == 'nccl' then return check(C.mrl_nccl_allreduce(self.nccl, ptr, n, C.MRL_DIST_F32, C.MRL_DIST_SUM)) end
  local host = host_staging(self, n)
  moonrl.check(C.mrl_device_memcpy(host, ptr, 4 * n))
  check(C.mrl_dist_allreduce(self.handle, host, n, C.MRL_DIST_F32, C.MRL_DIST_SUM))
  moonrl.check(C.mrl_device_memcpy(ptr, host, 4 * n))
end

-- bytes of a GPU buffer from rank root to every rank.
function World:gpu_broadcast(ptr, bytes, root)
  if self.size == 1 or bytes == 0 then return end
  if self.gpu_via == 'nccl' then return check(C.mrl_nccl_broadcast(self.nccl, ptr, bytes, root)) end
  local host = ffi.new('uint8_t[?]', bytes)
  if self.rank == root then moonrl.check(C.mrl_device_memcpy(host, ptr, bytes)) end
  check(C.mrl_dist_broadcast(self.handle, host, bytes, root))
  moonrl.check(C.mrl_device_memcpy(ptr, host, bytes))
end

-- Reduce a table of numbers (nested tables too) over the ranks with op ('sum', 'max', 'min');
-- every rank must pass the same keys. Returns a new table (the same on every rank).
local function leaves(t, out, prefix)
  local keys = {}
  for k, v in pairs(t) do
    if type(v) == 'number' or type(v) == 'table' then keys[#keys + 1] = k end
  end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  for _, k in ipairs(keys) do
    local v = t[k]
    if type(v) == 'table' then leaves(v, out, prefix .. tostring(k) .. '.')
    else out[#out + 1] = { t, k } end
  end
  return out
end

function World:reduce(t, op)
  if self.size == 1 then return t end
  if type(t) == 'number' then return self:reduce({ t }, op)[1] end
  local list = leaves(t, {}, '')
  local buf = #list <= 64 and self.scratch or ffi.new('double[?]', #list)
  for i, e in ipairs(list) do buf[i - 1] = e[1][e[2]] end
  check(C.mrl_dist_allreduce(self.handle, buf, #list, C.MRL_DIST_F64, OPS[op]))
  for i, e in ipairs(list) do e[1][e[2]] = buf[i - 1] end
  return t
end
function World:sum(t) return self:reduce(t, 'sum') end
function World:max(t) return self:reduce(t, 'max') end
function World:min(t) return self:reduce(t, 'min') end
-- True on every rank when it is true on any.
function World:any(flag)
  if self.size == 1 then return flag and true or false end
  return self:reduce(flag and 1 or 0, 'max') > 0
end

-- Point to point (pipeline parallel's rows): send copies and returns at once (the message goes
-- out meanwhile; flush_sends waits for all of them); recv waits for bytes from rank src. tag: a
-- channel (0 .. 999), in order within each.
function World:send(ptr, bytes, dest, tag) check(C.mrl_dist_send(self.handle, ptr, bytes, dest, tag or 0)) end
function World:recv(ptr, bytes, src, tag) check(C.mrl_dist_recv(self.handle, ptr, bytes, src, tag or 0)) end
function World:flush_sends()
  if self.size > 1 then check(C.mrl_dist_flush_sends(self.handle)) end
end

function World:broadcast(ptr, bytes, root)
  if self.size > 1 and bytes > 0 then check(C.mrl_dist_broadcast(self.handle, ptr, bytes, root or 0)) end
end

-- Rank root's string (default 0) on every rank.
function World:broadcast_string(s, root)
  if self.size == 1 then return s end
  root = root or 0
  local len = ffi.new('int64_t[1]', self.rank == root and #s or 0)
  check(C.mrl_dist_broadcast(self.handle, len, 8, root))
  local buf = ffi.new('uint8_t[?]', math.max(tonumber(len[0]), 1))
  if self.rank == root then ffi.copy(buf, s, #s) end
  check(C.mrl_dist_broadcast(self.handle, buf, len[0], root))
  return ffi.string(buf, len[0])
end

-- Every rank's string, as a list in rank order.
local blob_data, blob_off = ffi.new('const uint8_t *[1]'), ffi.new('const int64_t *[1]')
function World:gather_strings(s)
  if self.size == 1 then return { s } end
  check(C.mrl_dist_allgather_blobs(self.handle, s, #s, blob_data, blob_off))
  local out, off = {}, blob_off[0]
  for r = 0, self.size - 1 do out[r + 1] = ffi.string(blob_data[0] + off[r], off[r + 1] - off[r]) end
  return out
end

-- This rank's contiguous share of n items: first, last (1-based; last < first when empty).
function World:share(n, rank)
  local off, count = ffi.new('int64_t[1]'), ffi.new('int64_t[1]')
  C.mrl_dist_shard(n, self.size, rank or self.rank, off, count)
  return tonumber(off[0]) + 1, tonumber(off[0] + count[0])
end

-- ---- sharded training state: layouts, parameters (ZeRO-3) -------------------------------------

-- How w's ranks shard the training state: over all of them (group = 0 or w.size), or (hybrid
-- sharding, HSDP) within groups of `group` consecutive ranks, replicated across the groups.
-- { world = w, shards = K, index = this rank's shard (rank % K), replica = rank // K,
--   group = the World of its K ranks (w itself without groups) }. Every rank calls it (a
-- split); the layout of a group size is made once.
local layouts = {}
function M.shard_layout(w, group)
  local K = (group and group > 0) and group or w.size
  if w.size % K ~= 0 then
    moonrl.usage_error(string.format('dist.shard_group=%d does not divide the %d ranks that train', K, w.size))
  end
  local key = tostring(w.handle) .. ':' .. K
  if layouts[key] then return layouts[key] end
  local g = K == w.size and w or w:split(math.floor(w.rank / K), 'shard group')
  local layout = { world = w, shards = K, index = w.rank % K, replica = math.floor(w.rank / K), group = g }
  layouts[key] = layout
  return layout
end

-- Float rounding as C's float arithmetic does it (a double result of one float operation,
-- rounded to float, is the float operation's result).
local fbox = ffi.new('float[1]')
local function F(x) fbox[0] = x; return tonumber(fbox[0]) end

-- As torch.nn.utils.clip_grad_norm_ (and mrl_grad_clip_norm) over o's grad_norm and scale_grad:
-- the pre-clip norm. DP's, and a tensor-parallel optimizer's (M.tp_norm).
local function clip_grad_norm(o, max_norm)
  local norm = o:grad_norm()
  local coef = F(F(max_norm) / F(F(norm) + F(1e-6)))
  if not (coef >= 1) then o:scale_grad(coef) end
  return norm
end

-- The mesh of w's ranks for dist.tp = TP, dist.cp = CP and dist.pp = PP (each >= 1): rank r is
-- slot r % TP of its tensor-parallel group (TP consecutive ranks, each holding slices of every
-- layer: moonrl.model.load_tp), share (r // TP) % CP of its context-parallel group (CP ranks of
-- the same slot, each taking its share of each batch's tokens: model:set_cp), data-parallel index
-- (r // (TP CP)) % DP and pipeline stage r // (TP CP DP) (the stages of one pipeline: the ranks of
-- the same slot, share and index; moonrl.model.load_stage). { world = w, tp, cp, pp = the Worlds
-- of its groups (nil for a degree of 1), dp = the ranks of its slot, share and stage (one a
-- data-parallel index: what splits the data), grad = the ranks of its slot and stage (what sums
-- the gradients: dp, or with context parallel dp and cp), and with pipeline parallel norm (its
-- slot's tensor-parallel and pipeline ranks: the gradient norm's parts) and tied (the first and
-- last stages' ranks of its pipeline: a tied head's two copies), tp_rank, cp_rank, dp_rank,
-- pp_rank }. Every rank calls it (its splits are collectives); made once.
local meshes = {}
function M.mesh(w, TP, CP, PP)
  PP = PP or 1
  if w.size % (TP * CP * PP) ~= 0 then
    local named = {}
    for _, d in ipairs({ { 'tp', TP }, { 'cp', CP }, { 'pp', PP } }) do
      if d[2] > 1 then named[#named + 1] = string.format('dist.%s=%d', d[1], d[2]) end
    end
    moonrl.usage_error(string.format('%s does not divide the %d ranks that train', table.concat(named, ' x '), w.size))
  end
  local id = string.format('%s:%d:%d:%d', tostring(w.handle), TP, CP, PP)
  if meshes[id] then return meshes[id] end
  -- rank = tp + TP (cp + CP (dp + DP pp)): TP innermost (one node), the pipeline outermost (Megatron's order)
  local r, DP = w.rank, w.size / (TP * CP * PP)
  local tp, cp, dp, pp = r % TP, math.floor(r / TP) % CP, math.floor(r / (TP * CP)) % DP, math.floor(r / (TP * CP * DP))
  local mesh = { world = w, tp_rank = tp, cp_rank = cp, dp_rank = dp, pp_rank = pp }
  if TP > 1 then mesh.tp = w:split(math.floor(r / TP), 'tensor parallel') end
  if CP > 1 then mesh.cp = w:split(tp + TP * (dp + DP * pp), 'context parallel') end
  mesh.dp = w:split(tp + TP * (cp + CP * pp), 'data parallel')
  mesh.grad = CP > 1 and w:split(tp + TP * pp, 'gradient sums') or mesh.dp
  if PP > 1 then
    mesh.pp = w:split(tp + TP * (cp + CP * dp), 'pipeline')
    -- the gradient norm's squares
    mesh.norm = w:split(cp + CP * dp, 'gradient norm') -- (a stage's and a slice's parts: tensor x pipeline)
    -- a tied head: the first and last stages' copies of the embedding (their gradients summed)
    local ends = pp == 0 or pp == PP - 1
    mesh.tied = w:split(ends and tp + TP * (cp + CP * dp) or -1, 'tied embedding')
  end
  meshes[id] = mesh
  return mesh
end

-- Tensor and pipeline parallel: opt (a moonrl.optim AdamW over model's slices or stage, or
-- M.data_parallel's over the groups, ZeRO-1 and 2 included) made to measure and clip the whole
-- model's gradient norm: each element of the whole model is counted by one rank of the group
-- par.group (with tensor parallel par.tp: a split view's by every rank of it, a K/V head several
-- ranks hold by the first of them, a whole view's, the same on every rank, by its first; with
-- pipeline parallel each stage's own views, a tied head's copy of the embedding not at all: the
-- first stage counts it), the squares summed over the data-parallel ranks as they are without
-- model parallelism, then over par.group. With shared K/V heads, their gradients are summed over
-- the ranks that hold them (mrl_model_tp_sync_grads; ZeRO-1 and 2: in the rank's shard) once an
-- update's backwards are done: before the norm, or the step without one.
function M.parallel_norm(opt, model, par)
  local tpw, counted, copy = par.tp, {}, model:tied_copy()
  for _, v in ipairs(model:views()) do
    local split = tpw and C.mrl_model_tp_split(model.handle, v.name) ~= 0
    local mine = not tpw or (split and tpw.rank % C.mrl_model_tp_copies(model.handle, v.name) == 0) or
      (not split and tpw.rank == 0)
    if mine and not (copy and v.offset == copy.offset) then
      local last = counted[#counted]
      if last and last[1] + last[2] == v.offset then last[2] = last[2] + v.numel
      else counted[#counted + 1] = { v.offset, v.numel } end
    end
  end
  local synced = false
  local function sync(o)
    if synced then return end
    if o.sync then o:sync() end
    local sharded = (o.zero or 0) >= 1 -- (the shard's range is the one summed over the data-parallel ranks)
    if tpw then moonrl.check(C.mrl_model_tp_sync_grads(model.handle, sharded and o.shard_grads or nil, sharded and o.offset or 0,
      sharded and o.count or 0), 3) end
    if model.pp and (o.zero or 0) >= 2 then require('moonrl.train.pipeline').sync_tied_shard(model, o) end -- (a tied head's)
    synced = true
  end
  if opt.world then -- M.data_parallel's: its norm of the counted ranges, then summed over the group
    opt.counted, opt.norm_group = counted, par.group
    local norm = opt.grad_norm
    function opt.grad_norm(o)
      sync(o)
      return norm(o)
    end
  else
    local out = ffi.new('double[1]')
    function opt.grad_norm(o)
      sync(o)
      local g, s = o.grads or o:bind_grads(), 0
      for _, r in ipairs(counted) do
        moonrl.check(C.mrl_grad_norm(g + r[1], r[2], out), 3)
        s = s + out[0] * out[0]
      end
      return math.sqrt(par.group:sum(s))
    end
    opt.clip_grad_norm = clip_grad_norm
  end
  local step, zero = opt.step, opt.zero_grad
  function opt.step(o, ...)
    sync(o)
    synced = false
    return step(o, ...)
  end
  function opt.zero_grad(o, ...) -- (an update dropped: the next one syncs again)
    synced = false
    return zero(o, ...)
  end
  local zero_model = model.zero_grad
  model.zero_grad = function(m, ...)
    synced = false
    return zero_model(m, ...)
  end
  return opt
end

-- Shard `index` of the layout over n elements: offset, count (mrl_dist_group_shard).
local shard_out = ffi.new('int64_t[2]')
function M.layout_shard(layout, n, index)
  C.mrl_dist_group_shard(n, layout.world.size, layout.shards, index or layout.index, shard_out, shard_out + 1)
  return tonumber(shard_out[0]), tonumber(shard_out[1])
end

-- A parameter gather over the layout's group (mrl_dist_param_gather: its ranks' shards in the
-- layout), collected with its owner.
local function param_gather(layout, n)
  local out = ffi.new('mrl_dist_param_gather *[1]')
  check(C.mrl_dist_param_gather_create(layout.group.handle, n, layout.world.size, out))
  return ffi.gc(out[0], C.mrl_dist_param_gather_free)
end

-- A function that makes a buffer of n floats whole, each rank's shard of the layout being in
-- place: an all-gather of the shards over the world, or (hybrid sharding) within the group.
local function whole_gather(layout, n)
  if layout.shards == layout.world.size then
    return function(buf) check(C.mrl_dist_allgather_shards(layout.world.handle, buf, n, C.MRL_DIST_F32)) end
  end
  local g = param_gather(layout, n)
  return function(buf)
    check(C.mrl_dist_param_gather_start(g, buf, 0, n))
    check(C.mrl_dist_param_gather_wait(g, buf, 0, n))
  end
end

-- whole_gather for a GPU buffer: over the world, World:gpu_allgather_shards (NCCL, or through
-- the host); within the groups of hybrid sharding, through the host.
local function gpu_whole_gather(layout, n)
  local w = layout.world
  if layout.shards == w.size then return function(buf) w:gpu_allgather_shards(buf, n) end end
  local gather, o, c = whole_gather(layout, n), M.layout_shard(layout, n)
  return function(buf)
    local host = host_staging(w, n)
    if c > 0 then moonrl.check(C.mrl_device_memcpy(host + o, buf + o, 4 * c)) end
    gather(host)
    moonrl.check(C.mrl_device_memcpy(buf, host, 4 * n))
  end
end

-- A model loaded by shard (model.load_shard with the layout's shard) gets its gathers: every
-- forward and backward then gathers each part into place over the layout's group (a
-- collective: every rank runs the same ones), rank 0 writes what m:save writes. Every rank calls
-- it. layout: M.shard_layout's (a World: its plain layout).
function M.shard_model(layout, model)
  if not layout.shards then layout = M.shard_layout(layout) end
  model:set_param_gather(param_gather(layout, model.n_params), layout.world.rank == 0)
  model.shard_layout = layout
end

-- The sum of a sharded model's parameters, the same on every rank of its layout (a finiteness
-- check before an update is kept or the model saved): the shards of the first group (under
-- hybrid sharding the others hold copies), each summed where it lives, added over the ranks.
function M.sharded_sum(model)
  local off, cnt = model:shard()
  local s = cnt > 0 and model.shard_layout.replica == 0 and require('moonrl.train.ops').sum(model:param_buffer() + off,
    cnt) or 0
  return model.shard_layout.world:sum(s)
end

-- A whole fp32 copy of a sharded model's parameters on every rank (the engine's, which
-- generates alone): each rank's shard put in place and all-gathered; refresh() does it again
-- after an update. copy.buf: n floats (counted as parameters), where the model is (on a GPU the
-- compute copy of M.compute_copy in fp32, gathered part by part).
function M.whole_copy(model)
  if model.gpu then
    local copy = M.compute_copy(model, false, true)
    copy.buf, copy.n = C.mrl_model_copy_params(copy.handle), model.n_params
    return copy
  end
  local offset, count = model:shard()
  local n = model.n_params
  local buf = C.mrl_mem_alloc(4 * n, C.MRL_MEM_PARAMS)
  if buf == nil then moonrl.run_error('the whole copy of a sharded model: ' .. moonrl.last_error()) end
  local copy = { buf = ffi.gc(ffi.cast('float *', buf), C.mrl_mem_free), n = n }
  function copy.bytes() return 4 * n end
  local gather = whole_gather(model.shard_layout, n)
  function copy.refresh()
    ffi.copy(copy.buf + offset, model:param_buffer() + offset, 4 * count)
    gather(copy.buf)
  end
  copy.refresh()
  return copy
end

-- The engine's compute copy of a sharded model (model.h's mrl_model_copy), on its device: of a
-- bf16 model the bf16 copies of the matrices whole (with panels: their weight panels too) and
-- in fp32 only the tensors the engine reads in fp32, refreshed part by part as the forward
-- gathers them, so the fp32 weights are never whole on a rank; of an fp32 model (or fp32) every
-- tensor in fp32. copy.handle goes to Engine:set_home_copy; refresh() after an update (a
-- collective, as whole_copy's); bytes(): what it holds.
function M.compute_copy(model, panels, fp32)
  local out = ffi.new('mrl_model_copy *[1]')
  check(C.mrl_model_copy_create(model.handle, bit.bor(panels and C.MRL_MODEL_COPY_PANELS or 0,
    fp32 and C.MRL_MODEL_COPY_FP32 or 0), out))
  local c = ffi.gc(out[0], C.mrl_model_copy_free)
  local copy = { handle = c }
  function copy.refresh() check(C.mrl_model_copy_refresh(c)) end
  function copy.bytes() return tonumber(C.mrl_model_copy_bytes(c)) end
  copy.refresh()
  return copy
end

-- ---- data parallel optimizer ------------------------------------------------------------------


local DP = {}
DP.__index = DP

-- opt: a moonrl.optim AdamW over model's buffers. opts.zero: 0 (every rank keeps the whole
-- optimizer state and steps it), 1 (ZeRO-1: rank r keeps and steps only its shard of the
-- state, then the parameters are all-gathered; made from a deferred opt (optim.adamw's defer),
-- whose whole state is then never allocated) or 2 (ZeRO-2: and only its shard of the gradients:
-- the model lends each part of its backward a window of that range from C's
-- mrl_dist_grad_shard, reduce-scattered into the shard as soon as it is final and then reused;
-- the model's own gradient buffer is never made) or 3 (ZeRO-3: and only its shard of the
-- parameters: model was loaded by shard, M.shard_model, and nothing is all-gathered after the
-- step); opts.bucket_mb: gradient bucket size (ZeRO-2 and 3: the reduce-scatter's segment);
-- opts.shard_group: hybrid sharding (ZeRO-2 and 3): the state sharded within groups of that many
-- consecutive ranks and replicated across the groups (M.shard_layout), the gradients still
-- summed over every rank in rank order (the bits of plain data parallel);
-- opts.gpu_transport: how a GPU model's gradient sums travel (World:gpu_transport).
function M.data_parallel(w, opt, model, opts)
  opts = opts or {}
  local zero = opts.zero or 0
  local n = opt.n
  local self = setmetatable({ world = w, full = opt, zero = zero, model = model, params = opt.params, n = n,
    lr = opt.lr, pending = false, sharded = zero >= 1 }, DP)
  if (opts.shard_group or 0) > 0 and opts.shard_group ~= w.size and zero < 2 then
    moonrl.usage_error(string.format('dist.shard_group=%d shards the gradients and parameters within groups: it needs '
      .. 'dist.zero=2 or 3 (dist.zero=%d)', opts.shard_group, zero))
  end
  local layout = zero >= 2 and M.shard_layout(w, opts.shard_group) or M.shard_layout(w)
  self.layout = layout
  -- the checkpoint's optimizer files: one a shard, written by the first group's ranks
  self.shard_index, self.shard_count, self.shard_writes = layout.index, layout.shards, layout.replica == 0
  local device = C.mrl_device_of(opt.params)
  if zero >= 2 and not model then error('dist.zero=2: the optimizer must name its model (opt.model)', 2) end
  if device.kind ~= C.MRL_DEVICE_CPU then
    -- a GPU model's: ZeRO-0 and 1 sum the whole gradient buffer once the backward is done
    -- (dist.gpu_transport: NCCL, or through the host), no buckets; ZeRO-2 and 3's windows are in
    -- the GPU's memory, reduce-scattered by NCCL or through the host (ZeRO-3's parts gathered so)
    self.gpu = w:gpu_transport(opts.gpu_transport or 'auto', device.index)
  end
  if zero >= 2 then
    local out = ffi.new('mrl_dist_grad_shard *[1]')
    check(C.mrl_dist_grad_shard_create(w.handle, n, math.floor((opts.bucket_mb or 25) * 2 ^ 20), layout.shards, out))
    self.grad_shard = ffi.gc(out[0], C.mrl_dist_grad_shard_free)
    if self.gpu then check(C.mrl_dist_grad_shard_set_device(out[0], device)) end
    if self.gpu == 'nccl' and layout.shards == w.size then -- (hybrid sharding's sums go through the host)
      check(C.mrl_dist_grad_shard_set_nccl(out[0], w.nccl))
      if zero == 3 and model._gather then check(C.mrl_dist_param_gather_set_nccl(model._gather, w.nccl)) end
    end
    self.shard_grads = C.mrl_dist_grad_shard_grads(out[0])
    C.mrl_model_set_grad_windows(model.handle, C.mrl_dist_grad_shard_acquire, out[0])
    model.grad_windows = true -- (its backwards are collectives: moonrl.train.step's collective)
    C.mrl_model_set_grad_hook(model.handle, C.mrl_dist_grad_shard_ready, out[0])
  else
    self.grads = opt:bind_grads()
    if not self.gpu then
      local out = ffi.new('mrl_dist_buckets *[1]')
      local mode = zero == 1 and C.MRL_DIST_BUCKETS_REDUCE_SCATTER or C.MRL_DIST_BUCKETS_ALLREDUCE
      moonrl.check(C.mrl_dist_buckets_create(w.handle, self.grads, n, math.floor((opts.bucket_mb or 25) * 2 ^ 20), mode,
        out))
      self.buckets = ffi.gc(out[0], C.mrl_dist_buckets_free)
    end
  end
  -- the shard bounds of every rank (the gradient norm is summed over these pieces, one a rank,
  -- in every mode: ZeRO and plain data parallel clip by the same bits), and this rank's shard of
  -- the state (the same piece; under hybrid sharding the pieces of its group's shard)
  self.shards = {}
  for r = 0, w.size - 1 do
    local first, last = w:share(n, r)
    self.shards[r + 1] = { offset = first - 1, count = last - first + 1 }
  end
  local o, c = M.layout_shard(layout, n)
  local mine = { offset = o, count = c }
  self.per = w.size / layout.shards -- norm pieces a shard holds
  self.offset, self.count = mine.offset, mine.count
  -- ZeRO-1 and 2: the parameters made whole again after each step (within the group under
  -- hybrid sharding); ZeRO-3's shards stay as they are, gathered by the model as it computes
  if self.gpu and (zero == 1 or zero == 2) then
    self.gather_params = gpu_whole_gather(layout, n)
  elseif zero == 1 or zero == 2 then
    self.gather_params = whole_gather(layout, n)
  end
  if zero == 3 then
    local off, cnt = model:shard()
    if off ~= mine.offset or cnt ~= mine.count then
      error(string.format('dist.zero=3: the model holds %s, not this rank\'s shard [%d, %d) (load it with dist.shard_model)',
        off and string.format('[%d, %d)', off, off + cnt) or 'every parameter', mine.offset, mine.offset + mine.count), 2)
    end
  end
  self.after_step = {} -- functions called after each step (a sharded model's whole copies)
  if zero == 1 then self.shard_grads = self.grads + mine.offset end
  if zero == 0 then
    opt:create()
  else
    -- the shard's own AdamW: its state is 1/N of the whole (opt, deferred, never gets one)
    local ranges = {}
    for _, r in ipairs(opt.no_decay or model:no_decay_ranges()) do
      local a, b = math.max(r[1], mine.offset), math.min(r[1] + r[2], mine.offset + mine.count)
      if b > a then ranges[#ranges + 1] = { a - mine.offset, b - a } end
    end
    if mine.count <= 0 then error('dist.zero: fewer parameters than ranks', 2) end
    self.shard_opt = opt:shard(mine.offset, mine.count, ranges, self.shard_grads)
    self.full = nil
  end
  if model then
    if self.buckets then C.mrl_model_set_grad_hook(model.handle, C.mrl_dist_buckets_ready, self.buckets) end
    -- a new accumulation starts at the model's zero_grad: the next update syncs again
    local zero_grad = model.zero_grad
    -- (and not armed: a session arms every optimizer's buckets at the last micro-batch of any
    -- model's loop, e.g. a critic's, which must not start the policy's early in its next one)
    model.zero_grad = function(m)
      zero_grad(m); self:zero_shard(); self.synced = false
      if self.buckets then C.mrl_dist_buckets_arm(self.buckets, 0) end
    end
    if self.grad_shard then
      -- ZeRO-2: each backward's reduce-scatters are waited for before the next one adds to the
      -- shard (the accumulation then goes micro-batch by micro-batch, the same on every rank)
      local backward = model.backward
      model.backward = function(m, ...)
        backward(m, ...)
        check(C.mrl_dist_grad_shard_finish(self.grad_shard))
      end
    end
  end
  return self
end

-- ZeRO-2 and 3: the bytes this rank's gradient reduce-scatters sent and its parameter gathers
-- received since the last call (the policy's gathers: its forwards too, evaluation and
-- reference log-probs included).
function DP:traffic()
  local sent = self.grad_shard and tonumber(C.mrl_dist_grad_shard_bytes_sent(self.grad_shard)) or 0
  local gathered = self.model and self.model._gather and tonumber(C.mrl_dist_param_gather_bytes_received(self.model._gather)) or 0
  local ds, dg = sent - (self.sent_before or 0), gathered - (self.gathered_before or 0)
  self.sent_before, self.gathered_before = sent, gathered
  return ds, dg
end

-- ZeRO-2: the shard's accumulator to zero (a new update).
function DP:zero_shard()
  if self.grad_shard then C.mrl_dist_grad_shard_zero(self.grad_shard) end
end

-- The gradients this rank holds, as (pointer, count): the whole buffer, or (ZeRO-2) its shard;
-- what a fault injection poisons.
function DP:grad_span()
  if self.grad_shard then return self.shard_grads, self.count end
  return self.grads, self.n
end

-- The next backward is the last of this update: its buckets start as they become final.
function DP:arm()
  if self.buckets then C.mrl_dist_buckets_arm(self.buckets, 1) end
end

-- Wait for the gradient sums (once per update; the first reader of the gradients calls it).
function DP:sync()
  if self.synced then return end
  self.synced = true
  if self.gpu and not self.grad_shard then
    self.world:gpu_allreduce(self.grads, self.n)
    self.overlapped = 0
    return
  end
  if self.grad_shard then -- every backward's ranges are summed already (its wrapper waited)
    self.overlapped = 0
    return
  end
  check(C.mrl_dist_buckets_finish(self.buckets))
  -- buckets whose sums started while the backward ran (the rest waited for the end)
  self.overlapped = tonumber(C.mrl_dist_buckets_overlapped(self.buckets))
end

-- sum of g^2 of every shard, added in rank order: the same bits in both modes
local norm_out = ffi.new('double[1]')
function DP:grad_norm()
  self:sync()
  local w = self.world
  local parts = ffi.new('double[?]', w.size)
  local function part(s)
    if s.count <= 0 then return 0 end
    local g = self.zero >= 1 and self.shard_grads + (s.offset - self.offset) or self.grads + s.offset
    if not self.counted then
      moonrl.check(C.mrl_grad_norm(g, s.count, norm_out), 3)
      return norm_out[0] * norm_out[0]
    end
    local sum = 0 -- tensor parallel (M.tp_norm): the ranges this rank counts
    for _, r in ipairs(self.counted) do
      local a, b = math.max(r[1], s.offset), math.min(r[1] + r[2], s.offset + s.count)
      if b > a then
        moonrl.check(C.mrl_grad_norm(g + (a - s.offset), b - a, norm_out), 3)
        sum = sum + norm_out[0] * norm_out[0]
      end
    end
    return sum
  end
  if self.zero >= 1 then
    -- the pieces of this rank's shard (hybrid sharding: several, which the first group's ranks
    -- give), every rank's in rank order: piece j is rank j // per's slot j % per
    local per = self.per
    local mine = ffi.new('double[?]', per)
    local first = self.layout.index * per
    for i = 0, per - 1 do mine[i] = part(self.shards[first + i + 1]) end
    local all = ffi.new('double[?]', w.size * per)
    check(C.mrl_dist_allgather(w.handle, mine, 8 * per, all))
    for j = 0, w.size - 1 do parts[j] = all[j] end -- (the first group's ranks' slots are pieces 0 .. size - 1)
  else
    for r = 1, w.size do parts[r - 1] = part(self.shards[r]) end
  end
  local total = 0
  for r = 0, w.size - 1 do total = total + parts[r] end
  if self.norm_group then total = self.norm_group:sum(total) end -- (tensor parallel: over the group)
  return math.sqrt(total)
end

DP.clip_grad_norm = clip_grad_norm -- (the gradients' sums waited for by grad_norm)

-- The gradients this rank steps with: all of them, or its shard (ZeRO-1 and 2).
function DP:scale_grad(s)
  self:sync()
  if self.zero >= 1 then
    if self.count > 0 then moonrl.check(C.mrl_grad_scale(self.shard_grads, self.count, s), 2) end
  else
    moonrl.check(C.mrl_grad_scale(self.grads, self.n, s), 2)
  end
end

function DP:step(lr)
  self:sync()
  if self.grad_shard then C.mrl_dist_grad_shard_trim(self.grad_shard) end -- (the windows: until the next backward)
  if self.zero >= 1 then
    if self.count > 0 then self.shard_opt:step(lr) end
    if self.gather_params then self.gather_params(self.params) end
  else
    self.full:step(lr)
  end
  if self.model then self.model:trained() end -- the gathered shards too (a bf16 model's copies)
  for _, f in ipairs(self.after_step) do f() end
  self.synced = false
end

-- The sum of the parameters, the same on every rank (a guard's finiteness check): ZeRO-3's
-- shards summed over the ranks (M.sharded_sum); the whole buffer otherwise.
function DP:param_sum()
  if self.zero < 3 then return require('moonrl.train.ops').sum(self.params, self.n) end
  return M.sharded_sum(self.model)
end

-- A new accumulation: the gradients go to zero and the buckets wait for the next backward.
function DP:zero_grad()
  if self.grad_shard then self:zero_shard() else moonrl.check(C.mrl_grad_zero(self.grads, self.n), 2) end
  if self.buckets then C.mrl_dist_buckets_arm(self.buckets, 0) end
  self.synced = false
end

function DP:steps() return (self.shard_opt or self.full):steps() end

-- The optimizer state a checkpoint saves. Plain data parallel: the whole state, the same on
-- every rank (rank 0 writes it). ZeRO-1: this rank's shard alone (n: its count), with where it
-- lies in the whole (offset, total): each rank writes its own file (moonrl.train.checkpoint) and
-- nothing is gathered, so no rank ever holds more than its shard.
function DP:state()
  if self.zero == 0 then return self.full:state() end
  local s = self.shard_opt:state()
  s.offset, s.total = self.offset, self.n
  return s
end

-- ZeRO-1's resume: read(first, count, m, v) puts elements [first, first + count) of the saved m
-- and v into m[0..count) and v[0..count), here the shard optimizer's own buffers (CPU); then
-- the step count. Nothing of the other shards is read or held.
function DP:load_range(read, step)
  local s = self.shard_opt:state()
  read(self.offset, self.count, s.m, s.v)
  self.shard_opt:load_state({ m = s.m, v = s.v, n = s.n, step = step }) -- (the step: a copy onto itself is none)
end

-- Plain data parallel's restore from the whole state (m, v of n floats each); ZeRO-1 resumes
-- through DP:load_range, so that no rank holds the whole state.
function DP:load_state(s)
  if self.zero >= 1 then error('dist.zero: an optimizer shard is restored by DP:load_range', 2) end
  return self.full:load_state(s)
end

-- Bytes of optimizer state this rank holds (1/N of the whole with ZeRO-1 and 2).
function DP:state_bytes() return 8 * ((self.zero >= 1) and self.count or self.n) end

return M
