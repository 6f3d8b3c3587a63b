-- Multi-turn episodes (moonrl.env, moonrl.train.episodes) on a tiny random model with a byte-level
-- tokenizer and ChatML templates: the tokens are exact (the trainer's log-probs of the recorded
-- tokens are the engine's, the loss mask covers exactly the model's turns, and the text of every
-- episode is the template's rendering of its conversation), the earlier turns' K/V is reused,
-- extension failures are counted and handled (keep, split), limits end episodes with their reason,
-- environments that raise, hang or return garbage are contained, steps that pause let the other
-- episodes run, and GRPO trains on episodes.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local chat = require('moonrl.chat')
local env = require('moonrl.env')
local tools = require('moonrl.tools')
local episodes = require('moonrl.train.episodes')
local train = require('moonrl.train.step')

local TOK = 'tests/tok/fixtures/qwen2_split'
local tok = moonrl.tokenizer.load(TOK)
local EOS = tok:token_to_id('<|im_end|>')

-- ChatML, with the tools' declarations in a system turn (as Qwen2.5's)
local CHATML = [[{% if tools %}<|im_start|>system
Tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}<|im_end|>
{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}]]
-- the same, but an assistant turn before the last user message loses its text up to the first
-- 'e' (a stand-in for Qwen3's strip of earlier <think> blocks: the history is rewritten)
local STRIP = [[{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }}
{% if m.role == 'assistant' and loop.index0 < ns.last and 'e' in m.content %}{{ m.content.split('e', 1)[1] }}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}]]

local function template(src)
  local tpl = { bos_token = '', eos_token = '<|im_end|>', fn = chat.compile(src) }
  return setmetatable(tpl, { __index = { render = function(self, messages, extra)
    local vars = { messages = messages }
    for k, v in pairs(extra or {}) do vars[k] = v end
    if vars.add_generation_prompt == nil then vars.add_generation_prompt = false end
    return self.fn(vars)
  end } })
end

local model = moonrl.model.new({ model_type = 'qwen2', vocab_size = tok.vocab_size, hidden_size = 32,
  intermediate_size = 64, num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2,
  max_position_embeddings = 384, initializer_range = 0.05 }, { seed = 4 })
local function new_engine(m) return moonrl.engine.new(m or model, { kv_cache_bytes = 2 ^ 22, block_size = 4, seed = 7 }) end

-- A model that ends about half its turns with <|im_end|> (a random one almost never does): its
-- layers' outputs zeroed, so the last hidden state is the token's embedding, every embedding near
-- one direction c, and the head's <|im_end|> row along c.
local eos_model = moonrl.model.new({ model_type = 'qwen2', vocab_size = tok.vocab_size, hidden_size = 32,
  intermediate_size = 64, num_hidden_layers = 1, num_attention_heads = 4, num_key_value_heads = 2,
  max_position_embeddings = 384, initializer_range = 0.05, tie_word_embeddings = false }, { seed = 5 })
do
  math.randomseed(11)
  local p = eos_model:params()
  local c = {}
  for d = 1, 32 do c[d] = math.random() < 0.5 and -1 or 1 end
  for _, v in ipairs(eos_model:views()) do
    if v.name:find('o_proj.weight', 1, true) or v.name:find('down_proj.weight', 1, true) then
      for k = 0, v.numel - 1 do p[v.offset + k] = 0 end
    elseif v.name == 'model.embed_tokens.weight' then
      for k = 0, v.numel - 1 do p[v.offset + k] = c[k % 32 + 1] * (0.6 + 0.8 * math.random()) end
    elseif v.name == 'lm_head.weight' then
      for d = 0, 31 do p[v.offset + EOS * 32 + d] = 0.21 * c[d + 1] end
    end
  end
end

local records = { { prompt = 'add 2 and 3', answer = '5', prompt_index = 0 },
  { prompt = 'what is 7 times 6?', answer = '42', prompt_index = 1 } }
local sampling = { temperature = 1.0, max_tokens = 6, eos_ids = { EOS } }

-- three model turns, the environment answering "obs N" after each; a reward of 0.5 a turn
env.register('script', {
  reset = function(ep, record) return { { role = 'user', content = record.prompt } } end,
  step = function(ep, turn)
    if turn.n >= 3 then return {}, 0.5, true end
    return { { role = 'user', content = 'obs ' .. turn.n } }, 0.5, false
  end })

local function run(o)
  local opts = { engine = o.engine or new_engine(o.model), tok = tok, tpl = o.tpl, env = env.get(o.env or 'script'),
    template_vars = o.template_vars,
    records = o.records or records, group = o.group or 2, sampling = o.sampling or sampling, step = 1, seed = 3,
    limits = o.limits or { max_turns = 8, max_tokens = 200 }, extension = o.extension, concurrency = o.concurrency,
    tools = o.tools }
  local samples, stats = episodes.run(opts)
  return samples, stats, opts.engine
