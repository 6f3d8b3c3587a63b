-- moonrl.train.agents: episodes played by agent programs in any language (agent.command), against
-- the policy being trained. The rollout starts an OpenAI-compatible server in training mode on the
-- process's own engine (moonrl.serve.server, a free port on 127.0.0.1) and runs the command once
-- an episode, agent.concurrency at a time, each with its endpoint and its episode in the
-- environment:
--
--   OPENAI_BASE_URL=http://127.0.0.1:PORT/v1  OPENAI_API_KEY=<episode id>  (what the openai client reads)
--   MOONRL_EPISODE_ID=<episode id>  MOONRL_RECORD=<the record as JSON: prompt, answer, meta, and
--     prompt_ids: the prompt as the recipe tokenized it (with data.chat, through the template)>
--   MOONRL_MODEL=<the served model's name>
--
-- Every completion the agent asks for under its episode id (the API key does it) is sampled by
-- the engine with the recipe's temperature and top-p/k, at most <section>.max_tokens, from a
-- random stream of the episode's own, and recorded with its exact prompt and completion token ids,
-- log-probs and weight versions. The agent may report the episode's reward (POST
-- /v1/episodes/reward {"reward": x}); without one the config's reward judges the last
-- completion's text.
--
-- An episode's sample is its turns merged: a turn whose prompt extends the tokens so far (the
-- previous prompt and completion) continues the sample, the tokens between under a loss mask of
-- 0; one that does not (the agent rewrote its history) starts a new piece, and the episode trains
-- as its pieces (s.pieces, as an environment's split: moonrl.train.episodes). An agent that
-- exits with an error, is killed at agent.max_seconds, or asks for nothing ends its episode as a
-- failure (the reward's on_error decides: its group dropped by default), counted; the run goes on.
-- An agent may end its episode before it exits (POST /v1/episodes/done).
--
-- Workers (agent.workers=N > 0): N processes of the command play all the episodes, so that an
-- interpreter's start (a second of CPU for Python with `openai`) is paid N times a rollout, not
-- once an episode. A worker has OPENAI_BASE_URL, MOONRL_MODEL, OPENAI_API_KEY and
-- MOONRL_WORKER_ID (its own id) and MOONRL_AGENT_CONCURRENCY (the episodes it should play at
-- once); it asks for an episode with POST /v1/episodes/next under its key ({"episode_id",
-- "record"}; {"episode_id": null} once none is left: then it exits), names the episode in its
-- requests (`user` or `metadata.episode_id`), and ends it with POST /v1/episodes/done
-- {"episode_id", "reward"?, "error"?}. agent.concurrency bounds the episodes in flight (a
-- /next is held until one ends); agent.max_seconds is each episode's time from its hand-out.
--
--   local samples, stats = agents.run { engine, tok, tpl, records, group, sampling, step, seed,
--     command = 'python3 agent.py', concurrency = 16, workers = 0, max_seconds = 300, model_name = 'policy' }
-- samples and stats as moonrl.train.episodes.run's (stats.reasons: done, agent_error, max_seconds;
-- stats.agent_failures: agent processes that failed).
local moonrl = require('moonrl')
local json = require('moonrl.io.json')
local proc = require('moonrl.io.proc')
local server_mod = require('moonrl.serve.server')

local M = {}

local function add(e, ids, mask_value, lps)
  for k, id in ipairs(ids) do
    e.ids[#e.ids + 1], e.mask[#e.mask + 1], e.lps[#e.lps + 1] = id, mask_value, lps and lps[k] or 0
  end
end

-- Whether list starts with prefix (both Lua lists).
local function extends(list, prefix)
  if #list < #prefix then return false end
  for k = 1, #prefix do if list[k] ~= prefix[k] then return false end end
  return true
end

-- An episode's recorded turns as its sample and pieces (see the top).
local function merge(turns)
  local pieces, cur, splits = {}, nil, 0
  for _, t in ipairs(turns) do
    local so_far = cur and #cur.prompt_ids + #cur.ids
    if cur and extends(t.prompt_ids, cur.prompt_ids) and (function()
      for k = 1, #cur.ids do if t.prompt_ids[#cur.prompt_ids + k] ~= cur.ids[k] then return false end end
      return true end)() then
      local between = {}
      for k = so_far + 1, #t.prompt_ids do between[#between + 1] = t.prompt_ids[k] end
      add(cur, between, 0)
    else
      if cur then pieces[#pieces + 1] = cur; splits = splits + 1 end
      cur = { prompt_ids = t.prompt_ids, ids = {}, mask = {}, lps = {}, version = t.version }
    end
    local first = #cur.ids + 1
    add(cur, t.ids, 1, t.logprobs)
    cur.turn_ends = cur.turn_ends or {}
    cur.turn_ends[#cur.turn_ends + 1] = #cur.ids
    if t.version and cur.version and t.version ~= cur.version then
      cur.switches = cur.switches or {}
      cur.switches[#cur.switches + 1] = { first, t.version }
    end
    for _, s in ipairs(t.version_switches or {}) do
      cur.switches = cur.switches or {}
      cur.switches[#cur.switches + 1] = { first + s[1] - 1, s[2] }
    end
  end
  return cur, pieces, splits
end
M.merge = merge

local function record_json(rec)
  return json.object({ 'prompt', rec.prompt or json.null, 'answer', rec.answer or json.null, 'meta', rec.meta or json.null,
    'prompt_ids', rec.prompt_ids and json.array(rec.prompt_ids) or json.null })
end

-- The stderr's last line, for an error message.
local function last_line(r) return ((r.stderr or ''):match('([^\n]+)\n?$') or ''):sub(1, 300) end

local function exit_text(r)
  return r.signal ~= 0 and ('signal ' .. r.signal) or ('status ' .. tostring(r.exit_status))
end

function M.run(o)
  local engine, group, sampling = o.engine, o.group or 1, o.sampling or {}
  local concurrency, max_seconds, workers = o.concurrency or 16, o.max_seconds or 300, o.workers or 0
  local now = moonrl.now
  local t_start = now()
  if engine.streaming then error('agent.command: agents do not run in an engine stream (async.stream)', 0) end
  if engine:running() and engine.on_busy then engine.on_busy() end
  engine:reset()

  local E, by_id, queue, in_flight = {}, {}, {}, 0
  for i, rec in ipairs(o.records) do
    for j = 0, group - 1 do
      local id = string.format('ep-%d-%d-%d-%x', o.step or 0, rec.prompt_index or (i - 1), j, math.random(0, 0xffffff))
      local e = { id = id, rec = rec, i = i, j = j, turns = {}, reward = nil, state = 'waiting' }
      E[#E + 1], by_id[id], queue[#queue + 1] = e, e, e
    end
  end
  local function claim(e, worker)
    for k, q in ipairs(queue) do if q == e then table.remove(queue, k) break end end
    e.state, e.t0, e.worker, in_flight = 'running', now(), worker, in_flight + 1
  end
  local function finish(e, reason, err)
    if e.state ~= 'running' then return end
    e.state, e.reason, e.error, e.seconds, in_flight = 'done', reason, err, now() - e.t0, in_flight - 1
  end
  local record = {
    known = function(id) local e = by_id[id]; return e ~= nil and e.state == 'running' end,
    sampling = function(id)
      local e = by_id[id]
      return { temperature = sampling.temperature, top_p = sampling.top_p, top_k = sampling.top_k,
        max_tokens = sampling.max_tokens, seed = o.seed or 0, step = o.step or 0,
        prompt_index = e.rec.prompt_index or (e.i - 1), first_sample = #e.turns * group + e.j }
    end,
    turn = function(id, t) local e = by_id[id]; e.turns[#e.turns + 1] = t end,
    reward = function(id, r) by_id[id].reward = r end,
    done = function(id, r, err)
      local e = by_id[id]
      if r ~= nil then e.reward = r end
      if err then finish(e, 'agent_error', 'the agent failed its episode: ' .. err)
      elseif #e.turns == 0 then finish(e, 'agent_error', 'the agent asked for no completion')
      else finish(e, 'done') end
    end,
  }
  if workers > 0 then
    -- (hand_out calls next, answers, then claim: nothing runs between them)
    record.next = function()
      if #queue == 0 then return false end
      if in_flight >= concurrency then return nil end
      return { id = queue[1].id, record = record_json(queue[1].rec) }
    end
    record.claim = function(id, worker) claim(by_id[id], worker) end
  end
  local model_len = engine.model.config.max_position_embeddings or 4096
  local srv = server_mod.new({ engine = engine, tokenizer = o.tok, template = o.tpl,
    template_error = 'the model has no chat template (the completions endpoint takes text)',
    model_name = o.model_name or 'policy', model_path = o.model_name or 'policy', max_model_len = model_len,
    eos_ids = sampling.eos_ids, seed = o.seed, port = 0, host = '127.0.0.1', record = record,
    request_timeout = max_seconds, default_max_tokens = sampling.max_tokens })
  local base = string.format('http://127.0.0.1:%d/v1', srv.port)
  local common = { '/usr/bin/env', 'OPENAI_BASE_URL=' .. base, 'MOONRL_MODEL=' .. (o.model_name or 'policy') }
  local function spawn(vars, timeout)
    local argv = {}
    for _, x in ipairs(common) do argv[#argv + 1] = x end
    for _, x in ipairs(vars) do argv[#argv + 1] = x end
    for _, x in ipairs({ '/bin/sh', '-c', o.command }) do argv[#argv + 1] = x end
    return proc.spawn(argv, { timeout = timeout, max_output = 2 ^ 20 })
  end

  local running, procs, failures, started, last_failure = {}, {}, 0, 0, nil
  local function serve_once() srv:turn(2) end
  -- One process an episode: started agent.concurrency at a time, its exit the episode's end.
  local function step_processes()
    while #queue > 0 and #running < concurrency do
      local e = queue[1]
      claim(e)
      e.proc = spawn({ 'OPENAI_API_KEY=' .. e.id, 'MOONRL_EPISODE_ID=' .. e.id,
        'MOONRL_RECORD=' .. json.encode(record_json(e.rec)) }, max_seconds)
      running[#running + 1] = e
    end
    serve_once()
    local still = {}
    for _, e in ipairs(running) do
      if e.proc:done() then
        local r = e.proc:wait()
        e.proc = nil
        if not r.ok then failures = failures + 1 end
        if r.timed_out then finish(e, 'max_seconds', string.format('the agent ran past agent.max_seconds (%g s)', max_seconds))
        elseif not r.ok then
          finish(e, 'agent_error', string.format('the agent exited with %s: %s', exit_text(r), last_line(r)))
        elseif #e.turns == 0 then finish(e, 'agent_error', 'the agent asked for no completion')
        else finish(e, 'done') end
      else
        still[#still + 1] = e
      end
    end
    running = still
  end
  -- Workers (agent.workers): each plays the episodes it asks for (/v1/episodes/next) and ends them
  -- (/v1/episodes/done); one that exits while episodes wait is replaced, up to agent.workers + 3
  -- failures (exits with an error or having taken no episode), then the waiting episodes fail.
  local function start_worker()
    started = started + 1
    local wid = string.format('wk-%d-%d-%x', o.step or 0, started, math.random(0, 0xffffff))
    procs[#procs + 1] = { id = wid, p = spawn({ 'OPENAI_API_KEY=' .. wid, 'MOONRL_WORKER_ID=' .. wid,
      'MOONRL_AGENT_CONCURRENCY=' .. math.ceil(concurrency / workers) }, 0) }
  end
  local function step_workers()
    serve_once()
    local t = now()
    for _, e in ipairs(E) do
      if e.state == 'running' and t - e.t0 > max_seconds then
        finish(e, 'max_seconds', string.format('the episode ran past agent.max_seconds (%g s)', max_seconds))
      end
    end
    local still = {}
    for _, w in ipairs(procs) do
      if w.p:done() then
        local r = w.p:wait()
        local taken, open = 0, 0
        for _, e in ipairs(E) do
          if e.worker == w.id then
            taken = taken + 1
            if e.state == 'running' then
              open = open + 1
              finish(e, 'agent_error', string.format('its worker exited (%s) with the episode unfinished: %s', exit_text(r), last_line(r)))
            end
          end
        end
        if not r.ok or taken == 0 or open > 0 then
          failures = failures + 1
          last_failure = string.format('a worker exited with %s%s: %s', exit_text(r), taken == 0 and ', having taken no episode' or '',
            last_line(r))
        end
      else
        still[#still + 1] = w
      end
    end
    procs = still
    if #queue > 0 and failures > workers + 3 then
      for _, e in ipairs(queue) do
        e.state, e.t0 = 'running', now()
        in_flight = in_flight + 1
        finish(e, 'agent_error', 'the agent workers keep failing: ' .. (last_failure or ''))
      end
      queue = {}
    end
    while #procs < math.min(workers, #queue) do start_worker() end
  end

  local ok, err = pcall(function()
    while #queue > 0 or in_flight > 0 or #running > 0 do
      moonrl.check_stop()
      if workers > 0 then step_workers() else step_processes() end
    end
    -- the workers asked for more get {"episode_id": null}; given a second to exit
    local t_end = now() + 1
    while #procs > 0 and now() < t_end do
      serve_once()
      local still = {}
      for _, w in ipairs(procs) do if w.p:done() then w.p:wait() else still[#still + 1] = w end end
      procs = still
    end
  end)
  for _, e in ipairs(running) do if e.proc then e.proc:kill() end end
  for _, w in ipairs(procs) do w.p:kill() end
  srv:abort_all()
  if engine:num_unfinished() > 0 then engine:step() end
  srv:release_finished()
  srv:close()
  if not ok then error(err, 0) end

  local stats = { episodes = 0, turns = 0, tool_calls = {}, tool_errors = {}, env_seconds = 0, tool_seconds = 0,
    extension_failures = 0, splits = 0, env_tokens = 0, model_tokens = 0,
    reasons = { done = 0, agent_error = 0, max_seconds = 0 }, agent_failures = failures }
  local samples = {}
  for _, e in ipairs(E) do
    stats.episodes = stats.episodes + 1
    stats.turns = stats.turns + #e.turns
    stats.env_seconds = stats.env_seconds + (e.seconds or 0)
    stats.reasons[e.reason] = stats.reasons[e.reason] + 1
    local rec = e.rec
    local cur, pieces, splits = merge(e.turns)
    cur = cur or { prompt_ids = rec.prompt_ids or {}, ids = {}, mask = {}, lps = {} }
    stats.extension_failures, stats.splits = stats.extension_failures + splits, stats.splits + splits
    for _, p in ipairs(pieces) do p.loss_mask, p.rollout_logprobs, p.version_switches = p.mask, p.lps, p.switches end
    for _, p in ipairs({ cur, unpack(pieces) }) do
      for _, m in ipairs(p.mask) do
        if m == 1 then stats.model_tokens = stats.model_tokens + 1 else stats.env_tokens = stats.env_tokens + 1 end
      end
    end
    local last = e.turns[#e.turns]
    local failed = e.reason ~= 'done'
    local s = { prompt_ids = cur.prompt_ids, ids = cur.ids, loss_mask = cur.mask, rollout_logprobs = cur.lps,
      response = last and last.text or '', finish_reason = last and last.finish_reason or 'stop', prompt = rec.prompt,
      answer = rec.answer, meta = rec.meta, group = e.i, record = rec, version = cur.version, version_switches = cur.switches,
      episode = { turns = #e.turns, reason = e.reason, reward = e.reward, error = e.error, failed = failed or nil,
        turn_ends = cur.turn_ends,
        extension_failures = splits } }
    if #pieces > 0 then s.pieces = pieces end
    samples[#samples + 1] = s
  end
  stats.seconds = now() - t_start
  return samples, stats
end

return M
