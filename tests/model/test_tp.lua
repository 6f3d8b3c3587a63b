-- Tensor parallel over MPI (moonrl.model.load_tp: model.h's mrl_model_load_dir_tp with
-- moonrl.train.dist's group collectives): tests/model/tp_ranks.lua on 2 ranks over shared
-- memory and TCP, fp32 and bf16, and on 4 ranks: every rank's log-probs and entropy are the
-- whole model's and each slice's gradient the slice of the whole model's, within summation
-- order (fp32) or a bf16 rounding edge (bf16); the model the group saves is the whole model's
-- files byte for byte. One process: the whole model itself. Skipped where mpirun is absent.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local U = dofile('tests/recipes/util.lua')
local tiny = dofile('tests/lib/models.lua')

local exe = assert(rawget(_G, 'MOONRL_EXE'), 'needs the moonrl executable')
local mpirun = U.which('mpirun')
local dir = U.tmpdir('tp')

-- four query and four K/V heads (4 ranks: one each), an MLP of 48, a value-free Qwen2 with biases,
-- a vocabulary of 16 (the embedding and head split by vocabulary)
local model_dir = dir .. '/model'
tiny.model('qwen2', { num_key_value_heads = 4, initializer_range = 0.2, vocab_size = 16 }, { seed = 5 }):save(model_dir)
local whole_dir = dir .. '/whole'
moonrl.model.load(model_dir):save(whole_dir)

local function run(n, btl, words)
  local all = { 'dir=' .. model_dir }
  for _, w in ipairs(words) do all[#all + 1] = w end
  return U.run_ranks(exe, n, 'tests/model/tp_ranks.lua', all, { btl = btl and (btl .. ',self') })
end

-- the "tp ok" lines: their count and the largest differences
local function results(r)
  local count, lp, g = 0, 0, 0
  for line in r.stdout:gmatch('[^\n]+') do
    local a, b, placed, n, bad = line:match('^tp ok rank %d+ of %d+: %d+ split views, log%-probs (%S+), gradients (%S+), ' ..
      'slices placed (%d+) of (%d+), (%d+) differ')
    if a then
      count, lp, g = count + 1, math.max(lp, tonumber(a)), math.max(g, tonumber(b))
      if placed ~= n or bad ~= '0' then count = -1000 end -- (every element placed, at the whole model's value)
      print('  ' .. line)
    end
  end
  return count, lp, g
end

local function same_files(out)
  for _, f in ipairs({ 'model.safetensors', 'config.json' }) do
    if require('moonrl.io.fs').read(out .. '/' .. f) ~= require('moonrl.io.fs').read(whole_dir .. '/' .. f) then
      return false
    end
  end
  return true
end

t.test('one process: the slices of a group of one are the whole model', function()
  local r = run(0, nil, { 'out=' .. dir .. '/one' })
  local count, lp, g = results(r)
  t.eq(count, 1)
  t.eq(lp, 0)
  t.eq(g, 0)
  t.truthy(same_files(dir .. '/one'), 'saved: the whole model')
end)

if not mpirun then
  print('skipped the mpirun cases: no mpirun')
  t.done()
  return
end

t.test('2 ranks (shared memory and TCP, fp32 and bf16) and 4: the whole model\'s log-probs and gradient slices, and its files when saved', function()
  for _, case in ipairs({ { 2, 'vader', 'fp32' }, { 2, 'tcp', 'fp32' }, { 2, 'vader', 'bf16' }, { 4, 'vader', 'fp32' } }) do
    local out = string.format('%s/saved_%d_%s_%s', dir, case[1], case[2], case[3])
    local r = run(case[1], case[2], { 'out=' .. out, 'dtype=' .. case[3] })
    local count, lp, g = results(r)
    t.eq(count, case[1], 'one line a rank')
    local lp_tol, g_tol = case[3] == 'bf16' and 0.025 or 1e-5, case[3] == 'bf16' and 0.015 or 1e-5
    t.truthy(lp <= lp_tol and g <= g_tol, string.format('%d ranks %s: log-probs %.3g, gradients %.3g', case[1], case[3],
      lp, g))
    t.truthy(same_files(out), 'saved by the group: the whole model\'s files')
  end
end)

t.done()
