-- Test helpers for the recipe tests: the tiny random model of tests/lib/models.lua saved in
-- Hugging Face format with the default example's tokenizer (one token per digit, 15 ids), JSONL
-- files, and running a recipe file with command-line style overrides.
local config = require('moonrl.config')
local tiny = dofile('tests/lib/models.lua')

local M = {}

M.TOKENIZER = tiny.TOKENIZER

function M.tmpdir(tag)
  local d = os.tmpname()
  os.remove(d)
  d = d .. '-' .. tag
  require('moonrl.io.fs').mkdirs(d)
  return d
end

-- The tiny 'digits' model (opts: model_type, hidden_size, intermediate_size, layers, vocab_size,
-- kv_heads, tie (false: an lm_head of its own), seed) saved to dir; returns dir.
function M.tiny_model(dir, opts)
  opts = opts or {}
  return tiny.save(dir, 'digits', { model_type = opts.model_type, hidden_size = opts.hidden_size,
    intermediate_size = opts.intermediate_size, num_hidden_layers = opts.layers, vocab_size = opts.vocab_size,
    num_key_value_heads = opts.kv_heads, tie_word_embeddings = opts.tie },
    { seed = opts.seed or 1 })
end

-- model saved to dir with the tokenizer.json of tok_dir, and its tokenizer_config.json (or
-- config_text in its place: a chat template of the test's own); returns dir.
function M.save_model(dir, model, tok_dir, config_text)
  local fs = require('moonrl.io.fs')
  model:save(dir)
  fs.write(dir .. '/tokenizer.json', fs.read(tok_dir .. '/tokenizer.json'))
  fs.write(dir .. '/tokenizer_config.json', config_text or fs.read(tok_dir .. '/tokenizer_config.json'))
  return dir
end

-- The path of a program on PATH (nil when absent).
function M.which(name)
  for d in (os.getenv('PATH') or ''):gmatch('[^:]+') do
    if require('moonrl.io.fs').exists(d .. '/' .. name) then return d .. '/' .. name end
  end
end

-- The command line that starts exe on n ranks under mpirun (shared memory, or opts.btl; every
-- rank oversubscribing the cores) or, n = 0, alone; opts.env: 'VAR=value' words for every rank
-- (alone: through env(1)). Append exe's own words to it.
function M.rank_argv(n, exe, opts)
  opts = opts or {}
  local argv = {}
  if n > 0 then
    for _, a in ipairs({ M.which('mpirun'), '-n', tostring(n), '--oversubscribe', '--bind-to', 'none',
      '--allow-run-as-root', '--mca', 'btl', opts.btl or 'vader,self' }) do argv[#argv + 1] = a end
    for _, e in ipairs(opts.env or {}) do argv[#argv + 1] = '-x'; argv[#argv + 1] = e end
  elseif opts.env then
    argv[1] = '/usr/bin/env'
    for _, e in ipairs(opts.env) do argv[#argv + 1] = e end
  end
  argv[#argv + 1] = exe
  return argv
end

-- A recipe run by exe on n ranks (M.rank_argv; n = 0: one process) with its words; raises with
-- its output when it fails, unless opts.expect_fail; opts.timeout (seconds, 120). Returns proc's result.
function M.run_ranks(exe, n, recipe, words, opts)
  opts = opts or {}
  local argv = M.rank_argv(n, exe, opts)
  argv[#argv + 1], argv[#argv + 2] = 'run', recipe
  for _, w in ipairs(words) do argv[#argv + 1] = w end
  local r = require('moonrl.io.proc').run(argv, { timeout = opts.timeout or 120 })
  if opts.expect_fail then return r end
  if not r.ok then
    io.stderr:write(r.stdout, r.stderr)
    error(string.format('%s on %d ranks failed (status %s)', recipe, n, tostring(r.exit_status)), 2)
  end
  return r
end

-- A run stopped after step `stop` and resumed against the run never stopped (run(words, tag) ->
-- its directory; words checkpoint every step): the resumed checkpoint of step `last` holds files
-- (each name a file that must be there) and the whole model, and the final weights are the
-- never-stopped run's bits. Returns the never-stopped run's directory.
function M.check_resume(t, run, words, stop, last, files)
  local fs = require('moonrl.io.fs')
  local straight = run(words, 'straight')
  run(M.with(words, { 'train.steps=' .. stop }), 'part')
  local part = run(M.with(words, { 'run.resume=auto' }), 'part')
  local ckpt = string.format('%s/checkpoints/step-%06d', part, last)
  for _, f in ipairs(files) do t.truthy(fs.exists(ckpt .. '/' .. f), 'in the checkpoint: ' .. f) end
  t.truthy(require('moonrl').model.load(ckpt).n_params > 0, 'the checkpoint holds the whole model')
  t.eq(fs.read(part .. '/model/model.safetensors'), fs.read(straight .. '/model/model.safetensors'),
    'resumed: the weights of the run never stopped, bit for bit')
  return straight
end

-- `moonrl launch -n n --restarts 2` of a recipe with fault (a MOONRL_FAULT spec) into run
-- directory d (one thread a rank, Open MPI over shared memory), its words after; run it with
-- moonrl.io.proc.
function M.launch_argv(exe, n, fault, recipe, d, words)
  local argv = { '/usr/bin/env', 'PATH=' .. os.getenv('PATH'), 'MOONRL_FAULT=' .. fault, 'MOONRL_THREADS=1', exe,
    'launch', '-n', tostring(n), '--restarts', '2', '--backoff', '0.1', '--mpirun', '--mca btl vader,self', recipe,
    'run.dir=' .. d }
  for _, w in ipairs(words) do argv[#argv + 1] = w end
  return argv
end

-- The data-parallel tests' inputs in dir: a 2-layer tiny model and 60 additions as SFT examples,
-- preference pairs and RL questions. Returns the model directory and the three data files.
function M.ranks_setup(dir)
  local model_dir = M.tiny_model(dir .. '/init', { layers = 2 })
  local sft, prefs, rl = {}, {}, {}
  for i, p in ipairs(M.additions(60, 7)) do
    sft[i] = { prompt = p.prompt, response = p.answer }
    prefs[i] = { prompt = p.prompt, chosen = p.answer, rejected = p.answer .. '1' }
    rl[i] = { question = p.prompt, answer = p.answer }
  end
  return model_dir, M.write_jsonl(dir .. '/sft.jsonl', sft), M.write_jsonl(dir .. '/prefs.jsonl', prefs),
    M.write_jsonl(dir .. '/rl.jsonl', rl)
end

-- The relative difference ||a - b|| / ||a|| of two sets of tensors (M.weights' tables).
function M.rel_diff(a, b)
  local num, den = 0, 0
  for name, x in pairs(a) do
    local y = b[name]
    for i = 0, x.n - 1 do
      local d = x.buf[i] - y.buf[i]
      num, den = num + d * d, den + x.buf[i] * x.buf[i]
    end
  end
  return math.sqrt(num / math.max(den, 1e-30))
end

-- The first event of this kind in a run's events.jsonl (nil: none).
function M.event(run_dir, kind)
  local json = require('moonrl.io.json')
  for line in io.lines(run_dir .. '/events.jsonl') do
    local e = json.decode(line)
    if e.event == kind then return e end
  end
end

-- The records of a run's metrics.jsonl, one table a step.
function M.records(run_dir)
  local json = require('moonrl.io.json')
  local out = {}
  for l in io.lines(run_dir .. '/metrics.jsonl') do out[#out + 1] = json.decode(l) end
  return out
end

-- A run directory's events of one kind (events.jsonl), in order.
function M.events(run_dir, kind)
  local json = require('moonrl.io.json')
  local out = {}
  for line in io.lines(run_dir .. '/events.jsonl') do
    local e = json.decode(line)
    if e.event == kind then out[#out + 1] = e end
  end
  return out
end

function M.write_jsonl(path, records)
  local json = require('moonrl.io.json')
  local f = assert(io.open(path, 'w'))
  for _, r in ipairs(records) do f:write(json.encode(r), '\n') end
  f:close()
  return path
end

-- Addition problems "a+b=" with their sums, from a fixed seed.
function M.additions(n, seed, max)
  local s, out = seed or 1, {}
  local function rand(k)
    s = (s * 48271) % 2147483647
    return s % k
  end
  for i = 1, n do
    local a, b = rand(max or 10), rand(max or 10)
    out[i] = { a = a, b = b, prompt = a .. '+' .. b .. '=', answer = tostring(a + b) }
  end
  return out
end

-- A tiny model and a JSONL of n addition problems {question, answer} under dir, and the
-- command-line words of a tiny GRPO run on them (4 prompts x 4 samples of 4 tokens, one thread);
-- returns words, model_dir, data path.
function M.grpo_setup(dir, n, extra)
  local model_dir = M.tiny_model(dir .. '/init')
  local recs = {}
  for i, p in ipairs(M.additions(n or 40, 5)) do recs[i] = { question = p.prompt, answer = p.answer } end
  local data = M.write_jsonl(dir .. '/train.jsonl', recs)
  local words = { 'model.dir=' .. model_dir, 'data.path=' .. data, 'data.prompt=question', 'data.chat=false',
    'reward=exact', 'train.lr=1e-3', 'train.micro_batch_tokens=64', 'grpo.prompts=4', 'grpo.samples=4',
    'grpo.max_tokens=4', 'run.threads=1' }
  for _, w in ipairs(extra or {}) do words[#words + 1] = w end
  return words, model_dir, data
end

-- A tiny model (opts: tiny_model's) and a JSONL of n addition examples {prompt, response} under
-- dir, and the command-line words of a short SFT run on them (one thread); returns words,
-- model_dir, data path.
function M.sft_setup(dir, n, opts)
  local model_dir = M.tiny_model(dir .. '/init', opts or { layers = 2 })
  local recs = {}
  for i, p in ipairs(M.additions(n, 7)) do recs[i] = { prompt = p.prompt, response = p.answer } end
  local data = M.write_jsonl(dir .. '/sft.jsonl', recs)
  return { 'model.dir=' .. model_dir, 'data.path=' .. data, 'train.lr=1e-3', 'train.micro_batch_tokens=40',
    'run.threads=1', 'quiet=true' }, model_dir, data
end

-- A new list: the words of base, then those of extra.
-- Max over the views of ||a - b|| / ||b|| between two saved models (directories).
function M.weights_diff(a_dir, b_dir)
  local model = require('moonrl').model
  local a, b = model.load(a_dir), model.load(b_dir)
  local pa, pb = a:read_params(), b:read_params()
  local worst = 0
  for _, v in ipairs(b:views()) do
    local num, den = 0, 0
    for i = v.offset, v.offset + v.numel - 1 do
      local d = pa[i] - pb[i]
      num, den = num + d * d, den + pb[i] * pb[i]
    end
    local rel = den > 0 and math.sqrt(num / den) or math.sqrt(num)
    if not (rel <= worst) then worst = rel end
  end
  return worst
end

function M.with(base, extra)
  local w = {}
  for _, x in ipairs(base) do w[#w + 1] = x end
  for _, x in ipairs(extra or {}) do w[#w + 1] = x end
  return w
end

-- A copy of the list of words with run.dir=run_dir first and extra after.
function M.words(base, run_dir, extra)
  local w = { 'run.dir=' .. run_dir }
  for _, x in ipairs(base) do w[#w + 1] = x end
  for _, x in ipairs(extra or {}) do w[#w + 1] = x end
  return w
end

-- Run argv (a moonrl command line) and check that it is a usage error at start-up: exit status 2,
-- one line holding want, and no run_dir made. t: moonrl.testing; returns proc.run's result.
function M.expect_usage(t, argv, want, run_dir)
  local r = require('moonrl.io.proc').run(argv, { timeout = 60 })
  local what = table.concat(argv, ' ', 2)
  t.eq(r.exit_status, 2, what .. ': ' .. r.stderr)
  t.truthy(r.stderr:find(want, 1, true), what .. ': ' .. r.stderr)
  t.eq(select(2, r.stderr:gsub('\n', '')), 1, 'one line: ' .. r.stderr)
  t.truthy(not require('moonrl.io.fs').exists(run_dir), 'no run directory: ' .. what)
  return r
end

-- Run a recipe file with overrides {'key=value', ...}; returns what the recipe returns.
-- The tensors of a safetensors file as fp32: { [name] = { buf = float[n], n = n } } (a run's
-- saved model: RUN/model/model.safetensors).
function M.weights(path)
  local ffi = require('ffi')
  local st = require('moonrl.io.safetensors').open(path)
  local out = {}
  for _, name in ipairs(st:names()) do
    local n = st:info(name).numel
    local buf = ffi.new('float[?]', n)
    st:read_f32(name, buf)
    out[name] = { buf = buf, n = n }
  end
  return out
end

function M.run_recipe(path, words)
  config.overrides = config.parse_overrides(words)
  config.consumed = false
  local chunk = assert(loadfile(path))
  return chunk()
end

return M
