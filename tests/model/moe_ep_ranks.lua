-- One rank of tests/model/test_moe_ep.lua (run under mpirun): a qwen3_moe model with expert
-- parallelism over the world, each rank forwarding and back-propagating its block of a global
-- batch, against the same model alone on the whole batch (computed on every rank): this rank's
-- log-probs, and the gradients summed over the ranks, equal the single-process ones; a rank's
-- own expert gradients are the whole (the others' are zero before the sum). Prints one
-- "ep ok" line a rank.
--   mpirun -n P moonrl run tests/model/moe_ep_ranks.lua [dtype=bf16] [recompute=true] [replay=true]
--                                                        [arch=deepseek_v3] (DeepSeek-V3's router and shared expert)
-- idle=true: the last rank has no sequences (an empty batch) and serves its experts all the same.
-- hang=true: the last rank never runs its forward; the others' forward fails after the
-- communicator's timeout (2 s) with its report, and they print "ep timeout ok".
local moonrl = require('moonrl')
local dist = require('moonrl.train.dist')
local ffi = require('ffi')
local tiny = dofile('tests/lib/models.lua')

local opt = moonrl.config { dtype = 'fp32', recompute = false, replay = false, hang = false, idle = false,
  arch = 'qwen3_moe' }
local w = dist.world(opt.hang and 2 or nil)
local P, me = w.size, w.rank

-- 5 experts: uneven blocks over 2 ranks (3, 2) and 3 ranks (2, 2, 1); two sparse layers and a dense one
local cfg = tiny.config('qwen3_moe', { vocab_size = 23, num_hidden_layers = 3, tie_word_embeddings = false,
  initializer_range = 0.2, mlp_only_layers = { 1 }, router_aux_loss_coef = 0, output_router_logits = false })
if opt.arch == 'deepseek_v3' then -- 6 experts (3, 3 over 2 ranks; 2, 2, 2 over 3), a dense first layer, a shared one
  cfg = tiny.config('deepseek_v3_moe', { vocab_size = 23, tie_word_embeddings = false, initializer_range = 0.2 })
end
local E = cfg.num_experts or cfg.n_routed_experts

-- the global batch: 7 sequences of 3..15 tokens
local seqs, s = {}, 12345
for i = 1, 7 do
  local q = {}
  for j = 1, 3 + (i * 5) % 13 do
    s = (s * 1103515245 + 12345) % 2147483648
    q[j] = s % cfg.vocab_size
  end
  seqs[i] = q
end

local function model()
  local m = moonrl.model.new(cfg, { seed = 11 })
  if opt.dtype == 'bf16' then m:set_dtype('bf16') end
  m:set_recompute(opt.recompute)
  return m
end

-- d logprob of token t: a fixed pattern, so the backward reaches every part of the model
local function dlp_of(n, first)
  local d = ffi.new('float[?]', n)
  for t = 0, n - 1 do d[t] = math.cos(0.7 * (first + t)) end
  return d
end

-- routing replay: a fixed pick pattern for every other token (the rest -1: the router's own)
local function replay_for(m, n, first)
  if not opt.replay then return nil end
  local K, L = cfg.num_experts_per_tok, m:num_moe_layers()
  local r = ffi.new('int16_t[?]', n * L * K)
  for t = 0, n - 1 do
    for l = 0, L - 1 do
      for j = 0, K - 1 do
        local tok = first + t
        r[(t * L + l) * K + j] = tok % 2 == 0 and (tok + l + 2 * j) % E or -1
      end
    end
  end
  return r
end

-- the reference: the whole batch in one process
local ref = model()
local b_all = moonrl.model.batch(seqs)
local lp_ref = ref:forward(b_all, { routing = replay_for(ref, b_all.n_tokens, 0) })
ref:zero_grad()
ref:backward(dlp_of(b_all.n_tokens, 0))
local n_params = ref.n_params
local g_ref = ffi.new('float[?]', n_params)
ffi.copy(g_ref, ref:grads(), 4 * n_params)

-- this rank's block of the sequences (mrl_dist_shard's rule: the first 7 % P ranks one more;
-- idle: the last rank none)
local n_busy = opt.idle and P - 1 or P
local per, extra = math.floor(#seqs / n_busy), #seqs % n_busy
if me >= n_busy then per, extra = 0, 0 end
local first_seq = me * per + math.min(me, extra) + 1
local mine, first_tok = {}, 0
for i = 1, #seqs do
  if i < first_seq then first_tok = first_tok + #seqs[i] end
end
for i = first_seq, first_seq + per + (me < extra and 1 or 0) - 1 do mine[#mine + 1] = seqs[i] end

local m = model()
m:set_expert_parallel(w)
local e0, ne, on = m:expert_range()
assert(on, 'expert parallelism on')
local b = #mine > 0 and moonrl.model.batch(mine) or moonrl.model.empty_batch()
if opt.hang then
  if me == P - 1 then moonrl.sleep(4); return end -- (the others have given up by then)
  local ok, err = pcall(m.forward, m, b)
  assert(not ok, 'rank ' .. me .. ': the forward returned without the last rank')
  err = moonrl.error_text(err)
  assert(err:find('expert parallelism', 1, true) and err:find('rank ' .. (P - 1), 1, true), 'rank ' .. me .. ': ' .. err)
  io.stdout:write('ep timeout ok rank ' .. me .. ': ' .. err:gsub('\n.*', '') .. '\n')
  return
end
local lp = m:forward(b, { routing = replay_for(m, b.n_tokens, first_tok) })
local tol = opt.dtype == 'bf16' and 2e-2 or 2e-5
local worst = 0
for t = 0, b.n_tokens - 1 do
  local want = lp_ref[first_tok + t]
  worst = math.max(worst, math.abs(lp[t] - want) / math.max(1, math.abs(want)))
end
assert(worst <= tol, string.format('rank %d: log-probs differ from the single process by %.3g (tolerance %g)', me, worst, tol))
m:zero_grad()
m:backward(dlp_of(b.n_tokens, first_tok))
local g = ffi.new('float[?]', n_params)
ffi.copy(g, m:grads(), 4 * n_params)

-- before the sum: the experts of the other ranks have no gradient here, this rank's have it whole
local gtol = opt.dtype == 'bf16' and 5e-2 or 1e-5 -- of the largest gradient of the part compared
local own_nonzero = false
for _, v in ipairs(m:views()) do
  local e = tonumber(v.name:match('%.mlp%.experts%.(%d+)%.'))
  if e then
    local mine_e, vmax = e >= e0 and e < e0 + ne, 0
    for i = v.offset, v.offset + v.numel - 1 do vmax = math.max(vmax, math.abs(g_ref[i])) end
    for i = v.offset, v.offset + v.numel - 1 do
      if mine_e then
        own_nonzero = own_nonzero or g[i] ~= 0
        assert(math.abs(g[i] - g_ref[i]) <= gtol * vmax,
          string.format('rank %d: %s[%d]: its own expert\'s gradient %.6g, the single process %.6g', me, v.name,
            i - v.offset, g[i], g_ref[i]))
      else
        assert(g[i] == 0, string.format('rank %d: %s belongs to another rank, its gradient here is %g', me, v.name, g[i]))
      end
    end
  end
end
assert(ne == 0 or own_nonzero, 'rank ' .. me .. ': its experts got gradients')

-- the data-parallel sum is the single process's gradient
w:allreduce(g, n_params, 'f32', 'sum')
local gmax, gworst, where = 0, 0, nil
for i = 0, n_params - 1 do gmax = math.max(gmax, math.abs(g_ref[i])) end
for i = 0, n_params - 1 do
  local d = math.abs(g[i] - g_ref[i]) / gmax
  if d > gworst then gworst, where = d, i end
end
assert(gworst <= gtol, string.format('rank %d: summed gradients differ from the single process by %.3g of the largest at %d',
  me, gworst, where or -1))
io.stdout:write(string.format('ep ok rank %d/%d experts %d..%d tokens %d: log-probs %.2g, gradients %.2g\n', me, P, e0,
  e0 + ne - 1, b.n_tokens, worst, gworst))
