-- moonrl.data: streaming JSONL datasets, deterministic shuffles, splits,
-- positions that save and restore exactly, and the errors users see.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local data = require('moonrl.data')
local json = require('moonrl.io.json')
local ffi = require('ffi')

local tmp = os.tmpname()
local function write(path, lines)
  local f = assert(io.open(path, 'wb'))
  f:write(table.concat(lines, '\n'), '\n')
  f:close()
end

-- a file of N records: {"id": i, "q": "...", "a": ...}
local N = 50000
local big = tmp .. '.big.jsonl'
do
  local f = assert(io.open(big, 'wb'))
  local pad = string.rep('x', 200)
  for i = 1, N do
    f:write(string.format('{"id": %d, "q": "question %d %s", "a": %d}\n', i, i, pad, i * 7))
    if i % 1000 == 0 then f:write('\n') end   -- blank lines are not records
  end
  f:close()
end

local fields = { prompt = 'q', answer = 'a' }

t.test('the permutation is xoshiro256** + Fisher-Yates (known answers)', function()
  local p = ffi.new('int64_t[10]')
  moonrl.check(moonrl.C.mrl_data_permutation(12345, 10, p))
  local got = {}
  for i = 0, 9 do got[#got + 1] = tonumber(p[i]) end
  -- computed independently in Python from the algorithm's description
  t.eq(table.concat(got, ','), '2,6,9,5,1,8,7,0,4,3')
  moonrl.check(moonrl.C.mrl_data_permutation(0, 5, p))
  t.eq(table.concat({ tonumber(p[0]), tonumber(p[1]), tonumber(p[2]), tonumber(p[3]), tonumber(p[4]) }, ','), '3,4,1,2,0')
end)

t.test('a big file is streamed, not loaded', function()
  collectgarbage('collect')
  local before = collectgarbage('count') * 1024
  local ds = data.jsonl(big, { fields = fields })
  t.eq(ds:len(), N)
  local f = io.open(big, 'rb'); local size = f:seek('end'); f:close()
  local r = ds:get(N)
  t.eq(r.data.id, N); t.eq(r.answer, N * 7); t.eq(r.line, N + N / 1000 - 1, "file line after 49 blank lines")
  t.eq(ds:get(1).prompt:sub(1, 10), 'question 1')
  for i = 1, N, 997 do t.eq(ds:get(i).data.id, i) end
  collectgarbage('collect')
  local lua_heap = collectgarbage('count') * 1024 - before
  t.truthy(lua_heap < size / 10, string.format('Lua heap grew by %d bytes for a %d-byte file', lua_heap, size))
  local ix = tonumber(moonrl.C.mrl_line_index_bytes(ds.src.index))
  t.truthy(moonrl.memory().other >= ix and ix >= 8 * N, 'the line index is accounted')
  t.truthy(ix <= 8 * N + 2 ^ 20, string.format('the line index holds %d bytes for %d lines: 8 a line', ix, N))
end)

t.test('shuffling is deterministic and a permutation', function()
  local ds = data.jsonl(big, { fields = fields })
  local a, b, c = ds:shuffled(7), ds:shuffled(7), ds:shuffled(8)
  local seen, same, differs = {}, true, false
  for i = 1, 2000 do
    local ra = a:get(i).data.id
    if ra ~= b:get(i).data.id then same = false end
    if ra ~= c:get(i).data.id then differs = true end
  end
  t.truthy(same, 'same seed, same order'); t.truthy(differs, 'other seed, other order')
  local small = data.jsonl(big, { fields = fields }):split({ count = 100, seed = 1 })
  local _, v = data.jsonl(big, { fields = fields }):split({ count = 100, seed = 1 })
  local sv = v:shuffled(3)
  for i = 1, sv:len() do seen[sv:get(i).data.id] = true end
  local count = 0
  for i = 1, v:len() do if seen[v:get(i).data.id] then count = count + 1 end end
  t.eq(count, 100, 'every record exactly once')
end)

t.test('resume from a saved position gives the same batches', function()
  local _, small = data.jsonl(big, { fields = fields }):split({ count = 103, seed = 9 })
  local function ids(batch) local o = {} for i, r in ipairs(batch) do o[i] = r.data.id end return table.concat(o, ',') end
  local a = small:shuffled(42)
  local it = a:batches(10, { epochs = 3 })
  for _ = 1, 14 do it() end           -- into the second epoch
  local saved = json.decode(json.encode(a:state()))  -- through JSON, as a checkpoint would
  t.eq(saved.epoch, 1)
  local rest = {}
  for batch in it do rest[#rest + 1] = ids(batch) end
  local b = small:shuffled(42)
  b:restore(saved)
  local again = {}
  for batch in b:batches(10, { epochs = 2 }) do again[#again + 1] = ids(batch) end
  t.eq(table.concat(again, ';'), table.concat(rest, ';'))
  t.eq(#rest, 19, "batches left: 8 in epoch 1 (the last one has 3) and 11 in epoch 2")
  -- each epoch has its own order
  local e0 = small:shuffled(42); local e1 = small:shuffled(42); e1:restore({ epoch = 1, index = 0, n = 103, seed = '42' })
  t.truthy(ids(e0:batches(103)()) ~= ids(e1:batches(103)()), 'epochs differ')
  t.raises(function() small:shuffled(41):restore(saved) end, 'saved with seed 42')
  -- drop_last
  local n = 0
  for batch in small:batches(25, { drop_last = true }) do n = n + 1; t.eq(#batch, 25) end
  t.eq(n, 4)
end)

t.test('train/validation split: disjoint, complete, deterministic', function()
  local ds = data.jsonl(big, { fields = fields })
  local train, valid = ds:split({ fraction = 0.1, seed = 5 })
  t.eq(valid:len(), N / 10); t.eq(train:len() + valid:len(), N)
  local in_valid = {}
  for i = 1, valid:len() do in_valid[valid:row(i)] = true end
  for i = 1, train:len() do if in_valid[train:row(i)] then error('row ' .. train:row(i) .. ' in both') end end
  local _, valid2 = ds:split({ fraction = 0.1, seed = 5 })
  local _, valid3 = ds:split({ fraction = 0.1, seed = 6 })
  local same, diff = true, false
  for i = 1, valid:len() do
    if valid:row(i) ~= valid2:row(i) then same = false end
    if valid:row(i) ~= valid3:row(i) then diff = true end
  end
  t.truthy(same, 'same seed, same split'); t.truthy(diff, 'other seed, other split')
  local tr, va = ds:split({ count = 3, seed = 5 })
  t.eq(va:len(), 3); t.eq(tr:len(), N - 3)
end)

t.test('bad lines and missing fields name the file and line', function()
  local p = tmp .. '.bad.jsonl'
  write(p, { '{"q": "a", "a": 1}', '', '{"q": "b", "a": }', '{"a": 3}', '[1, 2]', '{"q": "e", "a": 5}' })
  local ds = data.jsonl(p, { fields = fields })
  t.eq(ds:len(), 5)
  t.raises(function() ds:get(2) end, p .. ':3: invalid JSON (column 17)')
  t.raises(function() ds:get(3) end, p .. ":4: missing field 'q' (for 'prompt')")
  t.raises(function() ds:get(4) end, p .. ':5: expected a JSON object')
  t.raises(function() for _ in ds:batches(2) do end end, p .. ':3:')
  local sk = data.jsonl(p, { fields = fields, on_error = 'skip' })
  local got = {}
  for batch in sk:batches(2) do for _, r in ipairs(batch) do got[#got + 1] = r.prompt end end
  t.eq(table.concat(got, ','), 'a,e')
  t.eq(sk:stats().skipped, 3)
  local opt = data.jsonl(p, { fields = fields, optional = { prompt = true } })
  t.eq(opt:get(3).prompt, nil); t.eq(opt:get(3).answer, 3)
  local nested = tmp .. '.nested.jsonl'
  write(nested, { '{"q": {"text": "deep"}, "a": 1}' })
  t.eq(data.jsonl(nested, { fields = { prompt = 'q.text' } }):get(1).prompt, 'deep')
  t.raises(function() data.jsonl(nested, { fields = { prompt = 'q.nope' } }):get(1) end, ":1: missing field 'q.nope'")
  os.remove(nested)
  t.raises(function() data.jsonl(tmp .. '.missing.jsonl') end, 'cannot open')
  t.raises(function() ds:get(6) end, 'out of range 1..5')
  os.remove(p)
end)

t.test('json: floats round-trip exactly; key order kept', function()
  for _, x in ipairs({ 0.1, 1 / 3, 1e-300, 123456789.123, -2.5e-7, 2 ^ 60, 5e-324, 1.7976931348623157e308 }) do
    t.eq(json.decode(json.encode(x)), x, json.encode(x))
  end
  t.eq(json.encode(0.1), '0.1'); t.eq(json.encode(1e-5), '1e-05'); t.eq(json.encode(1e16), '1e+16'); t.eq(json.encode(3), '3')
  local o = json.object { 'step', 3, 'loss', 0.25, 'tags', json.array {} }
  o.extra = json.null
  t.eq(json.encode(o), '{"step": 3, "loss": 0.25, "tags": [], "extra": null}')
  t.eq(json.encode(json.decode('{"z": [1, {"b": 2, "a": "é\\u00e9\\n"}]}')), '{"z": [1, {"b": 2, "a": "éé\\n"}]}')
  t.raises(function() json.decode('{"a": 1,}', 'cfg.json') end, 'cfg.json:1:9:')
  t.eq(json.decode('"\\ud83d\\ude00\\u00e9\\t"'), '\240\159\152\128\195\169\t', 'surrogate pair, escapes')
  t.eq(json.decode(' [ -1.5e2 , 0 , true , null ] ')[1], -150)
  t.eq(json.decode('[null]')[1], json.null)
  for _, bad in ipairs({ '"abc', '"a\nb"', '"\\q"', '[1 2]', '{"a" 1}', '', 'tru', '-', '1.2.3', '{} x', '"\\u12"' }) do
    local ok = pcall(json.decode, bad)
    t.eq(ok, false, 'rejects ' .. bad)
  end
end)

-- the process's peak resident memory, in bytes, after resetting it to what is resident now
local function peak_reset() local f = assert(io.open('/proc/self/clear_refs', 'w')); f:write('5'); f:close() end
local function peak()
  for l in io.lines('/proc/self/status') do
    local kb = l:match('^VmHWM:%s*(%d+)')
    if kb then return tonumber(kb) * 1024 end
  end
end

t.test('a record over max_record_bytes is refused naming file and line, before it is read', function()
  local path, mb = tmp .. '.huge.jsonl', 2 ^ 20
  local f = assert(io.open(path, 'wb'))
  f:write('{"q": "short", "a": 1}\n\n{"q": "')
  local chunk = string.rep('x', mb)
  for _ = 1, 64 do f:write(chunk) end   -- (64 MiB, written a MiB at a time: the test's own peak stays low)
  chunk = nil
  f:write('", "a": 2}\n{"q": "after", "a": 3}\n')
  f:close()
  local ds = data.jsonl(path, { fields = fields })
  collectgarbage('collect')
  peak_reset()
  local base = peak()
  t.raises(function() ds:get(2) end, path .. ':3: the record is 67108881 bytes, over the limit of 16777216 ' ..
    '(data.max_record_bytes)')
  local grew = peak() - base
  t.truthy(grew < 8 * mb, string.format('peak memory grew by %.1f MB refusing a 64 MB record', grew / mb))
  t.eq(ds:get(3).prompt, 'after')
  local skipping = data.jsonl(path, { fields = fields, on_error = 'skip' })
  t.eq(skipping:get(2), nil); t.eq(skipping:stats().skipped, 1)
  local roomy = data.jsonl(path, { fields = fields, max_record_bytes = 65 * mb })
  t.eq(#roomy:get(2).prompt, 64 * mb, 'a record under the limit reads')
  roomy = nil
  t.raises(function() data.jsonl(path, { fields = fields, max_record_bytes = 0 }) end, 'max_record_bytes must be')
  os.remove(path)
end)

os.remove(big)
os.remove(tmp)
t.done()
