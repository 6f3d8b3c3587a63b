-- DeepSeek-V3 from Lua: multi-head latent attention's config round trip and parameter count; the
-- engine's greedy tokens are the trainer's argmax and its log-probs the trainer's; SFT and GRPO
-- train a tiny deepseek_v3 through the recipes, and the saved model loads back. (Its numbers
-- against PyTorch and Transformers: tests/model/model_ref.py, hf_deepseek.py.)
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local json = require('moonrl.io.json')
local U = dofile('tests/recipes/util.lua')
local tiny = dofile('tests/lib/models.lua')
local models = require('moonrl.train.models')
local ffi = require('ffi')

local cfg = tiny.config('deepseek_v3')

t.test('a deepseek_v3 model: views, parameter count, config round trip', function()
  local m = moonrl.model.new(cfg, { seed = 4 })
  local c = m.config
  t.eq(c.model_type, 'deepseek_v3')
  t.eq(c.head_dim, 10, 'the attention head: max(6 + 4, 8)')
  t.eq(c.q_lora_rank, 16)
  t.eq(c.kv_lora_rank, 12)
  t.eq(c.rope_interleave, true, "DeepSeek's default")
  local names = {}
  for _, v in ipairs(m:views()) do names[v.name] = v end
  for _, n in ipairs({ 'q_a_proj', 'q_a_layernorm', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_a_layernorm', 'kv_b_proj',
    'o_proj' }) do
    t.truthy(names['model.layers.1.self_attn.' .. n .. '.weight'], n)
  end
  t.truthy(not names['model.layers.0.self_attn.q_proj.weight'], 'no q_proj with low-rank queries')
  local D, H, rq, rkv, dn, dr, dv, F, V = 32, 4, 16, 12, 6, 4, 8, 48, 15
  local attn = rq * D + rq + H * (dn + dr) * rq + (rkv + dr) * D + rkv + H * (dn + dv) * rkv + D * H * dv
  t.eq(m.n_params, V * D + 2 * (2 * D + attn + 3 * F * D) + D, 'parameter count')
  local copy = moonrl.model.new(m.config, { seed = 4 })
  t.eq(copy.n_params, m.n_params)
  local b = moonrl.model.batch({ { 1, 5, 9, 2, 7 }, { 3, 4, 11 } })
  local lp, lp2 = m:forward(b), copy:forward(b)
  for i = 0, b.n_tokens - 1 do t.eq(lp[i], lp2[i], 'same log-prob ' .. i) end
  local nq = moonrl.model.new(tiny.config('deepseek_v3', { q_lora_rank = json.null }))
  t.eq(nq.config.q_lora_rank, json.null, 'q_proj: null written back')
  t.truthy(nq:views()[3].name:find('q_proj', 1, true), nq:views()[3].name)
end)

t.test('config errors name the key', function()
  t.raises(function() moonrl.model.new(tiny.config('deepseek_v3', { qk_rope_head_dim = 5 })) end, 'qk_rope_head_dim')
  t.raises(function() moonrl.model.new(tiny.config('deepseek_v3', { num_key_value_heads = 2 })) end,
    'num_key_value_heads 2 differs')
  t.raises(function() moonrl.model.new(tiny.config('deepseek_v3', { kv_lora_rank = 0 })) end, 'kv_lora_rank')
  local function moe(over) return moonrl.model.new(tiny.config('deepseek_v3_moe', over)) end
  t.raises(function() moe({ n_group = 4 }) end, 'n_routed_experts = 6 in n_group = 4 groups')
  t.raises(function() moe({ topk_group = 4 }) end, 'topk_group = 4')
  t.raises(function() moe({ num_experts_per_tok = 5 }) end, 'num_experts_per_tok = 5')
  t.raises(function() moe({ routed_scaling_factor = 0 }) end, 'routed_scaling_factor')
  t.raises(function() moe({ scoring_func = 'softmax' }) end, "scoring_func 'softmax'")
  local m = moonrl.model.new(cfg)
  t.raises(function() m:set_lora({ rank = 4 }) end, 'multi-head latent attention')
end)

