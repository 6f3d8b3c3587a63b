-- A quantized base (QLoRA: model.h's mrl_model_create_quantized), on the tiny GGUF models of
-- make_qgguf.py (MOONRL_QGGUF_DIR; its driver runs this file): the layers' Q4_0, Q4_1 and Q8_0
-- matrices kept as blocks, dequantized a layer at a time where used, must compute the bits of the
-- same file dequantized whole (moonrl.io.gguf's plain model):
--   * log-probs and entropies, fp32 and bf16, llama (tied, its q/k rows put back in blocks),
--     qwen3 and qwen3moe (stacked experts in blocks);
--   * LoRA over it: the log-probs and every adapter gradient (random non-zero B);
--   * the engine (its steps of few rows read the blocks through the qgemm op, longer ones make
--     each layer whole): greedy and sampled tokens, and log-probs within 1e-5, with the model's
--     own adapters and an adapter set of its own in a slot;
--   * the memory: its blocks, the other tensors, and at most a layer (and the head's) beyond;
--   * GRPO over it: the run over the dequantized base's metrics, adapters and merged save, bit
--     for bit; killed and resumed, the run never stopped; SFT on 2 ranks, one process's adapters;
--     what it cannot be, usage errors;
--   * refusals naming why: a NaN block scale, a base without adapters, the buffer itself (params());
--     read_params() makes it whole, the dequantized model's;
--   * (MOONRL_QLORA_GPU=1, the emulated GPU's run) the same on the GPU against the CPU.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local ffi = require('ffi')
local gguf = require('moonrl.io.gguf')
local model_mod = require('moonrl.model')
local C = moonrl.C

local DIR = os.getenv('MOONRL_QGGUF_DIR') or error('MOONRL_QGGUF_DIR: the directory make_qgguf.py wrote')
local GPU = os.getenv('MOONRL_QLORA_GPU') == '1'
local ARCHS = { 'llama', 'qwen3', 'qwen3moe' }

local function load(arch, quantized)
  local g = gguf.open(DIR .. '/' .. arch .. '.gguf')
  local m = g:model({ quantized = quantized })
  g:close()
  return m
end

local function batch() return model_mod.batch({ { 1, 200, 3, 4, 150, 6, 7, 8, 9, 10, 11, 12 }, { 20, 30, 40, 50, 60 } }) end

-- the n floats at p as a table (the forward's buffers are reused by the next forward)
local function copy(p, n)
  local out = {}
  for i = 0, n - 1 do out[i] = p[i] end
  return out
end

local function same_bits(a, b, n, what)
  local bad = 0
  for i = 0, n - 1 do
    if a[i] ~= b[i] then bad = bad + 1 end
  end
  t.eq(bad, 0, what .. ': values that differ of ' .. n)
end

local function fill(p, n, scale, f)
  for i = 0, n - 1 do p[i] = scale * f(i) end
end

if not GPU then
  t.test('the quantized base computes the dequantized model\'s bits (fp32, bf16; llama, qwen3, qwen3-moe)', function()
    for _, arch in ipairs(ARCHS) do
      local full, q = load(arch, false), load(arch, true)
      t.truthy(q.quantized > 0 and q.quantized < q.n_params, arch .. ': blocks of ' .. q.quantized .. ' bytes')
      for _, dtype in ipairs({ 'fp32', 'bf16' }) do
        full:set_dtype(dtype)
        q:set_dtype(dtype)
        local b = batch()
        local lf, ef = full:forward(b)
        lf, ef = copy(lf, b.n_tokens), copy(ef, b.n_tokens)
        for pass = 1, 2 do -- (the second: every layer made whole again)
          local lq, eq = q:forward(b)
          same_bits(lq, lf, b.n_tokens, arch .. ' ' .. dtype .. ' pass ' .. pass .. ' log-probs')
          same_bits(eq, ef, b.n_tokens, arch .. ' ' .. dtype .. ' pass ' .. pass .. ' entropies')
        end
      end
    end
  end)

  t.test('LoRA over the quantized base: log-probs and every adapter gradient those over the dequantized one', function()
    for _, arch in ipairs(ARCHS) do
      for _, dtype in ipairs({ 'fp32', 'bf16' }) do
        local models = { load(arch, false), load(arch, true) }
        local lps, grads = {}, {}
        for i, m in ipairs(models) do
          m:set_dtype(dtype)
          m:set_lora({ rank = 4, alpha = 8, seed = 5 })
          local p, n = m:lora_buffer()
          fill(p, n, 0.2, math.sin) -- (B too: not the base's bits by construction)
          m:trained()
          local b = batch()
          local lp = m:forward(b)
          lps[i] = copy(lp, b.n_tokens)
          local dl = ffi.new('float[?]', b.n_tokens)
          fill(dl, b.n_tokens, -1, function(k) return 1 + k % 3 end)
          m:backward(dl)
          local g, gn = m:lora_grads()
          grads[i] = copy(g, gn)
          grads.n = gn
        end
        same_bits(lps[2], lps[1], batch().n_tokens, arch .. ' ' .. dtype .. ' log-probs with adapters')
        same_bits(grads[2], grads[1], grads.n, arch .. ' ' .. dtype .. ' adapter gradients')
        local nz = 0
        for k = 0, grads.n - 1 do nz = nz + (grads[2][k] ~= 0 and 1 or 0) end
        t.truthy(nz > grads.n / 2, arch .. ': most adapter gradients are non-zero (' .. nz .. ' of ' .. grads.n .. ')')
      end
    end
  end)

  t.test('the engine generates from the quantized base what it does from the dequantized one', function()
    for _, arch in ipairs({ 'llama', 'qwen3' }) do -- (multi-LoRA: dense models)
      local outs = {}
      for i, quantized in ipairs({ false, true }) do
        local m = load(arch, quantized)
        m:set_lora({ rank = 2, alpha = 4, seed = 1 })
        local p, n = m:lora_buffer()
        fill(p, n, 0.3, math.cos)
        m:trained()
        local ad = m:new_adapter({ rank = 4, alpha = 8, seed = 2 })
        local ap, an = ad:buffer()
        fill(ap, an, 0.3, math.sin)
        -- (the dequantized model read in place: its weight panels are another product's rounding)
        local e = moonrl.engine.new(m, { kv_cache_bytes = 4 * 2 ^ 20, max_batch_tokens = 128, max_seqs = 8, seed = 3,
          pack_weights = false })
        e:set_adapter(1, ad)
        local reqs = { { prompt_ids = { 1, 2, 3, 4, 5 }, n = 2 }, { prompt_ids = { 9, 8, 7 }, n = 1, adapter = 1 } }
        local greedy = e:generate(reqs, { temperature = 0, max_tokens = 6 })
        local sampled = e:generate(reqs, { temperature = 1.0, max_tokens = 6, seed = 4 })
        outs[i] = { greedy, sampled }
      end
      for k, what in ipairs({ 'greedy', 'sampled' }) do
        for r = 1, 2 do
          for j = 1, #outs[1][k][r] do
            local a, b = outs[1][k][r][j], outs[2][k][r][j]
            t.eq(table.concat(b.ids, ' '), table.concat(a.ids, ' '), arch .. ' ' .. what .. ' request ' .. r .. ' tokens')
            for x = 1, #a.logprobs do
              t.near(b.logprobs[x], a.logprobs[x], 1e-5, arch .. ' ' .. what .. ' request ' .. r .. ' log-prob ' .. x)
            end
          end
        end
      end
    end
  end)

  t.test('memory: the blocks, the other tensors, and a layer beyond them while it is used', function()
    local q = load('qwen3moe', true)
    q:set_lora({ rank = 2, seed = 1 })
    local views, quantized, biggest, layer = q:views(), {}, 0, {}
    for _, v in ipairs(views) do
      local l = v.name:match('^model%.layers%.(%d+)%.')
      if l then layer[l] = (layer[l] or 0) + v.numel end
    end
    for _, n in pairs(layer) do biggest = math.max(biggest, n) end
    local dense = 0 -- (the views outside the blocks: norms, embedding, head, the F16 matrix, the router)
    for _, v in ipairs(views) do
      if not (v.name:match('_proj%.weight$') and v.name:match('^model%.layers%.')) or v.name:match('layers%.1%.self_attn%.v_proj') then
        dense = dense + v.numel
      end
    end
    local peak = ffi.new('int64_t[1]')
    C.mrl_model_gathered_bytes(q.handle, peak) -- (starts the peak here)
    local b = batch()
    q:forward(b)
    q:backward(ffi.new('float[?]', b.n_tokens, 1))
    local now = tonumber(C.mrl_model_gathered_bytes(q.handle, peak))
    local page, ranges = 4096, 64 -- (a page at each end of each range pinned)
    t.truthy(tonumber(peak[0]) <= 4 * (dense + biggest) + 2 * page * ranges,
      string.format('peak %d bytes <= the other tensors %d + the biggest layer %d (+ pages)', tonumber(peak[0]), 4 * dense,
        4 * biggest))
    t.truthy(now <= 4 * dense + 2 * page * ranges, 'after the backward: the other tensors only (' .. now .. ' bytes)')
    t.truthy(q.quantized < 4 * (q.n_params - dense) / 3, 'the blocks: under a third of the matrices in fp32')
  end)

  t.test('the engine: steps of few rows read the blocks, longer ones make each layer whole', function()
    local q = load('qwen3', true)
    local dense = 0
    for _, v in ipairs(q:views()) do
      if not v.name:match('^model%.layers%.%d+%.[%w_]+%.[%w_]+_proj%.weight$') or v.name:match('layers%.1%.self_attn%.v_proj') then
        dense = dense + v.numel
      end
    end
    local e = moonrl.engine.new(q, { kv_cache_bytes = 4 * 2 ^ 20, max_batch_tokens = 256, max_seqs = 8, seed = 3 })
    local peak = ffi.new('int64_t[1]')
    local function peak_of(prompt_len)
      local ids = {}
      for i = 1, prompt_len do ids[i] = 1 + i % 200 end
      C.mrl_model_gathered_bytes(q.handle, peak)
      e:generate({ { prompt_ids = ids, n = 1 } }, { temperature = 0, max_tokens = 4 })
      C.mrl_model_gathered_bytes(q.handle, peak)
      return tonumber(peak[0])
    end
    local few, long = peak_of(10), peak_of(100)
    t.truthy(few <= 4 * dense + 2 * 4096 * 32, 'a prompt of 10 and decode: no layer made whole (' .. few .. ' bytes)')
    t.truthy(long > few + 4 * 4096, 'a prompt of 100 (past 64 rows): its layers made whole (' .. long .. ' bytes)')
  end)

  t.test('refusals: a NaN block scale, no adapters, the buffer itself, a wrong tensor; read_params made whole', function()
    local g = gguf.open(DIR .. '/bad.gguf')
    t.raises(function() g:model({ quantized = true }) end, "blk.1.attn_output.weight' (Q4_0): block 0's scale is a NaN",
      'a NaN scale names the tensor and block')
    g:close()
    local q = load('qwen3', true)
    local b = batch()
    q:forward(b)
    t.raises(function() q:backward(ffi.new('float[?]', b.n_tokens, 1)) end, 'base is quantized', 'no adapters: frozen')
    t.raises(function() q:params() end, 'quantized_base', 'params() of a quantized base')
    local full = load('qwen3', false)
    local pq, pf = q:read_params(), full:read_params()
    t.eq(ffi.string(pq, 4 * q.n_params), ffi.string(pf, 4 * full.n_params), 'read_params(): the dequantized model\'s')
    local blocks = ffi.new('uint8_t[?]', 18 * 128)
    local cfg = q.config
    t.raises(function()
      model_mod.new_quantized(cfg, { { name = 'model.layers.0.self_attn.nothing.weight', numel = 4096, type = 2, blocks = blocks } })
    end, 'which the model has not', 'a name the model has not')
    t.raises(function()
      model_mod.new_quantized(cfg, { { name = 'model.layers.0.self_attn.q_proj.weight', numel = 2048, type = 2, blocks = blocks } })
    end, '2048 weights given, the model has 4096', 'a size that is not the view\'s')
    t.raises(function()
      model_mod.new_quantized(cfg, { { name = 'model.layers.0.self_attn.q_proj.weight', numel = 4096, type = 12, blocks = blocks } })
    end, 'Q4_0, Q4_1 or Q8_0', 'a type the base does not keep')
  end)
  local U = dofile('tests/recipes/util.lua')
  local dir = U.tmpdir('qlora')
  local recs = {}
  for i, p in ipairs(U.additions(40, 9)) do recs[i] = { question = p.prompt, answer = p.answer } end
  -- (a reward the byte-level random model earns in part: the share of its bytes below 128)
  require('moonrl.io.fs').write(dir .. '/low_bytes.lua', 'local M = {}\nfunction M.low(s)\n  local _, n = ' ..
    's.response:gsub("[%z\\1-\\127]", "")\n  return n / math.max(#s.response, 1)\nend\nreturn M\n')
  local RL = { 'model.dir=' .. DIR .. '/qwen3.gguf', 'data.path=' .. U.write_jsonl(dir .. '/rl.jsonl', recs),
    'data.prompt=question', 'data.chat=false', 'reward=' .. dir .. '/low_bytes.lua:low', 'train.lr=1e-2',
    'train.micro_batch_tokens=64', 'run.threads=1', 'grpo.prompts=4', 'grpo.samples=4', 'grpo.max_tokens=4',
    'grpo.kl_coef=0.01', 'model.lora.rank=4' }

  t.test('grpo over the quantized base: the run over the dequantized base, bit for bit', function()
    local runs = {}
    for i, q in ipairs({ 'false', 'true' }) do
      runs[i] = U.run_recipe('recipes/grpo.lua', U.with(RL, { 'grpo.steps=3', 'model.lora.quantized_base=' .. q,
        'engine.pack_weights=false', 'model.lora.save_merged=true', 'run.dir=' .. dir .. '/grpo_' .. q }))
      -- (the dequantized run's engine reads its weights in place, as the quantized base's does)
    end
    local a, b = U.records(runs[1].dir), U.records(runs[2].dir)
    t.eq(#b, 3)
    for i = 1, 3 do
      for _, k in ipairs({ 'loss', 'reward', 'kl', 'grad_norm', 'mismatch/max_abs' }) do
        t.eq(b[i][k], a[i][k], 'step ' .. i .. ' ' .. k)
      end
    end
    t.truthy(a[1].grad_norm + a[2].grad_norm + a[3].grad_norm > 0, 'the adapters train')
    local _, n = runs[1].model:lora_buffer()
    t.eq(ffi.string(runs[2].model:lora_buffer(), 4 * n), ffi.string(runs[1].model:lora_buffer(), 4 * n),
      'the final adapters, byte for byte')
    local fs = require('moonrl.io.fs')
    t.eq(fs.read(runs[2].dir .. '/model_merged/model.safetensors'), fs.read(runs[1].dir .. '/model_merged/model.safetensors'),
      'model.lora.save_merged: the merged model, byte for byte')
    t.eq(U.event(runs[2].dir, 'lora').quantized_base, runs[2].model.quantized, 'the lora event names the blocks\' bytes')
    local id = require('moonrl.io.json').read_file(require('moonrl.train.checkpoint').latest(runs[2].dir ..
      '/checkpoints') .. '/lora_base.json')
    t.eq(id.path, DIR, 'the checkpoint names the .gguf file\'s directory')
    t.truthy(id.files['qwen3.gguf'] ~= nil, 'and its checksum')
  end)

  t.test('grpo over the quantized base: 4 kills, bit-identical final adapters and metrics', function()
    local K = dofile('tests/recipes/killer.lua')
    local rep = K.campaign({ recipe = 'recipes/grpo.lua', steps = 5, kills = 4, seed = 21, dir = dir .. '/resume',
      file = 'adapter_model.safetensors', words = U.with(RL, { 'grpo.steps=5', 'model.lora.quantized_base=true' }) })
    t.truthy(rep.kills >= 4, 'at least 4 kills (got ' .. rep.kills .. ')')
    for m, same in pairs(rep.same) do t.truthy(same, m .. ': adapters equal byte for byte') end
    t.eq(#rep.metrics, 5, 'one metrics line per step')
    for i = 1, 5 do t.eq(rep.metrics[i], rep.metrics_ref[i], 'metrics of step ' .. i) end
  end)

  t.test('sft over the quantized base on 2 ranks: each rank reads the file, the adapters of one process', function()
    if not U.which('mpirun') then print('  no mpirun: skipped') return end
    local sft = {}
    for i, p in ipairs(U.additions(32, 4)) do sft[i] = { prompt = p.prompt, response = p.answer } end
    local words = { 'model.dir=' .. DIR .. '/qwen3.gguf', 'data.path=' .. U.write_jsonl(dir .. '/sft.jsonl', sft),
      'train.steps=3', 'train.batch=8', 'train.lr=1e-2', 'model.lora.rank=4', 'model.lora.quantized_base=true',
      'run.threads=1' }
    local exe = rawget(_G, 'MOONRL_EXE')
    U.run_ranks(exe, 0, 'recipes/sft.lua', U.with(words, { 'run.dir=' .. dir .. '/sft1' }))
    U.run_ranks(exe, 2, 'recipes/sft.lua', U.with(words, { 'run.dir=' .. dir .. '/sft2' }))
    local e = U.rel_diff(U.weights(dir .. '/sft1/model/adapter_model.safetensors'),
      U.weights(dir .. '/sft2/model/adapter_model.safetensors'))
    t.truthy(e <= 1e-5, 'the adapters of 2 ranks within 1e-5 of one process: ' .. e)
    local moved = 0
    for name, w in pairs(U.weights(dir .. '/sft2/model/adapter_model.safetensors')) do
      if name:find('lora_B', 1, true) then for i = 0, w.n - 1 do moved = moved + (w.buf[i] ~= 0 and 1 or 0) end end
    end
    t.truthy(moved > 0, 'and trained: ' .. moved .. ' B values moved from 0')
  end)

  t.test('what a quantized base cannot be is a usage error naming the key', function()
    local function refused(extra, want)
      local ok, err = pcall(U.run_recipe, 'recipes/grpo.lua', U.with(RL, U.with({ 'grpo.steps=1',
        'run.dir=' .. dir .. '/bad' }, extra)))
      t.truthy(not ok and moonrl.error_text(err):find(want, 1, true), table.concat(extra, ' ') .. ': ' ..
        moonrl.error_text(err))
    end
    refused({ 'model.lora.quantized_base=true', 'model.lora.rank=0' }, 'model.lora.quantized_base: the quantized base is frozen')
    refused({ 'model.lora.quantized_base=true', 'model.dir=' .. dir }, 'model.lora.quantized_base: model.dir must be a .gguf')
    refused({ 'model.lora.quantized_base=true', 'engine.launch=auto' }, 'model.lora.quantized_base: not with engine.launch')
    refused({ 'model.lora.quantized_base=true', 'model.dir=' .. DIR .. '/bad.gguf' },
      "bad.gguf: tensor 'blk.1.attn_output.weight' (Q4_0) holds a NaN")
  end)
else
  if C.mrl_device_cuda_count() == 0 then
    print('no CUDA device visible: skipped')
    os.exit(77)
  end
  -- a quantized base of arch on device with adapters of rank, their values scale * f(i); and their count
  local function on_device(arch, dtype, device, rank, scale, f)
    local m = load(arch, true)
    m:set_dtype(dtype)
    m:to_device(device)
    m:set_lora({ rank = rank, alpha = 2 * rank, seed = 5 })
    local host = m:read_lora()
    local _, n = m:lora_buffer()
    fill(host, n, scale, f)
    m:write_lora(host)
    m:trained()
    return m, n
  end

  t.test('on the GPU: the quantized base and LoRA over it, the CPU\'s values', function()
    for _, arch in ipairs({ 'llama', 'qwen3' }) do -- (a MoE model runs on the CPU only)
      for _, dtype in ipairs({ 'fp32', 'bf16' }) do
        local lps, grads = {}, {}
        for i, device in ipairs({ 'cpu', 'cuda' }) do
          local m, n = on_device(arch, dtype, device, 4, 0.2, math.sin)
          local b = batch()
          lps[i] = copy(m:forward(b), b.n_tokens)
          m:backward(ffi.new('float[?]', b.n_tokens, -1))
          local g = ffi.new('float[?]', n)
          moonrl.check(C.mrl_device_memcpy(g, (m:lora_grads()), 4 * n))
          grads[i], grads.n = copy(g, n), n
        end
        local d, dg, gmax = 0, 0, 0
        for k = 0, batch().n_tokens - 1 do d = math.max(d, math.abs(lps[1][k] - lps[2][k])) end
        for k = 0, grads.n - 1 do
          dg, gmax = math.max(dg, math.abs(grads[1][k] - grads[2][k])), math.max(gmax, math.abs(grads[1][k]))
        end
        local tol = dtype == 'bf16' and 2e-2 or 1e-5
        t.truthy(d < 10 * tol, string.format('%s %s: log-probs GPU vs CPU within %.0e (%.3g)', arch, dtype, 10 * tol, d))
        t.truthy(gmax > 0 and dg / gmax < tol, string.format('%s %s: adapter gradients GPU vs CPU within %.0e of the ' ..
          'largest (%.3g)', arch, dtype, tol, dg / gmax))
      end
    end
  end)

  t.test('on the GPU: the engine over the quantized base, the CPU\'s greedy tokens', function()
    local outs = {}
    for i, device in ipairs({ 'cpu', 'cuda' }) do
      local m = on_device('qwen3', 'fp32', device, 2, 0.3, math.cos)
      local e = moonrl.engine.new(m, { kv_cache_bytes = 4 * 2 ^ 20, max_batch_tokens = 128, max_seqs = 8, seed = 3 })
      outs[i] = e:generate({ { prompt_ids = { 1, 2, 3, 4, 5 }, n = 1 }, { prompt_ids = { 9, 8, 7 }, n = 1 } },
        { temperature = 0, max_tokens = 8 })
    end
    for r = 1, 2 do
      t.eq(table.concat(outs[2][r][1].ids, ' '), table.concat(outs[1][r][1].ids, ' '), 'request ' .. r .. ' tokens')
      for k = 1, #outs[1][r][1].logprobs do
        t.near(outs[2][r][1].logprobs[k], outs[1][r][1].logprobs[k], 1e-4, 'request ' .. r .. ' log-prob ' .. k)
      end
    end
  end)
end

t.done()
