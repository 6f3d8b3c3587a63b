-- moonrl.train.threads: run.threads=auto, the thread count measured on the model.
--
--   local n = require('moonrl.train.threads').auto_threads(S, policy)   -- sets it, records it in S
local ffi = require('ffi')
local moonrl = require('moonrl')
local model_mod = require('moonrl.model')

local M = {}

-- A small model runs fastest on one thread on some CPUs (its matrices are too small to split)
-- and on all cores on others (bench/RESULTS.md, "The default run"), so `auto` times what a step does: a forward and a backward of a packed
-- batch of 16 sequences (up to 32 tokens each) at 1 thread and at n (the process's count: the
-- cores, or MOONRL_THREADS), interleaved, the best of each, and keeps the faster. A model of
-- over 30M parameters has products large enough to split: n, untimed. The timing takes a few
-- tenths of a second on a quiet machine (on a loaded one, where n threads can be many times
-- slower, a round or two); the weights are untouched (the gradients are zeroed after).
-- Returns the choice, how ('measured', 'model size', 'one core') and the seconds of each count
-- timed and the batch's tokens.
function M.measure_threads(model)
  local C = moonrl.C
  C.mrl_parallel_set_threads(0) -- the process's default (not what an earlier run in it chose)
  local n = tonumber(C.mrl_parallel_threads())
  if n <= 1 then return 1, 'one core' end
  if model.n_params > 30e6 then return n, 'model size' end
  local cfg = model.config
  local len, seqs = math.min(32, cfg.max_position_embeddings), {}
  for i = 1, 16 do
    local s = {}
    for t = 1, len do s[t] = (i * 7 + t * 3) % (cfg.vocab_size - 1) + 1 end
    seqs[i] = s
  end
  local b = model_mod.batch(seqs)
  local grad = ffi.new('float[?]', b.n_tokens)
  for t = 0, b.n_tokens - 1 do grad[t] = -1 / b.n_tokens end
  local function step(threads)
    C.mrl_parallel_set_threads(threads)
    local t0 = moonrl.now()
    model:forward(b)
    model:backward(grad)
    return moonrl.now() - t0
  end
  local best = { [1] = math.huge, [n] = math.huge }
  step(n); step(1) -- the first calls size the model's buffers and start the threads
  local spent = 0
  for _ = 1, 8 do -- alternating, so that a burst of load from elsewhere hits both
    for _, k in ipairs({ 1, n }) do
      local dt = step(k)
      spent = spent + dt
      if dt < best[k] then best[k] = dt end
    end
    if spent > 0.5 then break end
  end
  model:zero_grad()
  local choice = best[1] < best[n] and 1 or n
  C.mrl_parallel_set_threads(choice)
  return choice, 'measured', { [tostring(1)] = best[1], [tostring(n)] = best[n] }, b.n_tokens
end

-- Resolve run.threads=auto for session S with policy: the count of the run's checkpoint (a
-- resumed run keeps its choice: the bits depend on it), else the ranks' share of the host's cores
-- (a job of several processes: no timing, the ranks' counts must not differ by chance) or
-- MOONRL_THREADS when set, else measure_threads. Sets S.threads (recorded in manifest.json,
-- which `moonrl run --from` reads back) and says so on the run's first lines.
function M.auto_threads(S, policy)
  local C = moonrl.C
  local job = require('moonrl.train.dist').world() -- the whole job (trainers and rollout ranks)
  local t = S.memos.threads
  if t ~= nil then
    t = { chosen = t.chosen, by = 'checkpoint', seconds = t.seconds }
  elseif os.getenv('MOONRL_THREADS') then
    C.mrl_parallel_set_threads(0) -- the default: MOONRL_THREADS
    t = { chosen = tonumber(C.mrl_parallel_threads()), by = 'MOONRL_THREADS' }
  elseif job.size > 1 then
    C.mrl_parallel_set_threads(0) -- the default: the cores
    t = { chosen = math.max(1, math.floor(tonumber(C.mrl_parallel_threads()) / math.max(job.local_size, 1))), by = 'ranks' }
  else
    local chosen, by, seconds, tokens = M.measure_threads(policy)
    t = { chosen = chosen, by = by, seconds = seconds, tokens = tokens }
  end
  C.mrl_parallel_set_threads(t.chosen)
  S.memos.threads = { chosen = t.chosen, seconds = t.seconds } -- checkpointed with the run
  S.threads = t
  local parts = {}
  for k, v in pairs(t.seconds or {}) do parts[#parts + 1] = { tonumber(k), v } end
  table.sort(parts, function(a, b) return a[1] < b[1] end)
  for i, p in ipairs(parts) do parts[i] = string.format('%d: %.1f ms', p[1], 1000 * p[2]) end
  if S.world.rank == 0 and S.role ~= 'rollout' and S.cfg.quiet ~= true then
    print(string.format('threads: %d (run.threads=auto, %s%s)', t.chosen, t.by,
      #parts > 0 and (': a step of ' .. t.tokens .. ' tokens ' .. table.concat(parts, ', ')) or ''))
  end
  S:event('threads', { chosen = t.chosen, by = t.by, seconds = t.seconds }, { quiet = true })
  return t.chosen
end

return M
