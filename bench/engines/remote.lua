-- Servers in other processes as the rollout engine (moonrl.train.remote, docs/engines.md), on a
-- model of SmolLM2-135M's shape (random weights, the examples/agent tokenizer):
--   1. a weight sync: every tensor of the policy changed, written to /dev/shm and read by the
--      server through the control protocol (weight_sync: transfer, buckets through the
--      weight-transfer calls, moonrl serve's default; reload, a directory through reload_weights),
--      against a memcpy of the same bytes (what sharing the buffer in one process would cost at most);
--   2. rollout tokens/s: the same requests (prompts x samples x tokens, no end token) on moonrl's
--      engine in this process and on `servers` servers (each with `threads`), and whether they
--      draw the same tokens (moonrl serve: every sample; vLLM: greedy, its random streams its own).
--   build/moonrl run bench/engines/remote.lua [backend=moonrl|vllm] [servers=1] [prompts=16] [samples=4]
--     [tokens=64] [syncs=3] [weight_sync=auto|transfer|reload] [sync_dtype=auto|float32|bfloat16]
local moonrl = require('moonrl')
local ffi = require('ffi')
local fs = require('moonrl.io.fs')
local remote = require('moonrl.train.remote')

local cfg = moonrl.config { backend = 'moonrl', servers = moonrl.config.integer(1, { min = 1 }), prompts = moonrl.config.integer(16, { min = 1 }),
  samples = moonrl.config.integer(4, { min = 1 }), tokens = moonrl.config.integer(64, { min = 1 }),
  syncs = moonrl.config.integer(3, { min = 1 }), threads = moonrl.config.integer(0, { min = 0 }), weight_sync = 'auto',
  sync_dtype = 'auto' }

local dir = 'build/bench_engines_' .. tostring(os.time())
fs.mkdirs(dir)
local tok = moonrl.tokenizer.load('examples/agent')
local model = moonrl.model.new({ model_type = 'llama', vocab_size = tok.vocab_size, hidden_size = 576,
  intermediate_size = 1536, num_hidden_layers = 30, num_attention_heads = 9, num_key_value_heads = 3,
  max_position_embeddings = 2048, tie_word_embeddings = true, bos_token_id = 1, eos_token_id = 2 }, { seed = 1 })
model:save(dir .. '/model')
for _, f in ipairs({ 'tokenizer.json', 'tokenizer_config.json' }) do
  if fs.exists('examples/agent/' .. f) then fs.copy('examples/agent/' .. f, dir .. '/model/' .. f) end
end
local env = cfg.threads > 0 and ('env MOONRL_THREADS=' .. cfg.threads .. ' ') or ''
local e = remote.new({ backend = cfg.backend, servers = cfg.servers, model_dir = dir .. '/model', policy = model, tok = tok,
  launch = env .. remote.LAUNCH[cfg.backend](), log_dir = dir, seed = 1, eos_ids = {}, launch_timeout = 900,
  weight_sync = cfg.weight_sync, sync_dtype = cfg.sync_dtype })

local cpu = (fs.read('/proc/cpuinfo') or ''):match('model name%s*:%s*([^\n]+)') or '?'
print(string.format('CPU: %s; a model of %.1f M parameters (%.0f MB in fp32); %d %s server(s)', cpu, model.n_params / 1e6,
  4 * model.n_params / 2 ^ 20, cfg.servers, cfg.backend))

-- 1. syncs
local ok, err = pcall(function()
  e:sync(0)
  local p = model:read_params()
  local spare = ffi.new('float[?]', model.n_params)
  local sync_s, copy_s = 0, 0
  for v = 1, cfg.syncs do
    for _, view in ipairs(model:views()) do p[view.offset] = p[view.offset] + 1e-6 end -- (every tensor changed)
    model:write_params(p) -- (a write: the weights' generation moves, as after an update)
    local t0 = moonrl.now()
    e:sync(v)
    sync_s = sync_s + (moonrl.now() - t0)
    t0 = moonrl.now()
    ffi.copy(spare, p, 4 * model.n_params)
    copy_s = copy_s + (moonrl.now() - t0)
  end
  local m = e:metrics()
  print(string.format('weight sync by %s: %.3f s a version (%.0f MB to /dev/shm and into the server, labelled, checked); ' ..
    'memcpy of the fp32 weights %.4f s: %.0fx', e.weight_sync, sync_s / cfg.syncs, m.sync_bytes / (cfg.syncs + 1) / 2 ^ 20,
    copy_s / cfg.syncs, sync_s / copy_s))

  -- 2. rollout tokens/s
  local reqs = {}
  for i = 1, cfg.prompts do reqs[i] = { prompt_ids = tok:encode(i .. '*' .. (i + 7) .. '='), n = cfg.samples, prompt_index = i - 1 } end
  local sampling = { temperature = 1.0, max_tokens = cfg.tokens, eos_ids = {}, step = 1 }
  local engine = moonrl.engine.new(model, { kv_cache_bytes = 512 * 2 ^ 20, seed = 1 })
  local function run(gen)
    local t0 = moonrl.now()
    local res = gen:generate(reqs, sampling)
    local n = 0
    for _, r in ipairs(res) do for _, s in ipairs(r) do n = n + #s.ids end end
    return moonrl.now() - t0, n, res
  end
  run(engine) -- (warm)
  run(e)
  local t_in, n_in, r_in = run(engine)
  local t_out, n_out, r_out = run(e)
  local function same(a, b)
    local n = 0
    for i, r in ipairs(a) do
      for j, smp in ipairs(r) do if table.concat(smp.ids, ',') == table.concat(b[i][j].ids, ',') then n = n + 1 end end
    end
    return n
  end
  local what
  if cfg.backend == 'moonrl' then
    what = string.format('%d of %d samples the same tokens', same(r_in, r_out), cfg.prompts * cfg.samples)
  else -- (its own random streams: greedy samples compared)
    local g = { temperature = 0, max_tokens = cfg.tokens, eos_ids = {} }
    what = string.format('greedy: %d of %d samples the same tokens', same(engine:generate(reqs, g), e:generate(reqs, g)),
      cfg.prompts * cfg.samples)
  end
  print(string.format('rollout: in-process %.2f s (%.0f tokens/s); %d server(s) %.2f s (%.0f tokens/s): %.2fx the time; %s',
    t_in, n_in / t_in, cfg.servers, t_out, n_out / t_out, t_out / t_in, what))
end)
e:close()
fs.remove(dir)
if not ok then error(err, 0) end