end

-- The runs of consecutive mask values of a sample: { value, first, last } (1-based into ids).
local function runs_of(s)
  local out = {}
  for k, m in ipairs(s.loss_mask) do
    if #out > 0 and out[#out][1] == m then out[#out][3] = k else out[#out + 1] = { m, k, k } end
  end
  return out
end

local function sub(list, a, b)
  local out = {}
  for k = a, b do out[#out + 1] = list[k] end
  return out
end

-- The trainer's log-probs of the samples' tokens against the engine's, where the mask is 1.
local function check_logprobs(samples, what, m)
  local lp = train.logprobs(m or model, samples, 4096, { temperature = 1.0 })
  local worst, n = 0, 0
  for i, s in ipairs(samples) do
    t.eq(#lp[i], #s.ids, what .. ': one log-prob a response token')
    for k = 1, #s.ids do
      if s.loss_mask[k] == 1 then
        worst, n = math.max(worst, math.abs(lp[i][k] - s.rollout_logprobs[k])), n + 1
      else
        t.eq(s.rollout_logprobs[k], 0, what .. ': no engine log-prob under the mask\'s zeros')
      end
    end
  end
  t.truthy(n > 0 and worst < 1e-4, string.format('%s: max |trainer - engine| over %d model tokens = %g', what, n, worst))
end

-- Each episode's tokens against its conversation: the runs of the mask's ones are the model's
-- turns as sampled, and the whole decodes to the template's rendering of the conversation.
local function check_spelling(samples, tpl)
  t.eq(#samples, 4, 'records x group')
  t.eq(samples[1].prompt_ids, samples[2].prompt_ids, 'a group\'s episodes share their prompt table')
  for _, s in ipairs(samples) do
    t.eq(#s.loss_mask, #s.ids)
    t.eq(#s.rollout_logprobs, #s.ids)
    local turns = {}
    for _, m in ipairs(s.messages) do if m.role == 'assistant' then turns[#turns + 1] = m.content end end
    t.eq(#turns, s.episode.turns)
    -- every run of ones is one turn of the model, as it was sampled; the zeros between are the template's
    local k = 0
    for _, r in ipairs(runs_of(s)) do
      if r[1] == 1 then
        k = k + 1
        local ids = sub(s.ids, r[2], r[3])
        if ids[#ids] == EOS then ids[#ids] = nil end
        t.eq(tok:decode(ids, { skip_special = false }), turns[k], 'turn ' .. k .. ': the mask\'s ones are its tokens')
      end
    end
    t.eq(k, #turns, 'one run of ones a turn')
    t.eq(#s.episode.turn_ends, #turns, 'where each turn ends')
    for _, at in ipairs(s.episode.turn_ends) do
      t.truthy(s.loss_mask[at] == 1 and (s.loss_mask[at + 1] or 0) == 0, 'a turn\'s last token')
    end
    -- the episode's text is the template's rendering of its conversation (up to the end the model wrote)
    local all = {}
    for _, id in ipairs(s.prompt_ids) do all[#all + 1] = id end
    for _, id in ipairs(s.ids) do all[#all + 1] = id end
    local text, rendered = tok:decode(all, { skip_special = false }), tpl:render(s.messages)
    t.eq(rendered:sub(1, #text), text, 'the tokens spell the conversation')
    t.truthy(#rendered - #text <= #'<|im_end|>\n', 'all of it')
    t.eq(s.episode.extension_failures, 0)
    if s.episode.reason == 'done' then t.near(s.episode.reward, 1.5, 1e-12, 'three turns, 0.5 each') end
  end
end

t.test('episodes: exact tokens, the mask on the model\'s turns only, the text the template\'s, prefix reuse', function()
  local tpl = template(CHATML)
  local samples, stats, engine = run({ tpl = tpl })
  check_spelling(samples, tpl)
  t.truthy(stats.turns >= 4 and stats.env_tokens > 0 and stats.model_tokens > 0)
  t.truthy(engine:stats().prefix_hit_tokens > 0, 'later turns reuse the earlier turns\' K/V')
  check_logprobs(samples, 'ChatML')
  -- the same draws again: every turn's sample stream is fixed by (seed, step, prompt, sample, turn)
  local again = run({ tpl = tpl })
  for i, s in ipairs(samples) do t.eq(table.concat(again[i].ids, ','), table.concat(s.ids, ','), 'deterministic') end
  -- a plain template (no chat template): the contents one after another, the engine's end token kept
  local plain = run({})
  for _, s in ipairs(plain) do
    local all = {}
    for _, id in ipairs(s.prompt_ids) do all[#all + 1] = id end
    for _, id in ipairs(s.ids) do all[#all + 1] = id end
    t.truthy(tok:decode(all, { skip_special = true }):find(s.messages[1].content, 1, true) == 1)
  end
  check_logprobs(plain, 'plain')
  -- turns that end with the end token (the template's end of the message after it) and turns cut
  -- by max_tokens (the template's whole end after them)
  local ended = run({ tpl = tpl, model = eos_model, sampling = { temperature = 1.0, max_tokens = 3, eos_ids = { EOS } } })
  check_spelling(ended, tpl)
  local eos_turns, cut_turns = 0, 0
  for _, s in ipairs(ended) do
    for _, r in ipairs(runs_of(s)) do
      if r[1] == 1 then
        if s.ids[r[3]] == EOS then eos_turns = eos_turns + 1 else cut_turns = cut_turns + 1 end
      end
    end
  end
  t.truthy(eos_turns > 0 and cut_turns > 0, string.format('turns ended by <|im_end|>: %d, cut: %d', eos_turns, cut_turns))
  check_logprobs(ended, 'ended turns', eos_model)
end)

t.test('transcripts: a conversation as the tokens an episode of it has (SFT on multi-turn transcripts)', function()
  local tpl = template(CHATML)
  -- the runner's episodes on the model that ends its turns with <|im_end|>: those whose every turn
  -- ended so, and whose sampled tokens are the ones its text encodes to (sampling can pick others:
  -- what a transcript, made from text, cannot know), are their conversation's transcript
  local samples = run({ tpl = tpl, model = eos_model, sampling = { temperature = 1.0, max_tokens = 3, eos_ids = { EOS } } })
  local compared = 0
  for _, s in ipairs(samples) do
    local all_ended, k = true, 0
    for _, r in ipairs(runs_of(s)) do
      if r[1] == 1 then
        k = k + 1
        local ids = sub(s.ids, r[2], r[3])
        if ids[#ids] ~= EOS then all_ended = false else ids[#ids] = nil end
        local content
        for _, m in ipairs(s.messages) do if m.role == 'assistant' then content = content or {}; content[#content + 1] = m.content end end
        if table.concat(tok:encode(content[k], { add_special = false }), ',') ~= table.concat(ids, ',') then all_ended = false end
      end
    end
    if all_ended then
      local tr = episodes.transcript({ tok = tok, tpl = tpl, messages = s.messages, eos = EOS })
      t.eq(table.concat(tr.prompt_ids, ','), table.concat(s.prompt_ids, ','), 'the prompt')
      t.eq(table.concat(tr.ids, ','), table.concat(s.ids, ','), 'the tokens')
      t.eq(table.concat(tr.loss_mask, ','), table.concat(s.loss_mask, ','), 'the mask')
      compared = compared + 1
    end
  end
  t.truthy(compared > 0, 'episodes compared: ' .. compared)
  local ok = pcall(episodes.transcript, { tok = tok, tpl = tpl, messages = { { role = 'user', content = 'x' } } })
  t.eq(ok, false, 'no assistant turn: an error')
end)

t.test('extension failures: a template that rewrites earlier turns, kept or split', function()
  local tpl = template(STRIP)
  -- the model's turns must hold an 'e' for the strip to bite: greedy at a fixed seed does not decide
  -- that, so count what happened and check both policies' samples either way
  local kept, stats = run({ tpl = tpl, group = 3, sampling = { temperature = 1.0, max_tokens = 8, eos_ids = { EOS } } })
  local fails = 0
  for _, s in ipairs(kept) do
    fails = fails + s.episode.extension_failures
    t.eq(s.pieces, nil, 'keep: one sample an episode')
  end
  t.eq(fails, stats.extension_failures)
  t.truthy(fails > 0, 'the strip made the rendering leave the tokens')
  check_logprobs(kept, 'keep')
  local split, st2 = run({ tpl = tpl, group = 3, extension = 'split', sampling = { temperature = 1.0, max_tokens = 8, eos_ids = { EOS } } })
  t.eq(st2.splits, st2.extension_failures)
  local pieces = {}
  for _, s in ipairs(split) do
    for _, p in ipairs(s.pieces or {}) do
      t.eq(#p.ids, #p.loss_mask)
      t.eq(p.loss_mask[#p.loss_mask], 1, 'a piece ends with the model\'s turn')
      pieces[#pieces + 1] = { prompt_ids = p.prompt_ids, ids = p.ids, loss_mask = p.loss_mask, rollout_logprobs = p.rollout_logprobs }
    end
  end
  t.eq(#pieces, st2.splits)
  for _, s in ipairs(split) do pieces[#pieces + 1] = s end
  check_logprobs(pieces, 'split')
  -- expanded for training: each piece with its episode's advantage
  for _, s in ipairs(split) do s.adv = s.episode.turns end
  local flat = require('moonrl.rl').expand_pieces(split)
  t.eq(#flat, #split + st2.splits)
  for _, s in ipairs(flat) do t.eq(s.adv, s.episode.turns) end
end)

t.test('Qwen3\'s own template without thinking: its rendering drops the empty think blocks of earlier turns', function()
  -- with enable_thinking=false the generation prompt ends "<think>\n\n</think>\n\n", which the
  -- template leaves out of an assistant message once a user message follows it: the conversation
  -- rendered again is not the episode's tokens (veRL #6854, prime-rl #1334)
  local tpl = template(io.open('tests/chat/templates/Qwen-Qwen3-0.6B.jinja'):read('*a'))
  local samples, stats = run({ tpl = tpl, template_vars = { enable_thinking = false } })
  t.truthy(stats.extension_failures > 0, 'failures counted: ' .. stats.extension_failures)
  for _, s in ipairs(samples) do
    -- the tokens hold every generation prompt as it was, the empty think block included
    local all = {}
    for _, id in ipairs(s.prompt_ids) do all[#all + 1] = id end
    for _, id in ipairs(s.ids) do all[#all + 1] = id end
    local _, blocks = tok:decode(all, { skip_special = false }):gsub('<|im_start|>assistant\n<think>\n\n</think>\n\n', '')
    t.eq(blocks, s.episode.turns, 'one empty think block a turn, as generated')
    local k, turns = 0, {}
    for _, m in ipairs(s.messages) do if m.role == 'assistant' then turns[#turns + 1] = m.content end end
    for _, r in ipairs(runs_of(s)) do
      if r[1] == 1 then
        k = k + 1
        local ids = sub(s.ids, r[2], r[3])
        if ids[#ids] == EOS then ids[#ids] = nil end
        t.eq(tok:decode(ids, { skip_special = false }), turns[k])
      end
    end
  end
  check_logprobs(samples, 'Qwen3, keep')
  local split, st2 = run({ tpl = tpl, template_vars = { enable_thinking = false }, extension = 'split' })
  t.eq(st2.splits, st2.extension_failures)
  local all = {}
  for _, s in ipairs(split) do
    for _, p in ipairs(s.pieces or {}) do all[#all + 1] = p end
    all[#all + 1] = s
    -- every observation splits (each earlier turn loses its empty think block): the last sample's prompt is
    -- the rendering of the conversation before the last turn
    t.eq(#(s.pieces or {}), s.episode.turns - 1, 'a split after each observation')
    if s.pieces then
      t.eq(tok:decode(s.prompt_ids, { skip_special = false }), tpl:render(sub(s.messages, 1, #s.messages - 1),
        { add_generation_prompt = true, enable_thinking = false }), 'the new sample\'s prompt is the rendering')
    end
  end
  check_logprobs(all, 'Qwen3, split')
end)

t.test('turn-level credit: each turn its discounted return, against the same turn of the group', function()
  local rl = require('moonrl.rl')
  -- a group of three episodes: turns' step rewards {1, 0, 2}, {0, 1}, {2} (the last judged by the
  -- reward function: score 0.5 at its last turn); the mask's ones are the turns
  local function sample(rewards, reward, score, lens)
    local ids, mask, ends = {}, {}, {}
    for k, n in ipairs(lens) do
      for _ = 1, n do ids[#ids + 1], mask[#mask + 1] = 5, 1 end
      ends[k] = #ids
      if k < #lens then ids[#ids + 1], mask[#mask + 1] = 6, 0 end
    end
    return { ids = ids, loss_mask = mask, score = score,
      episode = { turns = #lens, turn_rewards = rewards, reward = reward, turn_ends = ends } }
  end
  local s = { sample({ 1, 0, 2 }, 3, 3, { 2, 1, 2 }), sample({ 0, 1 }, 1, 1, { 1, 3 }), sample({ 0 }, nil, 0.5, { 2 }) }
  local gamma = 0.5
  local adv = rl.turn_advantages(s, 3, gamma)
  -- returns: {1 + 0.5*(0 + 0.5*2), 0 + 0.5*2, 2} = {1.5, 1, 2}; {0 + 0.5*1, 1} = {0.5, 1}; {0.5}
  local function z(g, list)
    local m, v = 0, 0
    for _, x in ipairs(list) do m = m + x end
    m = m / #list
    for _, x in ipairs(list) do v = v + (x - m) ^ 2 end
    return (g - m) / (math.sqrt(v / #list) + 1e-6)
  end
  local t1 = { 1.5, 0.5, 0.5 }
  t.near(adv[1][1], z(1.5, t1), 1e-9, 'turn 1 against the group\'s turn 1')
  t.near(adv[1][2], z(1.5, t1), 1e-9)
  t.eq(adv[1][3], 0, 'the environment\'s token')
  t.near(adv[1][4], z(1, { 1, 1 }), 1e-9, 'turn 2 against the two episodes that reached it')
  t.eq(adv[1][6], 0, 'turn 3: reached by one episode alone')
  t.near(adv[2][1], z(0.5, t1), 1e-9)
  t.near(adv[2][3], z(1, { 1, 1 }), 1e-9)
  t.near(adv[3][2], z(0.5, t1), 1e-9, 'the reward function\'s score at the last turn')
  t.eq(#adv[1], #s[1].ids)
end)

t.test('limits end episodes with their reason', function()
  env.register('forever', { reset = function(_, r) return { { role = 'user', content = r.prompt } } end,
    step = function() return { { role = 'user', content = 'again' } }, nil, false end })
  local s1, st = run({ tpl = template(CHATML), env = 'forever', limits = { max_turns = 2, max_tokens = 500 } })
  for _, s in ipairs(s1) do
    t.eq(s.episode.reason, 'max_turns')
    t.truthy(s.episode.turns <= 2)
    t.eq(s.episode.reward, nil, 'no reward given: the reward function scores it')
  end
  t.eq(st.reasons.max_turns, 4)
  local s2 = run({ tpl = template(CHATML), env = 'forever', limits = { max_turns = 50, max_tokens = 40 },
    sampling = { temperature = 1.0, max_tokens = 6, eos_ids = {} } })
  for _, s in ipairs(s2) do
    t.eq(s.episode.reason, 'max_tokens')
    t.truthy(#s.ids <= 40, 'within the episode\'s tokens: ' .. #s.ids)
  end
  local s3 = run({ tpl = template(CHATML), env = 'forever', limits = { max_turns = 50, max_tokens = 400, max_seconds = 1e-6 } })
  for _, s in ipairs(s3) do t.eq(s.episode.reason, 'max_seconds') end
end)

t.test('faults: an environment that raises, returns garbage, or hangs is contained and counted', function()
  env.register('faulty', {
    reset = function(ep, r)
      if r.prompt_index == 1 and ep.index == 1 then return 'not messages' end
      return { { role = 'user', content = r.prompt } }
    end,
    step = function(ep, turn)
      if ep.record.prompt_index == 0 and ep.index == 0 then error('the environment broke') end
      if ep.record.prompt_index == 0 and ep.index == 1 then
        while true do env.pause() end -- a step that never ends (but gives way)
      end
      if ep.record.prompt_index == 1 and ep.index == 0 then return {}, 'a lot', true end
      return {}, 1, true
    end })
  local samples, st = run({ tpl = template(CHATML), env = 'faulty', group = 3,
    limits = { max_turns = 4, max_tokens = 100, max_step_seconds = 0.2 } })
  local by = {}
  for _, s in ipairs(samples) do by[(s.record.prompt_index) .. ':' .. (#by)] = s end
  t.eq(samples[1].episode.reason, 'env_error')
  t.truthy(samples[1].episode.error:find('the environment broke', 1, true))
  t.eq(samples[2].episode.reason, 'step_timeout')
  t.eq(samples[3].episode.reason, 'done')
  t.eq(samples[4].episode.reason, 'env_error')
  t.truthy(samples[4].episode.error:find('not a number', 1, true), samples[4].episode.error)
  t.eq(samples[5].episode.reason, 'env_error')
  t.truthy(samples[5].episode.error:find('not a list of messages', 1, true), samples[5].episode.error)
  t.eq(samples[6].episode.reward, 1)
  t.eq(st.reasons.env_error, 3)
  t.eq(st.reasons.step_timeout, 1)
end)

t.test('a step that waits gives way: the other episodes generate meanwhile', function()
  -- episode A's first step waits until episode B has finished two turns: a runner that blocked on A's
  -- step would never get there (and the step's 5 s limit would end A)
  local shared = { b_turns = 0 }
  env.register('waiting', {
    reset = function(_, r) return { { role = 'user', content = r.prompt } } end,
    step = function(ep, turn)
      if ep.record.prompt_index == 1 then
        shared.b_turns = turn.n
        if turn.n >= 2 then return {}, 1, true end
        return { { role = 'user', content = 'go on' } }, nil, false
      end
      while shared.b_turns < 2 do env.pause() end
      return {}, 1, true
    end })
  local samples = run({ tpl = template(CHATML), env = 'waiting', group = 1, limits = { max_turns = 4, max_tokens = 200,
    max_step_seconds = 5 }, sampling = { temperature = 1.0, max_tokens = 4, eos_ids = {} } })
  t.eq(samples[1].episode.reason, 'done', 'A waited for B')
  t.eq(samples[2].episode.turns, 2)
end)

t.test('tools: calls parsed, run, answered; malformed and failing calls are observations, counted', function()
  tools.register('boom', { description = 'fails', parameters = { type = 'object' },
    call = function() error('tool exploded') end }, { replace = true })
  tools.register('flood', { description = '100 MB', parameters = { type = 'object' },
    call = function() return string.rep('x', 100 * 2 ^ 20) end }, { replace = true })
  local script = { '<tool_call>{"name": "calculator", "arguments": {"expression": "347*812"}}</tool_call>',
    '<tool_call>{not json</tool_call>',
    '<tool_call>{"name": "boom", "arguments": {}}</tool_call><tool_call>{"name": "flood", "arguments": {}}</tool_call>' }
  -- the model's turns are scripted (a random model calls no tool): the environment reads them from its
  -- own list, and sees the tools' answers
  local seen = {}
  env.register('scripted_tools', { tools = { 'calculator', 'boom', 'flood' },
    reset = function(_, r) return { { role = 'user', content = r.prompt } } end,
    step = function(ep, turn)
      local text = script[turn.n]
      local calls, errors = tools.parse(text, 'auto', { known = { calculator = true, boom = true, flood = true } })
      if #calls + #errors == 0 then return {}, text:find('281764', 1, true) and 1 or 0, true end
      local obs = env.run_tools(ep, { tool_calls = calls, tool_errors = errors })
      seen[#seen + 1] = obs
      return obs, nil, false
    end })
  local samples, st = run({ tpl = template(CHATML), env = 'scripted_tools', records = { records[1] }, group = 1,
    limits = { max_turns = 6, max_tokens = 40000 }, sampling = { temperature = 1.0, max_tokens = 3, eos_ids = {} } })
  local s = samples[1]
  t.eq(s.episode.reason, 'max_tokens', 'the flood\'s 16 KiB leave no room for another turn')
  t.eq(seen[1][1].content, '281764')
  t.truthy(seen[2][1].content:find('^error: '), seen[2][1].content)
  t.truthy(seen[3][1].content:find('^error: .*tool exploded'), seen[3][1].content)
  t.truthy(#seen[3][2].content < 17000 and seen[3][2].content:find('%[cut: '), 'a flood is cut at 16 KiB')
  t.eq(s.messages[#s.messages].role, 'assistant', 'the observation that did not fit is not in the conversation')
  t.eq(st.tool_calls.calculator, 1)
  t.eq(st.tool_calls.boom, 1)
  t.eq(st.tool_errors.boom, 1)
  t.eq(st.tool_errors.malformed, 1)
  local m = episodes.metrics(st)
  t.truthy(m.masked_share > 0.3, 'the tools\' output is a large share of the tokens, and masked: ' .. m.masked_share)
  t.truthy(s.prompt_ids[1] and tok:decode(s.prompt_ids, { skip_special = false }):find('Tools: calculator boom flood', 1, true),
    'the offered tools are declared to the template')
end)

t.test('the python tool in an episode: its cell polled, the other episodes generating meanwhile', function()
  if not require('moonrl.sandbox').probe().namespaces then return print('  (skipped: no namespaces here)') end
  local engine = new_engine()
  local during
  env.register('py_wait', { tools = { 'python' },
    reset = function(_, r) return { { role = 'user', content = r.prompt } } end,
    step = function(ep, turn)
      if ep.record.prompt_index == 1 then -- B: many quick turns
        return { { role = 'user', content = 'more' } }, nil, false
      end
      local s0 = engine:stats().steps
      local obs = env.run_tools(ep, { tool_calls = { { name = 'python', arguments = { code = 'import time\ntime.sleep(0.4)\n6 * 7' } } } })
      during = { out = obs[1].content, steps = engine:stats().steps - s0 }
      return {}, 1, true
    end })
  local samples = run({ engine = engine, tpl = template(CHATML), env = 'py_wait', group = 1,
    limits = { max_turns = 40, max_tokens = 300, max_step_seconds = 20 }, sampling = { temperature = 1.0, max_tokens = 2, eos_ids = {} } })
  t.eq(during.out, '42\n', 'the cell\'s answer')
  t.truthy(during.steps > 0, 'the engine stepped while the cell ran: ' .. during.steps)
  t.eq(samples[1].episode.reason, 'done')
end)

-- An environment whose reward is the vowels of each turn, three turns: rewards that differ from the
-- first step on, for runs whose weights must move.
local VOWELS = [==[
local env = require('moonrl.env')
return { vowels = {
  reset = function(_, r) return { { role = 'user', content = r.prompt } } end,
  step = function(ep, turn)
    local _, n = turn.text:gsub('[aeiou]', '')
    return { { role = 'user', content = 'again' } }, n, turn.n >= 2
  end } }
]==]

t.test('grpo on episodes: env=guess, data.task=guess, with the held-out episodes and the env/ metrics', function()
  local U = dofile('tests/recipes/util.lua')
  local json = require('moonrl.io.json')
  local dir = U.tmpdir('episodes')
  local fs = require('moonrl.io.fs')
  local mdir = U.save_model(dir .. '/model', model, TOK, json.encode(json.object({ 'eos_token', '<|im_end|>', 'chat_template', CHATML })))
  local out = U.run_recipe('recipes/grpo.lua', { 'model.dir=' .. mdir, 'data.task=guess', 'env=guess', 'env.max_turns=3',
    'grpo.steps=2', 'grpo.prompts=2', 'grpo.samples=3', 'grpo.max_tokens=4', 'train.lr=1e-3', 'eval.every=2',
    'eval.prompts=3', 'run.dir=' .. dir .. '/run' })
  local recs = U.records(out.dir)
  t.eq(#recs, 2)
  for _, r in ipairs(recs) do
    t.eq(r['env/episodes'], 6)
    t.truthy(r['env/turns'] >= 1 and r['env/turns'] <= 3, 'turns an episode: ' .. tostring(r['env/turns']))
    t.eq(r['env/ended/done'] + r['env/ended/max_turns'] + r['env/ended/max_tokens'], 6)
    t.truthy(r['env/masked_share'] > 0 and r['env/masked_share'] < 1)
    t.truthy(r['mismatch/max_abs'] < 1e-4, 'engine vs trainer over the model\'s tokens: ' .. r['mismatch/max_abs'])
  end
  t.truthy(recs[2]['eval/turns'] >= 1, 'the held-out episodes\' mean turns')
  t.truthy(recs[2]['eval/reward'] ~= nil)

  -- killed again and again in multi-turn async training (one_step_off: a batch of episodes generated
  -- ahead, in each checkpoint) and resumed: the final weights and every step's metrics are those of
  -- the run never killed (no episode lost, none trained twice)
  fs.write(dir .. '/vowels.lua', VOWELS)
  local K = dofile('tests/recipes/killer.lua')
  local rep = K.campaign({ recipe = 'recipes/grpo.lua', steps = 5, kills = 4, seed = 21, dir = dir .. '/kills',
    words = { 'model.dir=' .. mdir, 'data.task=guess', 'env=' .. dir .. '/vowels.lua:vowels', 'grpo.steps=5',
      'grpo.prompts=2', 'grpo.samples=3', 'grpo.max_tokens=6', 'train.lr=1e-2', 'async.mode=one_step_off',
      'run.threads=1' } })
  print(string.format('  %d kills (%d at phases, %d in checkpoint writes, %d by timer) in %d attempts', rep.kills,
    rep.kinds.phase, rep.kinds.checkpoint, rep.kinds.timer, rep.attempts))
  t.truthy(rep.kills >= 4, 'kills: ' .. rep.kills)
  for m, same in pairs(rep.same) do t.truthy(same, m .. '/model.safetensors equal byte for byte') end
  t.eq(#rep.metrics, 5)
  for i = 1, 5 do t.eq(rep.metrics[i], rep.metrics_ref[i], 'metrics of step ' .. i) end
  t.truthy(rep.metrics_ref[1]:find('"reward/std":0[,}]') == nil, 'the rewards differ: the weights move')
  -- turn-level credit (env.credit=turn) trains too
  local out2 = U.run_recipe('recipes/grpo.lua', { 'model.dir=' .. mdir, 'data.task=guess',
    'env=' .. dir .. '/vowels.lua:vowels', 'env.credit=turn', 'env.discount=0.9', 'grpo.steps=2', 'grpo.prompts=2',
    'grpo.samples=3', 'grpo.max_tokens=6', 'train.lr=1e-2', 'run.dir=' .. dir .. '/turn_credit' })
  for _, r in ipairs(U.records(out2.dir)) do t.truthy(r.grad_norm > 0, 'a gradient from the turns\' advantages') end
end)

t.test('episodes on servers in other processes: one process\'s bits, each episode\'s turns on one server', function()
  local U = dofile('tests/recipes/util.lua')
  local json = require('moonrl.io.json')
  local fs = require('moonrl.io.fs')
  local exe = rawget(_G, 'MOONRL_EXE')
  if not exe then return print('  (skipped: needs the moonrl executable)') end
  local dir = U.tmpdir('episodes_remote')
  local mdir = U.save_model(dir .. '/model', model, TOK, json.encode(json.object({ 'eos_token', '<|im_end|>', 'chat_template', CHATML })))
  fs.write(dir .. '/vowels.lua', VOWELS)
  local function grpo(d, ...)
    local w = { 'model.dir=' .. mdir, 'data.task=guess', 'env=' .. dir .. '/vowels.lua:vowels', 'grpo.steps=3',
      'grpo.prompts=4', 'grpo.samples=3', 'grpo.max_tokens=6', 'train.lr=1e-2', 'run.threads=1',
      'run.dir=' .. dir .. '/' .. d, ... }
    U.run_ranks(exe, 0, 'recipes/grpo.lua', w, { timeout = 180 })
    return dir .. '/' .. d
  end
  local here, there = grpo('local'), grpo('remote', 'engine.launch=auto', 'engine.servers=2')
  t.truthy(fs.read(here .. '/model/model.safetensors') == fs.read(there .. '/model/model.safetensors'),
    'two moonrl serve processes: the final weights of one process, byte for byte')
  local a, b = U.records(here), U.records(there)
  t.truthy(a[1]['reward/std'] > 0 and a[1].grad_norm > 0, 'the rewards differ: the weights move')
  for i = 1, 3 do
    t.eq(b[i]['env/turns'], a[i]['env/turns'], 'the same episodes at step ' .. i)
    t.eq(b[i]['engine/requests'], math.floor(b[i]['env/turns'] * 12 + 0.5), 'a request a turn (12 episodes) at step ' .. i)
    t.eq(b[i]['engine/affine'], b[i]['engine/requests'] - 12, 'every later turn on its episode\'s server at step ' .. i)
    t.eq(b[i]['engine/affine_moved'], 0)
    t.truthy(b[i]['engine/server1/requests'] > 0 and b[i]['engine/server2/requests'] > 0, 'both servers play')
  end
  local off_here = grpo('off_local', 'async.mode=one_step_off')
  local off_there = grpo('off_remote', 'async.mode=one_step_off', 'engine.launch=auto', 'engine.servers=2')
  a, b = U.records(off_here), U.records(off_there)
  for i = 1, 3 do
    t.eq(b[i]['env/turns'], a[i]['env/turns'], 'one_step_off: the same episodes at step ' .. i)
    t.truthy(math.abs(b[i].loss - a[i].loss) < 1e-5, 'one_step_off: the loss at step ' .. i)
  end
end)

t.test('episodes over ranks: a rollout rank gives one process\'s bits; two data-parallel ranks share the episodes', function()
  local U = dofile('tests/recipes/util.lua')
  local json = require('moonrl.io.json')
  local fs = require('moonrl.io.fs')
  local exe, mpirun = rawget(_G, 'MOONRL_EXE'), U.which('mpirun')
  if not (exe and mpirun) then return print('  (skipped: needs the moonrl executable and mpirun)') end
  local dir = U.tmpdir('episodes_ranks')
  local mdir = U.save_model(dir .. '/model', model, TOK, json.encode(json.object({ 'eos_token', '<|im_end|>', 'chat_template', CHATML })))
  fs.write(dir .. '/vowels.lua', VOWELS)
  local function grpo(ranks, d, ...)
    local w = { 'model.dir=' .. mdir, 'data.task=guess', 'env=' .. dir .. '/vowels.lua:vowels', 'grpo.steps=3',
      'grpo.prompts=4', 'grpo.samples=3', 'grpo.max_tokens=6', 'train.lr=1e-2', 'run.threads=1',
      'run.dir=' .. dir .. '/' .. d, ... }
    U.run_ranks(exe, ranks, 'recipes/grpo.lua', w, { timeout = 180 })
    return dir .. '/' .. d
  end
  local function bytes(d) return fs.read(d .. '/model/model.safetensors') end
  local one = grpo(0, 'one', 'async.mode=one_step_off')
  local two = grpo(2, 'rollout', 'async.mode=one_step_off', 'dist.rollout_ranks=1')
  t.truthy(bytes(one) == bytes(two), '1 trainer + 1 rollout rank: the bits of one process')
  local a, b = U.records(one), U.records(two)
  for i = 1, 3 do t.eq(b[i]['env/turns'], a[i]['env/turns'], 'the same episodes at step ' .. i) end
  t.truthy(a[1]['reward/std'] > 0 and a[1].grad_norm > 0, 'the rewards differ: the weights move')
  -- data parallel: each rank plays its half of the prompts' episodes; the counts are summed
  local sync, dp = U.records(grpo(0, 'sync')), U.records(grpo(2, 'dp'))
  for i = 1, 3 do
    t.eq(dp[i]['env/episodes'], 12, 'every episode counted once at step ' .. i)
    t.eq(dp[i]['env/turns'], sync[i]['env/turns'], 'the same episodes as one process at step ' .. i)
    t.eq(dp[i]['reward/mean'], sync[i]['reward/mean'])
    t.truthy(math.abs(dp[i].loss - sync[i].loss) <= 1e-4 * math.max(1, math.abs(sync[i].loss)), 'the same loss at step ' .. i)
  end
  fs.remove(dir)
end)

t.done()
