-- Qwen3-MoE from Lua: a config table with experts, m.config round-tripping to the same model
-- (what a reference policy copy is built from), the load-balancing loss and its coefficient,
-- config errors; and a few GRPO steps of recipes/grpo.lua on a tiny MoE model (engine
-- generation, trainer, optimizer, checkpoint and the saved model all on the flat buffer).
-- Routing replay: the engine's routing record packed by moonrl.batch and replayed by the
-- trainer's forward (the experts the trainer runs are the engine's, token by token; the same
-- bits as its own routing on the same weights); GRPO with moe.routing_replay and
-- moe.aux_loss_coef, their metrics logged; the keys refused for a dense model.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local json = require('moonrl.io.json')
local U = dofile('tests/recipes/util.lua')
local tiny = dofile('tests/lib/models.lua')
local batch = require('moonrl.batch')
local models = require('moonrl.train.models')
local session = require('moonrl.train.session')
local ffi = require('ffi')

-- three layers (layer 1 dense) of 4 experts, the load-balancing loss on
local cfg = tiny.config('qwen3_moe', { num_hidden_layers = 3, num_experts = 4, mlp_only_layers = { 1 },
  router_aux_loss_coef = 0.02, output_router_logits = true })

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
  -- the same model again from m.config (as session.start builds a reference policy)
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
  local dense = tiny.model('qwen3')
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

