-- Qwen3-MoE from Lua: a config table with experts, m.config round-tripping to the same model
-- (what a reference policy copy is built from), the load-balancing loss and its coefficient,
-- config errors; and a few GRPO steps of recipes/grpo.lua on a tiny MoE model (engine
-- generation, trainer, optimizer, checkpoint and the saved model all on the flat buffer).
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local json = require('moonrl.json')
local U = dofile('tests/recipes/util.lua')
local R = require('moonrl.recipe')

local cfg = { model_type = 'qwen3_moe', vocab_size = 15, hidden_size = 32, intermediate_size = 48,
  num_hidden_layers = 3, num_attention_heads = 4, num_key_value_heads = 2, head_dim = 8,
  max_position_embeddings = 64, tie_word_embeddings = true, bos_token_id = 1, eos_token_id = 2,
  rms_norm_eps = 1e-6, initializer_range = 0.1, num_experts = 4, num_experts_per_tok = 2,
  moe_intermediate_size = 16, norm_topk_prob = true, mlp_only_layers = { 1 }, router_aux_loss_coef = 0.02,
  output_router_logits = true }

t.test('a qwen3_moe model: views, config round trip, aux loss', function()
  local m = moonrl.model.new(cfg, { seed = 4 })
  t.eq(m.config.model_type, 'qwen3_moe')
  t.eq(m.config.num_experts, 4)
  t.eq(m.config.num_experts_per_tok, 2)
  t.eq(m.config.moe_intermediate_size, 16)
  t.eq(m.config.norm_topk_prob, true)
  t.eq(#m.config.mlp_only_layers, 1)
  t.eq(m.config.mlp_only_layers[1], 1)
  local names = {}
  for _, v in ipairs(m:views()) do names[v.name] = v end
  t.truthy(names['model.layers.0.mlp.gate.weight'], 'router of sparse layer 0')
  t.truthy(names['model.layers.2.mlp.experts.3.down_proj.weight'], 'expert 3 of layer 2')
  t.truthy(names['model.layers.1.mlp.gate_proj.weight'] and not names['model.layers.1.mlp.gate.weight'],
    'layer 1 dense (mlp_only_layers)')
  local V, D, F, Fe, E = 15, 32, 48, 16, 4
  local attn = D + 4 * 8 * D + 2 * 2 * 8 * D + D * 4 * 8 + 2 * 8 + D
  t.eq(m.n_params, V * D + 3 * attn + 3 * F * D + 2 * (E * D + 3 * E * Fe * D) + D, 'parameter count')
  -- the same model again from m.config (as R.start builds a reference policy)
  local copy = moonrl.model.new(m.config, { seed = 4 })
  t.eq(copy.n_params, m.n_params)
  local b = moonrl.model.batch({ { 1, 5, 9, 2, 7 }, { 3, 4, 11 } })
  local lp = m:forward(b)
  local lp2 = copy:forward(b)
  for i = 0, b.n_tokens - 1 do t.eq(lp[i], lp2[i], 'same log-prob ' .. i) end
  local aux = m:router_aux_loss()
  -- E * sum_e f_e P_e: 1 when the routing is perfectly balanced, > 0 always, at most E
  t.truthy(aux > 0.5 and aux <= 4, 'aux loss ' .. aux)
  t.near(m:router_aux_coef(), 0.02, 1e-12, 'coef from the config (output_router_logits)')
  m:set_router_aux_coef(0)
  t.eq(m:router_aux_coef(), 0)
  t.raises(function() m:set_router_aux_coef(-1) end, '>= 0')
  local dense = moonrl.model.new({ model_type = 'qwen3', vocab_size = 15, hidden_size = 32, intermediate_size = 48,
    num_hidden_layers = 1, num_attention_heads = 4 })
  dense:forward(b)
  t.eq(dense:router_aux_loss(), 0, 'a dense model has no aux loss')
end)

t.test('config errors name the key', function()
  local function with(over)
    local c = {}
    for k, v in pairs(cfg) do c[k] = v end
    for k, v in pairs(over) do c[k] = v end
    return c
  end
  t.raises(function() moonrl.model.new(with({ num_experts_per_tok = 5 })) end, 'num_experts_per_tok')
  t.raises(function() moonrl.model.new(with({ decoder_sparse_step = 0 })) end, 'decoder_sparse_step')
  t.raises(function() moonrl.model.new(with({ mlp_only_layers = { -1 } })) end, 'mlp_only_layers')
  t.raises(function() moonrl.model.new(with({ num_experts = 0 })) end, 'num_experts')
  t.raises(function() moonrl.model.new(with({ model_type = 'qwen3_moe2' })) end, 'qwen3_moe2')
end)

t.test('grpo: a few steps on a tiny qwen3_moe', function()
  local dir = U.tmpdir('moe')
  local init = dir .. '/init'
  R.save({ dir = init }, moonrl.model.new(cfg, { seed = 1 }), U.TOKENIZER, init)
  local recs = {}
  for i, p in ipairs(U.additions(40, 5)) do recs[i] = { question = p.prompt, answer = p.answer } end
  local data = U.write_jsonl(dir .. '/train.jsonl', recs)
  local out = U.run_recipe('recipes/grpo.lua', { 'model.dir=' .. init, 'data.path=' .. data, 'data.prompt=question',
    'data.chat=false', 'reward=exact', 'train.lr=1e-3', 'train.micro_batch_tokens=64', 'grpo.steps=3',
    'grpo.prompts=4', 'grpo.samples=4', 'grpo.max_tokens=4', 'grpo.kl_coef=0.01', 'run.threads=1',
    'run.dir=' .. dir .. '/grpo' })
  local steps = {}
  for l in io.lines(out.dir .. '/metrics.jsonl') do steps[#steps + 1] = json.decode(l) end
  t.eq(#steps, 3, 'one metrics record per step')
  for _, r in ipairs(steps) do
    t.truthy(r['mismatch/max_abs'] < 1e-4, 'engine vs trainer log-probs: max |diff| ' .. r['mismatch/max_abs'])
    t.truthy(r.grad_norm > 0 and r.grad_norm == r.grad_norm, 'finite, nonzero gradient norm')
  end
  local trained = moonrl.model.load(out.dir .. '/model')
  t.eq(trained.config.model_type, 'qwen3_moe')
  t.eq(trained.config.num_experts, 4)
  -- the experts moved (the optimizer steps the whole flat buffer)
  local before = moonrl.model.load(init)
  local moved = {}
  for _, v in ipairs(trained:views()) do
    local a, b = trained:params(), before:params()
    for i = v.offset, v.offset + v.numel - 1 do
      if a[i] ~= b[i] then moved[v.name] = true; break end
    end
  end
  t.truthy(moved['model.layers.0.mlp.gate.weight'], 'the router trained')
  local experts = 0
  for e = 0, 3 do experts = experts + (moved['model.layers.2.mlp.experts.' .. e .. '.up_proj.weight'] and 1 or 0) end
  t.truthy(experts >= 1, experts .. ' experts of layer 2 trained')
  os.execute("rm -rf '" .. dir .. "'")
end)

t.done()
