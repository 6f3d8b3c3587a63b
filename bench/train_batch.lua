-- The training benchmarks' batch: n_seqs sequences of `seq` random tokens below `vocab` (a fixed
-- linear congruential stream from 12345: the same tokens every run, on every machine), packed, and
-- the loss's gradient -1/T for each of its T log-probs; and step(model, opt): one training step on
-- them (zero the gradients, forward, backward, the optimizer's step), its seconds.
--   local batch, grad, step = dofile(moonrl.home .. '/bench/train_batch.lua')(vocab, n_seqs, seq)
local moonrl = require('moonrl')
local ffi = require('ffi')

return function(vocab, n_seqs, seq)
  local seqs, rng = {}, 12345
  for s = 1, n_seqs do
    local t = {}
    for i = 1, seq do
      rng = (rng * 1103515245 + 12345) % 2147483648
      t[i] = rng % vocab
    end
    seqs[s] = t
  end
  local batch = moonrl.model.batch(seqs)
  local grad = ffi.new('float[?]', batch.n_tokens)
  for i = 0, batch.n_tokens - 1 do grad[i] = -1 / batch.n_tokens end
  local function step(model, opt)
    local t0 = moonrl.now()
    model:zero_grad()
    model:forward(batch)
    model:backward(grad)
    opt:step()
    return moonrl.now() - t0
  end
  return batch, grad, step
end