t.test('routing replay: the engine record, packed, replayed by the trainer', function()
  local m = moonrl.model.new(cfg, { seed = 7 })
  local K, n_moe = cfg.num_experts_per_tok, m:num_moe_layers()
  t.eq(n_moe, 2, 'layers 0 and 2 sparse')
  local W = n_moe * K
  local e = moonrl.engine.new(m, { kv_cache_bytes = 2 ^ 20, block_size = 4, max_batch_tokens = 16, record_routing = true })
  local records = { { prompt_ids = { 1, 5, 9, 3, 7, 4 }, prompt_index = 0 }, { prompt_ids = { 3, 4 }, prompt_index = 1 } }
  local results = e:generate(batch.requests(records, 3), { temperature = 1.0, max_tokens = 6, eos_ids = {} })
  local samples = batch.flatten(records, results)
  t.eq(#samples, 6)
  for _, s in ipairs(samples) do
    t.eq(ffi.sizeof(s.routing), 2 * W * (#s.prompt_ids + #s.ids), 'one row a position')
    local last = #s.prompt_ids + #s.ids - 1 -- never fed back: -1
    for q = 0, W - 1 do t.eq(s.routing[last * W + q], -1) end
  end
  -- packed with shared prompts, as the update packs them
  local b = batch.pack(samples, 1, #samples, { share_prompts = true, routing = W })
  t.truthy(b.routing ~= nil and b.n_seqs == 8, 'two shared prompts + six samples')
  local own_lp = m:forward(b)
  local own = m:routing()
  local lp = m:forward(b, { routing = b.routing })
  local replayed, differ = m:routing_replay_stats()
  local used = m:routing()
  local rows, equal = 0, 0
  for t0 = 0, b.n_tokens - 1 do
    if b.routing[t0 * W] >= 0 then
      rows = rows + 1
      local same = true
      for q = 0, W - 1 do same = same and used[t0 * W + q] == b.routing[t0 * W + q] and own[t0 * W + q] == used[t0 * W + q] end
      if same then equal = equal + 1 end
    end
  end
  -- every packed token but the samples' last ones was run by the engine (no prefix cache hits here)
  t.eq(rows, b.n_tokens - #samples, 'replayed rows')
  t.eq(equal, rows, "the trainer's experts are the engine's, and its own picks on the same weights")
  t.eq(replayed, rows * n_moe)
  t.eq(differ, 0)
  for i = 0, b.n_tokens - 1 do t.eq(lp[i], own_lp[i], 'bit-identical log-prob ' .. i) end
  -- a forced routing changes the result; a bad one is refused naming the entry
  local forced = ffi.new('int16_t[?]', b.n_tokens * W)
  for i = 0, b.n_tokens * W - 1, K do forced[i], forced[i + 1] = (own[i] + 1) % 4, (own[i] + 2) % 4 end
  local lp3 = m:forward(b, { routing = forced })
  local moved = 0
  for i = 0, b.n_tokens - 1 do if lp3[i] ~= own_lp[i] then moved = moved + 1 end end
  t.truthy(moved > b.n_tokens / 2, moved .. ' log-probs moved under a forced routing')
  forced[1] = forced[0]
  t.raises(function() m:forward(b, { routing = forced }) end, 'names expert')
  -- a dense model takes no routing
  local dense = tiny.model('qwen3')
  t.eq(dense:num_moe_layers(), 0)
  t.raises(function() dense:forward(b, { routing = b.routing }) end, 'without sparse layers')
end)

t.test('grpo: routing replay and the aux loss coefficient, logged', function()
  local dir = U.tmpdir('moe_r3')
  local init = dir .. '/init'
  models.save({ dir = init }, moonrl.model.new(cfg, { seed = 2 }), U.TOKENIZER, init)
  local recs = {}
  for i, p in ipairs(U.additions(40, 6)) do recs[i] = { question = p.prompt, answer = p.answer } end
  local data = U.write_jsonl(dir .. '/train.jsonl', recs)
  local function run(extra, name)
    local words = { 'model.dir=' .. init, 'data.path=' .. data, 'data.prompt=question', 'data.chat=false',
      'reward=exact', 'train.lr=1e-3', 'train.micro_batch_tokens=64', 'grpo.steps=2', 'grpo.prompts=4',
      'grpo.samples=4', 'grpo.max_tokens=4', 'grpo.epochs=2', 'run.threads=1',
      'run.dir=' .. dir .. '/' .. name }
    for _, w in ipairs(extra) do words[#words + 1] = w end
    local out = U.run_recipe('recipes/grpo.lua', words)
    local steps = {}
    for l in io.lines(out.dir .. '/metrics.jsonl') do steps[#steps + 1] = json.decode(l) end
    return steps
  end
  local replay = run({ 'moe.routing_replay=true', 'moe.aux_loss_coef=0.05' }, 'replay')
  t.eq(#replay, 2)
  for _, r in ipairs(replay) do
    t.near(r['moe/aux_coef'], 0.05, 1e-12, 'moe.aux_loss_coef applied')
    t.truthy(r['moe/aux_loss'] > 0.5 and r['moe/aux_loss'] <= 4, 'aux loss ' .. tostring(r['moe/aux_loss']))
    -- all but each sample's last token replayed (the engine never runs it)
    t.truthy(r['moe/replayed'] > 0.5 and r['moe/replayed'] < 1, 'replayed share ' .. tostring(r['moe/replayed']))
    t.eq(r['moe/routing_mismatch'], 0, 'fp32 engine and trainer: the same picks')
    t.truthy(r['mismatch/token_mult_prob_error'] >= 1 and r['mismatch/token_mult_prob_error'] < 1 + 1e-4,
      'token_mult_prob_error ' .. tostring(r['mismatch/token_mult_prob_error']))
    print(string.format('  replay on: token_mult_prob_error %.8f, replayed %.3f, routing mismatch %g, aux %.4f',
      r['mismatch/token_mult_prob_error'], r['moe/replayed'], r['moe/routing_mismatch'], r['moe/aux_loss']))
  end
  local plain = run({ 'moe.aux_loss_coef=0' }, 'plain')
  for i, r in ipairs(plain) do
    t.eq(r['moe/aux_coef'], 0, 'aux off')
    t.eq(r['moe/replayed'], 0, 'no replay by default')
    -- the same samples at step 1 (same seed, same weights): the same log-probs either way
    if i == 1 then t.eq(r['mismatch/max_abs'], replay[1]['mismatch/max_abs'], 'replay of the same picks changes nothing') end
  end
  local default = run({}, 'default')
  t.near(default[1]['moe/aux_coef'], 0.02, 1e-12, "default: the config's router_aux_loss_coef (output_router_logits)")
  local dense = dir .. '/dense'
  U.tiny_model(dense)
  t.raises(function()
    U.run_recipe('recipes/grpo.lua', { 'model.dir=' .. dense, 'data.path=' .. data, 'data.prompt=question',
      'data.chat=false', 'reward=exact', 'grpo.steps=1', 'moe.routing_replay=true', 'run.dir=' .. dir .. '/d' })
  end, 'moe.routing_replay')
  t.truthy(not require('moonrl.io.fs').exists(dir .. '/d'), 'refused before the run directory exists')
  os.execute("rm -rf '" .. dir .. "'")
end)

t.test('grpo: a few steps on a tiny qwen3_moe', function()
  local dir = U.tmpdir('moe')
  local init = dir .. '/init'
  models.save({ dir = init }, moonrl.model.new(cfg, { seed = 1 }), U.TOKENIZER, init)
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
