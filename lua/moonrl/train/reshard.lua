-- Weights from one layout into another among the same ranks (a pipeline's stages into an
-- engine's tensor-parallel slices over the same GPUs or processes: the colocated engine of
-- NeMo-RL's refit and veRL's resharding). Every rank of `group` holds a part of the source model
-- (its export: Model:export_range, in Hugging Face coordinates by Model:slices; opts.sends =
-- false: none, a replica of another's) and a part of the destination (its slices:
-- Model:slice_plan); together the exports hold each element once. The plan is made once: each rank's slice table
-- goes to every rank, each rank works out the ranges of every other's export it takes and tells
-- it. Each sync then packs, for each rank, exactly the ranges it takes, and one all-to-all-v
-- (mrl_dist_alltoallv) moves them: no rank gathers the whole model, each byte is sent once, and
-- each rank's checksum (CRC-32C) of what it sent is compared with what landed.
--   local p = reshard.plan(group, stage_model, engine_model, opts)
--   reshard.sync(p)     -- after each update: the engine's slices are the stages' weights
local ffi = require('ffi')
local moonrl = require('moonrl')
local json = require('moonrl.io.json')
local C = moonrl.C

local M = {}

-- bytes from src to dst, host or device memory (mrl_device_memcpy)
local function copy(dst, src, bytes)
  if bytes > 0 then moonrl.check(C.mrl_device_memcpy(dst, src, bytes), 3) end
end

function M.plan(group, src, dst, opts)
  local n = group.size
  local o, c = src:export_range()
  local sends = not (opts and opts.sends == false) -- (false: this rank exports nothing, a replica's)
  local tables = group:gather_strings(sends and json.encode(src:slices(o, c)) or '')
  local p = { group = group, src = src, dst = dst, offset = o, from = {}, packs = {},
    send_counts = ffi.new('int64_t[?]', n), recv_counts = ffi.new('int64_t[?]', n),
    crc_out = ffi.new('uint32_t[?]', n), crc_in = ffi.new('uint32_t[?]', n), ones = ffi.new('int64_t[?]', n) }
  local wants, total = {}, 0
  for q = 0, n - 1 do
    local plan = tables[q + 1] == '' and {} or dst:slice_plan(json.decode(tables[q + 1], string.format("rank %d's weight slices", q)))
    local mine, got = {}, 0
    for _, cp in ipairs(plan) do mine[#mine + 1], got = { cp.at, cp.count }, got + cp.count end
    wants[tostring(q)] = mine
    p.from[q + 1] = { at = total, plan = plan }
    p.recv_counts[q], total = got, total + got
    p.ones[q] = 1
  end
  local all = group:gather_strings(json.encode(wants))
  local send_total = 0
  for r = 0, n - 1 do
    local w = json.decode(all[r + 1], string.format("rank %d's ranges", r))[tostring(group.rank)] or {}
    local k = 0
    for _, rg in ipairs(w) do k = k + rg[2] end
    p.packs[r + 1], p.send_counts[r], send_total = w, k, send_total + k
  end
  p.send_buf, p.recv_buf = ffi.new('float[?]', math.max(send_total, 1)), ffi.new('float[?]', math.max(total, 1))
  p.send_total, p.recv_total = send_total, total
  p.bytes = 4 * group:sum(send_total) -- (what a sync moves over the group)
  return p
end

-- The source's weights now into the destination's slices. Returns the bytes the group moved.
function M.sync(p)
  local g, mine = p.group, p.src:param_buffer() + p.offset
  local at = 0
  for r = 0, g.size - 1 do
    local crc = 0
    for _, rg in ipairs(p.packs[r + 1]) do
      copy(p.send_buf + at, mine + rg[1], 4 * rg[2])
      crc = C.mrl_crc32c(crc, p.send_buf + at, 4 * rg[2])
      at = at + rg[2]
    end
    p.crc_out[r] = crc
  end
  moonrl.check(C.mrl_dist_alltoallv(g.handle, p.send_buf, p.send_counts, p.recv_buf, p.recv_counts, 4), 2)
  moonrl.check(C.mrl_dist_alltoallv(g.handle, p.crc_out, p.ones, p.crc_in, p.ones, 4), 2)
  local dst, bad = p.dst:param_buffer(), nil
  for q = 0, g.size - 1 do
    local f = p.from[q + 1]
    if C.mrl_crc32c(0, p.recv_buf + f.at, 4 * p.recv_counts[q]) ~= p.crc_in[q] and not bad then
      bad = string.format('rank %d\'s weights from rank %d differ from what it sent (CRC-32C)', g.rank, q)
    end
    local k = f.at
    for _, cp in ipairs(f.plan) do
      copy(dst + cp.to, p.recv_buf + k, 4 * cp.count)
      k = k + cp.count
    end
  end
  if g:any(bad) then moonrl.run_error('resharding the weights: ' .. (bad or 'another rank\'s did not arrive whole')) end
  p.dst:weights_changed()
  return p.bytes
end

return M
