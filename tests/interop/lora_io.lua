-- moonrl's side of peft_check.py (by environment: LORA_MODE, LORA_BASE, LORA_DIR, LORA_SEQS (JSON
-- lists of token ids), LORA_OUT):
--   read:  the base model with the PEFT adapter of LORA_DIR (Model:load_lora) -> the log-probs of
--          LORA_SEQS, as JSON in LORA_OUT
--   write: the base with adapters (LORA_RANK, LORA_ALPHA, LORA_TARGETS) of random A and B, saved
--          as a PEFT directory in LORA_DIR (Model:save_lora) -> their log-probs likewise
local moonrl = require('moonrl')
local json = require('moonrl.io.json')
local fs = require('moonrl.io.fs')

local mode, seqs = os.getenv('LORA_MODE'), json.decode(os.getenv('LORA_SEQS'))
local m = moonrl.model.load(os.getenv('LORA_BASE'))
if mode == 'read' then
  m:load_lora(os.getenv('LORA_DIR'))
else
  local targets = {}
  for s in os.getenv('LORA_TARGETS'):gmatch('[^,]+') do targets[#targets + 1] = s end
  m:set_lora({ rank = tonumber(os.getenv('LORA_RANK')), alpha = tonumber(os.getenv('LORA_ALPHA')), targets = targets,
    seed = 3 })
  local p, n = m:lora_buffer()
  local rng = require('moonrl.rng').new(17)
  for i = 0, n - 1 do p[i] = 0.4 * (rng:int(1000001) / 1000000 - 0.5) end -- (B too: the adapters matter)
  m:trained()
  m:save_lora(os.getenv('LORA_DIR'), { base = os.getenv('LORA_BASE') })
end
local lp = m:forward(moonrl.model.batch(seqs))
local out, k = {}, 0
for i, s in ipairs(seqs) do
  out[i] = {}
  for j = 1, #s do out[i][j] = lp[k]; k = k + 1 end
end
fs.write(os.getenv('LORA_OUT'), json.encode(out))
