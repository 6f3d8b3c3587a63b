-- The real-model examples (examples/grpo_gsm8k.lua, examples/dpo_preferences.lua) end to end for a
-- few steps on a tiny random Qwen2 saved in Hugging Face format, with a small byte-level BPE
-- tokenizer fixture (tests/tok/fixtures/qwen2_split) and a ChatML chat template; the agent
-- examples on their own tiny models for a few steps.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local json = require('moonrl.io.json')
local U = dofile('tests/recipes/util.lua')

local dir = U.tmpdir('examples')
local tok = moonrl.tokenizer.load('tests/tok/fixtures/qwen2_split')
local model = moonrl.model.new({ model_type = 'qwen2', vocab_size = tok.vocab_size, hidden_size = 32,
  intermediate_size = 64, num_hidden_layers = 1, num_attention_heads = 4, num_key_value_heads = 2,
  max_position_embeddings = 1024, tie_word_embeddings = true }, { seed = 4 })
model:save(dir .. '/qwen')
local f = assert(io.open(dir .. '/qwen/tokenizer.json', 'wb'))
f:write(assert(io.open('tests/tok/fixtures/qwen2_split/tokenizer.json', 'rb')):read('*a'))
f:close()
f = assert(io.open(dir .. '/qwen/tokenizer_config.json', 'wb'))
f:write(json.encode({ eos_token = '<|im_end|>', chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}\n" ..
  "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}" }))
f:close()

local function lines(path)
  local n = 0
  for _ in io.lines(path) do n = n + 1 end
  return n
end

t.test('examples/grpo_gsm8k.lua: GRPO with the math reward and the chat template', function()
  local data = U.write_jsonl(dir .. '/gsm8k.jsonl', {
    { question = 'Tom has 3 apples and buys 4 more. How many apples does he have?', answer = 'He has 3 + 4 = 7.\n#### 7' },
    { question = 'A box holds 12 eggs. How many eggs are in 2 boxes?', answer = '12 * 2 = 24\n#### 24' },
    { question = 'Sara had 10 dollars and spent 6. How much is left?', answer = '10 - 6 = 4\n#### 4' },
  })
  local out = U.run_recipe('examples/grpo_gsm8k.lua', { 'model.dir=' .. dir .. '/qwen', 'data.path=' .. data,
    'grpo.steps=2', 'grpo.prompts=2', 'grpo.samples=4', 'grpo.max_tokens=12', 'run.dir=' .. dir .. '/grpo' })
  t.eq(lines(out.dir .. '/metrics.jsonl'), 2)
  local m = moonrl.model.load(out.dir .. '/model')
  t.eq(m.config.model_type, 'qwen2')
  t.truthy(io.open(out.dir .. '/model/tokenizer_config.json'), 'tokenizer config copied')
end)

t.test('examples/dpo_preferences.lua: DPO on prompt/chosen/rejected with the chat template', function()
  local data = U.write_jsonl(dir .. '/prefs.jsonl', {
    { prompt = 'Say hello.', chosen = 'Hello!', rejected = 'No.' },
    { prompt = 'What is 2+2?', chosen = '4', rejected = '5' },
    { prompt = 'Name a color.', chosen = 'Blue.', rejected = 'Table.' },
    { prompt = 'Be polite.', chosen = 'Thank you.', rejected = 'Go away.' },
  })
  local out = U.run_recipe('examples/dpo_preferences.lua', { 'model.dir=' .. dir .. '/qwen', 'data.path=' .. data,
    'train.steps=3', 'train.pairs=2', 'train.lr=1e-3', 'run.dir=' .. dir .. '/dpo' })
  t.eq(lines(out.dir .. '/metrics.jsonl'), 3)
  t.eq(moonrl.model.load(out.dir .. '/model').config.model_type, 'qwen2')
end)

t.test('examples/agent_calculator.lua: the warm-up on transcripts, GRPO on two-turn episodes, held-out episodes', function()
  local out = U.run_recipe('examples/agent_calculator.lua', { 'sft.steps=30', 'sft.calls=0.5', 'grpo.steps=2',
    'grpo.prompts=4', 'heldout=10', 'run.threads=1', 'run.dir=' .. dir .. '/calc' })
  t.truthy(out.before and out.after, 'the held-out accuracy before and after')
  local recs = U.records(out.dir)
  t.eq(#recs, 2)
  for _, r in ipairs(recs) do
    t.eq(r['env/episodes'], 32)
    t.truthy(r['env/turns'] >= 1 and r['env/turns'] <= 2, 'two turns an episode that calls, one else')
    t.eq(r['env/ended/done'], 32, 'every episode ends with its answer (no third turn)')
    t.truthy(r['mismatch/max_abs'] < 1e-4)
  end
end)

t.test('examples/agent_guess.lua: the warm-up on games, GRPO on games of several turns, the held-out mean turns', function()
  local out = U.run_recipe('examples/agent_guess.lua', { 'sft.steps=30', 'grpo.steps=2', 'grpo.prompts=4', 'heldout=10',
    'run.threads=1', 'run.dir=' .. dir .. '/guess' })
  t.truthy(out.before >= 1 and out.before <= 10 and out.after >= 1 and out.after <= 10, 'mean turns before and after')
  for _, r in ipairs(U.records(out.dir)) do
    t.eq(r['env/episodes'], 32)
    t.eq(r['env/ended/done'] + r['env/ended/max_turns'] + r['env/ended/max_tokens'], 32)
    t.truthy(r['mismatch/max_abs'] < 1e-4)
  end
end)

t.test('examples/agent_openai.lua: the calculator episodes played by a Python program with the openai client', function()
  if not require('moonrl.io.proc').run({ '/bin/sh', '-c', 'python3 -c "import openai"' }).ok then
    return print('  (skipped: no openai package for python3)')
  end
  local out = U.run_recipe('examples/agent_openai.lua', { 'sft.steps=30', 'sft.calls=0.5', 'grpo.steps=1',
    'grpo.prompts=2', 'grpo.samples=2', 'heldout=2', 'run.threads=1', 'run.dir=' .. dir .. '/openai' })
  local r = U.records(out.dir)[1]
  t.eq(r['env/episodes'], 4)
  t.eq(r['env/ended/done'], 4, 'every program exited cleanly')
  t.truthy(r['env/turns'] >= 1 and r['env/turns'] <= 2)
  t.truthy(r['mismatch/max_abs'] < 1e-4)
end)

require('moonrl.io.fs').remove(dir)
t.done()