-- The trainer's log-prob of every token of the vocabulary after each position of seq (1-based
-- rows of V): the vocabulary's copies of seq, each with that token as every target.
local function all_logprobs(m, seq, V)
  local seqs, targets = {}, {}
  for v = 0, V - 1 do
    seqs[v + 1] = seq
    local tg = {}
    for i = 1, #seq do tg[i] = v end
    targets[v + 1] = tg
  end
  local lp = m:forward(moonrl.model.batch(seqs, { targets = targets }))
  local rows = {}
  for i = 1, #seq do
    rows[i] = {}
    for v = 0, V - 1 do rows[i][v] = lp[v * #seq + i - 1] end
  end
  return rows
end

t.test('deepseek_v3 with experts: views, parameter count, config round trip', function()
  local mc = tiny.config('deepseek_v3_moe')
  local m = moonrl.model.new(mc, { seed = 5 })
  t.eq(m:num_moe_layers(), 2, 'layers 1 and 2 (first_k_dense_replace 1)')
  local c = m.config
  for _, k in ipairs({ 'n_routed_experts', 'num_experts_per_tok', 'n_group', 'topk_group', 'moe_intermediate_size',
    'n_shared_experts', 'first_k_dense_replace' }) do
    t.eq(c[k], mc[k], k)
  end
  t.near(c.routed_scaling_factor, 2.5, 0)
  local names = {}
  for _, v in ipairs(m:views()) do names[v.name] = v end
  t.truthy(names['model.layers.0.mlp.gate_proj.weight'], 'layer 0 dense')
  t.truthy(names['model.layers.1.mlp.gate.e_score_correction_bias'], "the router's choice bias")
  t.truthy(names['model.layers.2.mlp.shared_experts.down_proj.weight'], 'the shared expert')
  t.truthy(names['model.layers.2.mlp.experts.5.up_proj.weight'], 'expert 5')
  local D, H, rq, rkv, dn, dr, dv, F, V, E, Fe = 32, 4, 16, 12, 6, 4, 8, 48, 15, 6, 16
  local attn = 2 * D + rq * D + rq + H * (dn + dr) * rq + (rkv + dr) * D + rkv + H * (dn + dv) * rkv + D * H * dv
  local sparse = E * D + E + 3 * E * Fe * D + 3 * Fe * D -- router, its bias, the experts, the shared one
  t.eq(m.n_params, V * D + 3 * attn + 3 * F * D + 2 * sparse + D, 'parameter count')
  local copy = moonrl.model.new(m.config, { seed = 5 })
  local b = moonrl.model.batch({ { 1, 5, 9, 2, 7 }, { 3, 4, 11 } })
  local lp, lp2 = m:forward(b), copy:forward(b)
  for i = 0, b.n_tokens - 1 do t.eq(lp[i], lp2[i], 'same log-prob ' .. i) end
  t.eq(m:router_aux_loss(), 0, "DeepSeek's router has no load-balancing loss")
  -- Kimi K2's config: the same architecture under model_type kimi_k2 (one group), written back as deepseek_v3
  local kimi = moonrl.model.new(tiny.config('deepseek_v3_moe', { model_type = 'kimi_k2',
    architectures = { 'DeepseekV3ForCausalLM' }, n_group = 1, topk_group = 1, routed_scaling_factor = 2.827 }))
  t.eq(kimi.config.model_type, 'deepseek_v3')
  t.eq(kimi.config.n_group, 1)
  t.eq(kimi.n_params, m.n_params)
end)

t.test("the engine, latent and expanded caches: greedy tokens are the trainer's argmax, its log-probs the trainer's", function()
  local prompts = { { 1, 5, 9, 3, 7, 4, 8, 6, 3, 2, 9, 5, 7, 1, 4, 6, 8, 3 }, { 3, 4 } } -- a prefill of two steps
  for _, case in ipairs({ { 'fp32', cfg }, { 'bf16', cfg }, { 'fp32', tiny.config('deepseek_v3_moe') },
    { 'fp32', tiny.config('deepseek_v3', { q_lora_rank = json.null, v_head_dim = 12, rope_interleave = false }) },
    -- rows of 32 + 32: the bf16 products of mla_paged_attn where the CPU has AVX512-BF16
    { 'bf16', tiny.config('deepseek_v3', { kv_lora_rank = 32, qk_rope_head_dim = 32 }) } }) do
    local dtype, tokens = case[1], {}
    for _, cache in ipairs({ 'latent', 'expanded' }) do
      local m = moonrl.model.new(case[2], { seed = 11 })
      if dtype == 'bf16' then m:set_dtype('bf16') end
      local e = moonrl.engine.new(m, { kv_cache_bytes = 2 ^ 20, block_size = 4, max_batch_tokens = 16, mla_cache = cache })
      local res = e:generate({ { prompt_ids = prompts[1] }, { prompt_ids = prompts[2] } },
        { temperature = 0, max_tokens = 10, eos_ids = {} })
      local what = dtype .. ' ' .. cache
      tokens[cache] = {}
      for i, p in ipairs(prompts) do
        local s = res[i][1]
        t.eq(#s.ids, 10)
        local seq = {}
        for _, x in ipairs(p) do seq[#seq + 1] = x end
        for _, x in ipairs(s.ids) do seq[#seq + 1] = x end
        local rows = all_logprobs(m, seq, 15)
        for j = 1, #s.ids do
          local at, best = #p + j - 1, 0
          for v = 1, 14 do if rows[at][v] > rows[at][best] then best = v end end
          t.eq(s.ids[j], best, what .. ': token ' .. j .. ' of request ' .. i .. ' is the argmax')
          local diff = math.abs(s.logprobs[j] - rows[at][best])
          t.truthy(diff < (dtype == 'fp32' and 1e-5 or 2e-2), what .. ': log-prob ' .. j .. ' differs by ' .. diff)
          tokens[cache][#tokens[cache] + 1] = s.ids[j]
        end
      end
    end
    for i = 1, #tokens.latent do t.eq(tokens.latent[i], tokens.expanded[i], dtype .. ': the same tokens from both caches') end
  end
end)

t.test('the latent cache: bytes per token, prefix sharing, forks and pre-emption as the expanded one', function()
  local c = cfg -- W = 12 + 4 a layer, against 2 * 4 heads * 10 (the padded head)
  local runs = {}
  for _, cache in ipairs({ 'latent', 'expanded' }) do
    local m = moonrl.model.new(c, { seed = 3 })
    -- a cache of few blocks: 6 samples of 40 tokens over a prompt of 9 cannot all stay (pre-emption)
    local e = moonrl.engine.new(m, { kv_cache_bytes = cache == 'latent' and 2 * 16 * 4 * 16 * 4 * 4 or
      2 * 16 * 4 * 80 * 4 * 4, block_size = 4, max_batch_tokens = 32, mla_cache = cache })
    local prompt = { 1, 5, 9, 3, 7, 4, 8, 6, 3 }
    local res = e:generate({ { prompt_ids = prompt, n = 6 }, { prompt_ids = prompt } },
      { temperature = 1.0, max_tokens = 40, eos_ids = {} })
    local st = e:stats()
    runs[cache] = { res = res, stats = st }
  end
  local l, x = runs.latent.stats, runs.expanded.stats
  t.eq(l.kv_bytes_per_token, 2 * (12 + 4) * 4, 'a latent row of 16 floats a layer, 2 layers')
  t.eq(x.kv_bytes_per_token, 2 * 2 * 4 * 10 * 4, 'K and V of 4 heads of 10, 2 layers')
  t.eq(x.kv_bytes_per_token / l.kv_bytes_per_token, 5, 'the expected ratio: 2 * heads * head_dim / (kv_lora_rank + qk_rope_head_dim)')
  t.eq(l.kv_blocks_total, x.kv_blocks_total, 'the same blocks from budgets in that ratio')
  t.truthy(l.preemptions > 0 and l.forks > 0 and l.prefix_hit_tokens > 0,
    string.format('pre-empted %d, forked %d, prefix hits %d', l.preemptions, l.forks, l.prefix_hit_tokens))
  for i, list in ipairs(runs.latent.res) do
    for j, s in ipairs(list) do
      local o = runs.expanded.res[i][j]
      for k = 1, #s.ids do t.eq(s.ids[k], o.ids[k], 'sample ' .. i .. '.' .. j .. ' token ' .. k) end
    end
  end
end)

-- A run directory with config c's model (seed) saved as dir/init and 40 addition problems: dir, the
-- model's directory, the RL data's path and the SFT data's.
local function run_setup(tag, c, seed)
  local dir = U.tmpdir(tag)
  local init = dir .. '/init'
  models.save({ dir = init }, moonrl.model.new(c, { seed = seed }), U.TOKENIZER, init)
  local sft, rl = {}, {}
  for i, p in ipairs(U.additions(40, 5)) do
    sft[i] = { prompt = p.prompt, response = p.answer }
    rl[i] = { question = p.prompt, answer = p.answer }
  end
  return dir, init, U.write_jsonl(dir .. '/rl.jsonl', rl), U.write_jsonl(dir .. '/sft.jsonl', sft)
end

t.test('sft and grpo train a tiny deepseek_v3; the saved model loads back', function()
  local dir, init, rl_data, sft_data = run_setup('deepseek', cfg, 1)
  local out = U.run_recipe('recipes/sft.lua', { 'model.dir=' .. init, 'data.path=' .. sft_data,
    'train.steps=8', 'train.batch=8', 'train.lr=3e-3', 'run.threads=1', 'run.dir=' .. dir .. '/sft' })
  local r = U.records(out.dir)
  t.truthy(r[#r].loss < r[1].loss, string.format('the SFT loss falls: %.4f -> %.4f', r[1].loss, r[#r].loss))
  out = U.run_recipe('recipes/grpo.lua', { 'model.dir=' .. out.dir .. '/model',
    'data.path=' .. rl_data, 'data.prompt=question', 'data.chat=false', 'reward=exact',
    'train.lr=1e-3', 'train.micro_batch_tokens=64', 'grpo.steps=3', 'grpo.prompts=4', 'grpo.samples=4',
    'grpo.max_tokens=4', 'grpo.kl_coef=0.01', 'run.threads=1', 'run.dir=' .. dir .. '/grpo' })
  r = U.records(out.dir)
  t.eq(#r, 3, 'one metrics record per step')
  local moved = 0
  for _, x in ipairs(r) do
    t.truthy(x['mismatch/max_abs'] < 1e-4, 'engine vs trainer log-probs: max |diff| ' .. x['mismatch/max_abs'])
    t.truthy(x.grad_norm == x.grad_norm and x.grad_norm < math.huge, 'a finite gradient norm')
    if x.grad_norm > 0 then moved = moved + 1 end
  end
  t.truthy(moved > 0, 'a step with rewards that differ trained') -- (a group of equal rewards has none)
  local trained = moonrl.model.load(out.dir .. '/model')
  t.eq(trained.config.model_type, 'deepseek_v3')
  t.eq(trained.config.kv_lora_rank, 12)
  local saved = json.read_file(out.dir .. '/model/config.json')
  t.eq(saved.head_dim, 4, "config.json's head_dim is Transformers' (qk_rope_head_dim)")
  t.eq(saved.first_k_dense_replace, 2, 'every layer dense')
  os.execute("rm -rf '" .. dir .. "'")
end)

t.test('grpo on a tiny deepseek_v3 with experts: routing replay logged; moe.aux_loss_coef refused', function()
  local dir, init, data = run_setup('deepseek_moe', tiny.config('deepseek_v3_moe'), 2)
  local words = { 'model.dir=' .. init, 'data.path=' .. data, 'data.prompt=question', 'data.chat=false',
    'reward=exact', 'train.lr=1e-3', 'train.micro_batch_tokens=64', 'grpo.steps=2', 'grpo.prompts=4', 'grpo.samples=4',
    'grpo.max_tokens=4', 'moe.routing_replay=true', 'run.threads=1' }
  local out = U.run_recipe('recipes/grpo.lua', U.with(words, { 'run.dir=' .. dir .. '/grpo' }))
  local r = U.records(out.dir)
  t.eq(#r, 2)
  for _, x in ipairs(r) do
    t.truthy(x['moe/replayed'] > 0, 'replayed picks: ' .. tostring(x['moe/replayed']))
    t.eq(x['moe/routing_mismatch'], 0, "the trainer's own picks are the engine's on the same weights")
    t.truthy(x['mismatch/max_abs'] < 1e-4, 'engine vs trainer log-probs: max |diff| ' .. x['mismatch/max_abs'])
  end
  local ok, err = pcall(U.run_recipe, 'recipes/grpo.lua', U.with(words, { 'moe.aux_loss_coef=0.01',
    'run.dir=' .. dir .. '/aux' }))
  t.truthy(not ok and tostring(err):find('has no load-balancing loss', 1, true), tostring(err))
  os.execute("rm -rf '" .. dir .. "'")
end)

t.test('the multi-token prediction layer: its weights saved and loaded; a config naming it without them loads without it', function()
  local dir = U.tmpdir('deepseek_mtp')
  local m = moonrl.model.new(tiny.config('deepseek_v3_moe', { num_nextn_predict_layers = 1 }), { seed = 3 })
  local names = {}
  for _, v in ipairs(m:views()) do names[v.name] = v end
  for _, n in ipairs({ 'enorm', 'hnorm', 'eh_proj', 'embed_tokens', 'shared_head.norm', 'shared_head.head',
    'self_attn.kv_b_proj', 'mlp.shared_experts.up_proj', 'mlp.experts.5.down_proj' }) do
    t.truthy(names['model.layers.3.' .. n .. '.weight'], n)
  end
  t.eq(names['model.layers.3.eh_proj.weight'].weight_decay, false, 'it does not train: no decay')
  models.save({ dir = dir .. '/a' }, m, U.TOKENIZER, dir .. '/a')
  local back = moonrl.model.load(dir .. '/a')
  t.eq(back.config.num_nextn_predict_layers, 1)
  t.eq(back.n_params, m.n_params)
  local a, b = m:params(), back:params()
  local v = names['model.layers.3.shared_head.head.weight']
  for i = v.offset, v.offset + v.numel - 1 do t.eq(a[i], b[i]) end
  -- (Transformers saves none: a config that names it, with no weights)
  local plain = moonrl.model.new(tiny.config('deepseek_v3_moe'), { seed = 3 })
  models.save({ dir = dir .. '/b' }, plain, U.TOKENIZER, dir .. '/b')
  local cj = json.read_file(dir .. '/b/config.json')
  cj.num_nextn_predict_layers = 1
  local f = assert(io.open(dir .. '/b/config.json', 'w'))
  f:write(json.encode(cj))
  f:close()
  local loaded = moonrl.model.load(dir .. '/b')
  t.eq(loaded.config.num_nextn_predict_layers, 0)
  t.eq(loaded.n_params, plain.n_params)
  t.raises(function() moonrl.engine.new(plain, { mtp = true }) end, 'needs a model with a multi-token prediction layer')
  os.execute("rm -rf '" .. dir .. "'")
end)

t.test('speculative decoding with the MTP layer: greedy outputs and log-probs as without it', function()
  local prompts = { { 1, 5, 9, 3, 7, 4, 8, 6, 3, 2, 9, 5, 7, 1, 4, 6, 8, 3 }, { 3, 4 }, { 6, 6, 7 } }
  for _, case in ipairs({ { 'fp32', 'deepseek_v3', 'latent' }, { 'fp32', 'deepseek_v3', 'expanded' },
    { 'bf16', 'deepseek_v3', 'latent' }, { 'fp32', 'deepseek_v3_moe', 'latent' } }) do
    local m = moonrl.model.new(tiny.config(case[2], { num_nextn_predict_layers = 1 }), { seed = 5 })
    if case[1] == 'bf16' then m:set_dtype('bf16') end
    local out, stats = {}, {}
    for _, mtp in ipairs({ false, true }) do
      local e = moonrl.engine.new(m, { kv_cache_bytes = 2 ^ 20, block_size = 4, max_batch_tokens = 16, mtp = mtp,
        mla_cache = case[3] })
      local reqs = {}
      for i, p in ipairs(prompts) do reqs[i] = { prompt_ids = p } end
      out[mtp] = e:generate(reqs, { temperature = 0, max_tokens = 24, eos_ids = {} })
      stats[mtp] = e:stats()
    end
    local what = table.concat(case, ' ')
    t.truthy(stats[true].spec_drafts > 20 and stats[false].spec_drafts == 0, what .. ': drafts ' .. stats[true].spec_drafts)
    for i = 1, #prompts do
      local a, b = out[true][i][1], out[false][i][1]
      for j = 1, 24 do
        t.eq(a.ids[j], b.ids[j], what .. ': token ' .. j .. ' of request ' .. i)
        t.truthy(math.abs(a.logprobs[j] - b.logprobs[j]) < (case[1] == 'bf16' and 2e-2 or 1e-5), what .. ': log-prob')
      end
    end
  end
end)

t.test('speculative decoding with the MTP layer: the sampled distribution is the model\'s (chi-square)', function()
  local m = moonrl.model.new(tiny.config('deepseek_v3', { num_nextn_predict_layers = 1, initializer_range = 0.3 }),
    { seed = 9 })
  local prompt, V, N = { 1, 5, 9, 3 }, 15, 1500
  -- the exact distribution of the second new token: sum over the first of p(t1) p(t2 | t1)
  local first = all_logprobs(m, prompt, V)[#prompt]
  local second = {}
  for v = 0, V - 1 do second[v] = 0 end
  for t1 = 0, V - 1 do
    local seq = { unpack(prompt) }
    seq[#seq + 1] = t1
    local row = all_logprobs(m, seq, V)[#seq]
    for v = 0, V - 1 do second[v] = second[v] + math.exp(first[t1] + row[v]) end
  end
  for _, mtp in ipairs({ false, true }) do
    local e = moonrl.engine.new(m, { kv_cache_bytes = 2 ^ 22, block_size = 4, max_batch_tokens = 512, mtp = mtp })
    local reqs = {}
    for i = 1, N do reqs[i] = { prompt_ids = prompt, prompt_index = i } end
    local res = e:generate(reqs, { temperature = 1.0, max_tokens = 2, eos_ids = {}, seed = 17 })
    local count = {}
    for v = 0, V - 1 do count[v] = 0 end
    for i = 1, N do count[res[i][1].ids[2]] = count[res[i][1].ids[2]] + 1 end
    local chi2 = 0
    for v = 0, V - 1 do chi2 = chi2 + (count[v] - N * second[v]) ^ 2 / (N * second[v]) end
    local st = e:stats()
    print(string.format('  mtp %s: chi-square %.1f over %d tokens (14 degrees of freedom, 36.1 at p = 0.001); drafts %d, ' ..
      'accepted %d', tostring(mtp), chi2, V, st.spec_drafts, st.spec_accepted))
    t.truthy(chi2 < 36.1, 'the second token\'s distribution is the model\'s: chi-square ' .. chi2)
    if mtp then
      t.truthy(st.spec_drafts >= N and st.spec_accepted > 20 and st.spec_accepted < st.spec_drafts,
        'drafts of every sample, some kept and some not')
    end
  end
end)

t.test('grpo with engine.mtp: the drafts\' acceptance and tokens a step logged', function()
  local dir, init, data = run_setup('deepseek_mtp_grpo', tiny.config('deepseek_v3', { num_nextn_predict_layers = 1 }), 2)
  local out = U.run_recipe('recipes/grpo.lua', { 'model.dir=' .. init, 'data.path=' .. data,
    'data.prompt=question', 'data.chat=false', 'reward=exact', 'train.lr=1e-3', 'train.micro_batch_tokens=64',
    'grpo.steps=2', 'grpo.prompts=4', 'grpo.samples=4', 'grpo.max_tokens=6', 'engine.mtp=true', 'run.threads=1',
    'run.dir=' .. dir .. '/grpo' })
  for _, x in ipairs(U.records(out.dir)) do
    local acc, tps = x['engine/spec_acceptance'], x['engine/tokens_per_step']
    t.truthy(acc and acc >= 0 and acc <= 1 and tps and tps > 0, string.format('acceptance %s, tokens a step %s',
      tostring(acc), tostring(tps)))
    t.truthy(x['mismatch/max_abs'] < 1e-4, 'engine vs trainer log-probs: max |diff| ' .. x['mismatch/max_abs'])
  end
  os.execute("rm -rf '" .. dir .. "'")
end)

t.test('sft with train.mtp_weight teaches the MTP layer: its loss falls, the engine\'s drafts are kept more often', function()
  local c = tiny.config('deepseek_v3', { num_nextn_predict_layers = 1 })
  local dir, init, _, sft_data = run_setup('deepseek_mtp_sft', c, 4)
  local function acceptance(model_dir)
    local m = moonrl.model.load(model_dir)
    local e = moonrl.engine.new(m, { kv_cache_bytes = 2 ^ 22, block_size = 4, max_batch_tokens = 256, mtp = true })
    local reqs = {}
    for i, p in ipairs(U.additions(24, 9)) do reqs[i] = { prompt = p.prompt } end
    e:generate(reqs, { temperature = 0, max_tokens = 8, eos_ids = {}, tokenizer = moonrl.tokenizer.load(U.TOKENIZER) })
    local st = e:stats()
    return st.spec_accepted / math.max(st.spec_drafts, 1)
  end
  local before = acceptance(init)
  local out = U.run_recipe('recipes/sft.lua', { 'model.dir=' .. init, 'data.path=' .. sft_data, 'train.steps=40',
    'train.batch=8', 'train.lr=1e-2', 'train.mtp_weight=0.5', 'run.threads=1', 'run.dir=' .. dir .. '/sft' })
  local r = U.records(out.dir)
  t.truthy(r[#r].mtp_loss < r[1].mtp_loss, string.format('the MTP loss falls: %.3f -> %.3f', r[1].mtp_loss, r[#r].mtp_loss))
  local after = acceptance(out.dir .. '/model')
  print(string.format('  greedy drafts kept: %.2f before, %.2f after', before, after))
  t.truthy(after > before, 'the trained MTP layer drafts better')
  os.execute("rm -rf '" .. dir .. "'")
end)

t.done()
