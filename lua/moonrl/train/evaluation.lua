-- moonrl.train.evaluation: held-out accuracy, the same for every recipe (the RL loop's evaluate stage,
-- SFT, DPO): greedy answers (temperature 0) to held-out prompts from the engine, judged by the
-- run's reward (accuracy: the share scoring >= 1; reward: the mean score).
--
--   local E = require('moonrl.train.evaluation')
--   cfg = moonrl.config { ..., eval = E.config(), reward = sections.reward_config('exact'), engine = sections.engine_config() }
--   E.check(cfg)                                   -- usage errors, before any work
--   local S = session.start(cfg, { ..., engine = E.wanted(cfg) })
--   local held = E.records(S, cfg)                 -- eval.data, eval.task or data.task's split
--   if E.due(cfg, step) then m.eval = S:phase('eval', E.accuracy, S, cfg, held, { eos_ids = ... }) end
--
-- The set: eval.data (JSONL with the data section's fields: the prompt, and the reference answer
-- the judge compares with: data.answer in RL, data.response in SFT, data.chosen in DPO),
-- eval.task's held-out split, data.task's when neither is given, or a recipe's own (SFT's
-- held-out split of its data). eval.prompts keeps the first N (0: all). Under several ranks each
-- answers its share and the counts are summed, so every rank returns the whole set's figures.
local moonrl = require('moonrl')
local config = require('moonrl.config')
local batch = require('moonrl.batch')
local prompts = require('moonrl.train.prompts')
local sections = require('moonrl.train.sections')
local session = require('moonrl.train.session')


local M = {}

-- Usage errors before any work: a bad task name, eval.every with no held-out
-- set (o.own: the recipe has one of its own).
function M.check(cfg, o)
  local e, d = cfg.eval, cfg.data or {}
  if not e then return end
  local tasks = require('moonrl.tasks')
  if e.task ~= nil then tasks.check(e.task, 'eval.task') end
  if e.data ~= nil and not require('moonrl.io.fs').exists(e.data) then
    moonrl.usage_error(string.format("config key 'eval.data': %s: no such file", e.data))
  end
  if e.every > 0 and not e.data and not e.task and not d.task and not (o and o.own) then
    moonrl.usage_error('eval.every: no held-out set: pass eval.data=FILE.jsonl or eval.task=NAME (or train on data.task)')
  end
end

-- Whether the run evaluates at all (the engine is made only then, by recipes that need none otherwise).
M.wanted = sections.eval_wanted

-- Whether step is an evaluation step.
function M.due(cfg, step)
  local e = cfg.eval
  return e ~= nil and e.every > 0 and step % e.every == 0
end

-- Whether lm-evaluation-harness runs at this step: eval.harness set, every eval.harness_every
-- steps (0: eval.every).
function M.harness_due(cfg, step)
  local e = cfg.eval
  if not (e and e.harness) then return false end
  local every = e.harness_every > 0 and e.harness_every or e.every
  return every > 0 and step % every == 0
end

