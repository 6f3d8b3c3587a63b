-- Each rank's memory in a job of 2 ranks (mpirun): every step's metrics hold the largest resident
-- peak over the ranks (memory/max_rank_peak_mb, a max-reduction every rank takes in S:log), and
-- `moonrl status` shows each rank's resident memory and peak (the heartbeat files). Rank 1 holds
-- 96 MiB more than rank 0 (a --require file), so rank 0's own peak cannot pass for the largest,
-- nor one rank's status for the other's. Alone, the metric is the process's own peak. ZeRO-1
-- (dist.zero=1) holds half of the optimizer state a rank, measured against plain data parallel.
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

-- ZeRO-1 on a model whose optimizer state dominates (~7M parameters: AdamW's m and v ~55 MB,
-- the parameters and the gradients half of that each): a rank holds its half of the state, the
-- whole one is never allocated on any rank, neither at the start, nor at a checkpoint (each rank
-- writes its own shard file), nor at a resume (each rank reads its range of the files).
t.test('dist.zero=1 on 2 ranks: half of the optimizer state per rank, never the whole on rank 1', function()
  local words = U.with(U.sft_setup(dir .. '/big', 40, { layers = 2, hidden_size = 512, intermediate_size = 1536 }),
    { 'train.steps=3', 'train.batch=4', 'run.checkpoint_every=1' })
  local function run(d, extra, env)
    local argv = { mpirun, '-n', '2', '--oversubscribe', '--bind-to', 'none', '--allow-run-as-root', '--mca', 'btl',
      'vader,self' }
    -- (meson's MALLOC_PERTURB_ fills every freed block, making short-lived buffers resident: the
    -- peaks would be those of the start-up's transients, not of what a rank holds)
    for _, e in ipairs({ 'MALLOC_PERTURB_=0', env }) do argv[#argv + 1] = '-x'; argv[#argv + 1] = e end
    for _, a in ipairs({ exe, 'run', 'recipes/sft.lua', 'run.dir=' .. d }) do argv[#argv + 1] = a end
    for _, w in ipairs(U.with(words, extra)) do argv[#argv + 1] = w end
    return proc.run(argv, { timeout = 300 })
  end
  local function rank1_peak(d) return json.decode(fs.read(d .. '/status/rank-1.json')).rss_peak_mb end
  local plain, zero = dir .. '/plain', dir .. '/zero'
  local r = run(plain, {})
  t.truthy(r.ok, r.stdout .. r.stderr)
  local plain_peak = rank1_peak(plain)
  -- ZeRO-1 dies at the start of step 3 (checkpoints of steps 1 and 2 written), then resumes
  r = run(zero, { 'dist.zero=1' }, 'MOONRL_FAULT=exit:step=3:phase=step')
  t.truthy(not r.ok, 'the first ZeRO-1 job died at step 3')
  local started_peak = rank1_peak(zero)
  r = run(zero, { 'dist.zero=1' })
  t.truthy(r.ok, r.stdout .. r.stderr)
  local resumed_peak = rank1_peak(zero)
  local whole_mb
  for line in io.lines(zero .. '/events.jsonl') do
    local e = json.decode(line)
    if e.event == 'data_parallel' then whole_mb = e.state_bytes / 2 ^ 20 end
  end
  t.truthy(whole_mb and whole_mb > 40, 'the whole state: ' .. tostring(whole_mb) .. ' MiB')
  local pm, zm = U.records(plain), U.records(zero)
  t.eq(#zm, 3, 'each step logged once')
  for i = 1, 3 do
    local p0, z0 = pm[i]['memory/optim_mb'], zm[i]['memory/optim_mb']
    print(string.format('  step %d rank 0 optimizer: plain %.1f MiB, zero=1 %.1f MiB', i, p0, z0))
    t.truthy(p0 >= whole_mb - 0.1, 'plain data parallel holds the whole state')
    t.truthy(z0 <= 0.55 * p0, string.format('step %d: zero=1 holds half: %.1f MiB of %.1f', i, z0, p0))
  end
  -- rank 0's peak of what moonrl holds: start-up and step 1; step 2, whose peak covers the
  -- checkpoint of step 1 written after step 1 was logged (gathering the whole state to rank 0
  -- for it held 8 bytes a parameter more there: plain's peak + whole/2); the resumed step 3
  for _, i in ipairs({ 1, 2, 3 }) do
    local p0, z0 = pm[i]['memory/peak_mb'], zm[i]['memory/peak_mb']
    print(string.format('  step %d rank 0 peak: plain %.1f MiB, zero=1 %.1f MiB (resident: %.1f, %.1f)', i, p0, z0,
      pm[i]['memory/rss_peak_mb'], zm[i]['memory/rss_peak_mb']))
    t.truthy(z0 <= p0 - whole_mb / 4, string.format('step %d: the peak holds no whole state: %.1f MiB, plain %.1f', i, z0, p0))
  end
  -- rank 1 saves its other half of the state (~whole/2) against plain data parallel: the whole
  -- state allocated once anywhere in its life (made then cut, gathered, read back) eats that
  print(string.format('  rank 1 resident peak: plain %.1f MiB, zero=1 %.1f MiB started, %.1f MiB resumed (state %.1f)',
    plain_peak, started_peak, resumed_peak, whole_mb))
  t.truthy(started_peak <= plain_peak - whole_mb / 4,
    string.format('rank 1 (start, checkpoints): %.1f MiB against %.1f', started_peak, plain_peak))
  t.truthy(resumed_peak <= plain_peak - whole_mb / 4,
    string.format('rank 1 (resume, checkpoint): %.1f MiB against %.1f', resumed_peak, plain_peak))
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
