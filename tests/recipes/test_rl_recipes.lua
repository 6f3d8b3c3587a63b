-- GRPO, PPO and RLVR recipes end to end for a few steps on a tiny random model in Hugging Face
-- format (generation through moonrl.engine),
-- and the reward-model plugin (a sequence-classification checkpoint read through the value head).
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local json = require('moonrl.io.json')
local U = dofile('tests/recipes/util.lua')
local tiny = dofile('tests/lib/models.lua')

local dir = U.tmpdir('rl')
local model_dir = U.tiny_model(dir .. '/init')
local recs = {}
for i, p in ipairs(U.additions(40, 5)) do recs[i] = { question = p.prompt, answer = p.answer } end
local data = U.write_jsonl(dir .. '/train.jsonl', recs)

local records = U.records

local function check_run(run_dir, steps, keys)
  local recsm = records(run_dir)
  t.eq(#recsm, steps, 'one metrics record per step')
  for _, k in ipairs(keys) do t.truthy(recsm[#recsm][k] ~= nil, 'metric ' .. k .. ' logged') end
  local m = moonrl.model.load(run_dir .. '/model')
  t.eq(m.config.vocab_size, 15)
  t.truthy(io.open(run_dir .. '/model/tokenizer.json'), 'tokenizer copied next to the model')
end

local COMMON = { 'model.dir=' .. model_dir, 'data.path=' .. data, 'data.prompt=question', 'data.chat=false',
  'reward=exact', 'train.lr=1e-3', 'train.micro_batch_tokens=64' }
local function with(extra) return U.with(COMMON, extra) end

t.test('grpo: a few steps with a KL reference, micro-batches and two epochs', function()
  local out = U.run_recipe('recipes/grpo.lua', with({ 'grpo.steps=3', 'grpo.prompts=4', 'grpo.samples=4',
    'grpo.max_tokens=4', 'grpo.kl_coef=0.01', 'grpo.epochs=2', 'grpo.entropy_coef=0.001', 'run.dir=' .. dir .. '/grpo' }))
  check_run(out.dir, 3, { 'reward/mean', 'reward/std', 'accuracy', 'response_length/mean', 'kl', 'entropy',
    'clip_frac', 'grad_norm', 'lr', 'tokens_per_s/generate', 'tokens_per_s/train', 'time/generate', 'time/train',
    'mismatch/mean_abs', 'mismatch/max_abs', 'mismatch/token_mult_prob_error' })
  -- the engine generated with the weights the first epoch's forward runs on: they must agree
  for _, r in ipairs(records(out.dir)) do
    t.truthy(r['mismatch/max_abs'] < 1e-4, 'engine vs trainer log-probs: max |diff| ' .. r['mismatch/max_abs'])
  end
end)

t.test('ppo: critic with a value head, GAE, policy and critic updates', function()
  local out = U.run_recipe('recipes/ppo.lua', with({ 'ppo.steps=3', 'ppo.prompts=6', 'ppo.samples=2',
    'ppo.max_tokens=4', 'run.dir=' .. dir .. '/ppo' }))
  check_run(out.dir, 3, { 'reward/mean', 'kl', 'entropy', 'critic/loss', 'grad_norm', 'time/critic', 'time/logprobs',
    'mismatch/max_abs' })
  t.truthy(out.critic.config.value_head, 'the critic has a value head')
  local c = moonrl.model.load(out.dir .. '/critic')
  t.truthy(c.config.value_head, 'the critic saved as a sequence-classification checkpoint')
end)

t.test('rlvr: dynamic sampling keeps only groups with a signal; overlong penalty', function()
  local out = U.run_recipe('recipes/rlvr.lua', with({ 'rlvr.steps=3', 'rlvr.prompts=4', 'rlvr.samples=4',
    'rlvr.max_tokens=4', 'overlong.buffer=2', 'run.dir=' .. dir .. '/rlvr' }))
  check_run(out.dir, 3, { 'reward/mean', 'dynamic_sampling/kept_ratio', 'dynamic_sampling/gen_batches' })
  for _, r in ipairs(records(out.dir)) do
    t.truthy(r['dynamic_sampling/kept_groups'] <= 4, 'at most rlvr.prompts groups kept')
  end
end)

t.test('reward model: a sequence-classification checkpoint scores through the value head', function()
  local rm = tiny.model('digits', { num_key_value_heads = 4, tie_word_embeddings = false }, { seed = 9, value_head = true })
  require('moonrl.train.models').save({ dir = dir }, rm, U.TOKENIZER, dir .. '/rm')
  local cj = json.read_file(dir .. '/rm/config.json')
  t.eq(cj.architectures[1], 'LlamaForSequenceClassification')
  local fn = require('rewards.reward_model').register('tiny_rm', dir .. '/rm')
  local tok = moonrl.tokenizer.load(U.TOKENIZER)
  local ids = tok:encode('3+4=7')
  local _, _, v = rm:forward(moonrl.model.batch({ ids }), { values = true })
  local got = moonrl.rewards.get('tiny_rm')({ prompt = '3+4=', response = '7' })
  t.near(got, v[#ids - 1], 1e-5, 'score at the last token')
  local list = fn:score({ { prompt = '3+4=', response = '7' }, { prompt = '1+1=', response = '2' } })
  t.near(list[1], got, 1e-5, 'batched scores')
  local out = U.run_recipe('recipes/grpo.lua', with({ 'reward=reward_model', 'reward_model.dir=' .. dir .. '/rm',
    'grpo.steps=2', 'grpo.prompts=2', 'grpo.samples=4', 'grpo.max_tokens=3', 'run.dir=' .. dir .. '/grpo_rm' }))
  t.eq(#records(out.dir), 2)
end)

require('moonrl.io.fs').remove(dir)
t.done()
