-- moonrl.train.episodes: multi-turn episodes on the engine (env=NAME; moonrl.env has the
-- environments' interface). An episode is one growing token sequence:
--
--   prompt (the chat template's rendering of reset's messages, generation prompt included)
--   model turn 1 (the tokens as sampled: loss mask 1, the engine's log-probs, weight versions)
--   observation 1 (the template's rendering of step's messages after the turn: mask 0)
--   model turn 2 ...
--
-- Every turn is one request whose prompt is the whole sequence so far, on an engine that is
-- never reset during the rollout: the K/V of the earlier turns comes from its prefix cache
-- (engine.h), so a turn computes only the observation's tokens and its own. The model's tokens
-- are never decoded and encoded again (what veRL found breaks PPO): the observation's tokens are
-- the template's text after the turn (the end of the assistant's message the model did not
-- write, then the observation's messages and the next generation prompt), encoded alone. That
-- text is read off a fixed stand-in conversation rendered with the observations, after the
-- stand-in answer's content, so a template that rewrites earlier turns (Qwen3's strip of <think>)
-- does not change it.
--
-- Extension: after each observation the whole conversation is rendered again, as a server that
-- re-applies the template to the messages would; when that text is not the decoded sequence
-- (the thinking strip, a template that rewrites history) it is an extension failure, counted, and
-- env.extension says what follows: 'keep' (the default) goes on appending to the exact tokens;
-- 'split' closes the sample there and starts a new one from the re-rendered prompt (the episode
-- then trains as several samples that share its advantage).
--
-- Limits (env.*): max_turns, max_tokens (the episode's tokens after its first prompt), max_seconds
-- (the episode's clock), max_step_seconds (an environment step that pauses past it), and the
-- model's positions; the episode's end reason is one of done, max_turns, max_tokens, max_seconds,
-- step_timeout, env_error (a turn cut by the per-turn max_tokens, the recipe's, goes to the
-- environment with turn.finish_reason = 'length'). Environment steps run in
-- coroutines (moonrl.env.pause), env.concurrency at a time, while the engine decodes the other
-- episodes' turns.
--
--   local samples, stats = episodes.run {
--     engine = S.engine, tok = S.tok, tpl = S.tpl (nil: 'plain', the messages' contents joined),
--     env = env_def, records = records, group = 8, sampling = self.sampling, step = seed_step,
--     seed = cfg.run.seed, limits = { max_turns = 8, max_tokens = 512, max_seconds = 0, max_step_seconds = 30 },
--     concurrency = 64, extension = 'keep', tools = { ... } (default env_def.tools), tool_format = 'auto',
--     system = '', template_vars = { enable_thinking = false }, span = function(name, t0, dt) end }
--
-- The samples (one per episode, records x group in order; with 'split', s.pieces before it):
-- prompt_ids (shared by the group's episodes whose prompts are the same), ids, loss_mask,
-- rollout_logprobs (0 under the mask's zeros), version and version_switches, response (the last
-- turn's text, what a reward judges), finish_reason (the last turn's), messages (the conversation:
-- data.system, reset's, then the turns and observations, the last observation kept only when a
-- turn followed it), the record's fields, and
-- s.episode = { turns, reason, reward (the steps' sum, or nil: none given), turn_rewards (each model
-- turn's step reward, 0 where none), turn_ends (where each turn of the sample ends in ids), error, failed (true on env_error: scored as a failing reward),
-- tool_calls, tool_errors, extension_failures }. stats: the batch's counts (M.metrics).
local moonrl = require('moonrl')
local ffi = require('ffi')
local envs = require('moonrl.env')
local tools = require('moonrl.tools')
local rng = require('moonrl.rng')

local M = {}

local REASONS = { 'done', 'max_turns', 'max_tokens', 'max_seconds', 'step_timeout', 'env_error' }
M.REASONS = REASONS

-- ---- rendering ---------------------------------------------------------------------------------

local STAND_IN = { { role = 'user', content = 'U' }, { role = 'assistant', content = 'A\1' } }

local function copy_list(t)
  local out = {}
  for i, v in ipairs(t) do out[i] = v end
  return out
end

-- How a conversation becomes text: the chat template (with the tools' declarations and any extra
-- variables), or 'plain' (the contents one after another).
local function renderer(o)
  local tpl = o.tpl
  if not tpl then
    return function(messages)
      local parts = {}
      for i, m in ipairs(messages) do parts[i] = m.content end
      return table.concat(parts)
    end, true
  end
  return function(messages, add_gen)
    local vars = {}
    for k, v in pairs(o.template_vars or {}) do vars[k] = v end
    vars.add_generation_prompt = add_gen
    if o.tool_schemas and #o.tool_schemas > 0 then vars.tools = o.tool_schemas end
    return tpl:render(messages, vars)
  end, false
end

-- What the template writes after an assistant's content when observations follow it: the end of
-- the message (its end token, a separator), the observations, the next generation prompt. Read off
-- the stand-in conversation rendered with them, after the stand-in answer's content (the messages
-- before it may render otherwise once a new user message follows: Qwen3's drops think blocks).
-- (plain: the observations' contents; end_text: the text of the end token the model wrote, '' for
-- none, which the template's text goes on after)
local function observation_text(render, plain, obs, end_text)
  if plain then
    local parts = {}
    for i, m in ipairs(obs) do parts[i] = m.content end
    return table.concat(parts)
  end
  local msgs = copy_list(STAND_IN)
  for _, m in ipairs(obs) do msgs[#msgs + 1] = m end
  local full = render(msgs, true)
  local at = full:find('A\1', 1, true)
  if not at then error('the chat template does not render an assistant message\'s content as it is', 0) end
  local text = full:sub(at + 2)
  if end_text ~= '' and text:sub(1, #end_text) == end_text then text = text:sub(#end_text + 1) end
  return text
end

-- ---- checks of what an environment returns --------------------------------------------------

local function check_messages(v, what)
  if type(v) ~= 'table' then error(string.format('%s returned %s, not a list of messages', what, type(v)), 0) end
  for i, m in ipairs(v) do
    if type(m) ~= 'table' or type(m.role) ~= 'string' or type(m.content) ~= 'string' then
      error(string.format('%s: message %d is not { role = text, content = text }', what, i), 0)
    end
  end
  return v
end

-- A conversation as the tokens an episode of it would have (for SFT on multi-turn transcripts: the
-- same layout the runner samples): o = { tok, tpl (nil: plain), messages (system/user/tool ...,
-- assistant turns among them), eos (the id each assistant turn ends with), tools (names: their
-- declarations to the template), template_vars }. The prompt is the messages before the first
-- assistant turn, rendered with the generation prompt; each assistant turn is its content's tokens
-- and eos (loss mask 1); the messages after it are their observation text (mask 0). Returns
-- { prompt_ids, ids, loss_mask }.
function M.transcript(o)
  local tok, msgs = o.tok, o.messages
  o.tool_schemas = o.tools and #o.tools > 0 and tools.schemas(o.tools) or nil
  local render, plain = renderer(o)
  local first = 1
  while msgs[first] and msgs[first].role ~= 'assistant' do first = first + 1 end
  if first == 1 or not msgs[first] then error('episodes.transcript: the messages need an opening and an assistant turn', 2) end
  local text = render({ unpack(msgs, 1, first - 1) }, true)
  local out = { prompt_ids = plain and tok:encode(text) or tok:encode(text, { add_special = false }), ids = {}, loss_mask = {} }
  local end_text = o.eos and tok:decode({ o.eos }, { skip_special = false }) or ''
  local function put(ids, m) for _, id in ipairs(ids) do out.ids[#out.ids + 1], out.loss_mask[#out.loss_mask + 1] = id, m end end
  local i = first
  while msgs[i] do
    put(tok:encode(msgs[i].content, { add_special = false }), 1)
    if o.eos then put({ o.eos }, 1) end
    local obs = {}
    i = i + 1
    while msgs[i] and msgs[i].role ~= 'assistant' do obs[#obs + 1] = msgs[i]; i = i + 1 end
    if #obs > 0 then put(tok:encode(observation_text(render, plain, obs, end_text), { add_special = false }), 0) end
  end
  return out
end

-- ---- the runner ------------------------------------------------------------------------------

local function add_count(t, k, n) t[k] = (t[k] or 0) + (n or 1) end

function M.run(o)
  local engine, tok, def, group = o.engine, o.tok, o.env, o.group or 1
  local limits = o.limits or {}
  local max_turns, max_tokens = limits.max_turns or 8, limits.max_tokens or 1024
  local max_seconds, max_step_seconds = limits.max_seconds or 0, limits.max_step_seconds or 0
  local positions = engine.model.config.max_position_embeddings or math.huge
  local concurrency = o.concurrency or 64
  local sampling = o.sampling or {}
  local per_turn = sampling.max_tokens or 64
  local eos = {}
  for _, id in ipairs(sampling.eos_ids or {}) do eos[id] = true end
  local tool_names = o.tools or def.tools or {}
  local known = {}
  for _, n in ipairs(tool_names) do known[n] = true end
  o.tool_schemas = #tool_names > 0 and tools.schemas(tool_names) or nil
  local render, plain = renderer(o)
  local now = moonrl.now
  local t_start = now()

  if engine.streaming then error('env: multi-turn episodes do not run in an engine stream (async.stream)', 0) end
  if engine:running() and engine.on_busy then engine.on_busy() end
  engine:reset() -- the weights may have changed since the engine last ran

  local stats = { episodes = 0, turns = 0, tool_calls = {}, tool_errors = {}, env_seconds = 0, tool_seconds = 0,
    extension_failures = 0, splits = 0, env_tokens = 0, model_tokens = 0, reasons = {} }
  for _, r in ipairs(REASONS) do stats.reasons[r] = 0 end
  -- every key present on every rank (the ranks sum these tables leaf by leaf)
  for _, n in ipairs(tool_names) do stats.tool_calls[n], stats.tool_errors[n] = 0, 0 end
  if #tool_names > 0 then stats.tool_errors.malformed = 0 end

  -- the episodes, records x group in order
  local E, group_prompts = {}, {}
  for i, rec in ipairs(o.records) do
    group_prompts[i] = {}
    for j = 0, group - 1 do
      local seed = o.seed or 0
      local ep = { record = rec, index = j, turns = 0, tools = tool_names, stats = {}, span = o.span,
        max_turns = max_turns, system = o.system,
        rng = rng.new(seed * 1000003 + (o.step or 0) * 7919 + (rec.prompt_index or (i - 1)) * 131 + j) }
      E[#E + 1] = { ep = ep, rec = rec, i = i, j = j, state = 'reset', t0 = now(), messages = {}, ids = {}, mask = {},
        lps = {}, pieces = {}, reward = nil, ext_fail = 0, turn_rewards = {}, turn_ends = {} }
    end
  end

  local queue, running = {}, {} -- environment calls waiting for a slot (env.concurrency); those started

  local function finish(e, reason)
    e.state, e.reason = 'done', reason
    add_count(stats.reasons, reason)
  end

  -- the sample the episode trains on now: its prompt and the tokens after it
  local function all_tokens(e)
    local seq = copy_list(e.prompt_ids)
    for _, t in ipairs(e.ids) do seq[#seq + 1] = t end
    return seq
  end

  local function submit(e)
    local used = #e.prompt_ids + #e.ids
    local budget = math.min(per_turn, max_tokens - e.total, positions - used)
    if budget < 1 then return finish(e, 'max_tokens') end
    e.turn_budget = budget
    e.stopped = nil
    e.req = engine:add({ prompt_ids = all_tokens(e), n = 1, max_tokens = budget, prompt_index = e.rec.prompt_index or (e.i - 1),
      first_sample = e.ep.turns * group + e.j, affinity = e }, sampling) -- (servers elsewhere: its turns on one)
    e.state = 'gen'
  end

  -- an environment call in a coroutine of its own (reset or step), queued for a slot
  local function start_env(e, fn, arg)
    local co = coroutine.create(function() return fn(e.ep, arg) end)
    envs.runner_coroutine(co)
    e.co, e.state = co, 'env'
    queue[#queue + 1] = e
  end

  local function opening(e, messages)
    local msgs = {}
    if o.system and o.system ~= '' then msgs[1] = { role = 'system', content = o.system } end
    for _, m in ipairs(messages) do msgs[#msgs + 1] = m end
    e.messages = msgs
    local text = render(msgs, true)
    local ids = plain and tok:encode(text) or tok:encode(text, { add_special = false })
    -- the group's episodes that open the same way share one prompt table (moonrl.batch packs it once)
    local shared = group_prompts[e.i]
    for _, p in ipairs(shared) do
      if #p == #ids then
        local same = true
        for k = 1, #p do if p[k] ~= ids[k] then same = false; break end end
        if same then ids = p; break end
      end
    end
    if not shared[ids] then shared[#shared + 1] = ids; shared[ids] = true end
    e.prompt_ids, e.total = ids, 0
    if #ids >= positions then return finish(e, 'max_tokens') end
    submit(e)
  end

  -- the observations after the model's turn, as tokens (mask 0); the extension check
  local function observe(e, obs)
    local last = e.ids[#e.ids] -- the model wrote the message's end token: the text goes on after it
    local end_text = last and eos[last] and tok:decode({ last }, { skip_special = false }) or ''
    local delta = tok:encode(observation_text(render, plain, obs, end_text), { add_special = false })
    if e.total + #delta >= max_tokens or #e.prompt_ids + #e.ids + #delta >= positions then
      return finish(e, 'max_tokens') -- (no room for another turn: the observation is not kept)
    end
    for _, m in ipairs(obs) do e.messages[#e.messages + 1] = m end
    for _, t in ipairs(delta) do
      e.ids[#e.ids + 1], e.mask[#e.mask + 1], e.lps[#e.lps + 1] = t, 0, 0
    end
    e.total = e.total + #delta
    stats.env_tokens = stats.env_tokens + #delta
    if not plain then
      local full = render(e.messages, true)
      local ours = tok:decode(all_tokens(e), { skip_special = false })
      if full ~= ours then
        e.ext_fail = e.ext_fail + 1
        stats.extension_failures = stats.extension_failures + 1
        if o.extension == 'split' then
          stats.splits = stats.splits + 1
          e.pieces[#e.pieces + 1] = { prompt_ids = e.prompt_ids, ids = e.ids, loss_mask = e.mask, rollout_logprobs = e.lps,
            version = e.version, version_switches = e.switches }
          -- the piece ends with the model's last turn: the observation starts the next one's prompt
          local p = e.pieces[#e.pieces]
          for _ = 1, #delta do table.remove(p.ids); table.remove(p.loss_mask); table.remove(p.rollout_logprobs) end
          e.prompt_ids, e.ids, e.mask, e.lps, e.version, e.switches = tok:encode(full, { add_special = false }), {}, {}, {}, nil, nil
          e.turn_ends = {}
        end
      end
    end
    submit(e)
  end

  -- the model's turn is done: its tokens appended, then the environment's step
  local function turn_done(e, toks, lps, n, reason)
    local first = #e.ids + 1
    for k = 0, n - 1 do
      e.ids[#e.ids + 1], e.mask[#e.mask + 1], e.lps[#e.lps + 1] = toks[k], 1, lps[k]
    end
    local v, sw = engine:versions(e.req, 0, n)
    if v then
      if e.version == nil then e.version = v
      elseif v ~= e.version and n > 0 then e.switches = e.switches or {}; e.switches[#e.switches + 1] = { first, v } end
      for _, s in ipairs(sw or {}) do e.switches = e.switches or {}; e.switches[#e.switches + 1] = { first + s[1] - 1, s[2] } end
    end
    engine:release(e.req)
    e.req = nil
    e.total = e.total + n
    e.turn_ends[#e.turn_ends + 1] = #e.ids
    stats.model_tokens = stats.model_tokens + n
    e.ep.turns = e.ep.turns + 1
    stats.turns = stats.turns + 1
    local body = {}
    for k = first, #e.ids do body[#body + 1] = e.ids[k] end
    if #body > 0 and eos[body[#body]] then body[#body] = nil end
    local text = tok:decode(body, { skip_special = false })
    e.last_text, e.finish_reason = text, reason
    e.messages[#e.messages + 1] = { role = 'assistant', content = text }
    if max_seconds > 0 and now() - e.t0 > max_seconds then return finish(e, 'max_seconds') end
    -- a turn cut by the episode's budget ends it; one cut by the turn's max_tokens goes to the
    -- environment as it is (turn.finish_reason = 'length'), the template closing the message
    if reason == 'length' and e.turn_budget < per_turn then return finish(e, 'max_tokens') end
    local calls, errors = {}, {}
    if #tool_names > 0 then calls, errors = tools.parse(text, o.tool_format or 'auto', { known = known }) end
    start_env(e, def.step, { text = text, tool_calls = calls, tool_errors = errors, finish_reason = reason, n = e.ep.turns })
  end

  -- an environment coroutine came back: paused, or with its results
  local function resumed(e, ok, a, b, c)
    if ok and a == envs.PAUSE and coroutine.status(e.co) == 'suspended' then
      if max_step_seconds > 0 and now() - e.step_t0 > max_step_seconds then
        e.co = nil -- (abandoned: what it holds is closed with the episode)
        stats.env_seconds = stats.env_seconds + (now() - e.step_t0)
        e.error = string.format('a step of the environment took more than env.max_step_seconds (%g s)', max_step_seconds)
        return finish(e, 'step_timeout')
      end
      return
    end
    e.co = nil
    local dt = now() - e.step_t0
    stats.env_seconds = stats.env_seconds + dt
    if o.span then o.span(e.prompt_ids and 'env step' or 'env reset', e.step_t0, dt) end
    if not ok then
      e.error = tostring(a):match('[^\n]*')
      return finish(e, 'env_error')
    end
    if not e.prompt_ids then -- reset's messages
      local okm, err = pcall(check_messages, a, 'reset')
      if not okm then e.error = err; return finish(e, 'env_error') end
      if #a == 0 then e.error = 'reset returned no messages'; return finish(e, 'env_error') end
      return opening(e, a)
    end
    local obs, reward, done = a, b, c
    if obs == nil then obs = {} end
    local okm, err = pcall(check_messages, obs, 'step')
    if not okm then e.error = err; return finish(e, 'env_error') end
    if reward ~= nil then
      if type(reward) ~= 'number' or reward ~= reward then
        e.error = 'step returned a reward that is not a number: ' .. tostring(reward)
        return finish(e, 'env_error')
      end
      e.reward = (e.reward or 0) + reward
    end
    e.turn_rewards[e.ep.turns] = reward or 0
    if done then return finish(e, 'done') end
    if e.ep.turns >= max_turns then return finish(e, 'max_turns') end
    if max_seconds > 0 and now() - e.t0 > max_seconds then return finish(e, 'max_seconds') end
    observe(e, obs)
  end

  local function resume(e) return resumed(e, coroutine.resume(e.co)) end

  -- the loop: the environments' calls (resets first) between the engine's steps
  for _, e in ipairs(E) do start_env(e, def.reset, e.rec) end
  while true do
    moonrl.check_stop()
    for _, e in ipairs(running) do if e.co then resume(e) end end -- the paused ones, once
    local still = {}
    for _, e in ipairs(running) do if e.co then still[#still + 1] = e end end
    running = still
    while #queue > 0 and #running < concurrency do -- the waiting ones, within env.concurrency
      local e = table.remove(queue, 1)
      e.step_t0 = now()
      resume(e)
      if e.co then running[#running + 1] = e end
    end
    local gen = false
    for _, e in ipairs(E) do if e.state == 'gen' then gen = true; break end end
    if gen then
      engine:step()
      for _, e in ipairs(E) do
        if e.state == 'gen' then
          if max_seconds > 0 and not e.stopped and now() - e.t0 > max_seconds then
            engine:stop_sample(e.req, 0) -- (it ends at the next step: its tokens so far kept)
            e.stopped = true
          end
          local toks, lps, n, reason = engine:output(e.req, 0)
          if reason then turn_done(e, toks, lps, n, reason) end
        end
      end
    elseif #running == 0 and #queue == 0 then
      break
    else
      moonrl.sleep(0.0005) -- every episode waits on its environment: no busy loop
    end
  end

  -- the samples, and what the episodes hold closed
  local samples = {}
  for _, e in ipairs(E) do
    if def.close then pcall(def.close, e.ep) end
    tools.close(e.ep)
    stats.episodes = stats.episodes + 1
    local st = e.ep.stats
    stats.tool_seconds = stats.tool_seconds + (st.tool_seconds or 0)
    for k, v in pairs(st.tool_calls or {}) do add_count(stats.tool_calls, k, v) end
    for k, v in pairs(st.tool_errors or {}) do add_count(stats.tool_errors, k, v) end
    local rec = e.rec
    local s = { prompt_ids = e.prompt_ids or {}, ids = e.ids, loss_mask = e.mask, rollout_logprobs = e.lps,
      response = e.last_text or '', finish_reason = e.finish_reason or 'stop', prompt = rec.prompt, answer = rec.answer,
      meta = rec.meta, group = e.i, record = rec, version = e.version, version_switches = e.switches, messages = e.messages,
      episode = { turns = e.ep.turns, reason = e.reason, reward = e.reward, error = e.error, turn_rewards = e.turn_rewards,
        turn_ends = e.turn_ends,
        failed = e.reason == 'env_error' or nil,
        extension_failures = e.ext_fail, tool_calls = st.tool_calls, tool_errors = st.tool_errors } }
    if #e.pieces > 0 then s.pieces = e.pieces end
    samples[#samples + 1] = s
  end
  stats.seconds = now() - t_start
  return samples, stats
end

-- The step's figures of a batch's stats (the env/* metrics): episodes' turns, tool calls and
-- errors by tool, environment and tool seconds (and the environment's share of the rollout's
-- time), the share of the episodes' response tokens under the mask's zeros, extension failures,
-- and the episodes ended by each limit.
function M.metrics(stats)
  if not stats then return nil end
  local n = math.max(stats.episodes, 1)
  local resp = stats.env_tokens + stats.model_tokens
  local m = { episodes = stats.episodes, turns = stats.turns / n, tool_calls = stats.tool_calls,
    tool_errors = stats.tool_errors, env_seconds = stats.env_seconds, tool_seconds = stats.tool_seconds,
    env_share = stats.seconds > 0 and math.min(1, stats.env_seconds / stats.seconds) or 0,
    masked_share = resp > 0 and stats.env_tokens / resp or 0, extension_failures = stats.extension_failures,
    splits = stats.splits, ended = stats.reasons, agent_failures = stats.agent_failures }
  return m
end

return M
