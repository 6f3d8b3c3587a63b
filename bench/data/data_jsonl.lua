-- Index a JSONL file and read random records with moonrl.data; prints
-- seconds to index and microseconds a random record.
-- usage: FILE=path N=reads moonrl run bench/data/data_jsonl.lua
local data = require('moonrl.data')
local moonrl = require('moonrl')
local path, n = os.getenv('FILE'), tonumber(os.getenv('N'))
local t0 = moonrl.now()
local ds = data.jsonl(path, { fields = { prompt = 'q', answer = 'a' } })
local t1 = moonrl.now()
local sh = ds:shuffled(1)
for i = 1, n do assert(sh:get(i).prompt) end
print(string.format('%.4f %.3f', t1 - t0, (moonrl.now() - t1) / n * 1e6))
