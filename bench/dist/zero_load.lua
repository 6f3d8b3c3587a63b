-- Loading a model by shard (model.load_shard: each rank reads its byte ranges of every tensor)
-- against loading it whole, timed on each rank of the job (one process: its shard is the whole
-- model split over 1). Prints one JSON line a rank: its shard's bytes and seconds, and (rank 0
-- alone, after the others) the whole model's.
--   moonrl run bench/dist/zero_load.lua dir=MODEL_DIR        (or under moonrl launch -n N)
local moonrl = require('moonrl')
local json = require('moonrl.io.json')
local dist = require('moonrl.train.dist')
local model = require('moonrl.model')

local cfg = moonrl.config { dir = moonrl.config.required('string') }
local w = dist.world()
-- the best of 3 reads (the files in the page cache after the first), every rank at once
local shard_s, count = math.huge, 0
for _ = 1, 3 do
  w:barrier()
  local t0 = moonrl.now()
  local m = model.load_shard(cfg.dir, w.size, w.size, w.rank)
  shard_s = math.min(shard_s, moonrl.now() - t0)
  count = select(2, m:shard())
  m = nil
  collectgarbage()
end
w:barrier()
local out = { rank = w.rank, shard_bytes = 4 * count, shard_s = shard_s }
if w.rank == 0 then
  out.whole_s = math.huge
  for _ = 1, 3 do
    local t0 = moonrl.now()
    local whole = model.load(cfg.dir)
    out.whole_s, out.whole_bytes = math.min(out.whole_s, moonrl.now() - t0), 4 * whole.n_params
    whole = nil
    collectgarbage()
  end
end
local lines = w:gather_strings(json.encode(out))
if w.rank == 0 then for _, l in ipairs(lines) do io.stdout:write(l, '\n') end end
