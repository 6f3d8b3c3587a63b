-- Two LoRA adapters (PEFT directories) for the model of DIR, with random A and B, for
-- test_serve.py's multi-LoRA checks. env: DIR (the model), OUT1, OUT2 (the adapter directories).
local moonrl = require('moonrl')
local model = moonrl.model.load(os.getenv('DIR'))
local rng = require('moonrl.rng').new(5)
for i, spec in ipairs({ { os.getenv('OUT1'), 4, 'all-linear' }, { os.getenv('OUT2'), 2, { 'q_proj', 'v_proj', 'down_proj' } } }) do
  local ad = model:new_adapter({ rank = spec[2], alpha = 16, targets = spec[3], seed = i })
  local p, n = ad:buffer()
  for k = 0, n - 1 do p[k] = 0.6 * (rng:int(2000001) / 1000000 - 1) end
  ad:save(spec[1], { base = os.getenv('DIR') })
end
