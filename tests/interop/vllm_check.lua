-- vllm serve (the CPU build, from the interop virtualenv of ./dev.sh vllm) as the rollout engine
-- (engine.backend=vllm, moonrl.train.remote): on a tiny tied Llama in fp32 (head_dim 32: vLLM's
-- CPU attention takes no less), its greedy tokens equal moonrl's own engine's on the same weights
-- at each of several versions pushed through vLLM's control protocol (a tied model served untied:
-- vLLM's reload would keep the old output layer); its sampled tokens' log-probs, at temperature 1
-- and 0.7, are the trainer's within the mismatch bound; GRPO runs through it with every sample of
-- its version. Skipped (77) without the virtualenv.
--
-- MODEL=DIR|FILE.gguf: the first two on that model instead (fp32; tests/interop/vllm.sh runs them
-- on SmolLM2-135M-Instruct), without the GRPO run.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local fs = require('moonrl.io.fs')
local U = dofile('tests/recipes/util.lua')
local remote = require('moonrl.train.remote')
local train = require('moonrl.train.step')

if not fs.exists((moonrl.home or '.') .. '/.venv-interop/bin/vllm') then
  print('skipped: no .venv-interop/bin/vllm (./dev.sh vllm installs it)')
  os.exit(77)
end
local dir = U.tmpdir('vllm')
local given = os.getenv('MODEL')
local mdir = given and require('moonrl.io.gguf').resolve(given) or
  U.tiny_model(dir .. '/tiny', { hidden_size = 128, intermediate_size = 256, layers = 2, tie = true })
local model = moonrl.model.load(mdir)
local tok = moonrl.tokenizer.load(mdir)
local engine = moonrl.engine.new(model, { kv_cache_bytes = 2 ^ 24, seed = 1 })
local t0 = moonrl.now()
local e = remote.new({ backend = 'vllm', launch = 'auto', servers = 1, model_dir = mdir, policy = model, tok = tok,
  seed = 1, log_dir = dir, eos_ids = {}, launch_timeout = 600 })
print(string.format('  vllm serve healthy in %.1f s', moonrl.now() - t0))
local reqs = {}
for i = 1, 6 do reqs[i] = { prompt_ids = tok:encode(i .. '+' .. (3 * i) .. '='), n = 1, prompt_index = i - 1 } end

local ok, err = pcall(function()
  t.test('greedy tokens equal moonrl\'s engine\'s at every version pushed', function()
    local p = model:read_params()
    local rng = moonrl.rng.new(5)
    for v = 0, 3 do
      if v > 0 then -- (another version: every weight moved)
        local eps = given and 0.002 or 0.05 -- (a real model: a step's worth, not noise that drowns it)
        for i = 0, model.n_params - 1 do p[i] = p[i] + eps * (rng:int(2001) - 1000) / 1000 end
        model:write_params(p)
      end
      e:sync(v)
      local sampling = { temperature = 0, max_tokens = 12, eos_ids = {} }
      local a, b = engine:generate(reqs, sampling), e:generate(reqs, sampling)
      local worst = 0
      for i = 1, #reqs do
        t.eq(table.concat(b[i][1].ids, ','), table.concat(a[i][1].ids, ','), string.format('version %d, prompt %d', v, i))
        for k = 1, #a[i][1].ids do worst = math.max(worst, math.abs(a[i][1].logprobs[k] - b[i][1].logprobs[k])) end
        t.eq(b[i][1].version, v, 'the sample\'s version')
      end
      t.truthy(worst < 1e-4, string.format('version %d: log-probs within %g', v, worst))
      print(string.format('  version %d: %d prompts x 12 greedy tokens the same; log-probs within %.2g', v, #reqs, worst))
    end
  end)

  t.test('sampled tokens: their log-probs are the trainer\'s, at temperature 1 and 0.7', function()
    for _, temp in ipairs({ 1.0, 0.7 }) do
      local res = e:generate(reqs, { temperature = temp, max_tokens = 12, eos_ids = {}, step = 3 })
      local samples = {}
      for i, r in ipairs(res) do
        samples[i] = { prompt_ids = reqs[i].prompt_ids, ids = r[1].ids, rollout_logprobs = r[1].logprobs }
      end
      local lp = train.logprobs(model, samples, 4096, { temperature = temp })
      local worst = 0
      for i, s in ipairs(samples) do
        for k = 1, #s.ids do worst = math.max(worst, math.abs(lp[i][k] - s.rollout_logprobs[k])) end
      end
      t.truthy(worst < 1e-3, string.format('temperature %g: max |trainer - vLLM| = %g', temp, worst))
      print(string.format('  temperature %g: max |trainer - vLLM| log-prob %.2g', temp, worst))
    end
  end)
end)
e:close()
if not ok then error(err, 0) end

if given then fs.remove(dir); t.done(); return end

t.test('grpo with engine.backend=vllm engine.launch=auto: every sample of its version, the mismatch within bound', function()
  local recs = {}
  for i, p in ipairs(U.additions(40, 3)) do recs[i] = { question = p.prompt, answer = p.answer } end
  local data = U.write_jsonl(dir .. '/rl.jsonl', recs)
  local out = U.run_recipe('tests/recipes/grpo_sevens.lua', { 'model.dir=' .. mdir, 'data.path=' .. data,
    'data.prompt=question', 'data.chat=false', 'reward=sevens', 'train.lr=1e-3', 'grpo.steps=3', 'grpo.prompts=4',
    'grpo.samples=4', 'grpo.max_tokens=8', 'run.threads=1', 'engine.backend=vllm', 'engine.launch=auto',
    'engine.launch_timeout=600', 'run.dir=' .. dir .. '/grpo' })
  local recs_ = U.records(out.dir)
  t.eq(#recs_, 3)
  for i, r in ipairs(recs_) do
    t.eq(r['async/staleness/0'], 16, 'every sample of version step - 1 at step ' .. i)
    t.truthy(r['mismatch/max_abs'] < 1e-3, 'the mismatch at step ' .. i .. ': ' .. r['mismatch/max_abs'])
    t.truthy(r['engine/ttft'] > 0 and r['engine/sync_share'] > 0, "vLLM's time to first token, read off its /metrics: " ..
      r['engine/ttft'])
  end
end)

fs.remove(dir)
t.done()
