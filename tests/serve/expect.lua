-- What `moonrl serve` must answer on the tiny model of make_tiny_model.lua, computed with the
-- engine directly (test_serve.py compares): greedy and seeded samples of a text prompt, a chat
-- prompt rendered with the model's template (with the 3 most likely tokens at each position). env: DIR (the model), OUT (the JSON to write).
local moonrl = require('moonrl')
local json = require('moonrl.io.json')
local dir, out = os.getenv('DIR'), os.getenv('OUT')
assert(dir and out, 'DIR and OUT must be set')
local model = moonrl.model.load(dir)
local tok = moonrl.tokenizer.load(dir)
local eos = {}
for _, id in ipairs({ model.config.eos_token_id, tok.eos_id }) do
  if type(id) == 'number' and id >= 0 and id ~= eos[1] then eos[#eos + 1] = id end
end
local function run(prompt_ids, n, opts, seed)
  local e = moonrl.engine.new(model, { kv_cache_bytes = 2 ^ 22, seed = seed or 0 })
  -- on_text: the text as the streaming decoder gives it (what moonrl generate prints, and serve returns)
  opts.tokenizer, opts.eos_ids, opts.on_text = tok, eos, function() end
  local r = e:generate({ { prompt_ids = prompt_ids, n = n } }, opts)[1]
  local list = json.array({})
  for j, s in ipairs(r) do
    local top = json.array({}) -- per token: [[id, logprob], ...] (opts.top_logprobs)
    for k, row in ipairs(s.top_logprobs or {}) do
      top[k] = json.array({})
      for i, a in ipairs(row) do top[k][i] = json.array({ a[1], a[2] }) end
    end
    list[j] = json.object({ 'ids', json.array(s.ids), 'logprobs', json.array(s.logprobs), 'text', s.text,
      'finish_reason', s.finish_reason, 'top', top })
  end
  return list
end
local prompt = tok:encode('Hello world')
local chat_text = moonrl.chat.load(dir):render({ { role = 'user', content = 'Hi' } }, { add_generation_prompt = true })
local chat_ids = tok:encode(chat_text, { add_special = false })
local f = assert(io.open(out, 'wb'))
f:write(json.encode(json.object({
  'prompt_ids', json.array(prompt),
  'greedy', run(prompt, 1, { temperature = 0, max_tokens = 20 }),
  'sampled', run(prompt, 3, { temperature = 1.0, max_tokens = 12 }, 7),
  'chat_prompt_ids', json.array(chat_ids),
  'chat', run(chat_ids, 1, { temperature = 0, max_tokens = 8, top_logprobs = 3 }),
})))
f:close()
