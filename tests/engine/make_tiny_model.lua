-- A tiny random Llama saved in Hugging Face format with a tokenizer fixture,
-- for the `moonrl generate` end-to-end test (test_generate_cli.sh), and the
-- greedy text the engine gives for PROMPT (OUT/expected.txt).
-- env: OUT (the directory to write), TOK (a tokenizer fixture directory), PROMPT, SEED (3).
local moonrl = require('moonrl')
local out, tokdir, prompt = os.getenv('OUT'), os.getenv('TOK'), os.getenv('PROMPT')
assert(out and tokdir and prompt, 'OUT, TOK and PROMPT must be set')
local tok = moonrl.tokenizer.load(tokdir)
local model = moonrl.model.new({ model_type = 'llama', vocab_size = tok.vocab_size, hidden_size = 64,
  intermediate_size = 128, num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2,
  max_position_embeddings = 512, initializer_range = 0.1 }, { seed = tonumber(os.getenv('SEED') or '3') })
model:save(out)
local function copy(from, to)
  local f = assert(io.open(from, 'rb'))
  local s = f:read('*a')
  f:close()
  f = assert(io.open(to, 'wb'))
  f:write(s)
  f:close()
end
copy(tokdir .. '/tokenizer.json', out .. '/tokenizer.json')
local f = assert(io.open(out .. '/tokenizer_config.json', 'wb'))
f:write([[{"eos_token": "<|im_end|>", "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}]])
f:close()
local engine = moonrl.engine.new(model, { kv_cache_bytes = 2 ^ 22 })
local r = engine:generate({ { prompt_ids = tok:encode(prompt) } },
  { temperature = 0, max_tokens = 20, tokenizer = tok, eos_ids = { tok:token_to_id('<|im_end|>') } })
f = assert(io.open(out .. '/expected.txt', 'wb'))
f:write(r[1][1].text, '\n')
f:close()
