-- Speculative decoding with DeepSeek-V3's multi-token prediction layer (engine.mtp), on a model
-- whose MTP layer was trained: a DeepSeek-V3-shaped model (MLA, the dense MLP, one MTP layer)
-- with random weights is fine-tuned by SFT with train.mtp_weight on a task with predictable
-- answers (after "a+b=", the last digits of a, a+b, a+2b, ...: twelve digits), then rollouts of
-- `prompts` prompts are generated with and without the MTP draft, alternating `rounds` times:
-- tokens a second, the drafts kept, tokens a step, greedy and at temperature 1; the greedy
-- outputs of the two compared.
--   moonrl run bench/deepseek/mtp_bench.lua [steps=300] [hidden=384] [layers=4]
local moonrl = require('moonrl')
local json = require('moonrl.io.json')

local cfg = moonrl.config {
  steps = moonrl.config.integer(300, { min = 1 }), hidden = moonrl.config.integer(384, { min = 64 }),
  layers = moonrl.config.integer(4, { min = 1 }), prompts = moonrl.config.integer(64, { min = 1 }),
  rounds = moonrl.config.integer(3, { min = 1 }), dir = '/tmp/moonrl_mtp_bench',
  tokens = moonrl.config.integer(12, { min = 1 }), -- new tokens a prompt (the answers' 12; the pattern goes on past them)
  trained = false, -- true: the model dir's sft/model from an earlier run (no training again)
}
local exe = rawget(_G, 'MOONRL_EXE') or 'moonrl'
local cpu = (io.popen('grep -m1 "model name" /proc/cpuinfo'):read('*l') or ''):gsub('.*: ', '')
if not cfg.trained then os.execute("rm -rf '" .. cfg.dir .. "' && mkdir -p '" .. cfg.dir .. "'") end

-- the data: 1,000 problems, their answers twelve digits
local recs, s = {}, 7
local function rand(k) s = (s * 48271) % 2147483647; return s % k end
for i = 1, 1000 do
  local a, b = rand(10), 1 + rand(9)
  local digits = {}
  for k = 0, 11 do digits[#digits + 1] = tostring((a + k * b) % 10) end
  recs[i] = { prompt = a .. '+' .. b .. '=', response = table.concat(digits) }
end
local f = assert(io.open(cfg.dir .. '/train.jsonl', 'w'))
for _, r in ipairs(recs) do f:write(json.encode(r), '\n') end
f:close()

local mc = { model_type = 'deepseek_v3', vocab_size = 15, hidden_size = cfg.hidden, intermediate_size = 2 * cfg.hidden,
  num_hidden_layers = cfg.layers, num_attention_heads = 8, num_key_value_heads = 8, q_lora_rank = cfg.hidden / 2,
  kv_lora_rank = cfg.hidden / 4, qk_nope_head_dim = 32, qk_rope_head_dim = 16, v_head_dim = 32,
  max_position_embeddings = 256, first_k_dense_replace = cfg.layers, num_nextn_predict_layers = 1,
  bos_token_id = 1, eos_token_id = 2, tie_word_embeddings = true, initializer_range = 0.02 }
if not cfg.trained then require('moonrl.train.models').save({ dir = cfg.dir .. '/init' }, moonrl.model.new(mc, { seed = 1 }),
  moonrl.home .. '/examples/default', cfg.dir .. '/init') end
local t0 = moonrl.now()
local cmd = string.format("%s run %s/recipes/sft.lua model.dir=%s/init data.path=%s/train.jsonl train.steps=%d " ..
  "train.batch=32 train.lr=3e-3 train.mtp_weight=0.5 data.chat=false eval.every=0 quiet=true run.dir=%s/sft > %s/sft.log 2>&1",
  exe, moonrl.home, cfg.dir, cfg.dir, cfg.steps, cfg.dir, cfg.dir)
if not cfg.trained then assert(os.execute(cmd) == 0, cmd) end
local last
for l in io.lines(cfg.dir .. '/sft/metrics.jsonl') do last = json.decode(l) end
local train_s = moonrl.now() - t0

local model = moonrl.model.load(cfg.dir .. '/sft/model')
local tok = moonrl.tokenizer.load(cfg.dir .. '/sft/model')
local reqs = {}
for i = 1, cfg.prompts do -- (as SFT encoded them: its special tokens added)
  reqs[i] = { prompt_ids = require('moonrl.train.prompts').prompt_ids(tok, nil, recs[#recs - i + 1].prompt), prompt_index = i }
end
local engines = {}
for _, mtp in ipairs({ false, true }) do
  engines[mtp] = moonrl.engine.new(model, { kv_cache_bytes = 64 * 2 ^ 20, max_batch_tokens = 1024, mtp = mtp })
end
local res = {}
for _, temp in ipairs({ 0, 1 }) do
  res[temp] = { [false] = {}, [true] = {} }
  for _ = 1, cfg.rounds do
    for _, mtp in ipairs({ false, true }) do
      local e = engines[mtp]
      local before = e:stats()
      local t1 = moonrl.now()
      local out = e:generate(reqs, { temperature = temp, max_tokens = cfg.tokens, eos_ids = {}, seed = 3 })
      local dt = moonrl.now() - t1
      local after = e:stats()
      local n = 0
      for i = 1, #reqs do n = n + #out[i][1].ids end
      local r = res[temp][mtp]
      r.best = math.max(r.best or 0, n / dt)
      r.drafts = after.spec_drafts - before.spec_drafts
      r.kept = after.spec_accepted - before.spec_accepted
      r.steps = after.steps - before.steps
      r.tokens = n
      r.out = out
    end
  end
end
local same, total = 0, 0
for i = 1, #reqs do
  local a, b = res[0][true].out[i][1].ids, res[0][false].out[i][1].ids
  for j = 1, #a do total, same = total + 1, same + (a[j] == b[j] and 1 or 0) end
end
print(string.format('%s; deepseek_v3 shapes (%d layers, hidden %d, 8 heads, a latent of %d, one MTP layer), fp32; ' ..
  'SFT %d steps with train.mtp_weight 0.5 (%.0f s; loss %.3f, mtp_loss %.3f); %d prompts x %d tokens; best of %d rounds',
  cpu, cfg.layers, cfg.hidden, cfg.hidden / 4, cfg.steps, train_s, last.loss, last.mtp_loss or 0, cfg.prompts, cfg.tokens, cfg.rounds))
print('| sampling | without MTP, tokens/s | with MTP, tokens/s | speed-up | drafts kept | tokens a sample\'s decode step |')
print('|---|---|---|---|---|---|')
for _, temp in ipairs({ 0, 1 }) do
  local a, b = res[temp][false], res[temp][true]
  local kept = b.kept / math.max(b.drafts, 1)
  print(string.format('| %s | %.1f | %.1f | %.2fx | %.2f | %.2f |', temp == 0 and 'greedy' or 'temperature 1',
    a.best, b.best, b.best / a.best, kept, 1 + kept))
end
print(string.format('greedy tokens with and without the draft: %d of %d the same', same, total))
