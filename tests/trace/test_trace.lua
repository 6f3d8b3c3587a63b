-- The Lua side of the timeline and TensorBoard writers.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local trace = require('moonrl.train.trace')

t.test('phases nest and survive errors', function()
  trace.enable(0)
  local a, b, secs = trace.phase('outer', function(x) return x, x * 2 end, 21)
  t.eq(a, 21)
  t.eq(b, 42)
  t.truthy(secs >= 0, 'seconds returned last')
  local x, y, z, s2 = trace.phase('holes', function() return 1, nil, 3 end)
  t.truthy(x == 1 and y == nil and z == 3 and s2 >= 0, 'a nil among the results: the seconds still last')
  local ok = pcall(trace.phase, 'failing', function() error('boom') end)
  t.eq(ok, false)
  t.eq(trace.count(), 6, 'begin and end recorded for the three phases')
  local path = os.tmpname()
  trace.write(path)
  local text = io.open(path):read('*a')
  os.remove(path)
  t.truthy(text:find('"name":"failing","ph":"E"', 1, true), 'phase closed after the error')
  trace.disable()
end)

t.test('complete events: spans already over, at their own start and duration', function()
  trace.enable(0)
  local t0 = moonrl.now()
  trace.complete('env step', t0 + 0.5, 0.25)
  trace.complete('tool calculator', t0 + 0.6, 0.01)
  local path = os.tmpname()
  trace.write(path)
  local ev = trace.read_events(io.open(path):read('*a')).events
  os.remove(path)
  local x = {}
  for _, e in ipairs(ev) do if e.ph == 'X' then x[#x + 1] = e end end
  t.eq(#x, 2)
  t.eq(x[1].name, 'env step')
  t.near(x[1].dur, 250000, 1e-6, 'duration in microseconds')
  t.near(x[2].ts - x[1].ts, 100000, 1e-3, 'each at its own start')
  trace.disable()
end)

t.test('tensorboard scalars from a nested table', function()
  local dir = os.tmpname()
  os.remove(dir)
  local tb = trace.tensorboard(dir)
  tb:scalars({ reward = { mean = 0.5, std = 0.1 }, kl = 0.01, note = 'skipped' }, 3)
  tb:flush()
  local data = io.open(tb.path, 'rb'):read('*a')
  tb:close()
  t.truthy(data:find('reward/mean', 1, true), 'nested tag joined with /')
  t.truthy(data:find('reward/std', 1, true), 'second nested tag')
  t.truthy(not data:find('note', 1, true), 'strings are not scalars')
  os.execute('rm -rf "' .. dir .. '"')
end)

t.test('merge: the ranks\' traces on one clock, one process track each; a foreign text is an error', function()
  local json = require('moonrl.io.json')
  local function rank_trace(rank)
    trace.enable(rank)
    trace.thread_name('main')
    trace.phase('work', function() moonrl.sleep(0.01) end)
    local text = trace.text()
    trace.disable()
    return text
  end
  local a = rank_trace(0)
  moonrl.sleep(0.05)
  local b = rank_trace(1) -- enabled 50+ ms later: its times shift by as much
  local t0a, t0b = tonumber(a:match('"t0_unix_us":(%d+)')), tonumber(b:match('"t0_unix_us":(%d+)'))
  t.truthy(t0b - t0a >= 50000, 'the wall clock of each trace start: ' .. (t0b - t0a))
  local m = json.decode(trace.merge({ a, b }))
  t.eq(m.otherData.ranks, 2, 'two ranks')
  local begins, names = {}, {}
  for _, e in ipairs(m.traceEvents) do
    if e.ph == 'B' then begins[e.pid] = e.ts end
    if e.ph == 'M' and e.name == 'process_name' then names[e.pid] = e.args.name end
  end
  t.eq(names[0], 'rank 0', 'rank 0 track')
  t.eq(names[1], 'rank 1', 'rank 1 track')
  local own_a = json.decode(a).traceEvents
  local first_a
  for _, e in ipairs(own_a) do if e.ph == 'B' then first_a = e.ts end end
  t.near(begins[0], first_a, 1e-3, 'the earliest trace keeps its times')
  t.truthy(begins[1] - begins[0] >= 50000, 'the later one is shifted onto its clock: ' .. (begins[1] - begins[0]))
  local ok, err = pcall(trace.merge, { a, '{"x": 1}' }, { 'rank-0.json', 'rank-1.json' })
  t.truthy(not ok and tostring(err):find('rank-1.json: not a moonrl trace', 1, true), tostring(err))
end)

t.test('stream and read_events: a stream cut anywhere reads back as its whole events', function()
  local path = os.tmpname()
  trace.enable(4)
  t.eq(trace.stream('/no/such/dir/trace-rank-4.json'), false, 'a stream that cannot be created: a warning')
  t.eq(trace.stream(path), true)
  trace.phase('outer', function() trace.phase('inner', function() end) end)
  trace.begin('open')
  local text = io.open(path, 'rb'):read('*a')
  trace.disable()
  os.remove(path)
  local whole = trace.read_events(text, 'stream')
  t.eq(whole.other.rank, 4)
  t.eq(whole.complete, false, 'a stream has no closing line')
  local phases = 0
  for _, e in ipairs(whole.events) do if e.ph ~= 'M' then phases = phases + 1 end end
  t.eq(phases, 5, 'the five phase events (and the track names)')
  t.eq(whole.dropped, 0)
  t.eq(whole.open[1], 'open (pid 4 tid 1)', 'the phase never ended: ' .. tostring(whole.open[1]))
  -- cut at every byte of the last three events' lines: never an error, the events before it kept,
  -- a cut line dropped, never more
  local cut_from = text:find('\n{"name":"inner","ph":"E"', 1, true)
  t.truthy(cut_from, 'the inner end event is on its own line')
  local all, last, bad = #whole.events, 0, nil
  for n = cut_from, #text do
    local r = trace.read_events(text:sub(1, n), 'cut')
    local kept = #r.events
    if not (kept >= all - 3 and kept >= last and r.dropped <= 1) then bad = bad or string.format(
      'cut at byte %d: %d events, %d dropped', n, kept, r.dropped) end
    last = kept
  end
  t.truthy(not bad, bad)
  t.eq(last, all, 'uncut: every event')
  local ok, err = pcall(trace.read_events, text:sub(1, 20), 'head.json')
  t.truthy(not ok and tostring(err):find('head.json: not a moonrl trace', 1, true), tostring(err))
end)

t.done()
