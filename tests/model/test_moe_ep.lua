-- Expert parallelism (model.h, mrl_model_set_expert_parallel): tests/model/moe_ep_ranks.lua
-- alone and under mpirun on 2 ranks (shared memory) and 3 (TCP), in fp32, bf16, with
-- activation recompute and with routing replay: each rank's log-probs and the summed gradients
-- equal one process's on the whole batch, a rank's own experts' gradients are whole and the
-- others' zero; a rank with no tokens (an empty batch) still serves its experts. A rank that never arrives fails the others' forward after the timeout with the
-- communicator's report; a dense model refuses the setting. Skipped where mpirun is absent.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local proc = require('moonrl.proc')
local U = dofile('tests/recipes/util.lua')

local exe = assert(rawget(_G, 'MOONRL_EXE'), 'needs the moonrl executable')
local mpirun = U.which('mpirun')
local WORKER = 'tests/model/moe_ep_ranks.lua'

local function run(n, btl, words)
  local argv = {}
  if n > 0 then
    for _, a in ipairs({ mpirun, '-n', tostring(n), '--oversubscribe', '--bind-to', 'none', '--allow-run-as-root',
      '--mca', 'btl', btl .. ',self' }) do argv[#argv + 1] = a end
  end
  for _, a in ipairs({ exe, 'run', WORKER }) do argv[#argv + 1] = a end
  for _, w in ipairs(words or {}) do argv[#argv + 1] = w end
  return proc.run(argv, { timeout = 120 })
end

local function oks(r)
  local n = 0
  for line in r.stdout:gmatch('[^\n]+') do
    if line:find('^ep ok rank') then
      n = n + 1
      print('  ' .. line)
    end
  end
  return n
end

t.test('one process: expert parallelism over a world of one is the plain model, bit for bit', function()
  local r = run(0)
  t.truthy(r.ok, r.stderr)
  t.eq(oks(r), 1)
  t.truthy(r.stdout:find('log-probs 0, gradients 0', 1, true), r.stdout)
end)

t.test('a dense model refuses expert parallelism', function()
  local m = moonrl.model.new({ model_type = 'qwen3', vocab_size = 15, hidden_size = 32, intermediate_size = 48,
    num_hidden_layers = 1, num_attention_heads = 4 })
  t.raises(function() m:set_expert_parallel(require('moonrl.dist').world()) end, 'has no sparse layers')
  t.raises(function() m:forward(moonrl.model.empty_batch()) end, 'n_tokens = 0', 'an empty batch without expert parallelism')
  local _, count, on = m:expert_range()
  t.eq(on, false)
  t.eq(count, 0)
end)

if not mpirun then
  print('skipped the mpirun cases: no mpirun')
  t.done()
  return
end

for _, c in ipairs({ { 2, 'vader' }, { 3, 'tcp' } }) do
  for _, words in ipairs({ {}, { 'dtype=bf16' }, { 'recompute=true', 'replay=true' }, { 'idle=true', 'recompute=true' } }) do
    local name = string.format('%d ranks (%s) %s: the single-process log-probs and gradients', c[1], c[2],
      #words > 0 and table.concat(words, ' ') or 'fp32')
    t.test(name, function()
      local r = run(c[1], c[2], words)
      t.truthy(r.ok, r.stdout .. r.stderr)
      t.eq(oks(r), c[1], 'every rank')
    end)
  end
end

t.test('a rank that never runs its forward: the others fail after the timeout, the report names it', function()
  local r = run(2, 'vader', { 'hang=true' })
  local line = r.stdout:match('ep timeout ok rank 0: [^\n]+')
  t.truthy(line, r.stdout .. r.stderr)
  print('  ' .. line)
  t.truthy(line:find('timed out', 1, true), line)
end)

t.done()
