-- One rank of tests/model/test_tp.lua (run under mpirun): the model in dir loaded whole and as
-- this rank's tensor-parallel slices over the world (moonrl.model.load_tp), a forward and a
-- backward of the same batch on both: this rank's log-probs and entropy against the whole
-- model's, and each slice's gradient against the slice of the whole gradient (a whole view's
-- against the whole); this rank's slices as Model:slices exports them land where the whole
-- model holds the same values, and the whole model's slices land where this rank holds the same
-- values; then the group saves the slices to out. Prints one "tp ok rank R" line.
--   mpirun -n P moonrl run tests/model/tp_ranks.lua dir=DIR out=OUT [dtype=bf16]
local moonrl = require('moonrl')
local dist = require('moonrl.train.dist')
local ffi = require('ffi')

local opt = moonrl.config { dir = '', out = '', dtype = 'fp32' }
local w = dist.world()
local whole = moonrl.model.load(opt.dir)
local m = moonrl.model.load_tp(opt.dir, w)
whole:set_dtype(opt.dtype)
m:set_dtype(opt.dtype)

local seqs, s = {}, 4321
for i = 1, 5 do
  local q = {}
  for j = 1, 4 + (i * 7) % 11 do
    s = (s * 1103515245 + 12345) % 2147483648
    q[j] = s % whole.config.vocab_size
  end
  seqs[i] = q
end
local b = moonrl.model.batch(seqs)
local n = b.n_tokens
local dlp = ffi.new('float[?]', n)
for t = 0, n - 1 do dlp[t] = math.cos(0.7 * t) end

local function run(model)
  local lp, ent = model:forward(b)
  model:zero_grad()
  model:backward(dlp, nil)
  return lp, ent
end
local lp0, ent0 = run(whole)
local lp1, ent1 = run(m)
local d_lp = 0
for t = 0, n - 1 do d_lp = math.max(d_lp, math.abs(lp1[t] - lp0[t]), math.abs(ent1[t] - ent0[t])) end

-- each view: its slice of the whole gradient (rows or columns, as the shapes say)
local g0, g1 = whole:grads(), m:grads()
local by_name = {}
for _, v in ipairs(whole:views()) do by_name[v.name] = v end
local worst, split = 0, 0
for _, v in ipairs(m:views()) do
  local u = by_name[v.name]
  local rows = v.shape[1] ~= u.shape[1]
  local cols = not rows and #v.shape == 2 and v.shape[2] ~= u.shape[2]
  if rows or cols then split = split + 1 end
  local num, den = 0, 0
  for i = 0, v.numel - 1 do
    local j
    if rows then j = u.offset + w.rank * v.numel + i
    elseif cols then
      local r, c = math.floor(i / v.shape[2]), i % v.shape[2]
      j = u.offset + r * u.shape[2] + w.rank * v.shape[2] + c
    else j = u.offset + i end
    local d = g1[v.offset + i] - g0[j]
    num, den = num + d * d, den + g0[j] * g0[j]
  end
  local rel = den > 0 and math.sqrt(num / den) or math.sqrt(num)
  if not (rel <= worst) then worst = rel end
end
m:save(opt.out)
local size = m:tp()
-- this rank's slices in the whole tensors' coordinates (Model:slices), placed in the whole model
-- (Model:slice_plan): its values, bit for bit, and every element of each split view once; and the
-- whole model's slices placed in this rank's slices, each element of them once
local plan, placed, bad = whole:slice_plan(m:slices()), 0, 0
local wp, mp = whole:params(), m:params()
for _, c in ipairs(plan) do
  for i = 0, c.count - 1 do
    if wp[c.to + i] ~= mp[c.at + i] then bad = bad + 1 end
  end
  placed = placed + c.count
end
-- the other way: the whole model's slices placed in this rank's (its part of each tensor taken)
local got = 0
for _, c in ipairs(m:slice_plan(whole:slices())) do
  for i = 0, c.count - 1 do
    if mp[c.to + i] ~= wp[c.at + i] then bad = bad + 1 end
  end
  got = got + c.count
end
io.stdout:write(string.format('tp ok rank %d of %d: %d split views, log-probs %.3g, gradients %.3g, slices placed %d of %d, ' ..
  '%d differ\n', w.rank, size, split, d_lp, worst, placed + got, 2 * m.n_params, bad)) -- (print is rank 0's alone)
