-- moonrl.train.pipeline: pipeline parallel (dist.pp), the order of one update's micro-batches on
-- each stage. A stage model (moonrl.model.load_stage) sends its rows itself: a forward receives
-- its input from the stage before and sends its output to the next, a backward the other way.
-- What this module decides is the order, 1F1B (PipeDream-Flush, Megatron's default): stage s of p
-- runs min(p - s - 1, m) forwards ahead, then one forward and one backward in turn, then the
-- backwards left; so the last stage runs each micro-batch's forward, loss and backward together
-- (the recipe's own step, unchanged: the loss boundary is there), and stage s holds the
-- activations of at most p - s micro-batches (its activation slots).
--
--   local pipeline = require('moonrl.train.pipeline')
--   pipeline.stages(L, p, pipeline.costs(config))  -- balanced layer counts of p stages
--   pipeline.run(model, list, step, refs)  -- list: { {b, first}, ... }; step(b, first, i) on the last stage
--   pipeline.forward_only(model, list)     -- every stage's forwards, in order (log-probs without gradient)
--   pipeline.broadcast_lists(model, lists, n)  -- the last stage's per-sample lists on every stage
--   pipeline.share(model, t)               -- the last stage's table (a step's numbers) on every stage
local ffi = require('ffi')
local moonrl = require('moonrl')
local C = moonrl.C
local trace = require('moonrl.train.trace')

local M = {}

-- The layer count of each of p stages (dist.pp_layers: given) for layers of cost layer_cost each
-- and a head of cost head_cost on the last stage: contiguous runs whose largest cost is least
-- (the later stages taking the extra layers of a tie, the last one fewer for its head).
function M.stages(L, p, layer_cost, head_cost)
  if p > L then return nil end
  -- best[k][i]: the least largest cost of the first i layers over k stages
  local best, cut = {}, {}
  for k = 1, p do
    best[k], cut[k] = {}, {}
    for i = k, L - (p - k) do
      if k == 1 then
        best[k][i] = i * layer_cost
      else
        local b, at = math.huge, nil
        for j = k - 1, i - 1 do
          local c = math.max(best[k - 1][j], (i - j) * layer_cost + (k == p and head_cost or 0))
          if c <= b then b, at = c, j end
        end
        best[k][i], cut[k][i] = b, at
      end
    end
  end
  local counts, i = {}, L
  for k = p, 2, -1 do
    local j = cut[k][i]
    counts[k], i = i - j, j
  end
  counts[1] = i
  return counts
end

-- The per-token cost of a layer and of the head (multiply-adds) of a config table. (A mixture of
-- experts: a layer's MLP is its num_experts_per_tok experts' and the router, every layer counted
-- as sparse.)
function M.costs(c)
  local hd = c.head_dim or c.hidden_size / c.num_attention_heads
  local D, q, kv = c.hidden_size, c.num_attention_heads * hd, c.num_key_value_heads * hd
  local mlp = (c.num_experts or 0) > 0 and 3 * D * c.num_experts_per_tok * c.moe_intermediate_size + D * c.num_experts
    or 3 * D * c.intermediate_size
  return D * (2 * q + 2 * kv) + mlp, D * c.vocab_size
end

-- One update's micro-batches (list: { {b, first}, ... } in order, the same on every stage) on a
-- stage model. The last stage calls step(b, first, i) for the i-th (the recipe's forward, loss
-- and backward of it); the others run the model's forwards and backwards in 1F1B order, each
-- micro-batch in activation slot (j - 1) % (p - s). refs: models (a frozen reference) whose
-- forward of each micro-batch the step runs before the model's: the other stages run theirs
-- there too. Ends with a tied head's gradient summed over its two copies (mesh.tied) and the
-- sends flushed. Returns the stage's time waiting for rows (seconds) and the time its schedule
-- took.
function M.run(model, list, step, refs, opts)
  local pp = model.pp
  local s, p, K = pp.stage, pp.stages, #list
  local t0, wait0 = moonrl.now(), pp.wait
  -- each op a span of the stage's track in the trace (a rank's: F3, B1, ... in 1F1B's order)
  local function span(name, j, fn)
    local label = string.format('%s%d', name, j)
    trace.begin(label)
    fn()
    trace.finish(label)
  end
  pp.replayed, pp.replay_differ = 0, 0 -- (a mixture of experts: this stage's layers' routing replay, step's on the last)
  if s == p - 1 then
    for i, e in ipairs(list) do span('FB', i, function() step(e[1], e[2], i) end) end
  else
    local moe = model:num_moe_layers() > 0
    local slots = math.max(math.min(p - s, K), 1)
    model:pp_slots(slots) -- (the same count as before: nothing)
    local ahead = math.min(p - s - 1, K)
    local function F(j)
      span('F', j, function()
        for _, r in ipairs(refs or {}) do r:forward(list[j][1]) end
        model:use_slot((j - 1) % slots)
        local b = list[j][1] -- (routing replay: every stage replays its own layers' picks of the rows)
        model:forward(b, b.routing and setmetatable({ routing = b.routing }, { __index = opts }) or opts)
        if moe then
          local r, d = model:routing_replay_stats()
          pp.replayed, pp.replay_differ = pp.replayed + r, pp.replay_differ + d
        end
      end)
    end
    local function B(j)
      span('B', j, function()
        model:use_slot((j - 1) % slots)
        model:backward()
      end)
    end
    for j = 1, ahead do F(j) end
    for j = ahead + 1, K do F(j); B(j - ahead) end
    for j = K - ahead + 1, K do B(j) end
    model:use_slot(0)
  end
  local wait, took = pp.wait - wait0, moonrl.now() - t0 -- (the schedule's: the tied head's sum waits for the first stage)
  M.sync_tied(model)
  pp.world:flush_sends()
  for _, r in ipairs(refs or {}) do r.pp.world:flush_sends() end
  trace.counter('pipeline wait', took > 0 and wait / took or 0) -- (the stage's share of its loop spent waiting)
  return wait, took
end

-- Every stage's forwards of the micro-batches in order (no backward): the stages work on
-- successive micro-batches at once (each replaying its batch's routing, b.routing, where it has
-- one). Returns the outputs of each on the last stage (a list of { lp, ent, val }), nothing on
-- the others.
function M.forward_only(model, list, opts)
  local out = {}
  for i, e in ipairs(list) do
    local b = e[1]
    local lp, ent, val = model:forward(b, b.routing and setmetatable({ routing = b.routing }, { __index = opts }) or opts)
    out[i] = { lp, ent, val }
  end
  model.pp.world:flush_sends()
  return out
end

-- A tied head: the first stage's gradient of the embedding and the last stage's of its copy,
-- summed on both (before the data-parallel sums, which are linear: the same), so that the two
-- copies take the same update.
function M.sync_tied(model)
  local pp = model.pp
  if not (pp.tied and model.config.tie_word_embeddings) or model.grad_windows then return end -- (ZeRO-2, 3: below)
  for _, v in ipairs(model:views()) do
    if v.name == 'model.embed_tokens.weight' then
      if model.gpu then -- (over NCCL, or through the host: dist.gpu_transport)
        pp.tied:gpu_transport(pp.tied.gpu_asked or 'auto', C.mrl_model_get_device(model.handle).index)
        pp.tied:gpu_allreduce(model:grads() + v.offset, v.numel)
      else
        pp.tied:allreduce(model:grads() + v.offset, v.numel, 'f32', 'sum')
      end
      return
    end
  end
end

-- The same under ZeRO-2 and 3, which keep no gradient buffer: each rank holds the sums of its
-- shard (o.shard_grads, elements [o.offset, o.offset + o.count) of the stage's), final once the
-- optimizer syncs (dist.parallel_norm calls this then). The embedding's (or its copy's: both
-- first in their stage's buffer) gradient is put together over the shard group (each rank its
-- part, zeros elsewhere, summed), summed between the ends, and each rank takes its part back.
function M.sync_tied_shard(model, o)
  local pp = model.pp
  if not (pp and pp.tied and model.config.tie_word_embeddings) then return end
  local v = model:views()[1] -- (model.embed_tokens.weight, at offset 0 on both ends)
  local lo, hi = math.max(o.offset, v.offset), math.min(o.offset + o.count, v.offset + v.numel)
  local buf = ffi.new('float[?]', v.numel) -- (zeros)
  if hi > lo then moonrl.check(C.mrl_device_memcpy(buf + (lo - v.offset), o.shard_grads + (lo - o.offset), 4 * (hi - lo))) end
  o.layout.group:allreduce(buf, v.numel, 'f32', 'sum')
  pp.tied:allreduce(buf, v.numel, 'f32', 'sum')
  if hi > lo then moonrl.check(C.mrl_device_memcpy(o.shard_grads + (lo - o.offset), buf + (lo - v.offset), 4 * (hi - lo))) end
end

-- The last stage's t (a table of numbers, strings, tables) on every stage: a step's numbers,
-- which only the last stage computes (the loss), before the data-parallel sums.
function M.share(model, t)
  local pp = model.pp
  local json = require('moonrl.io.json')
  local root = pp.stages - 1
  return json.decode(pp.world:broadcast_string(pp.world.rank == root and json.encode(t) or '', root))
end

-- lists (one list of numbers per sample, or nil) on every stage as the last stage has them: what
-- the last stage's forwards gave (log-probs, values) for the steps that read them everywhere.
function M.broadcast_lists(model, lists, n)
  local pp = model.pp
  local w, root = pp.world, pp.stages - 1
  local lens = ffi.new('int64_t[?]', n + 1)
  if w.rank == root then
    for i = 1, n do lens[i - 1] = lists[i] and #lists[i] or -1 end
  end
  w:broadcast(lens, 8 * n, root)
  local total = 0
  for i = 0, n - 1 do total = total + math.max(tonumber(lens[i]), 0) end
  local buf = ffi.new('float[?]', math.max(total, 1))
  local at = 0
  if w.rank == root then
    for i = 1, n do
      for k, x in ipairs(lists[i] or {}) do buf[at + k - 1] = x end
      at = at + math.max(tonumber(lens[i - 1]), 0)
    end
  end
  w:broadcast(buf, 4 * total, root)
  at = 0
  for i = 1, n do
    local len = tonumber(lens[i - 1])
    if len < 0 then
      lists[i] = nil
    else
      local t = {}
      for k = 1, len do t[k] = buf[at + k - 1] end
      lists[i], at = t, at + len
    end
  end
  return lists
end

return M
