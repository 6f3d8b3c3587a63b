-- `moonrl trace merge`: the timelines that killed ranks leave behind (their streams,
-- trace-rank-R.json), joined into one trace.json. Real kills: a process SIGKILLed as a step
-- begins (MOONRL_FAULT) and one inside a phase, and rank 1 of an mpirun job (skipped without
-- mpirun); then such a file cut in the middle of an event and with a corrupt line, and the
-- errors for bad input.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')
local proc = require('moonrl.io.proc')
local trace = require('moonrl.train.trace')
local U = dofile('tests/recipes/util.lua')

local exe = rawget(_G, 'MOONRL_EXE') or 'build/moonrl'
local dir = U.tmpdir('trace_merge')
local model_dir = U.tiny_model(dir .. '/init', { layers = 2 })
local sft = {}
for i, p in ipairs(U.additions(40, 3)) do sft[i] = { prompt = p.prompt, response = p.answer } end
local data = U.write_jsonl(dir .. '/sft.jsonl', sft)
local WORDS = { 'model.dir=' .. model_dir, 'data.path=' .. data, 'train.steps=5', 'train.batch=8', 'train.lr=1e-3',
  'train.micro_batch_tokens=40', 'run.threads=1' }

local function words(run_dir, ...)
  local w = { 'run.dir=' .. run_dir }
  for _, x in ipairs(WORDS) do w[#w + 1] = x end
  for _, x in ipairs({ ... }) do w[#w + 1] = x end
  return w
end

local function sft_run(run_dir, env, prefix)
  local argv = { '/usr/bin/env', 'PATH=' .. os.getenv('PATH'), 'MOONRL_FAULT=' .. (env or '') }
  for _, a in ipairs(prefix or {}) do argv[#argv + 1] = a end
  for _, a in ipairs({ exe, 'run', 'recipes/sft.lua' }) do argv[#argv + 1] = a end
  for _, w in ipairs(words(run_dir, 'dist.timeout=10')) do argv[#argv + 1] = w end
  return proc.run(argv, { timeout = 180 })
end

local function cli(...)
  local r = proc.run({ exe, 'trace', ... }, { timeout = 60 })
  r.text = (r.stdout or '') .. (r.stderr or '')
  return r
end

-- A merged file's events by pid: { track = its process name, n = events but metadata,
-- begun = { [phase name] = times begun } }, and the decoded file
local function by_rank(path)
  local tr = json.decode(fs.read(path), path)
  local out = {}
  for _, e in ipairs(tr.traceEvents) do
    local r = out[e.pid] or { begun = {}, n = 0 }
    out[e.pid] = r
    if e.ph ~= 'M' then r.n = r.n + 1 end
    if e.ph == 'B' then r.begun[e.name] = (r.begun[e.name] or 0) + 1 end
    if e.ph == 'M' and e.name == 'process_name' then r.track = e.args.name end
  end
  return out, tr
end

t.test('a clean run leaves trace.json and no stream; merging it is nothing to do', function()
  local d = dir .. '/clean'
  local r = sft_run(d)
  t.truthy(r.ok, r.stdout .. r.stderr)
  t.truthy(fs.exists(d .. '/trace.json'), 'trace.json')
  t.truthy(not fs.exists(d .. '/trace-rank-0.json'), 'the stream is removed at a clean end')
  local m = cli('merge', d)
  t.eq(m.exit_status, 0, m.text)
  t.truthy(m.text:find('whole already', 1, true), m.text)
end)

t.test('one process killed as a step began: its stream merges into trace.json', function()
  local d = dir .. '/killed1'
  local r = sft_run(d, 'kill:step=3:phase=train')
  t.truthy(not r.ok and r.signal == 9, 'SIGKILLed: ' .. tostring(r.signal) .. ' ' .. r.stderr)
  t.truthy(not fs.exists(d .. '/trace.json'), 'no trace.json: the process never reached its end')
  t.truthy(fs.exists(d .. '/trace-rank-0.json'), 'its stream is there')
  local m = cli('merge', d)
  t.eq(m.exit_status, 0, m.text)
  t.truthy(m.text:find('cut short', 1, true), 'the file did not end: ' .. m.text)
  local ranks, tr = by_rank(d .. '/trace.json')
  t.eq(tr.otherData.ranks, 1, 'one rank')
  t.eq(tr.otherData.merged_from[1], 'trace-rank-0.json', 'its source')
  t.truthy(ranks[0] and ranks[0].track == 'rank 0', 'the rank 0 track')
  -- killed as step 3's train phase began: steps 1 and 2 are in the timeline, whole
  t.eq(ranks[0].begun.train, 2, 'the train phases of steps 1 and 2')
  -- the merge of the merge's own output is refused as an input, and redone in place
  local again = cli('merge', d)
  t.eq(again.exit_status, 0, 'a trace.json this command wrote is replaced: ' .. again.text)
  local bad = cli('merge', d .. '/trace.json', '-o', d .. '/x.json')
  t.eq(bad.exit_status, 2, bad.text)
  t.truthy(bad.text:find('already a merged timeline', 1, true), bad.text)
end)

t.test('a process killed inside a phase: the merge names the phase it never ended', function()
  local d = dir .. '/inside'
  local script = dir .. '/die_in_phase.lua'
  fs.write(script, [[
local moonrl = require('moonrl')
local run = require('moonrl.train.run').start({ run = { dir = os.getenv('DIE_IN') } }, { name = 'die', tensorboard = false })
for step = 1, 3 do run:phase('generate', function() end) end
run:phase('train', function()
  run:phase('backward', function() moonrl.C.mrl_fault_kill() end) -- SIGKILL: no finish, no trace.json
end)
]])
  local r = proc.run({ '/usr/bin/env', 'DIE_IN=' .. d, exe, 'run', script }, { timeout = 60 })
  t.truthy(not r.ok and r.signal == 9, 'SIGKILLed: ' .. tostring(r.signal) .. ' ' .. r.stderr)
  local m = cli('merge', d)
  t.eq(m.exit_status, 0, m.text)
  t.truthy(m.text:find('rank 0, 10 events; cut short (the rank did not end: killed?); ' ..
    'never ended: train (pid 0 tid 1), backward (pid 0 tid 1)', 1, true), m.text)
  local ranks = by_rank(d .. '/trace.json')
  t.eq(ranks[0].begun.generate, 3, 'the three whole generate phases')
  t.eq(ranks[0].n, 8, 'and the two begun, never ended')
end)

local mpirun = U.which('mpirun')
local job = dir .. '/killed2'
t.test('rank 1 of an mpirun job killed: both ranks on one clock in trace.json', function()
  local plugin = (exe:match('^(.*)/[^/]+$') or '.') .. '/libmoonrl_mpi.so' -- what moonrl.train.dist loads
  if not (mpirun and fs.exists(plugin)) then
    print('  (no mpirun, or moonrl built without MPI: skipped)')
    return
  end
  local r = sft_run(job, 'kill:step=3:phase=train:rank=1', { mpirun, '-n', '2', '--oversubscribe', '--bind-to', 'none',
    '--allow-run-as-root', '--mca', 'btl', 'vader,self', '-x', 'MOONRL_FAULT' })
  t.truthy(not r.ok, 'the job failed')
  t.truthy(not fs.exists(job .. '/trace.json'), 'no merged trace.json: the ranks did not end together')
  t.truthy(fs.exists(job .. '/trace-rank-0.json') and fs.exists(job .. '/trace-rank-1.json'),
    'each rank left its timeline: ' .. table.concat(fs.list(job), ' '))
  local m = cli('merge', job)
  t.eq(m.exit_status, 0, m.text)
  t.truthy(m.text:find('trace%-rank%-1%.json: rank 1, %d+ events; cut short'), 'rank 1 was cut short: ' .. m.text)
  local ranks, tr = by_rank(job .. '/trace.json')
  t.eq(tr.otherData.ranks, 2, 'two ranks')
  t.truthy(ranks[0] and ranks[1] and ranks[0].track == 'rank 0' and ranks[1].track == 'rank 1', 'a track per rank')
  t.eq(ranks[1].begun.train, 2, 'rank 1 trained steps 1 and 2, killed as step 3 began')
  t.truthy((ranks[0].begun.train or 0) >= 2, 'rank 0 too')
  -- one clock: both ranks' first step begins within a second of the other
  local first = {}
  for _, e in ipairs(tr.traceEvents) do
    if e.ph == 'B' and e.name == 'train' and not first[e.pid] then first[e.pid] = e.ts end
  end
  t.truthy(first[0] and first[1] and math.abs(first[0] - first[1]) < 1e6,
    string.format('their first train phases line up: %s vs %s us', tostring(first[0]), tostring(first[1])))
end)

t.test('a file cut mid-event and a corrupt line: complete events kept, the rest counted', function()
  local src = job .. '/trace-rank-1.json'
  if not fs.exists(src) then src = dir .. '/killed1/trace-rank-0.json' end -- (no mpirun)
  local text = fs.read(src)
  local whole = trace.read_events(text, src)
  local d = dir .. '/cut'
  fs.mkdirs(d)
  -- the same timeline as ranks 0 and 1, rank 0 started 1 s earlier
  local t0 = tonumber(text:match('"t0_unix_us":(%d+)'))
  local function as_rank(r, start)
    return (text:gsub('"rank":%d+', '"rank":' .. r, 1):gsub('"pid":%d+', '"pid":' .. r)
      :gsub('"name":"rank %d+"', '"name":"rank ' .. r .. '"'):gsub('"t0_unix_us":%d+', '"t0_unix_us":' .. start, 1))
  end
  -- rank 1 cut 7 bytes into its last event's line
  local one = as_rank(1, t0)
  fs.write(d .. '/trace-rank-1.json', one:sub(1, one:match('.*()\n{') + 7))
  -- rank 0 with a line of garbage in its middle
  local lines = {}
  for l in as_rank(0, t0 - 1000000):gmatch('[^\n]+') do lines[#lines + 1] = l end
  table.insert(lines, 5, '{"name":"torn" ,,, garbage')
  fs.write(d .. '/trace-rank-0.json', table.concat(lines, '\n'))
  local m = cli('merge', d)
  t.eq(m.exit_status, 0, m.text)
  t.truthy(m.text:find('trace%-rank%-1%.json: rank 1, ' .. (#whole.events - 1) .. ' events; 1 incomplete or corrupt ' ..
    'event dropped %(first at line ' .. (#lines - 1) .. '%)'), 'the cut last event: ' .. m.text)
  t.truthy(m.text:find('trace%-rank%-0%.json: rank 0, ' .. #whole.events .. ' events; 1 incomplete or corrupt event ' ..
    'dropped %(first at line 5%)'), 'the corrupt line: ' .. m.text)
  t.truthy(m.text:find('2 events dropped', 1, true), m.text)
  local tr = json.decode(fs.read(d .. '/trace.json'))
  t.eq(#tr.traceEvents, 2 * #whole.events - 1, 'every complete event in the merge')
  -- rank 0 started 1 s earlier: rank 1's times are shifted by 1e6 us onto its clock
  local firsts = {}
  for _, e in ipairs(tr.traceEvents) do
    if e.ph == 'B' and not firsts[e.pid] then firsts[e.pid] = e.ts end
  end
  t.near(firsts[1] - firsts[0], 1e6, 1e-3, 'one clock: the later start shifted by the difference')
end)

t.test('bad input: a file that is no trace, a run directory with none, a trace.json a run wrote', function()
  local d = dir .. '/bad'
  fs.mkdirs(d)
  fs.write(d .. '/trace-rank-0.json', '{"displayTimeUnit":"ms","otherData":{"rank":0,"t0_unix_us":1},"traceEvents":[\n')
  fs.write(d .. '/trace-rank-1.json', 'not a trace at all\n')
  local m = cli('merge', d)
  t.eq(m.exit_status, 2, m.text)
  t.truthy(m.text:find(d .. '/trace-rank-1.json: not a moonrl trace', 1, true), m.text)
  t.truthy(m.text:find('remove it to merge the others', 1, true), m.text)
  os.remove(d .. '/trace-rank-1.json')
  local one = cli('merge', d)
  t.eq(one.exit_status, 0, 'a stream with no event yet is still a trace: ' .. one.text)
  local empty = dir .. '/empty'
  fs.mkdirs(empty)
  local e = cli('merge', empty)
  t.eq(e.exit_status, 2, e.text)
  t.truthy(e.text:find('holds no trace-rank-R.json and no trace.json', 1, true), e.text)
  local clean = dir .. '/clean'
  fs.write(clean .. '/trace-rank-1.json', fs.read(dir .. '/killed1/trace-rank-0.json'))
  local c = cli('merge', clean)
  t.eq(c.exit_status, 2, c.text)
  t.truthy(c.text:find('exists and was not written by trace merge', 1, true), c.text)
  local o = cli('merge', clean, '-o', clean .. '/leftovers.json')
  t.eq(o.exit_status, 0, o.text)
  local files = cli('merge', clean .. '/trace-rank-1.json')
  t.eq(files.exit_status, 2, files.text)
  t.truthy(files.text:find('give -o OUT.json', 1, true), files.text)
  local sub = cli('split', clean)
  t.eq(sub.exit_status, 2, sub.text)
  t.truthy(sub.text:find("unknown subcommand 'split'", 1, true), sub.text)
end)

t.done()
