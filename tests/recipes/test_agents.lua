-- Agent programs (agent.command, moonrl.train.agents) playing episodes through the OpenAI-compatible
-- server in training mode, with a Python agent of urllib alone (tests/recipes/agent_script.py): its
-- turns recorded with their exact tokens and sampled at the trainer's temperature whatever it asked
-- (the log-probs are the trainer's), merged where a prompt extends the turn before and split where
-- it does not, its reported reward kept; an agent that dies, hangs, reports nothing, drops a
-- request or is unknown to the server is contained and counted; GRPO trains on agents' episodes.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local json = require('moonrl.io.json')
local fs = require('moonrl.io.fs')
local agents = require('moonrl.train.agents')
local train = require('moonrl.train.step')

local TOK = 'examples/agent'
local tok = moonrl.tokenizer.load(TOK)
local model = moonrl.model.new({ model_type = 'llama', vocab_size = tok.vocab_size, hidden_size = 32,
  intermediate_size = 64, num_hidden_layers = 1, num_attention_heads = 4, num_key_value_heads = 2,
  max_position_embeddings = 48, tie_word_embeddings = true, bos_token_id = 1, eos_token_id = 2 }, { seed = 3 })
local AGENT = 'python3 tests/recipes/agent_script.py'

local function records(faults)
  local out = {}
  for i, f in ipairs(faults) do
    local prompt = (10 + i) .. '*' .. (30 + i) .. '='
    out[i] = { prompt = prompt, prompt_ids = tok:encode(prompt), answer = tostring((10 + i) * (30 + i)), prompt_index = i - 1,
      meta = f ~= '' and { fault = f } or nil }
  end
  return out
end

local function run(faults, o)
  o = o or {}
  local engine = moonrl.engine.new(model, { kv_cache_bytes = 2 ^ 21, block_size = 4, seed = 7 })
  return agents.run({ engine = engine, tok = tok, records = records(faults), group = o.group or 2,
    sampling = { temperature = 1.0, max_tokens = 4, eos_ids = { 2 } }, step = 1, seed = 3, command = o.command or AGENT,
    concurrency = o.concurrency or 4, workers = o.workers, max_seconds = o.max_seconds or 20 })
end

local function check_logprobs(samples, what)
  local lp = train.logprobs(model, samples, 4096, { temperature = 1.0 })
  local worst, n = 0, 0
  for i, s in ipairs(samples) do
    for k = 1, #s.ids do
      if s.loss_mask[k] == 1 then worst, n = math.max(worst, math.abs(lp[i][k] - s.rollout_logprobs[k])), n + 1 end
    end
  end
  t.truthy(n > 0 and worst < 1e-4, string.format('%s: max |trainer - engine| over %d tokens = %g', what, n, worst))
end

t.test('agents\' turns: exact tokens merged into one sample, the trainer\'s temperature, the reward reported', function()
  local samples, stats = run({ '', '' })
  t.eq(#samples, 4)
  for _, s in ipairs(samples) do
    t.eq(s.episode.reason, 'done', tostring(s.episode.error))
    t.eq(s.episode.turns, 2)
    t.eq(s.pieces, nil, 'the second prompt extends the first turn: one sample')
    -- first completion (mask 1), "0=" (mask 0), second completion (mask 1)
    local zeros = {}
    for k, m in ipairs(s.loss_mask) do if m == 0 then zeros[#zeros + 1] = s.ids[k] end end
    t.eq(table.concat(zeros, ','), '5,16', 'the agent\'s own tokens between the turns, masked')
    local sevens = 0
    for k, id in ipairs(s.ids) do if s.loss_mask[k] == 1 and id == 12 then sevens = sevens + 1 end end
    t.eq(s.episode.reward, sevens, 'the reward the agent reported')
    t.eq(s.prompt_ids[1], 1, 'the prompt as the recipe tokenized it')
  end
  t.eq(stats.turns, 8)
  t.eq(stats.reasons.done, 4)
  -- sampled at temperature 1 though the agent asked for 0.2: the trainer's log-probs at 1 agree
  check_logprobs(samples, 'agents')
  -- every episode draws from a stream of its own: the same tokens whatever the agents' timing
  local again = run({ '', '' })
  for i, s in ipairs(samples) do t.eq(table.concat(again[i].ids, ','), table.concat(s.ids, ','), 'deterministic') end
  -- played by two workers of two threads each (agent.workers): the same episodes, the same tokens
  local by_workers, wstats = run({ '', '' }, { workers = 2 })
  for i, s in ipairs(samples) do
    t.eq(by_workers[i].episode.reason, 'done', tostring(by_workers[i].episode.error))
    t.eq(table.concat(by_workers[i].ids, ','), table.concat(s.ids, ','), 'workers: the tokens of one process an episode')
    t.eq(table.concat(by_workers[i].loss_mask, ','), table.concat(s.loss_mask, ','))
    t.eq(by_workers[i].episode.reward, s.episode.reward, 'the reward its worker reported with done')
  end
  t.eq(wstats.agent_failures, 0)
end)

t.test('agents\' faults: dies, hangs, reports nothing, drops a request, rewrites its history', function()
  local samples, stats = run({ 'die', 'hang', 'no_reward', 'disconnect', 'rewrite' }, { group = 1, max_seconds = 4 })
  t.eq(samples[1].episode.reason, 'agent_error')
  t.truthy(samples[1].episode.failed and samples[1].episode.error:find('status 3', 1, true), samples[1].episode.error)
  t.eq(samples[2].episode.reason, 'max_seconds')
  t.truthy(samples[2].episode.failed)
  t.eq(samples[3].episode.reason, 'done')
  t.eq(samples[3].episode.reward, nil, 'no reward reported: the reward function will judge it')
  t.eq(samples[4].episode.reason, 'done', 'a dropped request does not end the episode')
  t.eq(samples[5].episode.reason, 'done')
  t.eq(#(samples[5].pieces or {}), 1, 'a second prompt that is not the first turn extended starts a new piece')
  local p = samples[5].pieces[1]
  t.truthy(#p.ids >= 1 and #p.ids <= 4 and p.loss_mask[1] == 1, 'the first turn\'s tokens')
  -- (the dropped request may have finished before the server saw its client go: then it is a turn
  -- the agent never read, and the next prompt does not extend it)
  t.eq(stats.extension_failures, 1 + #(samples[4].pieces or {}))
  t.eq(stats.reasons.agent_error + stats.reasons.max_seconds, 2)
  local all = { samples[5], p }
  check_logprobs(all, 'pieces')
  -- an agent that is no program at all
  local bad, bstats = run({ '' }, { group = 1, command = 'exit 7' })
  t.eq(bad[1].episode.reason, 'agent_error')
  t.eq(bstats.agent_failures, 1)
end)

t.test('agent workers\' faults: an episode that hangs, fails or reports nothing; a worker that dies or never works', function()
  -- one worker playing five episodes at once
  local samples, stats = run({ 'hang', 'no_reward', 'fail', 'rewrite', 'disconnect' },
    { group = 1, workers = 1, concurrency = 5, max_seconds = 4 })
  t.eq(samples[1].episode.reason, 'max_seconds', 'a hanging episode ends at agent.max_seconds; its worker goes on')
  t.eq(samples[2].episode.reason, 'done')
  t.eq(samples[2].episode.reward, nil)
  t.eq(samples[3].episode.reason, 'agent_error')
  t.truthy(samples[3].episode.error:find('the tool broke', 1, true), samples[3].episode.error)
  t.eq(samples[4].episode.reason, 'done')
  t.eq(#(samples[4].pieces or {}), 1, 'rewritten history: a new piece')
  t.eq(samples[5].episode.reason, 'done', 'a dropped request does not end the episode')
  t.eq(stats.agent_failures, 0)
  -- a worker that dies in its first episode: that episode fails, a new worker plays the rest
  local died, dstats = run({ 'die', '', '', '' }, { group = 1, workers = 1, concurrency = 1 })
  t.eq(died[1].episode.reason, 'agent_error')
  t.truthy(died[1].episode.error:find('its worker exited (status 3)', 1, true), died[1].episode.error)
  for i = 2, 4 do t.eq(died[i].episode.reason, 'done', tostring(died[i].episode.error)) end
  t.eq(dstats.agent_failures, 1)
  -- workers that exit at once: replaced agent.workers + 3 times, then the episodes fail
  local dead, xstats = run({ '', '' }, { group = 1, workers = 2, command = 'exit 7' })
  for i = 1, 2 do
    t.eq(dead[i].episode.reason, 'agent_error')
    t.truthy(dead[i].episode.error:find('keep failing: a worker exited with status 7', 1, true), dead[i].episode.error)
  end
  -- (past agent.workers + 3 = 5: 6, or 7 when the last two die in the same poll)
  t.truthy(xstats.agent_failures == 6 or xstats.agent_failures == 7, 'failures: ' .. xstats.agent_failures)
end)

t.test('the server in training mode: unknown episodes and bad rewards refused, others served as always', function()
  local dir = os.tmpname()
  os.remove(dir)
  fs.mkdirs(dir)
  fs.write(dir .. '/probe.sh', [[
u=$OPENAI_BASE_URL
c() { curl -s -o /dev/null -w '%{http_code} ' -H "Authorization: Bearer $1" -H 'Content-Type: application/json' -d "$2" "$u/$3"; }
c nobody '{"prompt": [1, 5], "max_tokens": 2}' completions
c $OPENAI_API_KEY '{"prompt": [1, 5], "max_tokens": 2, "n": 2}' completions
c $OPENAI_API_KEY '{"reward": "much"}' episodes/reward
c $OPENAI_API_KEY '{"episode_id": "ep-nope", "reward": 1}' episodes/reward
c $OPENAI_API_KEY '{"prompt": [1, 5], "max_tokens": 2}' completions
c $OPENAI_API_KEY '{"reward": 2.5}' episodes/reward
c $OPENAI_API_KEY '{}' episodes/next
c $OPENAI_API_KEY '{"error": 5}' episodes/done
c $OPENAI_API_KEY '{}' episodes/done
c $OPENAI_API_KEY '{"prompt": [1, 5], "max_tokens": 2}' completions
curl -s -o /dev/null -w '%{http_code}' -d '{"prompt": [1, 5], "max_tokens": 2}' -H 'Content-Type: application/json' "$u/completions"
]])
  if not require('moonrl.io.fs').exists('/usr/bin/curl') then return print('  (skipped: no curl)') end
  local samples = run({ '' }, { group = 1, command = 'sh ' .. dir .. '/probe.sh > ' .. dir .. '/codes' })
  t.eq(fs.read(dir .. '/codes'), '404 400 400 404 200 200 404 400 200 404 200',
    'unknown episode, n > 1, a reward not a number, an unknown episode\'s reward, then served; next without workers, '
    .. 'an error not a string, done, then its episode unknown; no episode: served')
  t.eq(samples[1].episode.turns, 1, 'only the request of its episode recorded')
  t.eq(samples[1].episode.reward, 2.5)
  fs.remove(dir)
end)

t.test('grpo on agents\' episodes: agent.command, the env/ metrics, the held-out episodes', function()
  local U = dofile('tests/recipes/util.lua')
  local dir = U.tmpdir('agents')
  local mdir = U.save_model(dir .. '/model', model, TOK)
  local data = {}
  for i, r in ipairs(records({ '', '', '', '', '', '' })) do data[i] = { prompt = r.prompt, answer = r.answer } end
  U.write_jsonl(dir .. '/data.jsonl', data)
  local out = U.run_recipe('recipes/grpo.lua', { 'model.dir=' .. mdir, 'data.path=' .. dir .. '/data.jsonl',
    'data.chat=false', 'reward=exact', 'agent.command=' .. AGENT, 'grpo.steps=2', 'grpo.prompts=2', 'grpo.samples=3',
    'grpo.max_tokens=4', 'train.lr=1e-2', 'eval.every=2', 'eval.data=' .. dir .. '/data.jsonl', 'eval.prompts=2',
    'run.dir=' .. dir .. '/run' })
  local recs = U.records(out.dir)
  t.eq(#recs, 2)
  for _, r in ipairs(recs) do
    t.eq(r['env/episodes'], 6)
    t.eq(r['env/turns'], 2)
    t.eq(r['env/ended/done'], 6)
    t.eq(r['env/agent_failures'], 0)
    t.truthy(r['mismatch/max_abs'] < 1e-4, 'engine vs trainer: ' .. r['mismatch/max_abs'])
  end
  t.eq(recs[2]['eval/turns'], 2, 'the held-out episodes played by the agent')
  fs.remove(dir)
end)

t.done()
