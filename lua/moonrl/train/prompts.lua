-- moonrl.train.prompts: text to token ids the way every recipe does it, and the datasets they
-- are drawn from.
--
--   local prompts = require('moonrl.train.prompts')
--   local ids = prompts.prompt_ids(tok, tpl, text, system)    -- through the chat template
--   local ids = prompts.completion_ids(tok, text)             -- the response and eos
--   local eos = prompts.eos_ids(tok, model)
--   local view = prompts.open_data(cfg, { prompt = 'prompt' })  -- data.path as a moonrl.data view
--   local view = prompts.task_records(cfg, 'heldout')           -- data.task's split
local ffi = require('ffi')
local moonrl = require('moonrl')
local json = require('moonrl.io.json')

local M = {}

-- The end-of-sequence ids: the tokenizer's eos, the model's eos, and opts.extra.
function M.eos_ids(tok, model, extra)
  local ids, seen = {}, {}
  local function add(id)
    if id and id >= 0 and not seen[id] then seen[id] = true; ids[#ids + 1] = id end
  end
  add(tok.eos_id)
  add(model and model.config.eos_token_id)
  for _, id in ipairs(extra or {}) do add(id) end
  return ids
end

-- Prompt token ids: through the chat template as one user turn (plus an optional system turn)
-- with the generation prompt, or the raw text encoded with the tokenizer's special tokens.
function M.prompt_ids(tok, tpl, text, system)
  if tpl then
    local messages = {}
    if system and system ~= '' then messages[1] = { role = 'system', content = system } end
    messages[#messages + 1] = { role = 'user', content = text }
    return tok:encode(tpl:render(messages, { add_generation_prompt = true }), { add_special = false })
  end
  return tok:encode(text)
end

-- Completion token ids: the text followed by the end-of-sequence token.
function M.completion_ids(tok, text, eos)
  local ids = tok:encode(text, { add_special = false })
  eos = eos or tok.eos_id
  if eos then ids[#ids + 1] = eos end
  return ids
end

-- cfg.data.path as a moonrl.data view of fields (record field -> JSON key; optional: those that
-- may be missing), data.on_error applied; a file that cannot be opened is a usage error naming
-- the key and the file (a recipe opens it before session.start: no run directory is left behind).
function M.open_data(cfg, fields, optional)
  local ok, view = pcall(require('moonrl.data').jsonl, cfg.data.path, { fields = fields, optional = optional,
    on_error = cfg.data.on_error == 'skip' and 'skip' or 'error', max_record_bytes = cfg.data.max_record_bytes })
  if not ok then moonrl.usage_error('data.path: ' .. moonrl.error_text(view)) end
  return view
end

-- data.task's split ('train' or 'heldout') as a moonrl.data view (its records: prompt, answer,
-- and what else the task gives, e.g. rejected).
function M.task_records(cfg, split)
  local t = require('moonrl.tasks').load(cfg.data.task, cfg.run.seed)
  return require('moonrl.data').records(t[split], { name = 'data.task=' .. cfg.data.task .. (split == 'train' and '' or ' (' .. split .. ')') })
end

-- ---- the session's prompts and rewards --------------------------------------------------------
-- Methods of the run's session (moonrl.train.session installs them): the step's prompts drawn
-- from its dataset, and their completions scored by the config's reward.

local P = {}
M.session_methods = P

-- The next records of the dataset (cycling through epochs), each with prompt_ids (through the
-- chat template when the config's data.chat, with data.system). A record that cannot be read,
-- rendered or encoded, or whose prompt leaves no room to generate, is skipped when
-- data.on_error is 'skip' (counted), else an error naming the file and line.
function P:prompts(n)
  if self.group_stream then return self:group_prompt(n) end
  local all = self:global_prompts(n)
  if self.world.size == 1 then return all end
  return (self:shard(all))
end

-- How many prompts a rollout draws: n, or 1 when each group is a rollout of its own
-- (async.stream_unit=group, moonrl.train.rollout), for a recipe that draws its prompts itself.
function P:rollout_count(n)
  if self.group_stream then
    self.group_batch = self.group_batch or n
    return 1
  end
  return n
end

-- A group stream's draw (moonrl.train.rollout): one record, the first of those a resumed run had drawn
-- but not trained on, else the next; the batch's size n noted.
function P:group_prompt(n)
  self.group_batch = self.group_batch or n
  local rec = self.requeue and table.remove(self.requeue, 1)
  local out
  if rec then
    rec.prompt_index = 0
    out = { rec }
  else
    out = self:global_prompts(1)
  end
  self.group_drawn = out
  return out
end

-- The step's whole batch of n records (every rank reads the same), each with prompt_index, its
-- 0-based place in it; kept as self.batch_records for S:score.
function P:global_prompts(n)
  local out = {}
  local d = self.cfg.data
  local skip = d.on_error == 'skip'
  -- one record at a time: a skipped record takes the next one, and none is passed over
  self.batches = self.batches or self.data:batches(1, { epochs = math.huge })
  local tries = 0
  while #out < n do
    local batch = self.batches()
    tries = tries + 1
    if not batch or tries > n + 10 * self.data:len() then
      error((d.path or ('data.task=' .. tostring(d.task))) .. ': no usable records (every one was skipped)', 0)
    end
    for _, r in ipairs(batch) do
      local ok, ids = pcall(M.prompt_ids, self.tok, self.tpl, r.prompt, d.system)
      local why = not ok and tostring(ids)
      if ok and self.max_prompt_tokens and #ids > self.max_prompt_tokens then
        why = string.format('prompt of %d tokens leaves no room to generate (the model has %d positions)', #ids,
          self.max_prompt_tokens + 1)
      end
      if why then
        why = string.format('%s:%d: %s', d.path or ('data.task=' .. tostring(d.task)), r.line or 0, why)
        if not skip then error(why .. ' (data.on_error=skip skips such records)', 0) end
        self.data.src.skipped = self.data.src.skipped + 1
        self:event('data_skipped', { message = why }, { quiet = true })
      else
        r.prompt_ids = ids
        out[#out + 1] = r
        r.prompt_index = #out - 1
      end
    end
  end
  self.batch_records = out
  return out
end

-- The dataset's skipped-record count (for the step's metrics).
function P:data_metrics()
  return self.data and { skipped = self.data.src.skipped } or nil
end

-- Rewards of samples (a flat list, `group` consecutive samples per prompt) by the config's
-- reward (reward.name): the scores (double array), the samples kept, and metrics. A sample whose
-- reward fails drops its whole group with reward.on_error = 'drop' (its group's advantages
-- would be wrong), scores 0 with 'zero', is an error with 'stop'.
-- Episodes (moonrl.train.episodes, moonrl.train.agents: s.episode) that got rewards from their
-- environment or agent keep them (the reward function scores the others); one that failed (its
-- environment's error, its agent's) is a failure as a failing reward is. env_stats: the episodes' counts, summed over the ranks with m.
function P:score(samples, group, env_stats)
  local rc = self.cfg.reward
  local scores, failures, stats = ffi.new('double[?]', math.max(#samples, 1)), {}, nil
  local need = {} -- the samples the reward function scores
  for i, s in ipairs(samples) do
    local ep = s.episode
    if ep and ep.failed then
      failures[#failures + 1] = { index = i, message = 'the episode failed: ' .. tostring(ep.error) }
    elseif ep and ep.reward ~= nil then
      scores[i - 1] = ep.reward
    else
      need[#need + 1] = i
    end
  end
  if #need > 0 then
    local sub = {}
    for k, i in ipairs(need) do sub[k] = samples[i] end
    local sc, _, fails, st = require('moonrl.rewards').score_batch(rc.name, sub, nil,
      { on_error = rc.on_error, timeout = rc.timeout, workers = rc.workers })
    for k, i in ipairs(need) do scores[i - 1] = sc[k - 1] end
    for _, f in ipairs(fails) do failures[#failures + 1] = { index = need[f.index], message = f.message } end
    table.sort(failures, function(a, b) return a.index < b.index end)
    stats = st
  end
  if rc.on_error == 'stop' and #failures > 0 then error(failures[1].message, 0) end
  local m = { errors = #failures, dropped_groups = 0, stats = stats, env = env_stats } -- (stats: a batch reward's, this rank's)
  if #failures == 0 or rc.on_error ~= 'drop' then return self:gather_scored(scores, samples, m) end
  for i, f in ipairs(failures) do
    if i <= 3 then self:event('reward_error', { message = f.message }) end
  end
  group = group or 1
  local bad = {}
  for _, f in ipairs(failures) do bad[math.floor((f.index - 1) / group)] = true end
  local kept = {}
  for i, s in ipairs(samples) do
    if not bad[math.floor((i - 1) / group)] then kept[#kept + 1] = s end
  end
  for _ in pairs(bad) do m.dropped_groups = m.dropped_groups + 1 end
  local out = ffi.new('double[?]', math.max(#kept, 1))
  local k = 0
  for i = 1, #samples do
    if not bad[math.floor((i - 1) / group)] then out[k] = scores[i - 1]; k = k + 1 end
  end
  return self:gather_scored(out, kept, m)
end

-- With several ranks: every rank's scored samples, in the order of the global batch (the ranks'
-- shares are contiguous), so that advantages and metrics are those of one process. A rank's own
-- samples stay the same tables; the others' are rebuilt from their records (every rank has the
-- batch's records) and what the owner sends: tokens, log-probs, text, finish reason, score.
-- Each sample gets .rank, the rank that generated it (and trains on it: train.policy_step).
function P:gather_scored(scores, samples, m)
  local w = self.world
  if w.size == 1 then return scores, samples, m end
  local mine = {}
  for i, s in ipairs(samples) do
    s.rank = w.rank
    mine[i] = json.object({ 'p', s.record and s.record.prompt_index or json.null, 'ids', json.array(s.ids),
      'lp', s.rollout_logprobs and json.array(s.rollout_logprobs) or json.null, 'f', s.finish_reason or json.null,
      't', s.response or '', 's', scores[i - 1], 'm', s.loss_mask or json.null, 'e', s.episode or json.null,
      'pc', s.pieces or json.null })
  end
  local blobs = w:gather_strings(json.encode(json.array(mine)))
  local all, values = {}, {}
  for r, text in ipairs(blobs) do
    if r - 1 == w.rank then
      for i, s in ipairs(samples) do all[#all + 1] = s; values[#all] = scores[i - 1] end
    else
      for _, e in ipairs(json.decode(text, 'rank ' .. (r - 1))) do
        local rec = self.batch_records[e.p + 1]
        all[#all + 1] = { prompt_ids = rec.prompt_ids, ids = e.ids, rollout_logprobs = e.lp ~= json.null and e.lp or nil,
          response = e.t, finish_reason = e.f ~= json.null and e.f or nil, prompt = rec.prompt, answer = rec.answer,
          meta = rec.meta, group = e.p + 1, record = rec, rank = r - 1, loss_mask = e.m ~= json.null and e.m or nil,
          episode = e.e ~= json.null and e.e or nil, pieces = e.pc ~= json.null and e.pc or nil }
        values[#all] = e.s
      end
    end
  end
  local out = ffi.new('double[?]', math.max(#all, 1))
  for i, v in ipairs(values) do out[i - 1] = v end
  return out, all, w:sum(m)
end

return M
