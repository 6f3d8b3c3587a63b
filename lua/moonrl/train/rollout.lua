-- moonrl.train.rollout: where and when a recipe's rollouts run (async.mode, dist.rollout_ranks), so
-- that the recipe states only what one rollout is:
--
--   S:rollout(function(step)              -- prompts -> completions -> rewards, for batch `step`
--     ...; return samples, info           -- samples (each with .score), info: JSON-able metrics
--   end, { engine = e })                  -- the engine it generates with (default S.engine)
--   for step in S:steps() do
--     local samples, info = S:next_batch() -- this step's batch, however it was made
--     ...
--
-- Modes (async.mode):
--   sync          batch s is generated with the weights after step s-1 (version s-1), then
--                 trained on: generation and training wait for each other.
--   one_step_off  batch s is generated with version s-2: batch s+1 is generated while batch s
--                 trains (NeMo-RL / verl one-step-off); staleness 1.
--   async         up to async.max_staleness = k batches ahead: batch s uses version s-1-k. A
--                 bounded queue of k batches between the rollouts and the trainer (AReaL-style
--                 bounded staleness, at batch granularity: each batch is generated with the
--                 newest weights the schedule allows).
-- With async.partial = 'finish' (the default) the schedule is fixed, so a run is deterministic
-- and its batches (and results) do not depend on where the rollouts run. With 'continue' a
-- version published while a batch is generated is taken by its requests from the next token on
-- (PipelineRL; KV cache kept): fresher samples, timing-dependent.
--
-- Where: in this process, between steps (or, async.engine_threads = N, on an engine thread
-- beside the step's training, from a copy of the weights: the same batches); or on
-- dist.rollout_ranks = R ranks of the job (the last R ranks; they only generate and score, the
-- others train): after each update trainer rank 0 publishes the weights as a numbered version
-- (a weight store in shared memory for the rollout ranks of its host, async.weights; else an
-- MPI broadcast), and the rollout ranks send each batch back. Every sample carries .version,
-- the policy version of its first token (.version_switches: later tokens' newer ones); a sample
-- more than async.max_staleness versions behind the weights it trains is dropped
-- (async.stale = 'drop') or its advantage scaled by async.stale_weight ('downweight'), and
-- counted.
--
-- async.stream = true (rollout ranks, async.partial=continue): the rollout ranks keep one engine
-- for the whole phase and queue batch j's requests as soon as the weights of version
-- j - 1 - max_staleness are published, while the batches before it are still generated: the
-- engine never drains at a batch's end (no straggler bubble), each request takes the newest
-- weights between steps, and batch j goes to the trainers once its last group is done. The
-- trainers take batch j when it comes (nothing is queued on their side). Timing-dependent.
-- async.stream_unit = 'group' (one rollout rank): each group a rollout of its own, a batch the
-- first groups to finish (serve_groups below).
--
-- Checkpoints hold the batches generated but not yet trained on (S.extra.pending, the same
-- JSON a rollout rank sends), and the data position and generators after the last of them:
-- a resumed run trains on exactly the batches the uninterrupted one would have, none dropped
-- or counted twice, and the rollouts go on from the checkpoint's weights.
local ffi = require('ffi')
local moonrl = require('moonrl')
local json = require('moonrl.io.json')
local C = moonrl.C
local sections = require('moonrl.train.sections')
local dist = require('moonrl.train.dist')
local fault = require('moonrl.train.fault')

local M = {}

-- ---- batches as text: what goes over the wire and into checkpoints --------------------------

local SKIP = { record = true, prompt_ids = true, rank = true, group = true }

-- samples: a list whose consecutive samples of one group share their prompt_ids table.
function M.encode(samples, info)
  local groups, group_of, list = {}, {}, {}
  for i, s in ipairs(samples) do
    local g = group_of[s.prompt_ids]
    if not g then
      groups[#groups + 1] = json.array(s.prompt_ids)
      g = #groups
      group_of[s.prompt_ids] = g
    end
    local e = json.object({ 'g', g })
    if type(s.routing) == 'cdata' then -- the engine's routing record (moe.routing_replay): int16 per entry
      local list = {}
      for k = 0, ffi.sizeof(s.routing) / 2 - 1 do list[k + 1] = s.routing[k] end
      e.routing = json.array(list)
    end
    for k, v in pairs(s) do
      if not SKIP[k] and type(k) == 'string' then
        local t = type(v)
        if t == 'number' or t == 'string' or t == 'boolean' or (t == 'table' and (json.is_array(v) or json.is_object(v))) then
          e[k] = v
        end
      end
    end
    list[i] = e
  end
  return json.encode(json.object({ 'groups', groups, 'samples', list, 'info', info or json.object() }))
end

function M.decode(text, source)
  local t = json.decode(text, source or 'rollout batch')
  local samples = {}
  for i, e in ipairs(t.samples) do
    local s = {}
    for k, v in pairs(e) do if k ~= 'g' then s[k] = v end end
    if type(s.routing) == 'table' then -- back to the int16 record batch.pack_routing reads
      local r = ffi.new('int16_t[?]', #s.routing)
      for k = 1, #s.routing do r[k - 1] = s.routing[k] end
      s.routing = r
    end
    s.prompt_ids, s.group = t.groups[e.g], e.g -- one table per group: batch.pack shares its rows
    samples[i] = s
  end
  return samples, t.info
end

-- ---- the schedule --------------------------------------------------------------------------

local CORRECTIONS = { auto = true, none = true, tis = true, tis_seq = true, mis_token = true, mis_seq = true, mis_geo = true }

local function check_config(cfg)
  local a = cfg.async
  if not a then return end
  local ok = { sync = true, one_step_off = true, async = true }
  if not ok[a.mode] then
    moonrl.usage_error(string.format("config key 'async.mode' must be sync, one_step_off or async, got '%s'", tostring(a.mode)))
  end
  if a.decoupled ~= 'auto' and a.decoupled ~= 'true' and a.decoupled ~= 'false' then
    moonrl.usage_error(string.format("config key 'async.decoupled' must be auto, true or false, got '%s'", tostring(a.decoupled)))
  end
  if a.mode == 'async' and a.max_staleness < 1 then
    moonrl.usage_error("async.mode=async needs async.max_staleness >= 1 (0 is sync)")
  end
  if a.mode == 'one_step_off' and a.max_staleness < 1 then
    moonrl.usage_error('async.mode=one_step_off makes samples 1 version stale: async.max_staleness must be >= 1')
  end
  if not CORRECTIONS[a.correction] then
    moonrl.usage_error(string.format("config key 'async.correction' must be none, tis, tis_seq, mis_token, mis_seq " ..
      "or mis_geo, got '%s'", tostring(a.correction)))
  end
  if a.stale ~= 'drop' and a.stale ~= 'downweight' then
    moonrl.usage_error(string.format("config key 'async.stale' must be drop or downweight, got '%s'", tostring(a.stale)))
  end
  if a.partial ~= 'finish' and a.partial ~= 'continue' then
    moonrl.usage_error(string.format("config key 'async.partial' must be finish or continue, got '%s'", tostring(a.partial)))
  end
  if a.weights ~= 'auto' and a.weights ~= 'shm' and a.weights ~= 'mpi' then
    moonrl.usage_error(string.format("config key 'async.weights' must be auto, shm or mpi, got '%s'", tostring(a.weights)))
  end
  local remote = cfg.dist and cfg.dist.rollout_ranks > 0
  if a.engine_threads > 0 and (sections.lag(cfg) == 0 or remote) then
    moonrl.usage_error('async.engine_threads overlaps the next batch with this step in one process: it needs ' ..
      'async.mode one_step_off or async, and no dist.rollout_ranks')
  end
  if a.stream then
    if not remote or sections.lag(cfg) == 0 or a.partial ~= 'continue' then
      moonrl.usage_error('async.stream=true streams batches from dist.rollout_ranks with requests of several ' ..
        'batches in one engine: it needs dist.rollout_ranks, async.mode one_step_off or async, and ' ..
        'async.partial=continue')
    end
  end
  if a.stream_unit ~= 'batch' and a.stream_unit ~= 'group' then
    moonrl.usage_error(string.format("config key 'async.stream_unit' must be batch or group, got '%s'",
      tostring(a.stream_unit)))
  end
  if a.stream_unit == 'group' and not (a.stream and cfg.dist.rollout_ranks == 1) then
    moonrl.usage_error('async.stream_unit=group regroups finished groups into batches on one rollout rank: it needs ' ..
      'async.stream=true and dist.rollout_ranks=1')
  end
  if a.weights_delta then
    local bf16 = cfg.model and (cfg.model.dtype == 'bf16' or cfg.model.dtype == 'bfloat16')
    if not remote or a.weights == 'shm' or not bf16 or a.partial == 'continue' or a.stream then
      moonrl.usage_error('async.weights_delta=true sends the rollout ranks the bf16 values that changed: it needs ' ..
        'dist.rollout_ranks, model.dtype=bf16, async.weights auto or mpi, and neither async.stream nor ' ..
        'async.partial=continue')
    end
  end
  if a.partial == 'continue' then
    if sections.lag(cfg) == 0 then moonrl.usage_error('async.partial=continue needs async.mode one_step_off or async') end
    if not remote and a.engine_threads == 0 then
      moonrl.usage_error('async.partial=continue updates requests in flight: it needs dist.rollout_ranks or ' ..
        'async.engine_threads (in one process the batch is generated between steps, with nothing to update it)')
    end
    if remote and a.weights == 'mpi' then
      moonrl.usage_error('async.partial=continue takes new weights between generation steps through shared memory: ' ..
        'not with async.weights=mpi')
    end
  end
end
M.check_config = check_config


-- ---- the rollouts of a session -----------------------------------------------------------------
-- S:rollout(fn, opts) makes them (S.rollouts); the session's loop drives them: S:next_batch()
-- (next_batch), the end of each step (after_update), a rollback, the start of a loop (begin, or
-- serve on a rollout rank). Their state beside the session's: the pending batches, the weight
-- stores, the batch in flight on an engine thread.

local Rollouts = {}
Rollouts.__index = Rollouts
M.Rollouts = Rollouts

-- S: the session; fn(step) -> samples, info: one rollout; opts.engine: the engine it generates
-- with (default S.engine), which shared-memory weights, in-flight updates and the engine thread drive.
function M.new(S, fn, opts)
  local cfg = S.cfg
  return setmetatable({ S = S, rollout_fn = fn, rollout_engine = opts and opts.engine or S.engine,
    -- trainers whose policy is sharded (dist.zero=3) send the rollout ranks their shards
    -- themselves (deliver_shards), every trainer in it: no rank holds the weights whole
    -- ZeRO-3's shards, tensor parallel's slices or pipeline stages: each trainer sends its own (deliver_shards)
    shard_delivery = cfg.dist and (cfg.dist.zero == 3 or (cfg.dist.tp or 1) > 1 or (cfg.dist.pp or 1) > 1 or
      (cfg.dist.rollout_tp or 1) > 1 or cfg.async.weights_delta) and (cfg.dist.rollout_ranks or 0) > 0 },
    Rollouts)
end

-- The step's async metrics: staleness, queue, waits, the weight publication.
function Rollouts:metrics(info)
  local m = info and info.async
  if not m then return nil end
  -- idle shares: the trainer's wait for this batch over its step so far; the rollout side's
  -- wait for weights over that wait plus its generation of the batch
  local step_s = moonrl.now() - self.S.run.step_t0
  m.trainer_idle_share = step_s > 0 and math.min(1, m.trainer_wait_seconds / step_s) or 0
  if info.rollout_wait_seconds and info.gen_seconds then
    local busy = info.rollout_wait_seconds + info.gen_seconds
    m.rollout_idle_share = busy > 0 and info.rollout_wait_seconds / busy or 0
  end
  if self.publish_info then m.publish = self.publish_info; self.publish_info = nil end
  return m
end

-- ---- weight versions through a weight store (moonrl/weight_store.h) ------------------------
-- Trainer rank 0 publishes each version into shared memory for the rollout ranks of its host
-- (one copy; their engines read it in place), or, in one process, for the engine thread (its
-- double buffer: the weights of the batch it generates, while the update changes the model's).
-- A store's versions only grow; a phase start or a rollback publishes policy versions that came
-- before, so a store version is epoch * 2^32 + the policy version.
local EPOCH = 2 ^ 32
local function store_version(self, v) return (self.epoch or 0) * EPOCH + v end
local function policy_version(sv) return sv % EPOCH end
local function next_epoch(self) self.epoch = (self.epoch or 0) + 1 end

-- Each sample's policy version: its first token's, as the engine recorded it from a store (and
-- its later switches), else `version`, the weights it was generated with.
local function stamp_versions(samples, version)
  for _, s in ipairs(samples) do
    s.version = s.version and policy_version(s.version) or version
    for _, sw in ipairs(s.version_switches or {}) do sw[2] = policy_version(sw[2]) end
  end
end

local function new_store(name, n, readers)
  local h = ffi.new('mrl_weight_store *[1]')
  moonrl.check(C.mrl_weight_store_create(name, n, readers, h), 3)
  return ffi.gc(h[0], C.mrl_weight_store_free)
end

local function free_store(st)
  ffi.gc(st, nil)
  C.mrl_weight_store_free(st)
end

-- The whole weights this process has: the policy's buffer, or a sharded policy's whole copy
-- (the engine's, all-gathered after each update).
-- What a version sends to the rollout ranks by MPI: the policy's LoRA adapters when it trains
-- them (the rollout ranks hold the same base: it went at the phase's start), else its weights.
local function version_weights(S)
  if S.policy:lora() then return S.policy:lora_buffer() end
  return S.policy:params()
end

-- A version received into version_weights' buffer: the model's generation moves on.
local function received(S)
  if S.policy:lora() then S.policy:trained() end
end

local function whole_weights(S)
  if S.engine_copy then
    -- (a bf16 compute copy is not whole fp32: a session makes one only where nothing publishes)
    assert(S.engine_copy.buf, 'the whole weights of a sharded policy whose engine reads a bf16 compute copy')
    return S.engine_copy.buf, S.engine_copy.n
  end
  return S.policy:params()
end

-- ZeRO-3, tensor or pipeline parallel with rollout ranks: every trainer sends its shard (or its
-- slices, or its shard of them, or its stage's tensors) of the weights to every rollout rank
-- (under hybrid sharding the first group's trainers, under tensor or pipeline parallel the first
-- data-parallel group's). The export is in Hugging Face coordinates: at the first delivery each
-- sending trainer's slice table (Model:slices of its export) goes to every rank, and a rollout
-- rank plans where each trainer's slices land in its own model (Model:slice_plan; a rollout rank
-- of a tensor-parallel group, dist.rollout_tp, takes its part of each tensor). Rollout ranks that
-- hold the policy whole take every trainer's whole export: one all-to-all-v of the same buffer
-- (mrl_dist_send_pieces), received straight into the policy when each export lands whole where
-- it arrives (the same layout), else into a staging buffer copied from by the plan. Rollout ranks
-- that hold slices tell each trainer the ranges of its export they take, once; each version the
-- trainers pack each one's ranges and one all-to-all-v (mrl_dist_alltoallv) sends each rank
-- exactly those: no byte goes to a rank that does not hold it, and no rank gathers the whole
-- model. Every rank of the job calls it.
local function shard_plans(self, job)
  local policy, T = self.S.policy, job.size - self.S.cfg.dist.rollout_ranks
  -- (sharded: the first shard group's trainers; tensor or pipeline parallel: the first data-parallel
  -- group's; context parallel, whose ranks hold the same weights: its first rank's)
  local cp = self.S.cp_world
  local sends = job.rank < T and (policy.shard_layout and policy.shard_layout.replica == 0 or
    not policy.shard_layout and self.S.world.rank == 0 and (not cp or cp.rank == 0))
  local tables = job:gather_strings(sends and json.encode(policy:slices(policy:export_range())) or '')
  local p = { counts = ffi.new('int64_t[?]', job.size), to = ffi.new('uint8_t[?]', job.size), from = {},
    in_place = true, total = 0, recv_counts = ffi.new('int64_t[?]', job.size), send_counts = ffi.new('int64_t[?]', job.size) }
  local wants, exact = {}, job.rank >= T and policy:tp() > 1 -- (a rollout rank of slices: its ranges of each)
  for q = 0, job.size - 1 do
    p.to[q] = q >= T and 1 or 0
    if tables[q + 1] ~= '' then
      local slices = json.decode(tables[q + 1], string.format("trainer %d's weight slices", q))
      local count = 0
      for _, sl in ipairs(slices) do count = count + sl.count * (sl.rows or 1) end
      p.counts[q] = count
      if job.rank >= T then
        local plan = policy:slice_plan(slices)
        if exact then -- the ranges of q's export this rank takes, in plan order: received one after the other
          local mine, got = {}, 0
          for _, c in ipairs(plan) do mine[#mine + 1], got = { c.at, c.count }, got + c.count end
          wants[tostring(q)] = mine
          p.from[#p.from + 1] = { at = p.total, plan = plan, q = q }
          p.recv_counts[q], p.total = got, p.total + got
        else
          local c = plan[1]
          if count > 0 and not (#plan == 1 and c.at == 0 and c.to == p.total and c.count == count) then p.in_place = false end
          p.from[#p.from + 1] = { at = p.total, plan = plan, q = q }
          p.total = p.total + count
        end
      elseif not exact then
        p.total = p.total + count
      end
    end
  end
  -- whether any rollout rank takes a part only: then every rank goes the exact way
  p.delta = self.S.cfg.async.weights_delta -- (async.weights_delta: the packed way, whatever the layouts)
  p.exact, p.ranges = job:any(exact) or p.delta, exact
  if p.exact then
    local all = job:gather_strings(exact and json.encode(wants) or '')
    p.packs, p.send_total = {}, 0
    if sends then -- each rollout rank's ranges of this trainer's export
      for r = T, job.size - 1 do
        local w = all[r + 1] ~= '' and json.decode(all[r + 1], string.format("rollout rank %d's ranges", r))[tostring(job.rank)]
        if all[r + 1] == '' then -- (a rollout rank that holds the policy whole: all of it)
          w = { { 0, tonumber(p.counts[job.rank]) } }
        end
        local n = 0
        for _, rg in ipairs(w or {}) do n = n + rg[2] end
        p.packs[r], p.send_counts[r], p.send_total = w or {}, n, p.send_total + n
      end
      p.send_buf = ffi.new('float[?]', math.max(p.send_total, 1))
      if p.delta then -- the last version's bf16 of each one's ranges, and room for the changes
        p.prev16 = ffi.new('uint16_t[?]', math.max(p.send_total, 1))
        p.at, p.val = ffi.new('uint32_t[?]', math.max(p.send_total, 1)), ffi.new('uint16_t[?]', math.max(p.send_total, 1))
      end
    end
    if p.delta then -- a delta's counts: one from each exporting trainer to each rollout rank (pair_*)
      p.d_send_counts, p.d_recv_counts = ffi.new('int64_t[?]', job.size), ffi.new('int64_t[?]', job.size)
      p.counts_out, p.counts_in = ffi.new('int64_t[?]', job.size), ffi.new('int64_t[?]', job.size)
    end
    if p.delta and job.rank >= T then -- where each trainer's stream lands: its plan's copies, by stream position
      for _, f in ipairs(p.from) do
        local n, at = #f.plan, 0
        f.starts, f.tos, f.counts = ffi.new('int64_t[?]', n + 1), ffi.new('int64_t[?]', n + 1), ffi.new('int64_t[?]', n + 1)
        for i, cp in ipairs(f.plan) do
          f.starts[i - 1], f.tos[i - 1], f.counts[i - 1] = p.ranges and at or cp.at, cp.to, cp.count
          at = at + cp.count
        end
      end
    end
    if job.rank >= T and not exact then -- (whole among rollout ranks of slices: its whole plans, received in full)
      for q = 0, T - 1 do p.recv_counts[q] = p.counts[q] end
    end
    p.bytes = 4 * job:sum(p.send_total) -- (every trainer's to every rollout rank: what a version costs)
  end
  -- one number from each exporting trainer to each rollout rank (a version's checksum, a delta's
  -- count): the pairs' counts, and the checksums' buffers
  local exports, receives = p.counts[job.rank] > 0, job.rank >= T
  p.pair_s, p.pair_r = ffi.new('int64_t[?]', job.size), ffi.new('int64_t[?]', job.size)
  for q = 0, job.size - 1 do
    p.pair_s[q] = exports and q >= T and 1 or 0
    p.pair_r[q] = receives and p.counts[q] > 0 and 1 or 0
  end
  p.crc_out, p.crc_in = ffi.new('uint32_t[?]', job.size), ffi.new('uint32_t[?]', job.size)
  if job.rank >= T and (p.exact or not p.in_place) then -- (deltas: whole versions come in bf16)
    local buf = C.mrl_mem_alloc((p.delta and 2 or 4) * math.max(p.total, 1), C.MRL_MEM_PARAMS)
    if buf == nil then moonrl.run_error('the staging buffer of the trainers\' shards: ' .. moonrl.last_error()) end
    if p.delta then p.staging16 = ffi.gc(ffi.cast('uint16_t *', buf), C.mrl_mem_free)
    else p.staging = ffi.gc(ffi.cast('float *', buf), C.mrl_mem_free) end
  end
  return p
end

-- A version's checksum: each sending trainer's CRC-32C of what each rollout rank should now hold
-- of its export (its ranges' current values, in order; with deltas their bf16 values), and each
-- rollout rank's of what it holds there (its policy's weights where the plan put them), compared
-- on the rollout rank: the whole way, packing, transfer and placing, checked every version.
-- Returns true on every rank when all rollout ranks agree.
local crc16 -- (a rollout rank's bf16 of a copy, under deltas)
local function check_version(self, job, p, mine, count)
  local T = job.size - self.S.cfg.dist.rollout_ranks
  if mine then
    local k, off = 0, 0
    for r = T, job.size - 1 do
      local crc = 0
      if p.delta then -- (the bf16 values: what a rollout rank holds after deltas)
        crc = C.mrl_crc32c(0, p.prev16 + off, 2 * p.send_counts[r])
        off = off + p.send_counts[r]
      else
        for _, rg in ipairs(p.exact and p.packs[r] or { { 0, count } }) do crc = C.mrl_crc32c(crc, mine + rg[1], 4 * rg[2]) end
      end
      p.crc_out[k], k = crc, k + 1
    end
  end
  moonrl.check(C.mrl_dist_alltoallv(job.handle, mine and p.crc_out or nil, p.pair_s,
    job.rank >= T and p.crc_in or nil, p.pair_r, 4), 2)
  local bad
  if job.rank >= T then
    local dst, k = self.S.policy:params(), 0
    for _, f in ipairs(p.from) do
      if p.counts[f.q] > 0 then
        local crc = 0
        for _, cp in ipairs(f.plan) do
          if p.delta then
            if not crc16 or crc16.n < cp.count then crc16 = { n = cp.count, buf = ffi.new('uint16_t[?]', cp.count) } end
            C.mrl_convert_f32_to_bf16(dst + cp.to, crc16.buf, cp.count)
            crc = C.mrl_crc32c(crc, crc16.buf, 2 * cp.count)
          else
            crc = C.mrl_crc32c(crc, dst + cp.to, 4 * cp.count)
          end
        end
        if crc ~= p.crc_in[k] and not bad then
          bad = string.format('rollout rank %d\'s weights from trainer %d differ from what it sent (CRC-32C %08x, sent %08x)',
            job.rank, f.q, crc, p.crc_in[k])
        end
        k = k + 1
      end
    end
  end
  if not job:any(bad) then return true end
  if bad then moonrl.log('warn', 'weight sync: %s', bad) end
  return false, bad
end

-- A delta (async.weights_delta): each rollout rank's ranges of this trainer's export whose bf16
-- value changed since the last version go out as (position, bf16 value), the positions in the
-- stream the rank takes; counts first, then positions and values (two all-to-all-v). A rollout
-- rank sets each such element of its policy to the value. Returns the changes this trainer sent.
local function send_delta(job, p, mine, receiving, T)
  local total, off = 0, 0
  for r = 0, job.size - 1 do
    local len = mine and r >= T and tonumber(p.send_counts[r]) or 0
    p.d_send_counts[r] = 0
    if len > 0 then
      local k = tonumber(C.mrl_weights_bf16_delta(p.prev16 + off, p.send_buf + off, len, len, p.at + total, p.val + total))
      p.d_send_counts[r], total, off = k, total + k, off + len
    end
  end
  -- the counts: one to each rollout rank from each trainer that exports
  local k = 0
  for q = T, job.size - 1 do
    if mine then p.counts_out[k], k = p.d_send_counts[q], k + 1 end
  end
  moonrl.check(C.mrl_dist_alltoallv(job.handle, mine and p.counts_out or nil, p.pair_s, receiving and p.counts_in or nil,
    p.pair_r, 8), 2)
  local n_in = 0
  k = 0
  for q = 0, job.size - 1 do
    p.d_recv_counts[q] = 0
    if p.pair_r[q] > 0 then p.d_recv_counts[q], n_in, k = p.counts_in[k], n_in + tonumber(p.counts_in[k]), k + 1 end
  end
  local at_in = receiving and ffi.new('uint32_t[?]', math.max(n_in, 1)) or nil
  local val_in = receiving and ffi.new('uint16_t[?]', math.max(n_in, 1)) or nil
  moonrl.check(C.mrl_dist_alltoallv(job.handle, mine and p.at or nil, p.d_send_counts, at_in, p.d_recv_counts, 4), 2)
  moonrl.check(C.mrl_dist_alltoallv(job.handle, mine and p.val or nil, p.d_send_counts, val_in, p.d_recv_counts, 2), 2)
  return total, at_in, val_in
end

-- A rollout rank: the changes from each trainer (in rank order) into its policy, each position
-- found among the plan's copies by its stream start (both ascend).
local function apply_delta(p, dst, at_in, val_in)
  local j = 0
  for _, f in ipairs(p.from) do
    local n = tonumber(p.d_recv_counts[f.q])
    C.mrl_weights_bf16_apply(dst, f.starts, f.tos, f.counts, #f.plan, at_in + j, val_in + j, n)
    j = j + n
  end
end

local function deliver_shards(self, force_full)
  local job = dist.world()
  self.shard_plans = self.shard_plans or shard_plans(self, job)
  local p, policy = self.shard_plans, self.S.policy
  local T = job.size - self.S.cfg.dist.rollout_ranks
  local t0 = moonrl.now()
  local o, c = policy:export_range() -- (its shard; tensor parallel: its slices; pipeline: its stage's)
  local mine = p.counts[job.rank] > 0 and policy:param_buffer() + o
  local receiving = p.to[job.rank] == 1
  local bytes, changed, full = p.bytes or 4 * p.total, nil, true
  if p.delta then -- a whole version the first time, every full_sync_every, and after a checksum that differed
    full = force_full or not p.synced or (self.since_full or 0) + 1 >= self.S.cfg.async.full_sync_every
  end
  if p.exact then -- each rollout rank its ranges of each trainer's export, packed
    local at = 0
    for r = 0, job.size - 1 do
      for _, rg in ipairs(mine and p.packs[r] or {}) do
        ffi.copy(p.send_buf + at, mine + rg[1], 4 * rg[2])
        at = at + rg[2]
      end
    end
    if not full then -- the changes; a whole version instead when they would cost more (6 bytes each, 2 a value)
      local n, at_in, val_in = send_delta(job, p, mine, receiving, T)
      local t = job:sum({ n = n, of = mine and p.send_total or 0, senders = mine and 1 or 0 })
      changed = t.of > 0 and t.n / t.of or 0
      if 6 * t.n > 2 * t.of then
        full = true
      else
        if receiving then apply_delta(p, policy:params(), at_in, val_in) end
        bytes = 6 * t.n + 8 * t.senders * (job.size - T) -- (and a count a pair)
      end
    end
    if full and p.delta then -- in bf16: what the rollout ranks hold under deltas (the values rounded to bf16)
      if mine then C.mrl_convert_f32_to_bf16(p.send_buf, p.prev16, p.send_total) end
      moonrl.check(C.mrl_dist_alltoallv(job.handle, mine and p.prev16 or nil, p.send_counts,
        receiving and p.staging16 or nil, p.recv_counts, 2), 2)
      bytes = p.bytes / 2
    elseif full then
      moonrl.check(C.mrl_dist_alltoallv(job.handle, mine and p.send_buf or nil, p.send_counts,
        receiving and p.staging or nil, p.recv_counts, 4), 2)
    end
  else
    local recv = receiving and (p.in_place and policy:params() or p.staging) or nil
    moonrl.check(C.mrl_dist_send_pieces(job.handle, mine or nil, mine and c or 0, p.to, recv, p.counts, 4), 2)
  end
  if receiving then
    if full and (p.exact or not p.in_place) then
      local dst = policy:params()
      for _, f in ipairs(p.from) do
        local at = f.at
        for _, cp in ipairs(f.plan) do
          local from = p.ranges and at or f.at + cp.at
          if p.delta then C.mrl_convert_bf16_to_f32(p.staging16 + from, dst + cp.to, cp.count)
          else ffi.copy(dst + cp.to, p.staging + from, 4 * cp.count) end
          at = at + cp.count
        end
      end
    end
    if fault.process_fault('sync_corrupt') and p.from[1] and p.from[1].plan[1] then -- (a wrong element: the checksum's test)
      local at = policy:params() + p.from[1].plan[1].to
      at[0] = at[0] + 1
    end
    policy:weights_changed()
  end
  local ok, why = check_version(self, job, p, mine, c)
  if not ok then -- a whole version again, once
    if force_full then moonrl.run_error('weight sync: ' .. (why or 'a rollout rank\'s weights differ from the trainers\' after a whole version')) end
    if job.rank == 0 then self.S:event('weight_resync', { message = why or 'a rollout rank\'s checksum differed' }, { quiet = true }) end
    self.resyncs = (self.resyncs or 0) + 1
    return deliver_shards(self, true)
  end
  if p.delta then self.since_full, p.synced = full and 0 or (self.since_full or 0) + 1, true end
  local secs = moonrl.now() - t0
  return { seconds = secs, gb_per_s = secs > 0 and bytes / secs / 1e9 or 0, bytes = bytes,
    changed = changed, full = p.delta and (full and 1 or 0) or nil, resyncs = self.resyncs }
end

local function publish_store(self, st, v)
  local t0 = moonrl.now()
  local p, n = whole_weights(self.S)
  moonrl.check(C.mrl_weight_store_publish(st, p, store_version(self, v), 0), 2)
  local secs = moonrl.now() - t0
  return { seconds = secs, gb_per_s = secs > 0 and 4 * n / secs / 1e9 or 0, bytes = 4 * n }
end

-- A sharded policy's version into the shared-memory store (every trainer calls it): trainer rank 0
-- takes a free slot, every trainer of the first shard group copies its shard into it (they opened
-- the store as co-writers), and once all are done rank 0 publishes it. No rank holds the weights
-- whole; the rollout ranks read them in place.
local slot_out = ffi.new('int[1]')
local function publish_shards(self, v)
  local t0 = moonrl.now()
  local W, policy = self.S.grad_world or self.S.world, self.S.policy -- (context parallel: the shards span its ranks too)
  local slot = 0
  if W.rank == 0 then
    moonrl.check(C.mrl_weight_store_begin(self.store, slot_out), 2)
    slot = slot_out[0]
  end
  slot = tonumber(W:broadcast_string(tostring(slot), 0))
  if self.store and policy.shard_layout.replica == 0 then
    local o, c = policy:shard()
    moonrl.check(C.mrl_weight_store_write(self.store, slot, o, policy:param_buffer() + o, c), 2)
  end
  W:barrier()
  if W.rank == 0 then moonrl.check(C.mrl_weight_store_commit(self.store, slot, store_version(self, v), 0), 2) end
  local secs, n = moonrl.now() - t0, policy.n_params
  return { seconds = secs, gb_per_s = secs > 0 and 4 * n / secs / 1e9 or 0, bytes = 4 * n }
end

-- Whether the weights go through a shared-memory store, and a version into it.
local function uses_store(self) return self.store ~= nil or self.shard_store end
local function store_publish(self, v)
  if self.shard_store then return publish_shards(self, v) end
  return publish_store(self, self.store, v)
end

local store_count = 0 -- (the stores this process made: their names)

-- A store some rank could not open (failed: why, rank by rank): let go of it; the weights go by
-- MPI, or the run stops where only the store will do (async.weights=shm, partial=continue).
local function no_store(self, failed, needs, instead)
  if self.store then free_store(self.store); self.store, self.reader = nil, nil end
  local a, why = self.S.cfg.async, table.concat(failed, '; ')
  if a.weights == 'shm' or a.partial == 'continue' then
    moonrl.usage_error((a.weights == 'shm' and 'async.weights=shm' or 'async.partial=continue') .. ' needs ' .. needs ..
      ', in its shared memory: ' .. why)
  end
  moonrl.log('info', 'rollout ranks: %s (%s)', instead, why)
end

-- With sharded trainers (deliver_shards' case), at the first phase start, a collective over the
-- job: trainer rank 0 makes the store, the first shard group's other trainers open it as
-- co-writers and the rollout ranks as readers; where one cannot (another host) the shards go by
-- MPI (async.weights=auto) or the run stops (shm, partial=continue).
local function setup_shard_store(self)
  local a, job = self.S.cfg.async, dist.world()
  local d = self.S.cfg.dist
  if a.weights == 'mpi' or (d.tp or 1) > 1 or (d.pp or 1) > 1 or (d.rollout_tp or 1) > 1 or a.weights_delta then
    return -- (slices, stages and deltas: by MPI)
  end
  local n, R = self.S.policy.n_params, self.S.cfg.dist.rollout_ranks
  local T = job.size - R
  local name = ''
  if job.rank == 0 then
    store_count = store_count + 1
    name = string.format('/moonrl-%d-%d', C.mrl_process_id(), store_count)
    self.store = new_store(name, n, R)
  end
  name = job:broadcast_string(name, 0)
  local ok, h = 'ok', ffi.new('mrl_weight_store *[1]')
  if fault.process_fault('no_shm') then
    ok = 'fault injection: no shared memory with trainer rank 0'
  elseif job.rank >= T then
    if C.mrl_weight_store_open(name, n, job.rank - T, h) == 0 then
      self.store, self.reader = ffi.gc(h[0], C.mrl_weight_store_free), job.rank - T
    else
      ok = moonrl.last_error()
    end
  elseif job.rank > 0 and self.S.policy.shard_layout.replica == 0 then
    if C.mrl_weight_store_open_writer(name, n, h) == 0 then self.store = ffi.gc(h[0], C.mrl_weight_store_free)
    else ok = moonrl.last_error() end
  end
  local all = job:gather_strings(ok)
  if job.rank == 0 then moonrl.check(C.mrl_weight_store_unlink(self.store)) end -- nothing left in /dev/shm
  local failed = {}
  for r = 1, #all do
    if all[r] ~= 'ok' then failed[#failed + 1] = string.format('rank %d of %d: %s', r - 1, #all, all[r]) end
  end
  if #failed == 0 then
    self.shard_store = job.rank < T -- (the trainers publish together; the rollout ranks read as ever)
    return
  end
  no_store(self, failed, 'the trainers and every rollout rank on one host', 'the trainers\' shards by MPI')
end

-- Collective over the link, at its first phase start: trainer rank 0 makes a shared-memory store
-- for the rollout ranks and they open it; if one cannot (another host), the weights go by MPI
-- broadcast (async.weights=auto) or the run stops (shm).
local function setup_store(self)
  local a = self.S.cfg.async
  if self.store_checked then return end
  self.store_checked = true
  if self.shard_delivery then return setup_shard_store(self) end
  if a.weights == 'mpi' or not self.rollout_engine then return end -- (no engine to read it)
  if self.S.policy:lora() then return end -- (LoRA: each version is the adapters, by MPI)
  local n, name = self.S.policy.n_params, ''
  if self.S.role ~= 'rollout' then
    store_count = store_count + 1
    name = string.format('/moonrl-%d-%d', C.mrl_process_id(), store_count)
    self.store = new_store(name, n, self.S.link.size - 1)
  end
  name = self.S.link:broadcast_string(name, 0)
  local ok = 'ok'
  if self.S.role == 'rollout' and fault.process_fault('no_shm') then
    ok = 'fault injection: no shared memory with trainer rank 0'
  elseif self.S.role == 'rollout' then
    local h = ffi.new('mrl_weight_store *[1]')
    if C.mrl_weight_store_open(name, n, self.S.link.rank - 1, h) == 0 then
      self.store, self.reader = ffi.gc(h[0], C.mrl_weight_store_free), self.S.link.rank - 1
    else
      ok = moonrl.last_error()
    end
  end
  local all = self.S.link:gather_strings(ok)
  if self.S.role ~= 'rollout' then moonrl.check(C.mrl_weight_store_unlink(self.store)) end -- nothing left in /dev/shm
  local failed = {}
  for r = 2, #all do
    if all[r] ~= 'ok' then failed[#failed + 1] = string.format('rollout rank %d of %d: %s', r - 1, #all - 1, all[r]) end
  end
  if #failed == 0 then return end
  no_store(self, failed, 'every rollout rank on trainer rank 0\'s host', 'weights by MPI broadcast')
end

-- Batch j made here, now, before this step's update: with the weights of version step - 1.
-- Samples carry the version of their first token; with async.partial=continue the engine thread
-- may switch to newer weights while they are generated (s.version_switches).
local function make_local(self, j)
  local t0 = moonrl.now()
  local e = self.rollout_engine
  if e and e.remote and not coroutine.running() then e:sync(self.S.step - 1) end -- (servers elsewhere: version step - 1)
  local samples, info = self.rollout_fn(j)
  info = info or {}
  local version = self.S.step - 1
  stamp_versions(samples, version)
  info.gen_seconds = moonrl.now() - t0
  return { samples = samples, info = info, version = version }
end

-- One process, async.engine_threads = N: batch j is started now, before this step's update, on
-- an engine thread of N threads reading a copy of the weights of version step - 1, and finished
-- after the update (finish_background): its rollout function runs in a coroutine that yields
-- while the engine thread generates (moonrl.engine: Engine:generate with engine.background).
-- The same batch, version and bits as make_local, with generation overlapping training.
local function finish_background(self, after_update)
  local f = self.inflight
  if not f then return end
  self.inflight = nil
  local e = self.rollout_engine
  if after_update and self.S.cfg.async.partial == 'continue' and not self.S.pending_rollback then
    self.publish_info = publish_store(self, self.thread_store, self.S.step) -- taken up by the requests in flight
  end
  e.background, e.on_busy = nil, nil -- the rest of the rollout function generates in line
  local t0 = moonrl.now()
  local ok, b = coroutine.resume(f.co)
  local waited = moonrl.now() - t0
  e:use_weights(nil)
  if not ok then error(b, 0) end
  b.info.gen_seconds = f.main_seconds + waited -- the main thread's share: the rest ran beside training
  self.trainer_wait = (self.trainer_wait or 0) + waited
  self.pending[f.j] = b
end

local function start_background(self, j)
  local a, e = self.S.cfg.async, self.rollout_engine
  if e.remote then -- servers in other processes (moonrl.train.remote): they hold version step - 1, then generate
    e:sync(self.S.step - 1)
    e.background = true
    e.on_busy = function() finish_background(self, false) end
    local co = coroutine.create(make_local)
    local t0 = moonrl.now()
    local ok, b = coroutine.resume(co, self, j)
    if not ok then e.background, e.on_busy = nil, nil; error(b, 0) end
    self.inflight = { co = co, j = j, main_seconds = moonrl.now() - t0 }
    if coroutine.status(co) == 'dead' then self.inflight, e.background, e.on_busy, self.pending[j] = nil, nil, nil, b end
    return
  end
  if not self.thread_store then self.thread_store = new_store(nil, self.S.policy.n_params, 1) end
  local v = store_version(self, self.S.step - 1)
  if C.mrl_weight_store_latest(self.thread_store, nil) < v then -- (partial=continue published it after the update)
    self.publish_info = publish_store(self, self.thread_store, self.S.step - 1)
  end
  e:use_weights({ store = self.thread_store, reader = 0, min_version = v, follow = a.partial == 'continue' })
  e.background = a.engine_threads
  e.on_busy = function() finish_background(self, false) end -- another generate (an evaluation) first finishes it
  local co = coroutine.create(make_local)
  local t0 = moonrl.now()
  local ok, b = coroutine.resume(co, self, j)
  if not ok then e.background, e.on_busy = nil, nil; e:use_weights(nil); error(b, 0) end
  self.inflight = { co = co, j = j, main_seconds = moonrl.now() - t0 }
  if coroutine.status(co) == 'dead' then -- it generated nothing in the background
    self.inflight = nil
    e.background, e.on_busy = nil, nil
    e:use_weights(nil)
    self.pending[j] = b
  end
end

-- The pending batches (generated, not trained on) as checkpoint state; and back.
local function save_pending(self)
  local p = json.object()
  for j, b in pairs(self.pending or {}) do p[tostring(j)] = b.text or M.encode(b.samples, b.info) end
  self.S.extra.pending = p
end

local function load_pending(self)
  self.pending = {}
  for k, text in pairs(self.S.extra.pending or {}) do
    local samples, info = M.decode(text, 'pending batch ' .. k)
    self.pending[tonumber(k)] = { samples = samples, info = info, text = text }
  end
end

-- Received from the rollout ranks: batch j's text, applied to this session (its data position
-- and generators are those after the batch, for checkpoints).
local function receive(self, j)
  local t0 = moonrl.now()
  local text = self.S.link and self.S.link:broadcast_string('', 1) or '' -- link rank 1: the first rollout rank
  local trainers = self.S.mesh_world or self.S.world -- (a dist.tp mesh: all its groups')
  if trainers.size > 1 then text = trainers:broadcast_string(text, 0) end -- trainer 0 to the others
  local waited = moonrl.now() - t0
  local samples, info = M.decode(text, 'rollout batch ' .. j)
  if info.step ~= j then
    moonrl.run_error(string.format('rollout ranks sent batch %s where batch %d was expected', tostring(info.step), j))
  end
  if info.positions then self.S:restore_positions(info.positions) end
  if info.inflight then self.S.extra.stream_inflight = info.inflight end -- (a group stream's: drawn, not yet sent)
  self.trainer_wait = (self.trainer_wait or 0) + waited
  if info.stop then self.rollout_stop = true end
  return { samples = samples, info = info, text = text }
end

-- This step's batch: samples (each with .version and .staleness) and info (the rollout's
-- metrics, plus info.async: staleness histogram, queue depth, idle shares).
function Rollouts:next_batch()
  local s, L = self.S.step, sections.lag(self.S.cfg)
  if not self.pending then load_pending(self) end
  if self.S.remote then
    if not self.pending[s] then self.pending[s] = receive(self, s) end
  else
    local threaded = self.rollout_engine and (self.rollout_engine.remote or
      (self.S.cfg.async and self.S.cfg.async.engine_threads > 0))
    for j = s, math.min(s + L, self.S.run.total or s) do
      if not self.pending[j] then
        if threaded and j == s + L and j > s then start_background(self, j) else self.pending[j] = make_local(self, j) end
      end
    end
  end
  local b = self.pending[s]
  self.pending[s] = nil
  -- the weights this batch trains are version s - 1 (the updates of steps 1 .. s-1)
  local a = self.S.cfg.async or { max_staleness = 0, stale = 'drop' }
  local histogram, kept, dropped, worst, switched = json.object(), {}, 0, 0, 0
  for _, smp in ipairs(b.samples) do
    -- a sample's staleness is its first token's: with async.partial=continue later tokens may
    -- come from newer weights (smp.version_switches), never older
    smp.staleness = (s - 1) - (smp.version or 0)
    if smp.version_switches then switched = switched + 1 end
    local k = tostring(smp.staleness)
    histogram[k] = (histogram[k] or 0) + 1
    if smp.staleness > worst then worst = smp.staleness end
    if smp.staleness > a.max_staleness then
      if a.stale == 'drop' then dropped = dropped + 1
      else smp.adv_scale = a.stale_weight; kept[#kept + 1] = smp end
    else
      kept[#kept + 1] = smp
    end
  end
  local depth = 0
  for _ in pairs(self.pending) do depth = depth + 1 end
  -- the trainer's waits for batches since the last step's figure (after_update's too)
  local waited = (self.trainer_wait or 0) - (self.trainer_wait_logged or 0)
  self.trainer_wait_logged = self.trainer_wait
  b.info.async = { staleness = histogram, max_staleness_seen = worst, dropped_stale = dropped, queue_depth = depth,
    switched_samples = switched, batches_in_flight = b.info.batches_in_flight, groups_in_flight = b.info.groups_in_flight,
    trainer_wait_seconds = waited, rollout_wait_seconds = b.info.rollout_wait_seconds }
  return kept, b.info
end

-- After the step's update: the rollout ranks get their next batches asked for and the step's
-- header (trainer side), and the pending batches go into the state a checkpoint saves.
-- Returns the stop decision of this step when it made one (the trainers and the rollout ranks
-- must agree on it: the session uses it as is).
function Rollouts:after_update()
  if self.S.step == 0 then return nil end
  local s, L, T = self.S.step, sections.lag(self.S.cfg), self.S.run.total
  local stop
  finish_background(self, true)
  if self.S.remote then
    -- partial=continue: the new weights first, for the requests in flight on the rollout ranks
    local streamed = self.S.cfg.async.stream -- batches taken as they come, in next_batch
    local early = uses_store(self) and self.S.cfg.async.partial == 'continue' and s + L + 1 <= T
      and not self.S.pending_rollback and not streamed
    if early then self.publish_info = store_publish(self, s) end
    for j = s + 1, streamed and 0 or math.min(s + L, T) do
      if not self.pending[j] then self.pending[j] = receive(self, j) end
    end
    stop = moonrl.stop_requested() or self.rollout_stop or false
    local trainers = self.S.mesh_world or self.S.world
    if trainers.size > 1 then stop = trainers:any(stop) end
    if stop and not moonrl.stop_requested() then moonrl.C.mrl_request_stop(-2, 'a stop requested by a rollout rank') end
    self:publish(s, { stop = stop, rollback = self.S.pending_rollback ~= nil, published = early })
  end
  save_pending(self)
  return stop
end

-- Trainer rank 0 to every rollout rank, once a step: the header of version v, and the weights
-- when a batch still to come needs them. The header says whether to stop, to roll back (the
-- trainers go back to a checkpoint: Rollouts:rollback), or that the phase is done (its last step).
function Rollouts:publish(v, flags)
  if not self.S.link and not self.shard_delivery then return end
  local L, T = sections.lag(self.S.cfg), self.S.run.total
  -- the weights go when a batch still to come can use them: batch j is started with version
  -- j - 1 - lag; streamed, every batch after v takes v up while it is generated
  local weights = (self.S.cfg.async.stream and v < T or v + L + 1 <= T) and not flags.stop and not flags.rollback
  if not self.S.link then -- a trainer of a sharded policy without the link: its shard, with the others
    if weights and self.shard_store then
      if not flags.published then store_publish(self, v) end
    elseif weights then
      deliver_shards(self)
    end
    return
  end
  if weights and uses_store(self) and not flags.published then self.publish_info = store_publish(self, v) end
  local t0 = moonrl.now()
  self.S.link:broadcast_string(json.encode(json.object({ 'version', v, 'stop', flags.stop, 'rollback', flags.rollback,
    'done', v >= T, 'weights', weights })), 0)
  if not weights or uses_store(self) then return end
  if self.shard_delivery then
    self.publish_info = deliver_shards(self)
    return
  end
  local p, n = version_weights(self.S)
  self.S.link:broadcast(p, 4 * n, 0)
  local secs = moonrl.now() - t0
  self.publish_info = { seconds = secs, gb_per_s = secs > 0 and 4 * n / secs / 1e9 or 0, bytes = 4 * n }
end

-- A guard's rollback (moonrl.train.session): the trainers are back at a checkpoint's step t. The
-- batches generated since are dropped when the rollback skips the data (guard.skip_batch: new
-- batches from the data as it is now), or are the checkpoint's pending ones (a replay). The
-- rollout ranks, told in the step's header, start again from the checkpoint's weights.
function Rollouts:rollback()
  next_epoch(self)
  local fresh = self.S.cfg.guard.skip_batch
  if fresh then self.pending, self.S.extra.pending = {}, nil else self.pending = nil end
  if self.S.link or self.shard_delivery then self:sync_weights({ fresh = fresh }) end
end

-- Trainer rank 0's weights, data positions, generators and step to every rollout rank (the
-- start of a phase: an earlier phase ran on the trainers alone; or a rollback: opts.fresh when
-- the trainers dropped their pending batches). Returns the header on a rollout rank.
-- The rollout ranks wait here, with no deadline, for as long as the trainers' earlier phases
-- take (an SFT warm-up may last hours): a trainer that dies meanwhile ends the job through the
-- launcher; every wait after this one has dist.timeout again.
function Rollouts:sync_weights(opts)
  if not self.S.link then -- a trainer of a sharded policy without the link: its shard, with the others
    if self.shard_delivery then
      if not self.store_checked then -- (the link's ranks do it at this point too)
        self.store_checked = true
        setup_shard_store(self)
      end
      deliver_shards(self)
    end
    return nil
  end
  self.want = nil
  local rollout = self.S.role == 'rollout'
  if rollout then self.S.link:set_timeout(0) end
  local head = json.object({ 'positions', self.S:positions(), 'global_step', self.S.global_step - self.S.step,
    'step', self.S.step, 'fresh', opts and opts.fresh or false,
    'inflight', self.S.extra.stream_inflight or json.array() })
  head = self.S.link:broadcast_string(rollout and '' or json.encode(head), 0)
  if rollout then self.S.link:set_timeout(self.S.cfg.dist.timeout) end
  if not self.store_checked then -- the first phase start: how the weights will go
    setup_store(self)
    if not rollout then
      self.S:event('rollout_weights', { via = self.store and 'shared memory' or self.shard_delivery and 'trainer shards' or 'mpi',
        rollout_ranks = self.S.link.size - 1 }, { quiet = true })
    end
  end
  if self.shard_delivery then
    deliver_shards(self)
  else
    local p, n = self.S.policy:params()
    self.S.link:broadcast(p, 4 * n, 0)
    if self.S.policy:lora() then -- (and its adapters: the versions after send only them)
      p, n = self.S.policy:lora_buffer()
      self.S.link:broadcast(p, 4 * n, 0)
      received(self.S)
    end
  end
  if not rollout then return nil end
  head = json.decode(head, 'phase start')
  self.S:restore_positions(head.positions)
  self.S.requeue = head.inflight -- a group stream's prompts drawn but in no batch yet: drawn again first
  self.S.step = head.step
  self.S.global_step = head.global_step + self.S.step -- the trainers' count of the earlier phases
  return head
end

-- The start of a phase with a rollout (every rank): a new epoch of store versions, and the
-- rollout ranks get the trainers' weights.
function Rollouts:begin()
  local a = self.S.cfg.async
  if a and (a.engine_threads > 0 or a.partial == 'continue') and not self.rollout_engine then
    moonrl.usage_error('async.engine_threads and async.partial=continue drive the rollout\'s engine: declare it with ' ..
      'S:rollout(fn, { engine = e }) (or S.engine)')
  end
  next_epoch(self)
  if self.S.link or self.shard_delivery then self:sync_weights() end
end

-- The header trainer rank 0 sends after each of its steps (Rollouts:publish), and the weights with it.
local function receive_header(self)
  local head = json.decode(self.S.link:broadcast_string('', 0), 'weights header')
  if head.weights then
    if self.store then
      self.want = store_version(self, head.version) -- in the store: the engine takes it at the batch's start
    elseif self.shard_delivery then
      deliver_shards(self)
    else
      local p, n = version_weights(self.S)
      self.S.link:broadcast(p, 4 * n, 0)
      received(self.S)
    end
    self.version = head.version
  end
  return head
end

-- Batches first .. total for the trainers; those up to free_until with the weights at hand,
-- each later one after the header of the version the schedule gives it (batch j: version
-- j - 1 - lag). Returns the header that ended the phase for this rank: the last step's (done),
-- a stop or a rollback.
local function serve(self, first, free_until, total)
  local L = sections.lag(self.S.cfg)
  local base = self.S.global_step - self.S.step -- the steps of the phases before this one
  local idle = 0
  for j = first, total do
    -- the batch's step, for heartbeats, fault points and timeout reports
    self.S.step, self.S.global_step = j, base + j
    self.S.run.step = self.S.global_step
    if j > free_until then
      local t0 = moonrl.now()
      local head = receive_header(self)
      idle = idle + moonrl.now() - t0
      if head.stop or head.rollback then return head end
    end
    self.S.world:set_step(self.S.global_step)
    self.S.link:set_step(self.S.global_step)
    local t0 = moonrl.now()
    local e = self.store and self.rollout_engine
    if e then -- the weights in the store; else those at hand (the phase start's), newer ones taken up when they come
      e:use_weights({ store = self.store, reader = self.reader, min_version = self.want, timeout = self.S.cfg.dist.timeout,
        follow = self.S.cfg.async.partial == 'continue', version = store_version(self, self.version) })
    end
    local ok, samples, info = pcall(self.rollout_fn, j)
    if e then e:use_weights(nil) end
    if not ok then error(samples, 0) end
    info = info or {}
    stamp_versions(samples, self.version or 0)
    info.gen_seconds, info.step, info.positions = moonrl.now() - t0, j, self.S:positions()
    info.rollout_wait_seconds, idle = idle, 0
    info.stop = moonrl.stop_requested()
    local text = M.encode(samples, info)
    if self.S.world.rank == 0 then self.S.link:broadcast_string(text, 1) else self.S.link:broadcast_string('', 1) end
  end
  while true do -- the headers of the trainers' last steps: nothing more to generate unless they roll back
    local head = receive_header(self)
    if head.done or head.stop or head.rollback then return head end
  end
end

-- What the two streaming loops share (serve_stream, serve_groups): the rollout engine as a stream
-- (Engine:stream) on the store's versions, taking each new one between steps; the session's step
-- set to a batch's; and the hand-off of batch j: its text sent to the trainers and the header
-- after it awaited, the engine generating on its thread meanwhile (the time it had nothing to
-- generate is the rank's idle time, in the next batch's rollout_wait_seconds).
local function open_stream(self)
  local e = self.rollout_engine
  local st = { engine = e, base = self.S.global_step - self.S.step, idle = 0 }
  st.stream = e:stream(tonumber(C.mrl_parallel_threads()))
  e:use_weights({ store = self.store, reader = self.reader, min_version = self.want, timeout = self.S.cfg.dist.timeout,
    follow = true, version = store_version(self, self.version) })
  function st.at_step(j)
    self.S.step, self.S.global_step = j, st.base + j
    self.S.run.step = self.S.global_step
  end
  function st.close(head)
    st.stream:close()
    e:use_weights(nil)
    self.S.group_stream = nil
    return head
  end
  -- Returns the header when it ends the phase (done, stop, rollback), the stream closed; else nil.
  function st.hand_off(j, samples, info)
    st.at_step(j)
    self.S.world:set_step(self.S.global_step)
    self.S.link:set_step(self.S.global_step)
    stamp_versions(samples, self.version or 0)
    info.step, info.rollout_wait_seconds, st.idle = j, st.idle, 0
    info.stop = moonrl.stop_requested()
    local text = M.encode(samples, info)
    st.stream:background()
    if self.S.world.rank == 0 then self.S.link:broadcast_string(text, 1) else self.S.link:broadcast_string('', 1) end
    local starved = C.mrl_engine_num_unfinished(e.handle) == 0
    local t0 = moonrl.now()
    local head = receive_header(self)
    if starved then st.idle = st.idle + moonrl.now() - t0 end
    if head.stop or head.rollback or head.done then return st.close(head) end
  end
  function st.drain() -- the trainers' last headers: nothing more to generate unless they roll back
    while true do
      local head = receive_header(self)
      if head.done or head.stop or head.rollback then return st.close(head) end
    end
  end
  return st
end

-- async.stream: batches first .. total from one engine (Engine:stream). Batch j's rollout function
-- runs in a coroutine started once the header of version j - 1 - lag has come (the batches
-- before it still in the engine), and resumed, in batch order, when its requests are done: the
-- rollout ranks' collectives (the scores gathered) keep one order. The engine steps here while
-- this rank waits for it, and on a background thread while this rank scores, sends a batch or
-- waits for a header. Each coroutine's prompts are drawn before its first generate: the data
-- positions after them go with its batch. Returns the header that ended the phase (done, stop,
-- rollback).
local function serve_stream(self, first, total)
  local L, st = sections.lag(self.S.cfg), open_stream(self)
  local live, next_j = {}, first
  local function resume(b, ...)
    st.at_step(b.j)
    self.S.batch_records = b.records
    local ok, r1, r2 = coroutine.resume(b.co, ...)
    if not ok then error(r1, 0) end
    b.records = self.S.batch_records
    if coroutine.status(b.co) == 'dead' then b.job, b.samples, b.info = nil, r1, r2 or {}
    else b.job = r1 end
  end
  local function admit()
    local upto = math.min(total, (self.version or 0) + 1 + L)
    while next_j <= upto do
      local b = { j = next_j, co = coroutine.create(self.rollout_fn), t0 = moonrl.now() }
      live[next_j], next_j = b, next_j + 1
      resume(b, b.j)
      b.positions = self.S:positions()
    end
  end
  for j = first, total do
    admit()
    local b = live[j]
    while b.job do
      if st.stream:done(b.job) then resume(b) else st.stream:step() end
    end
    live[j] = nil
    local in_flight = 0 -- the batches after it already in the engine
    for _ in pairs(live) do in_flight = in_flight + 1 end
    local info = b.info
    info.gen_seconds, info.positions, info.batches_in_flight = moonrl.now() - b.t0, b.positions, in_flight
    local head = st.hand_off(j, b.samples, info)
    if head then return head end
  end
  return st.drain()
end

-- Sum b into a (numbers added, tables merged key by key, anything else kept from a): the info of a
-- batch made of several groups' rollouts.
local function merge_info(a, b)
  for k, v in pairs(b) do
    local x = a[k]
    if type(v) == 'number' and type(x) == 'number' then a[k] = x + v
    elseif type(v) == 'table' and type(x) == 'table' and not json.is_array(v) then merge_info(x, v)
    elseif x == nil then a[k] = v end
  end
  return a
end

-- async.stream_unit = 'group' (one rollout rank): every group is a rollout of its own. The
-- rollout function runs once per group g (its step argument: g, the stream of its seeds) and its
-- S:prompts(n) draws one record (S.group_stream; a recipe that draws its own prompts asks
-- S:rollout_count(n)). As many groups are in the engine as the staleness bound allows (group k
-- of a batch of P is started once version ceil(k / P) - 1 - lag is published) and each goes to a
-- queue when it is done; batch j is the first P groups in the queue. The records of the groups
-- drawn but in no batch yet go with each batch (the trainers checkpoint them): a resumed run
-- draws those again first, so no prompt is lost or trained twice.
local function serve_groups(self, first, total)
  local L, st = sections.lag(self.S.cfg), open_stream(self)
  self.S.group_stream = true
  local live, done, P = {}, {}, nil -- live: groups in the engine (admission order); done: finished, in order
  local started = 0 -- groups started in this phase
  local g0 = (first - 1) * 100000 -- group g's seeds: (seed, g, ...); a resume starts another range
  local function resume(b, ...)
    local ok, r1, r2 = coroutine.resume(b.co, ...)
    if not ok then error(r1, 0) end
    if coroutine.status(b.co) == 'dead' then b.job, b.samples, b.info = nil, r1 or {}, r2 or {}
    else b.job = r1 end
  end
  local function start_group()
    started = started + 1
    local b = { g = g0 + started, co = coroutine.create(self.rollout_fn), t0 = moonrl.now() }
    self.S.group_drawn = nil
    resume(b, b.g)
    b.records = self.S.group_drawn
    P = P or self.S.group_batch
    live[#live + 1] = b
  end
  local function admit(j_first)
    if not P then start_group() end -- its S:prompts says how many groups a batch has
    if not P then moonrl.usage_error('async.stream_unit=group: the rollout function drew no prompts through ' ..
      'S:prompts (a recipe that draws its own asks S:rollout_count(n))') end
    local cap = (total - j_first + 1) * P -- no more groups than the batches still to send need
    while started < cap do
      local k = started + 1 -- this group's place in the stream: batch ceil(k / P) at the earliest
      local j = j_first + math.ceil(k / P) - 1
      if (self.version or 0) < j - 1 - L then break end
      start_group()
    end
  end
  for j = first, total do
    st.at_step(j)
    admit(first)
    while #done < P do -- the first groups to finish
      local moved = false
      for i = 1, #live do
        local b = live[i]
        if b.job and st.stream:done(b.job) then resume(b) end
        if not b.job then
          table.remove(live, i)
          done[#done + 1] = b
          moved = true
          break
        end
      end
      if not moved then st.stream:step() end
    end
    local samples, info, t_first = {}, {}, math.huge
    for _ = 1, P do
      local b = table.remove(done, 1)
      for _, smp in ipairs(b.samples) do samples[#samples + 1] = smp end
      merge_info(info, b.info)
      t_first = math.min(t_first, b.t0)
    end
    local inflight = json.array()
    for _, list in ipairs({ done, live }) do
      for _, b in ipairs(list) do
        for _, r in ipairs(b.records or {}) do inflight[#inflight + 1] = r end
      end
    end
    info.gen_seconds, info.positions, info.inflight = moonrl.now() - t_first, self.S:positions(), inflight
    info.groups_in_flight = #live + #done
    local head = st.hand_off(j, samples, info)
    if head then return head end
  end
  return st.drain()
end

-- The rollout ranks' loop (their S:steps): the batches of the phase, each with the weights the
-- schedule gives it, sent to the trainers; ends when trainer rank 0 says so. After a rollback it
-- starts again from the checkpoint's step t: at batch t + 1 when the trainers dropped their
-- pending batches, else after them (t + lag + 1), as after a resume.
function Rollouts:serve(total)
  local L = sections.lag(self.S.cfg)
  local first, free_until = 1, L + 1
  if self.S.step > 0 then first = self.S.step + L + 1; free_until = first end -- resumed: up to step + L in the checkpoint
  local streamed = self.S.cfg.async.stream -- the trainers hold no batch ahead: on from the next one
  if streamed then first = self.S.step + 1 end
  self.version = self.S.step -- the checkpoint's weights (0: the initial ones)
  while true do
    local head
    if streamed and self.S.cfg.async.stream_unit == 'group' then head = serve_groups(self, first, total)
    elseif streamed then head = serve_stream(self, first, total)
    else head = serve(self, first, free_until, total) end
    if head.stop then self.rollout_stopped = true end -- the trainers stopped: they do not finish with us
    if not head.rollback then return end
    next_epoch(self)
    head = self:sync_weights()
    self.version = self.S.step
    if streamed then first = self.S.step + 1
    elseif head.fresh then first, free_until = self.S.step + 1, self.S.step + L + 1
    else first = self.S.step + L + 1; free_until = first end
  end
end

return M
