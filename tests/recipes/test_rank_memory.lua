-- Each rank's memory in a job of 2 ranks (mpirun): every step's metrics hold the largest resident
-- peak over the ranks (memory/max_rank_peak_mb, a max-reduction every rank takes in S:log), and
-- `moonrl status` shows each rank's resident memory and peak (the heartbeat files). Rank 1 holds
-- 96 MiB more than rank 0 (a --require file), so rank 0's own peak cannot pass for the largest,
-- nor one rank's status for the other's. Alone, the metric is the process's own peak.
local t = require('moonrl.testing')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')
local proc = require('moonrl.io.proc')
local U = dofile('tests/recipes/util.lua')

local exe = assert(rawget(_G, 'MOONRL_EXE'), 'needs the moonrl executable')
local mpirun = U.which('mpirun')
if not mpirun then
  io.stdout:write('(skipped: no mpirun)\n')
  os.exit(77)
end

local dir = U.tmpdir('rank_memory')
local SFT = U.with(U.sft_setup(dir, 40), { 'train.steps=3', 'train.batch=8' })

-- run before the recipe on each rank: rank 1 holds 96 MiB, zero-filled (resident) through moonrl
local HOLD_MB = 96
local heavy = dir .. '/heavy_rank1.lua'
fs.write(heavy, string.format([[
if tonumber(os.getenv('OMPI_COMM_WORLD_RANK') or '0') == 1 then
  local C = require('moonrl').C
  _G.heavy_rank1 = C.mrl_mem_alloc(%d * 2 ^ 20, C.MRL_MEM_OTHER) -- never freed: held to the end
  assert(_G.heavy_rank1 ~= nil)
end
]], HOLD_MB))

t.test('2 ranks: the largest rank peak in each step, each rank in moonrl status', function()
  local d = dir .. '/two'
  local argv = { mpirun, '-n', '2', '--oversubscribe', '--bind-to', 'none', '--allow-run-as-root', '--mca', 'btl',
    'vader,self', exe, 'run', 'recipes/sft.lua', '--require', heavy, 'run.dir=' .. d }
  for _, w in ipairs(SFT) do argv[#argv + 1] = w end
  local r = proc.run(argv, { timeout = 120 })
  t.truthy(r.ok, r.stdout .. r.stderr)
  local ms = U.records(d)
  t.eq(#ms, 3, 'each step logged once')
  for _, m in ipairs(ms) do
    local mine, most = m['memory/rss_peak_mb'], m['memory/max_rank_peak_mb']
    t.truthy(type(most) == 'number' and most >= mine, string.format('step %d: %s >= rank 0 %s', m.step, tostring(most), mine))
    t.truthy(most >= mine + HOLD_MB / 2, string.format('step %d: rank 1 (%d MiB more) is the largest: %s, rank 0 %s',
      m.step, HOLD_MB, tostring(most), mine))
  end
  -- moonrl status: each rank's memory, in --json and in the text
  local s = proc.run({ exe, 'status', d, '--json' }, { timeout = 60 })
  t.eq(s.exit_status, 0, s.stderr)
  local info = json.decode(s.stdout)
  t.eq(#info.ranks, 2, 'both ranks')
  for i, rk in ipairs(info.ranks) do
    t.eq(rk.rank, i - 1)
    t.truthy(type(rk.rss_mb) == 'number' and rk.rss_mb > 0, 'rank ' .. rk.rank .. ': resident now ' .. tostring(rk.rss_mb))
    t.truthy(type(rk.rss_peak_mb) == 'number' and rk.rss_peak_mb >= rk.rss_mb,
      'rank ' .. rk.rank .. ': its peak ' .. tostring(rk.rss_peak_mb))
  end
  t.truthy(info.ranks[2].rss_peak_mb >= info.ranks[1].rss_peak_mb + HOLD_MB / 2,
    string.format("each rank's own: rank 1 %s MiB, rank 0 %s", info.ranks[2].rss_peak_mb, info.ranks[1].rss_peak_mb))
  t.truthy(info.ranks[2].rss_peak_mb >= ms[#ms]['memory/max_rank_peak_mb'] - 1,
    'the lifetime peak covers the last step peak')
  local text = proc.run({ exe, 'status', d }, { timeout = 60 }).stdout
  t.truthy(text:find('memory %(resident, per rank%): 0: %d+ MB %(peak %d+ MB%) | 1: %d+ MB %(peak %d+ MB%)') ~= nil, text)
end)

t.test('one process: the largest rank peak is its own', function()
  local d = dir .. '/one'
  local argv = { exe, 'run', 'recipes/sft.lua', 'run.dir=' .. d }
  for _, w in ipairs(SFT) do argv[#argv + 1] = w end
  local r = proc.run(argv, { timeout = 120 })
  t.truthy(r.ok, r.stdout .. r.stderr)
  for _, m in ipairs(U.records(d)) do t.eq(m['memory/max_rank_peak_mb'], m['memory/rss_peak_mb']) end
end)

fs.remove(dir)
t.done()
