-- The moonrl side of bench/decode/generate_bench.py (run through `moonrl run`):
--   BENCH_MODE=save BENCH_DIR=D BENCH_CONFIG=json   create a random model, save it in Hugging Face format
--   BENCH_MODE=run  BENCH_DIR=D BENCH_CASE=json     generate with moonrl.engine, print one JSON line
-- BENCH_PACK=0 reads the weights in place instead of through weight panels (engine.h).
-- BENCH_DTYPE=bf16: model.dtype=bf16 (the engine reads bf16 weight panels, and its KV cache is bf16).
-- BENCH_KV=fp32|bf16|auto: the KV cache's dtype (engine kv_cache_dtype; default auto).
-- BENCH_DEVICE=cuda: the model (and so the engine) on a GPU (bench/gpu/gpu_decode.py).
-- A case: { prompts = P, n = samples per prompt, prompt_len = L, new = N, temperature = T }; prompt i
-- (0-based) token k is (k * 31 + i * 7 + 1) % vocab, as on the PyTorch side.
local moonrl = require('moonrl')
local json = require('moonrl.io.json')
local mode, dir = os.getenv('BENCH_MODE'), os.getenv('BENCH_DIR')
assert(mode and dir, 'BENCH_MODE and BENCH_DIR must be set')
if mode == 'save' then
  local cfg = json.decode(os.getenv('BENCH_CONFIG'), 'BENCH_CONFIG')
  moonrl.model.new(cfg, { seed = 1 }):save(dir)
  return
end
local case = json.decode(os.getenv('BENCH_CASE'), 'BENCH_CASE')
local model = moonrl.model.load(dir)
if os.getenv('BENCH_DTYPE') then model:set_dtype(os.getenv('BENCH_DTYPE')) end
if os.getenv('BENCH_DEVICE') then model:to_device(os.getenv('BENCH_DEVICE')) end
local V = model.config.vocab_size
local engine = moonrl.engine.new(model, { kv_cache_bytes = 2 ^ 30, max_batch_tokens = 2048, max_seqs = 256,
  block_size = tonumber(os.getenv('BENCH_BLOCK') or 16), prefix_caching = false, pack_weights = os.getenv('BENCH_PACK') ~= '0', kv_cache_dtype = os.getenv('BENCH_KV') })
local function requests(P, n, L)
  local reqs = {}
  for i = 0, P - 1 do
    local p = {}
    for k = 0, L - 1 do p[k + 1] = (k * 31 + i * 7 + 1) % V end
    reqs[i + 1] = { prompt_ids = p, n = n }
  end
  return reqs
end
local opts = { temperature = case.temperature, max_tokens = case.new, eos_ids = {} }
engine:generate(requests(2, 1, 16), { temperature = 0, max_tokens = 4, eos_ids = {} }) -- warm up
local reqs = requests(case.prompts, case.n, case.prompt_len)
local best, st = math.huge, nil
for _ = 1, case.repeats or 1 do
  local before = engine:stats()
  local t0 = moonrl.now()
  local res = engine:generate(reqs, opts)
  local dt = moonrl.now() - t0
  local after = engine:stats()
  local gen = 0
  for _, l in ipairs(res) do for _, s in ipairs(l) do gen = gen + #s.ids end end
  if dt < best then
    best = dt
    st = { generated = gen, steps = after.steps - before.steps, prefill_tokens = after.prefill_tokens - before.prefill_tokens,
      decode_tokens = after.decode_tokens - before.decode_tokens, preemptions = after.preemptions - before.preemptions }
  end
end
st.seconds = best
st.threads = moonrl.version().threads
st.n_params = model.n_params
st.dtype = model:dtype()
st.device = model:device()
print(json.encode(st))
