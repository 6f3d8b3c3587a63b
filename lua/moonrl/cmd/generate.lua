-- moonrl generate: sample text from a Hugging Face model directory with the
-- generation engine, streaming the text to the terminal as it comes.
local moonrl = require('moonrl')

local M = {}

local USAGE = [[
usage: moonrl generate --model DIR --prompt TEXT [options]
  --model DIR          a Hugging Face model directory (config.json, *.safetensors, tokenizer.json),
                       or a .gguf file (converted once into MOONRL_CACHE, default ~/.cache/moonrl)
  --prompt TEXT        the prompt
  --chat               wrap the prompt as a user message with the model's chat template
  -n N                 samples of the prompt (default 1; the first is streamed, the others follow)
  --temperature T      default 1.0; 0 is greedy
  --top-p P            default 1.0 (off)
  --top-k K            default 0 (off)
  --min-p P            default 0 (off)
  --max-tokens M       new tokens at most (default 128)
  --seed S             default 0
  --stop TEXT          stop at this string (may be repeated)
  --tokenizer PATH     tokenizer.json or its directory (default: the model directory)
  --lora DIR           a PEFT LoRA adapter over the model (its adapter_config.json, adapter_model.safetensors)
  --kv-cache-mb MB     KV cache size (default 256)
  --tp N               tensor parallel over N ranks (started here with mpirun): each holds its
                       slices of every layer, the ranks generate together, rank 0 prints]]

local NUMBERS = {
  ['-n'] = { 'n', true, 1 }, ['--temperature'] = { 'temperature', false, 0 }, ['--top-p'] = { 'top_p', false, 0 },
  ['--top-k'] = { 'top_k', true, 0 }, ['--min-p'] = { 'min_p', false, 0 }, ['--max-tokens'] = { 'max_tokens', true, 1 },
  ['--seed'] = { 'seed', true, 0 }, ['--kv-cache-mb'] = { 'kv_cache_mb', false, 0 }, ['--tp'] = { 'tp', true, 1 },
}
local STRINGS = { ['--model'] = 'model', ['--prompt'] = 'prompt', ['--tokenizer'] = 'tokenizer', ['--lora'] = 'lora' }

local function parse(args)
  local o = require('moonrl.cli.cmdline').parse(args, { command = 'generate', usage = USAGE, numbers = NUMBERS,
    strings = STRINGS, lists = { ['--stop'] = 'stop' }, flags = { ['--chat'] = 'chat' },
    defaults = { n = 1, temperature = 1.0, top_p = 1.0, top_k = 0, min_p = 0, max_tokens = 128, seed = 0,
      kv_cache_mb = 256, tp = 1 },
    required = { '--model', '--prompt' } })
  if not o then return nil end
  if o.top_p > 1 or o.top_p <= 0 then moonrl.usage_error('generate: --top-p must be in (0, 1]') end
  if o.min_p > 1 then moonrl.usage_error('generate: --min-p must be in [0, 1]') end
  return o
end

function M.main(args)
  local o = parse(args)
  if not o then return 0 end
  local world = o.tp > 1 and require('moonrl.train.dist').world() or nil
  if world and world.size == 1 then return require('moonrl.cmd.launch').start_self('generate', o.tp, args) end
  if world and world.size ~= o.tp then
    moonrl.usage_error(string.format('generate: --tp %d on a job of %d ranks (it starts its own: run it alone)', o.tp,
      world.size))
  end
  local lead = not world or world.rank == 0 -- (the others generate with it, silently)
  local inference = require('moonrl.serve.inference')
  local m, err = inference.load(o.model, { tokenizer = o.tokenizer, template = o.chat, tp = world })
  if not m then moonrl.usage_error('generate: ' .. tostring(err)) end
  local model, tok = m.model, m.tokenizer
  if o.lora then
    if world then moonrl.usage_error('generate: --lora is not served with --tp yet') end
    local ok, lerr = pcall(model.load_lora, model, o.lora)
    if not ok then moonrl.usage_error('generate: --lora ' .. o.lora .. ': ' .. moonrl.error_text(lerr)) end
  end
  local prompt_ids
  if o.chat then
    local tpl = m.template
    if not tpl then moonrl.usage_error('generate: --chat: ' .. tostring(m.template_error)) end
    local text = tpl:render({ { role = 'user', content = o.prompt } }, { add_generation_prompt = true })
    prompt_ids = tok:encode(text, { add_special = false })
  else
    prompt_ids = tok:encode(o.prompt)
  end
  if #prompt_ids == 0 then moonrl.usage_error('generate: the prompt encodes to no tokens') end
  local max_len = model.config.max_position_embeddings
  if #prompt_ids >= max_len then
    moonrl.usage_error(string.format('generate: the prompt has %d tokens, the model takes %d at most', #prompt_ids, max_len))
  end
  local max_tokens = math.min(o.max_tokens, max_len - #prompt_ids)
  local ok, engine = pcall(moonrl.engine.new, model, { kv_cache_bytes = math.floor(o.kv_cache_mb * 2 ^ 20),
    max_seqs = math.max(o.n, 1), seed = o.seed })
  if not ok then moonrl.usage_error('generate: ' .. tostring(engine)) end
  local t0 = moonrl.now()
  -- many samples: how many are done, on stderr, when stdout is not the terminal the first
  -- sample streams to (moonrl.io.progress)
  local progress = require('moonrl.io.progress')
  local prog = lead and o.n > 1 and not progress.isatty(1) and progress.new('generate', o.n, { unit = 'sample' }) or nil
  local results = engine:generate({ { prompt_ids = prompt_ids, n = o.n } }, {
    temperature = o.temperature, top_p = o.top_p, top_k = o.top_k, min_p = o.min_p, max_tokens = max_tokens,
    eos_ids = inference.eos_ids(m.dir, model, tok), stop = #o.stop > 0 and o.stop or nil, tokenizer = tok,
    on_text = function(_, j, piece)
      if j == 1 and lead then
        io.write(piece)
        io.flush()
      end
      if prog and prog:due() then prog:update(engine:stats().finished) end
    end,
  })
  if prog then prog.done = o.n; prog:finish() end
  if not lead then return 0 end
  local dt = moonrl.now() - t0
  io.write('\n')
  local generated = 0
  for j, s in ipairs(results[1]) do
    generated = generated + #s.ids
    if j > 1 then io.write(string.format('--- sample %d ---\n%s\n', j, s.text)) end
  end
  io.flush()
  io.stderr:write(string.format('[%d tokens in %.2f s, %.1f tokens/s; finish: %s]\n', generated, dt,
    generated / math.max(dt, 1e-9), results[1][1].finish_reason))
  return 0
end

return M