-- lm-evaluation-harness's tasks (eval.harness) run against the policy as it is now: its
-- local-completions model talks to an OpenAI-compatible server on this process's engine
-- (moonrl.serve.server, a free port of 127.0.0.1; echo for log-likelihoods), or to the first
-- server of an engine elsewhere, synced first. The scores come back as { task = { metric = x } }
-- (each results file's "<metric>,<filter>" without ",none"; no stderr). A harness that fails is an
-- event and a warning; the run goes on. out_dir: where lm_eval writes.
function M.harness(S, cfg, out_dir)
  local e = cfg.eval
  local json = require('moonrl.io.json')
  local fs = require('moonrl.io.fs')
  local proc = require('moonrl.io.proc')
  local cmd = e.harness_command
  if not cmd then
    local venv = (moonrl.home or '.') .. '/.venv-interop/bin/lm_eval'
    cmd = fs.exists(venv) and venv or 'lm_eval'
  end
  local engine, srv, base = S.engine, nil, nil
  if engine.remote then
    engine:sync_current()
    base = engine.servers[1].url
  else
    if engine:running() and engine.on_busy then engine.on_busy() end
    engine:reset() -- (cached prefixes of other weights)
    srv = require('moonrl.serve.server').new({ engine = engine, tokenizer = S.tok, template = S.tpl,
      model_name = 'policy', model_path = 'policy', max_model_len = S.policy.config.max_position_embeddings,
      port = 0, host = '127.0.0.1', request_timeout = e.harness_timeout })
    base = string.format('http://127.0.0.1:%d', srv.port)
  end
  local name = engine.remote and engine.name or 'policy'
  fs.mkdirs(out_dir)
  local argv = { '/bin/sh', '-c', string.format('exec %s --model local-completions --model_args ' ..
    'base_url=%s/v1/completions,model=%s,tokenizer=%s,tokenized_requests=True,max_length=%d,num_concurrent=8,max_retries=1' ..
    ' --tasks %s --output_path %s%s%s', cmd, base, name, S.tok_dir, S.policy.config.max_position_embeddings, e.harness,
    out_dir, e.harness_include and (' --include_path ' .. e.harness_include) or '',
    e.harness_limit > 0 and (' --limit ' .. e.harness_limit) or '') }
  local p = proc.spawn(argv, { timeout = e.harness_timeout, max_output = 2 ^ 20 })
  local ok, err = pcall(function()
    while not p:done() do
      moonrl.check_stop()
      if srv then
        srv:turn(20)
      else
        moonrl.sleep(0.05)
      end
    end
  end)
  if not ok then p:kill() end
  if srv then
    srv:abort_all()
    if engine:num_unfinished() > 0 then engine:step() end
    srv:release_finished()
    srv:close()
    engine:reset()
  end
  if not ok then error(err, 0) end
  local r = p:wait()
  local results
  for _, f in ipairs(fs.is_dir(out_dir) and fs.list(out_dir) or {}) do -- (lm_eval writes <out>/<model>/results_*.json)
    local sub = out_dir .. '/' .. f
    for _, g in ipairs(fs.is_dir(sub) and fs.list(sub) or {}) do
      if g:match('^results_.*%.json$') then results = sub .. '/' .. g end
    end
  end
  if not r.ok or not results then
    local why = string.format('lm_eval %s: %s', r.timed_out and 'ran past eval.harness_timeout' or
      ('exited with status ' .. tostring(r.exit_status)), ((r.stderr or '') .. (r.stdout or '')):sub(-800))
    S:event('harness_error', { message = why })
    return nil
  end
  local doc = json.decode(fs.read(results), results)
  local out = {}
  for task, metrics in pairs(doc.results or {}) do
    local t = {}
    for k, v in pairs(metrics) do
      local metric = k:match('^(.-),none$') or k
      if type(v) == 'number' and not metric:find('stderr') then t[metric] = v end
    end
    out[task] = t
  end
  return out
end

-- The held-out records { prompt, answer, meta, prompt_ids, prompt_index, ... }: eval.data, eval.task,
-- data.task's held-out split, else own (a list of { prompt, answer }; nil: none). o.answer: the
-- data section's key of eval.data's reference answer (default data.answer or 'answer').
function M.records(S, cfg, own, o)
  local e, d = cfg.eval, cfg.data or {}
  local list = {}
  if e.data then
    local key = o and o.answer or d.answer or 'answer'
    local view = require('moonrl.data').jsonl(e.data, { fields = { prompt = d.prompt or 'prompt', answer = key },
      optional = { answer = true }, max_record_bytes = d.max_record_bytes })
    local n = e.prompts > 0 and math.min(e.prompts, view:len()) or view:len() -- (only what is used is read)
    for i = 1, n do list[i] = view:get(i) end
  elseif e.task or d.task then
    local t = require('moonrl.tasks').load(e.task or d.task, cfg.run.seed)
    for i, r in ipairs(t.heldout) do list[i] = { prompt = r.prompt, answer = r.answer, meta = r.meta } end
  else
    list = own or {}
  end
  local n = e.prompts > 0 and math.min(e.prompts, #list) or #list
  local out = {}
  for i = 1, n do -- (a copy of each record: a reward may read its other fields, s.record)
    local r = {}
    for k, v in pairs(list[i]) do r[k] = v end
    r.prompt_index, r.prompt_ids = i - 1, r.prompt_ids or prompts.prompt_ids(S.tok, S.tpl, r.prompt, d.system)
    out[i] = r
  end
  return out
end

-- The answer budget when neither eval.max_tokens nor the recipe gives one: twice the longest
-- reference answer's tokens (so that a right answer always fits, and a rambling one is cut).
function M.answer_budget(S, records)
  local longest = 1
  for _, r in ipairs(records) do
    if r.answer then longest = math.max(longest, #prompts.completion_ids(S.tok, r.answer)) end
  end
  return 2 * longest
end

-- Greedy answers to records (this rank's share), judged by cfg.reward: { accuracy, reward,
-- prompts } over the whole set. o.max_tokens: the recipe's budget (eval.max_tokens > 0 wins;
-- neither: M.answer_budget); o.eos_ids: the ids that end an answer (default the policy's);
-- o.episodes(records, sampling) -> samples: greedy multi-turn episodes in place of single answers
-- (env.name: scored by their environments' rewards where given), and turns (their mean) too.
function M.accuracy(S, cfg, records, o)
  o = o or {}
  local mine = S.world.size > 1 and S:shard(records) or records
  local right, sum, turns = 0, 0, 0
  if #mine > 0 then
    local max_tokens = cfg.eval.max_tokens > 0 and cfg.eval.max_tokens or o.max_tokens or M.answer_budget(S, records)
    local sampling = { temperature = 0, max_tokens = max_tokens, eos_ids = o.eos_ids or prompts.eos_ids(S.tok, S.policy),
      tokenizer = S.tok }
    local samples
    if o.episodes then
      samples = o.episodes(mine, sampling)
    else
      samples = batch.flatten(mine, S.engine:generate(batch.requests(mine, 1), sampling))
    end
    local scores = M.scores(cfg, samples)
    for i, s in ipairs(samples) do
      sum = sum + scores[i]
      if scores[i] >= 1 then right = right + 1 end
      turns = turns + (s.episode and s.episode.turns or 0)
    end
  end
  local t = { right = right, sum = sum, turns = turns }
  if S.world.size > 1 then t = S:sum(t) end
  local n = math.max(#records, 1)
  return { accuracy = t.right / n, reward = t.sum / n, prompts = #records, turns = o.episodes and t.turns / n or nil }
end

-- The held-out samples' scores (a Lua list): an episode's reward from its environment where it got
-- one (0 where the episode failed), else the reward function's (0 where it fails).
function M.scores(cfg, samples)
  local out, need, sub = {}, {}, {}
  for i, s in ipairs(samples) do
    local ep = s.episode
    if ep and ep.failed then out[i] = 0
    elseif ep and ep.reward ~= nil then out[i] = ep.reward
    else need[#need + 1] = i; sub[#sub + 1] = s end
  end
  if #sub > 0 then
    local sc = require('moonrl.rewards').score_batch(cfg.reward.name, sub, nil,
      { on_error = 'zero', timeout = cfg.reward.timeout, workers = cfg.reward.workers })
    for k, i in ipairs(need) do out[i] = sc[k - 1] end
  end
  return out
end

return M
