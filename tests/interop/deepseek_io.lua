-- For vllm_deepseek.py: a tiny random DeepSeek-V3 saved by moonrl as a Hugging Face directory, with
-- the trainer's log-probs of a sequence and the engine's greedy tokens after a prompt, as JSON.
-- env: DS_DIR (where to save), DS_OVER (JSON: the preset's keys to change), DS_SEQ, DS_PROMPT
-- (JSON id lists), DS_OUT (the JSON file written).
local moonrl = require('moonrl')
local tiny = dofile('tests/lib/models.lua')
local json = require('moonrl.io.json')
local dir, out = assert(os.getenv('DS_DIR'), 'DS_DIR'), assert(os.getenv('DS_OUT'), 'DS_OUT')
local seq, prompt = json.decode(os.getenv('DS_SEQ')), json.decode(os.getenv('DS_PROMPT'))
tiny.save(dir, 'deepseek_v3_moe', json.decode(os.getenv('DS_OVER') or '{}'), { seed = 7 })
local m = moonrl.model.load(dir)
local lp = m:forward(moonrl.model.batch({ seq }))
local lps = {}
for i = 0, #seq - 2 do lps[#lps + 1] = lp[i] end
local e = moonrl.engine.new(m, { kv_cache_bytes = 2 ^ 24 })
local r = e:generate({ { prompt_ids = prompt } }, { temperature = 0, max_tokens = 8, eos_ids = {} })
local f = assert(io.open(out, 'w'))
f:write(json.encode({ logprobs = lps, greedy = r[1][1].ids }))
f:close()
