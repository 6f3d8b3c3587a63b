-- moonrl.serve.server: an OpenAI-compatible HTTP server over one generation engine
-- (what `moonrl serve` runs; the API as vLLM serves it).
--
--   GET  /health                 200, empty body
--   GET  /v1/models              the one served model
--   POST /v1/completions         prompt (string, list of strings, token ids, list of token-id lists)
--   POST /v1/chat/completions    messages rendered with the model's chat template
--   GET  /metrics                Prometheus text: requests, tokens, the engine's counters
--   POST /v1/episodes/reward     training mode: {"episode_id": ..., "reward": x} (below)
--   POST /v1/episodes/next       training mode, agent workers: the next episode to play
--   POST /v1/episodes/done       training mode: {"episode_id": ..., "reward"?: x, "error"?: text}
--   the control protocol of vLLM's RL API (what a trainer drives a rollout fleet with; below):
--   POST /pause?mode=wait|keep|abort, POST /resume, GET /is_paused, POST /collective_rpc
--   (method reload_weights), POST /update_weight_version, GET /weight_info, POST /reset_prefix_cache,
--   and its weight transfer: POST /init_weight_transfer_engine, /start_weight_update, /update_weights,
--   /finish_weight_update, /shutdown_weight_transfer_engine (moonrl.serve.transfer: buckets as
--   safetensors files, any subset of the tensors)
--
-- Training mode (o.record: what moonrl.train.agents gives, for an RL loop that trains on the
-- requests of agent programs): a request that names an episode (the request's `user`, its
-- `metadata.episode_id`, or the API key: `Authorization: Bearer <episode id>`, so that an agent
-- given only base_url and api_key needs no change) must name one record.known(id) knows and ask
-- for one sample, and is sampled as record.sampling(id) says ({ temperature, top_p, top_k, min_p,
-- max_tokens (a cap), seed, step, prompt_index, first_sample }: the trainer's temperature, and a
-- random stream of the episode's own, whatever the agent asked); once done it goes to
-- record.turn(id, { prompt_ids, ids, logprobs, text,
-- finish_reason, version, version_switches }), its exact tokens; /v1/episodes/reward hands the
-- episode's reward to record.reward(id, x), /v1/episodes/done ends it (record.done(id, reward,
-- error)). Requests naming no episode are served as always.
--
-- Agent workers (a program that plays many episodes, record.next given): POST /v1/episodes/next,
-- the worker's id as its API key, answers {"episode_id", "record"} with the next episode
-- record.next(worker) hands out (claimed by record.claim(id, worker) once the answer went out),
-- {"episode_id": null} once none is left (record.next gives false), and is held while
-- record.next gives nil (episodes enough in flight) until hand_out finds one.
--
-- The control protocol (vLLM's, served without its VLLM_SERVER_DEV_MODE gate): /pause stops
-- generation: mode=wait (the default) answers once the requests in flight are done, keep freezes
-- them where they are, abort ends them (finish_reason "abort"); requests that arrive while paused
-- wait, unread, until /resume. /collective_rpc {"method": "reload_weights", "kwargs":
-- {"weights_path": DIR}} reads new weights (a Hugging Face directory) into the served model: the
-- requests kept in flight go on with them from their next token; cached prefixes are dropped when
-- none is. /update_weight_version {"new_version": label} names the weights; each sample records
-- the version of each of its tokens, and a request with return_token_ids gets, besides token_ids
-- and prompt_token_ids (vLLM's), weight_versions: [{version, start, end}] spans of its tokens (as
-- vLLM's token API gives them). A request may also pin its random stream to the one moonrl's
-- engine gives a rollout's sample (moonrl_stream: [step, prompt_index, first_sample], with seed),
-- so a fleet of servers samples what the trainer's own engine would.
--
-- One loop on one thread: poll the HTTP server (core/serve/http.c; 0 ms while the engine has work,
-- longer when idle), turn new requests into engine requests, run one engine step, push the new
-- text of streaming requests (SSE), answer and release the finished ones. Every request shares the
-- engine, so requests that arrive while others generate join the running batch (continuous
-- batching); the engine is never reset.
--
-- Limits, before any work is spent on a request: the HTTP layer's (head and body sizes, the time
-- to receive them, connections; see moonrl/http.h), a body that is not UTF-8, a prompt too long
-- in bytes to fit the context whatever it encodes to (more than max_model_len times the most bytes
-- a token stands for, mrl_tok_max_text_bytes), too many prompts or samples. Every request has a
-- deadline (request_timeout): past it, it gets a 503 (an error event on a stream) and its samples
-- stop.
--
-- Randomness: a request with `seed` samples from the streams (seed, 0, prompt i, sample j): the
-- same seed gives the same text, whatever else is running. Without one, the server's --seed and
-- the request's serial number key the streams.
-- Log-probs are the engine's: under softmax(logits / temperature) over the whole vocabulary
-- (temperature 1 when greedy). top_logprobs (chat's top_logprobs, completions' logprobs = k, at
-- most 20) are the engine's k most likely tokens at each position, under the same distribution.
local moonrl = require('moonrl')
local ffi = require('ffi')
local json = require('moonrl.io.json')
local engine_mod = require('moonrl.engine')
local fs = require('moonrl.io.fs')
local C = moonrl.C

local M = {}

local obj, arr, null = json.object, json.array, json.null

-- ---- errors --------------------------------------------------------------------------------

local HttpError = {}
HttpError.__index = HttpError

local function fail(status, message, param, etype)
  error(setmetatable({ status = status, message = message, param = param, type = etype }, HttpError), 0)
end

local function bad(message, param) fail(400, message, param) end

local ERROR_TYPES = { [400] = 'BadRequestError', [404] = 'NotFoundError', [405] = 'MethodNotAllowed',
  [413] = 'BadRequestError', [500] = 'InternalServerError', [503] = 'ServiceUnavailable' }

local function error_body(status, message, param, etype)
  return json.encode(obj({ 'error', obj({ 'message', message, 'type', etype or ERROR_TYPES[status] or 'BadRequestError',
    'param', param or null, 'code', status }) }))
end

-- ---- text ----------------------------------------------------------------------------------

-- JSON wants valid UTF-8: a token that ends inside a character (byte-level BPE) decodes to bytes
-- that are not. Each maximal ill-formed subpart becomes one U+FFFD, as Python's
-- decode(errors='replace') does (Unicode's recommended practice).
local function utf8_clean(s)
  if not s:find('[\128-\255]') then return s end
  local out, i, n = {}, 1, #s
  local byte = string.byte
  while i <= n do
    local c = byte(s, i)
    local len = c < 0x80 and 1 or (c >= 0xC2 and c <= 0xDF) and 2 or (c >= 0xE0 and c <= 0xEF) and 3
      or (c >= 0xF0 and c <= 0xF4) and 4 or 0
    local k = len > 0 and 1 or 0 -- bytes of the character well formed so far
    while k > 0 and k < len and i + k <= n do
      local d = byte(s, i + k)
      local lo, hi = 0x80, 0xBF
      if k == 1 then -- the second byte's narrower ranges (no overlongs, no surrogates, <= U+10FFFF)
        if c == 0xE0 then lo = 0xA0 elseif c == 0xED then hi = 0x9F elseif c == 0xF0 then lo = 0x90
        elseif c == 0xF4 then hi = 0x8F end
      end
      if d < lo or d > hi then break end
      k = k + 1
    end
    if len > 0 and k == len then
      out[#out + 1] = s:sub(i, i + len - 1)
      i = i + len
    else
      out[#out + 1] = '\239\191\189'
      i = i + math.max(k, 1)
    end
  end
  return table.concat(out)
end
M.utf8_clean = utf8_clean

-- nil when s is well-formed UTF-8, else the 1-based position of the first byte that is not (a
-- byte loop that LuaJIT compiles: ~1 ms a MB, faster than a pattern search for [\128-\255]).
local function utf8_error(s)
  local byte, n, i = string.byte, #s, 1
  while i <= n do
    local c = byte(s, i)
    if c < 0x80 then
      i = i + 1
    else
      local len = (c >= 0xC2 and c <= 0xDF) and 2 or (c >= 0xE0 and c <= 0xEF) and 3 or (c >= 0xF0 and c <= 0xF4) and 4 or 0
      if len == 0 or i + len - 1 > n then return i end
      local lo, hi = 0x80, 0xBF -- the second byte's narrower ranges: no overlongs, no surrogates, <= U+10FFFF
      if c == 0xE0 then lo = 0xA0 elseif c == 0xED then hi = 0x9F elseif c == 0xF0 then lo = 0x90 elseif c == 0xF4 then hi = 0x8F end
      local d = byte(s, i + 1)
      if d < lo or d > hi then return i end
      for k = 2, len - 1 do
        d = byte(s, i + k)
        if d < 0x80 or d > 0xBF then return i end
      end
      i = i + len
    end
  end
  return nil
end
M.utf8_error = utf8_error

-- An integer as text, exactly, however large (string.format's %d wraps past 2^63).
local function int_text(x) return string.format('%.0f', x) end

-- The end of s[1..upto] moved back to a character boundary (a streamed piece never splits one).
local function char_boundary(s, from, upto)
  while upto > from do
    local b = s:byte(upto + 1)
    if not b or b < 0x80 or b >= 0xC0 then break end
    upto = upto - 1
  end
  return upto
end

-- ---- request fields ------------------------------------------------------------------------

local function field(body, key)
  local v = body[key]
  if v == null then return nil end
  return v
end

local function number_field(body, key, lo, hi, integer, default)
  local v = field(body, key)
  if v == nil then return default end
  if type(v) == 'boolean' or type(v) ~= 'number' or v ~= v then
    bad(string.format("'%s' must be a number", key), key)
  end
  if integer and v ~= math.floor(v) then bad(string.format("'%s' must be an integer", key), key) end
  if (lo and v < lo) or (hi and v > hi) then
    bad(string.format("'%s' must be %s (got %s)", key,
      hi and lo and string.format('in [%s, %s]', lo, hi) or lo and ('>= ' .. lo) or ('<= ' .. hi), json.number(v)), key)
  end
  return v
end

local function bool_field(body, key, default)
  local v = field(body, key)
  if v == nil then return default end
  if type(v) ~= 'boolean' then bad(string.format("'%s' must be true or false", key), key) end
  return v
end

local function stop_strings(body)
  local v = field(body, 'stop')
  if v == nil then return {} end
  if type(v) == 'string' then v = { v } end
  if type(v) ~= 'table' or json.is_object(v) then bad("'stop' must be a string or a list of strings", 'stop') end
  if #v > 16 then bad("'stop' takes 16 strings at most", 'stop') end
  local out = {}
  for _, s in ipairs(v) do
    if type(s) ~= 'string' then bad("'stop' must be a string or a list of strings", 'stop') end
    if s == '' then bad("'stop' must not contain an empty string", 'stop') end -- as vLLM
    out[#out + 1] = s
  end
  return out
end

local function stop_token_ids(body, vocab)
  local v = field(body, 'stop_token_ids')
  if v == nil then return {} end
  if type(v) ~= 'table' or json.is_object(v) then bad("'stop_token_ids' must be a list of token ids", 'stop_token_ids') end
  for _, id in ipairs(v) do
    if type(id) ~= 'number' or id ~= math.floor(id) or id < 0 or id >= vocab then
      bad("'stop_token_ids' must be a list of token ids in the vocabulary", 'stop_token_ids')
    end
  end
  return v
end

-- Fields we do not implement: a clear 400 rather than a silently different result.
local function unsupported(body, names)
  for _, k in ipairs(names) do
    local v = field(body, k)
    if v ~= nil and v ~= false and v ~= 0 and not (type(v) == 'table' and next(v) == nil) then
      bad(string.format("'%s' is not supported by moonrl serve", k), k)
    end
  end
end

-- ---- the server ----------------------------------------------------------------------------

local Server = {}
Server.__index = Server

-- o: { engine, tokenizer, template (or nil, template_error), model_name, model_path, max_model_len,
--      eos_ids, seed, max_n, host, port, http config fields, shutdown_timeout, log (function) }
function M.new(o)
  local self = setmetatable({
    engine = o.engine, tok = o.tokenizer, tpl = o.template, tpl_error = o.template_error,
    name = o.model_name, path = o.model_path, max_len = o.max_model_len, eos = o.eos_ids or {},
    seed = o.seed or 0, max_n = o.max_n or 128, default_max_tokens = o.default_max_tokens,
    shutdown_timeout = o.shutdown_timeout or 10, request_timeout = o.request_timeout or 600,
    log = o.log or function() end, record = o.record,
    jobs = {}, active = {}, to_release = {}, serial = 0, created = os.time(), next_waiting = {},
    held = {}, pause_waiters = {}, version_label = o.weight_version or 'default', adapters = {},
    counters = { requests = 0, errors = 0, prompt_tokens = 0, generation_tokens = 0, running_peak = 0,
      active_peak = 0, gone = 0, timed_out = 0, ttft_sum = 0, ttft_count = 0 },
    stats = ffi.new('mrl_engine_stats'), req = ffi.new('mrl_http_request'), got = ffi.new('int[1]'),
    gone_ids = ffi.new('int64_t[64]'),
  }, Server)
  -- a prompt of more bytes than max_len tokens can stand for cannot fit the context: refused before
  -- it is encoded (a tokenizer that can drop text has no such bound: its prompts are encoded)
  self.version_labels = { [0] = self.version_label } -- (the engine's version -> its label)
  self.max_token_bytes = tonumber(C.mrl_tok_max_text_bytes(self.tok.handle))
  self.max_prompt_bytes = self.max_token_bytes > 0 and self.max_len * self.max_token_bytes or math.huge
  local cfg = ffi.new('mrl_http_config')
  C.mrl_http_config_default(cfg)
  for _, k in ipairs({ 'max_body_bytes', 'max_header_bytes', 'max_connections', 'idle_timeout_s', 'header_timeout_s',
    'body_timeout_s' }) do
    if o[k] then cfg[k] = o[k] end
  end
  -- the HTTP layer's deadline is the backstop for a request this loop does not know of; the loop
  -- ends its own requests at request_timeout (with an error event on a stream)
  cfg.request_timeout_s = self.request_timeout + 5
  local h = ffi.new('mrl_http *[1]')
  moonrl.check(C.mrl_http_open(o.host or '127.0.0.1', o.port or 8000, cfg, h), 2)
  self.http = h[0]
  self.port = tonumber(C.mrl_http_port(self.http))
  return self
end

-- true when the answer went out (it fails only for a client gone)
function Server:respond(hid, status, body, ctype)
  return C.mrl_http_respond(self.http, hid, status, ctype or 'application/json', body, #body) == 0
end

function Server:respond_error(hid, status, message, param, etype)
  self.counters.errors = self.counters.errors + 1
  self:respond(hid, status, error_body(status, message, param, etype))
end

function Server:send(job, text)
  C.mrl_http_stream_write(self.http, job.hid, text, #text)
end

function Server:send_event(job, o) self:send(job, 'data: ' .. json.encode(o) .. '\n\n') end

-- ---- building jobs -------------------------------------------------------------------------

-- The model a request names: the served model (slot 0), or a LoRA adapter by its name (its
-- engine slot); a 404 for another. Returns the slot and the name answers carry.
function Server:check_model(body)
  local m = field(body, 'model')
  if m == nil then return 0, self.name end
  if type(m) ~= 'string' then bad("'model' must be a string", 'model') end
  if self.adapters[m] then return self.adapters[m].slot, m end
  if m ~= self.name and m ~= self.path then
    fail(404, string.format('The model `%s` does not exist.', m), 'model', 'NotFoundError')
  end
  return 0, self.name
end

-- LoRA adapters served beside the model (vLLM's LoRA serving): a PEFT directory under a name,
-- in an engine slot of its own (moonrl.engine's set_adapter); the same name again replaces it
-- (requests in flight go on with the new one from the next step: an in-flight update).
function Server:load_adapter(name, dir)
  if type(name) ~= 'string' or name == '' or #name > 200 then bad("'lora_name' (a string) is required", 'lora_name') end
  if type(dir) ~= 'string' or dir == '' then bad("'lora_path' (a directory) is required", 'lora_path') end
  if name == self.name then bad(string.format("'%s' is the served model's name", name), 'lora_name') end
  if self.engine.tick then bad('LoRA adapters are not served with --tp yet', 'lora_name') end
  local ok, ad = pcall(require('moonrl.model').load_adapter, self.engine.model, dir)
  if not ok then bad(moonrl.error_text(ad), 'lora_path') end
  local slot = self.adapters[name] and self.adapters[name].slot
  if not slot then
    local used = {}
    for _, a in pairs(self.adapters) do used[a.slot] = true end
    slot = 1
    while used[slot] do slot = slot + 1 end
    if slot > 64 then bad('64 LoRA adapters are served already: unload one first', 'lora_name') end
  end
  local set_ok, err = pcall(self.engine.set_adapter, self.engine, slot, ad)
  if not set_ok then bad(moonrl.error_text(err), 'lora_name') end
  self.adapters[name] = { slot = slot, dir = dir, ad = ad }
  self:new_version() -- (what a request of this name computes changed: its samples' version with it)
  self.log(string.format('LoRA adapter %s from %s (rank %d) in slot %d', name, dir, ad:info().rank, slot))
end

function Server:unload_adapter(name)
  local a = type(name) == 'string' and self.adapters[name]
  if not a then fail(404, string.format('The LoRA adapter `%s` is not loaded.', tostring(name)), 'lora_name', 'NotFoundError') end
  for _, job in ipairs(self.active) do
    if job.adapter == a.slot then fail(409, string.format("LoRA adapter '%s' has requests in flight", name), 'lora_name') end
  end
  self.engine:set_adapter(a.slot, nil)
  self.adapters[name] = nil
end

-- The 400 of a prompt too long for the context (n_prompt: its tokens, or nil with n_bytes: its
-- bytes, when it was refused before encoding).
function Server:context_error(param, n_prompt, max_tokens, n_bytes)
  if n_bytes then
    bad(string.format("This model's maximum context length is %d tokens. However, the %s %s bytes long, more than " ..
      '%d tokens can hold (one stands for %d bytes of text at most). Please reduce the length of the %s.', self.max_len,
      param == 'messages' and 'messages rendered with the chat template are' or 'prompt is', int_text(n_bytes),
      self.max_len, self.max_token_bytes, param), param)
  end
  bad(string.format("This model's maximum context length is %d tokens. However, you requested %s tokens " ..
    '(%d in the %s, %s in the completion). Please reduce the length of the %s or completion.', self.max_len,
    int_text(n_prompt + (max_tokens or 1)), n_prompt, param, int_text(max_tokens or 1), param), param)
end

-- A prompt of n tokens (and max_tokens to come) that does not fit the context: its 400.
function Server:check_context(param, n, max_tokens)
  if n >= self.max_len or (max_tokens and n + max_tokens > self.max_len) then self:context_error(param, n, max_tokens) end
end

-- Encode a prompt's text, once its length in bytes could fit the context; its ids become a Lua
-- table only once they fit too.
function Server:encode_prompt(text, param, max_tokens, add_special)
  if #text > self.max_prompt_bytes then self:context_error(param, nil, nil, #text) end
  local ids, n = self.tok:encode(text, { cdata = true, add_special = add_special })
  self:check_context(param, n, max_tokens)
  local list = {}
  for i = 0, n - 1 do list[i + 1] = ids[i] end
  return list
end

function Server:token_list(v, param, max_tokens)
  self:check_context(param, #v, max_tokens) -- before looking at each id
  local vocab = self.tok.vocab_size
  local model_vocab = self.engine.model.whole_config.vocab_size
  if model_vocab and model_vocab < vocab then vocab = model_vocab end
  for _, id in ipairs(v) do
    if type(id) ~= 'number' then
      bad(string.format("'%s' must be a string, a list of strings, a list of token ids or a list of such lists " ..
        '(it holds a %s where a token id belongs)', param, id == null and 'null' or json.is_object(id) and 'object' or
        type(id) == 'table' and 'list' or type(id)), param)
    end
    if id ~= math.floor(id) or id < 0 or id >= vocab then
      bad(string.format("'%s' holds a token id outside the vocabulary [0, %d): %s", param, vocab, json.number(id)), param)
    end
  end
  local ids = {}
  for i = 1, #v do ids[i] = v[i] end
  return ids
end

local PROMPT_SHAPE = "'prompt' must be a string, a list of strings, a list of token ids or a list of such lists"

-- The prompts of a completions request: a list of token-id lists. Their number (times n) is checked
-- before any is encoded, each one's length as soon as it is known.
function Server:prompts(body, n, max_tokens)
  local p = field(body, 'prompt')
  if p == nil then bad("'prompt' is required", 'prompt') end
  local items
  if type(p) == 'string' then
    items = { p }
  elseif type(p) == 'table' and not json.is_object(p) then
    if #p == 0 then bad("'prompt' must not be empty", 'prompt') end
    items = type(p[1]) == 'number' and { p } or p
  else
    bad(PROMPT_SHAPE, 'prompt')
  end
  if #items > 64 then bad("'prompt' holds 64 prompts at most", 'prompt') end
  if #items * n > self.max_n then
    bad(string.format('%d prompts x n = %d samples: %d at most in one request', #items, #items * n, self.max_n), 'n')
  end
  local list = {}
  for i, q in ipairs(items) do
    if type(q) == 'string' then list[i] = self:encode_prompt(q, 'prompt', max_tokens)
    elseif type(q) == 'table' and not json.is_object(q) and #q > 0 then list[i] = self:token_list(q, 'prompt', max_tokens)
    else bad(PROMPT_SHAPE, 'prompt') end
  end
  return list
end

local function content_text(content, i)
  if type(content) == 'string' then return content end
  if content == nil then return '' end
  if type(content) == 'table' and not json.is_object(content) then
    local parts = {}
    for _, part in ipairs(content) do
      if type(part) ~= 'table' or part.type ~= 'text' or type(part.text) ~= 'string' then
        bad(string.format("messages[%d].content: only text parts ({\"type\": \"text\", \"text\": ...}) are supported", i - 1),
          'messages')
      end
      parts[#parts + 1] = part.text
    end
    return table.concat(parts, '\n')
  end
  bad(string.format('messages[%d].content must be a string or a list of text parts', i - 1), 'messages')
end

local ROLES = { system = true, developer = true, user = true, assistant = true, tool = true, ['function'] = true }

-- The prompt of a chat request, rendered with the chat template.
function Server:chat_prompt(body, max_tokens)
  local msgs = field(body, 'messages')
  if msgs == nil then bad("'messages' is required", 'messages') end
  if type(msgs) ~= 'table' or json.is_object(msgs) or #msgs == 0 then
    bad("'messages' must be a non-empty list of messages", 'messages')
  end
  if not self.tpl then bad('this model has no chat template: ' .. tostring(self.tpl_error), 'messages') end
  local list = arr({})
  for i, m in ipairs(msgs) do
    if type(m) ~= 'table' or not json.is_object(m) then bad(string.format('messages[%d] must be an object', i - 1), 'messages') end
    if type(m.role) ~= 'string' then bad(string.format('messages[%d].role must be a string', i - 1), 'messages') end
    if not ROLES[m.role] then
      bad(string.format("messages[%d].role '%s' is not one of system, developer, user, assistant, tool, function", i - 1,
        utf8_clean(m.role:sub(1, 64))), 'messages')
    end
    local content = field(m, 'content')
    -- as OpenAI: only an assistant message that calls tools may leave its content out
    if content == nil and not (m.role == 'assistant' and (field(m, 'tool_calls') ~= nil or field(m, 'function_call') ~= nil)) then
      bad(string.format('messages[%d].content is required', i - 1), 'messages')
    end
    local copy = obj()
    for _, k in ipairs(json.keys(m)) do copy[k] = m[k] end
    copy.content = content_text(content, i)
    list[i] = copy
  end
  local extra = { add_generation_prompt = bool_field(body, 'add_generation_prompt', true) }
  local kw = field(body, 'chat_template_kwargs')
  if kw ~= nil then
    if not json.is_object(kw) then bad("'chat_template_kwargs' must be an object", 'chat_template_kwargs') end
    for _, k in ipairs(json.keys(kw)) do extra[k] = kw[k] end
  end
  local tools = field(body, 'tools')
  if tools ~= nil then extra.tools = tools end
  local ok, text = pcall(self.tpl.render, self.tpl, list, extra)
  if not ok then bad('the chat template failed on these messages: ' .. moonrl.error_text(text), 'messages') end
  return self:encode_prompt(text, 'messages', max_tokens, false)
end

local function new_id(prefix, serial)
  return string.format('%s-%x%05x', prefix, os.time(), serial % 0x100000)
end

-- A request's job: validated, tokenised and queued in the engine (or an HttpError raised with
-- nothing left queued).
function Server:new_job(hid, body, chat, episode)
  if not json.is_object(body) then bad('the body must be a JSON object') end
  local adapter, model_name = self:check_model(body)
  unsupported(body, { 'presence_penalty', 'frequency_penalty', 'logit_bias', 'suffix', 'repetition_penalty' })
  if chat then unsupported(body, { 'echo', 'prompt_logprobs' }) end
  local stream = bool_field(body, 'stream', false)
  -- the prompt scored (completions): echo (its tokens and log-probs before the completion's; with
  -- max_tokens 0, nothing generated: lm-evaluation-harness's log-likelihoods) and vLLM's prompt_logprobs
  local echo = not chat and bool_field(body, 'echo', false)
  local prompt_lps = not chat and number_field(body, 'prompt_logprobs', 0, 20, true, nil) or nil
  if stream and (echo or prompt_lps) then bad("'echo' and 'prompt_logprobs' are not served on a stream", 'stream') end
  if (echo or prompt_lps) and adapter > 0 then
    bad("'echo' and 'prompt_logprobs' score prompts with the served model, not a LoRA adapter yet", echo and 'echo' or 'prompt_logprobs')
  end
  if (echo or prompt_lps) and (self.engine.tick or self.engine.model:device() ~= 'cpu') then
    bad("'echo' and 'prompt_logprobs' score prompts with a whole model on the CPU (not --tp, not a GPU yet)",
      echo and 'echo' or 'prompt_logprobs')
  end
  local n = number_field(body, 'n', 1, self.max_n, true, 1)
  local best_of = number_field(body, 'best_of', 1, self.max_n, true, n)
  if best_of ~= n then bad("'best_of' other than n is not supported", 'best_of') end
  local temperature = number_field(body, 'temperature', 0, 100, false, 1.0)
  local top_p = number_field(body, 'top_p', 0, 1, false, 1.0)
  if top_p <= 0 then bad("'top_p' must be in (0, 1]", 'top_p') end
  local top_k = number_field(body, 'top_k', -1, 2 ^ 31 - 1, true, 0)
  local min_p = number_field(body, 'min_p', 0, 1, false, 0)
  local seed = number_field(body, 'seed', -2 ^ 53, 2 ^ 53, true, nil)
  local max_tokens = number_field(body, chat and 'max_completion_tokens' or 'max_tokens', echo and 0 or 1, nil, true, nil)
  if chat and max_tokens == nil then max_tokens = number_field(body, 'max_tokens', 1, nil, true, nil) end
  local logprobs, top_logprobs = nil, nil
  if chat then
    logprobs = bool_field(body, 'logprobs', false) or nil
    top_logprobs = number_field(body, 'top_logprobs', 0, 20, true, nil)
    if top_logprobs and not logprobs then bad("'top_logprobs' needs 'logprobs': true", 'top_logprobs') end
  else
    logprobs = number_field(body, 'logprobs', 0, 20, true, nil)
  end
  local token_ids = bool_field(body, 'return_tokens_as_token_ids', false) -- vLLM's: "token_id:123"
  local return_ids = bool_field(body, 'return_token_ids', false) -- vLLM's: choices[].token_ids, prompt_token_ids
  local pinned = field(body, 'moonrl_stream')
  if pinned ~= nil then
    if type(pinned) ~= 'table' or json.is_object(pinned) or #pinned ~= 3 or seed == nil then
      bad("'moonrl_stream' must be [step, prompt_index, first_sample], with a 'seed'", 'moonrl_stream')
    end
    for _, x in ipairs(pinned) do
      if type(x) ~= 'number' or x ~= math.floor(x) or x < 0 or x > 2 ^ 53 then
        bad("'moonrl_stream' must hold three integers >= 0", 'moonrl_stream')
      end
    end
  end
  local stops = stop_strings(body)
  local stop_ids = stop_token_ids(body, self.tok.vocab_size)
  local include_usage = false
  local so = field(body, 'stream_options')
  if so ~= nil then
    if not json.is_object(so) then bad("'stream_options' must be an object", 'stream_options') end
    include_usage = bool_field(so, 'include_usage', false)
  end
  local prompts = chat and { self:chat_prompt(body, max_tokens) } or self:prompts(body, n, max_tokens)
  for _, ids in ipairs(prompts) do
    if #ids == 0 then bad('the prompt encodes to no tokens', chat and 'messages' or 'prompt') end
  end
  self.serial = self.serial + 1
  local max_stop = 0
  for _, s in ipairs(stops) do max_stop = math.max(max_stop, #s) end
  local job = {
    hid = hid, chat = chat, stream = stream, n = n, serial = self.serial, t0 = moonrl.now(), deadline = moonrl.now() + self.request_timeout,
    id = new_id(chat and 'chatcmpl' or 'cmpl', self.serial), created = os.time(),
    logprobs = logprobs, top_logprobs = top_logprobs, include_usage = include_usage, token_ids = token_ids,
    return_ids = return_ids, echo = echo, prompt_lps = prompt_lps, temperature = temperature,
    stops = stops, max_stop = max_stop, reqs = {}, samples = {}, remaining = 0, prompt_tokens = 0,
    adapter = adapter, model_name = model_name,
  }
  local ignore_eos = bool_field(body, 'ignore_eos', false) -- vLLM's: generate max_tokens whatever comes
  local opts = { temperature = temperature, top_p = top_p, top_k = top_k, min_p = min_p,
    eos_ids = ignore_eos and {} or self.eos,
    stop_ids = stop_ids, seed = seed or self.seed, step = seed and 0 or self.serial,
    top_logprobs = (chat and top_logprobs or (not chat and logprobs)) or 0 }
  if max_tokens == 0 then -- (echo alone: the prompts scored, no sample generated)
    for i, ids in ipairs(prompts) do
      job.reqs[i] = { n = n, prompt_len = #ids, prompt_ids = ids }
      job.prompt_tokens = job.prompt_tokens + #ids
      for j = 1, n do
        job.samples[#job.samples + 1] = { q = job.reqs[i], j = j - 1, index = (i - 1) * n + (j - 1), n_tokens = 0,
          watch = { text = '' }, finish = 'length', empty = true }
      end
    end
    return job
  end
  local q = {} -- (an episode's request: the sampling and the random stream its recorder sets)
  if pinned then
    if #prompts ~= 1 then bad("'moonrl_stream' takes one prompt", 'moonrl_stream') end
    opts.step, q.prompt_index, q.first_sample = pinned[1], pinned[2], pinned[3]
  end
  if episode then
    q = self.record.sampling(episode)
    for _, k in ipairs({ 'temperature', 'top_p', 'top_k', 'min_p', 'seed', 'step' }) do
      if q[k] ~= nil then opts[k] = q[k] end
    end
    job.episode = episode
  end
  for i, ids in ipairs(prompts) do
    local mt = max_tokens or (chat and self.default_max_tokens or 16)
    if q.max_tokens then mt = math.min(mt, q.max_tokens) end
    mt = math.min(mt, self.max_len - #ids)
    local ok, eid = pcall(self.engine.add, self.engine, { prompt_ids = ids, n = n, max_tokens = mt,
      prompt_index = q.prompt_index or (i - 1), first_sample = q.first_sample, adapter = adapter }, opts)
    if not ok then
      self:abandon(job) -- the prompts queued before this one
      bad(moonrl.error_text(eid), chat and 'messages' or 'prompt')
    end
    job.reqs[i] = { eid = eid, n = n, prompt_len = #ids, prompt_ids = ids }
    job.prompt_tokens = job.prompt_tokens + #ids
    for j = 1, n do
      job.samples[#job.samples + 1] = { eid = eid, q = job.reqs[i], j = j - 1, index = (i - 1) * n + (j - 1),
        watch = engine_mod.new_watch(self.tok), sent = 0, lp_sent = 0 }
      job.remaining = job.remaining + 1
    end
  end
  return job
end

-- Stop what a job has queued and let its requests be released once the engine has finished them.
function Server:abandon(job)
  for _, q in ipairs(job.reqs) do
    for j = 0, q.n - 1 do
      local _, _, _, reason = self.engine:output(q.eid, j)
      if not reason then self.engine:stop_sample(q.eid, j) end
    end
    self.to_release[#self.to_release + 1] = q.eid
  end
  job.reqs = {}
end

-- ---- responses -----------------------------------------------------------------------------

function Server:token_text(job, id)
  if job.token_ids then return 'token_id:' .. id end
  return utf8_clean(self.tok:decode({ id }))
end

-- The logprobs of tokens [from, to) of a sample (completions format, or the chat format's list).
function Server:logprobs_of(job, s, from, to, text_base)
  local toks, lps = self.engine:output(s.eid, s.j)
  local alts = self.engine:top_logprobs(s.eid, s.j, to) -- nil when none asked
  if job.chat then
    local content = arr({})
    for k = from, to - 1 do
      local t = self:token_text(job, toks[k])
      local lp = lps[k]
      local bytes = arr({ t:byte(1, -1) })
      local top = arr({})
      for _, a in ipairs(alts and alts[k + 1] or {}) do
        local at = self:token_text(job, a[1])
        top[#top + 1] = obj({ 'token', at, 'logprob', a[2], 'bytes', arr({ at:byte(1, -1) }) })
      end
      content[#content + 1] = obj({ 'token', t, 'logprob', lp, 'bytes', bytes, 'top_logprobs', top })
    end
    return obj({ 'content', content })
  end
  local tokens, token_lps, top, offsets = arr({}), arr({}), arr({}), arr({})
  local off = text_base or 0
  for k = from, to - 1 do
    local t = self:token_text(job, toks[k])
    tokens[#tokens + 1] = t
    token_lps[#token_lps + 1] = lps[k]
    if job.logprobs > 0 then
      top[#top + 1] = self:top_entry(job, t, lps[k], alts and alts[k + 1] or {}, job.logprobs)
    else
      top[#top + 1] = null
    end
    offsets[#offsets + 1] = off
    off = off + #t
  end
  return obj({ 'tokens', tokens, 'token_logprobs', token_lps, 'top_logprobs', top, 'text_offset', offsets })
end

-- A completions top_logprobs entry: { token: logprob } of the k most likely (alts: { {id, lp}, ...
-- } best first), the chosen token t first (added when not among them, as OpenAI's).
function Server:top_entry(job, t, lp, alts, k)
  local pairs_ = { t, lp }
  for j = 1, math.min(k, #alts) do
    local at = self:token_text(job, alts[j][1])
    if at ~= t then pairs_[#pairs_ + 1], pairs_[#pairs_ + 2] = at, alts[j][2] end
  end
  return obj(pairs_)
end

function Server:usage(job)
  return obj({ 'prompt_tokens', job.prompt_tokens, 'completion_tokens', job.completion_tokens or 0,
    'total_tokens', job.prompt_tokens + (job.completion_tokens or 0) })
end

function Server:chunk(job, choices)
  return obj({ 'id', job.id, 'object', job.chat and 'chat.completion.chunk' or 'text_completion', 'created', job.created,
    'model', job.model_name, 'choices', choices })
end

-- New text (and finish) of a streaming sample.
function Server:stream_sample(job, s, final)
  local w = s.watch
  local upto = final and #w.text or char_boundary(w.text, s.sent, #w.text - math.max(job.max_stop - 1, 0))
  local piece = upto > s.sent and w.text:sub(s.sent + 1, upto) or ''
  local lp = null
  local want_lp = job.logprobs ~= nil and (piece ~= '' or final)
  if want_lp then
    local to = final and s.n_tokens or w.fed
    if to > s.lp_sent then lp = self:logprobs_of(job, s, s.lp_sent, to) end
    s.lp_sent = math.max(s.lp_sent, to)
  end
  if piece == '' and not final and lp == null then return end
  s.sent = upto
  local choice
  if job.chat then
    local delta = obj()
    if not s.role_sent then delta.role = 'assistant'; s.role_sent = true end
    if piece ~= '' or not final then delta.content = utf8_clean(piece) end
    choice = obj({ 'index', s.index, 'delta', delta, 'logprobs', lp, 'finish_reason', final and s.finish or null })
  else
    choice = obj({ 'index', s.index, 'text', utf8_clean(piece), 'logprobs', lp, 'finish_reason', final and s.finish or null })
  end
  self:send_event(job, self:chunk(job, arr({ choice })))
end

function Server:finish_job(job)
  job.completion_tokens = 0
  for _, s in ipairs(job.samples) do job.completion_tokens = job.completion_tokens + s.n_tokens end
  self.counters.generation_tokens = self.counters.generation_tokens + job.completion_tokens
  self.counters.prompt_tokens = self.counters.prompt_tokens + job.prompt_tokens
  if job.stream then
    if job.include_usage then
      local c = self:chunk(job, arr({}))
      c.usage = self:usage(job)
      self:send_event(job, c)
    end
    self:send(job, 'data: [DONE]\n\n')
    C.mrl_http_stream_end(self.http, job.hid)
    if job.episode then self:record_turn(job) end
  else
    local choices = arr({})
    for _, s in ipairs(job.samples) do
      local text = utf8_clean(s.watch.text)
      local lp = null
      if job.echo then
        local pt = self:prompt_scores(job, s.q)
        text = pt.text .. text
        if job.logprobs ~= nil then lp = self:echo_logprobs(job, s, pt) end
      elseif job.logprobs ~= nil then
        lp = self:logprobs_of(job, s, 0, s.n_tokens)
      end
      local c
      if job.chat then
        c = obj({ 'index', s.index, 'message', obj({ 'role', 'assistant', 'content', text }),
          'logprobs', lp, 'finish_reason', s.finish })
      else
        c = obj({ 'index', s.index, 'text', text, 'logprobs', lp, 'finish_reason', s.finish })
      end
      if job.return_ids then self:token_ids_of(job, s, c) end
      if job.prompt_lps then c.prompt_logprobs = self:prompt_scores(job, s.q).vllm end
      choices[#choices + 1] = c
    end
    local sent = self:respond(job.hid, 200, json.encode(obj({ 'id', job.id, 'object', job.chat and 'chat.completion' or
      'text_completion', 'created', job.created, 'model', job.model_name, 'choices', choices, 'usage', self:usage(job) })))
    -- (a turn whose agent is known to be gone is not its episode's: it never saw it)
    if job.episode and sent then self:record_turn(job) end
  end
  for _, q in ipairs(job.reqs) do if q.eid then self.to_release[#self.to_release + 1] = q.eid end end
end

-- A prompt scored once for all its samples (echo, prompt_logprobs): each token's text, and from
-- the second on its log-prob under the request's temperature (1 when greedy), the k most likely
-- tokens there and its rank (the served model's forward: mrl_model_forward_top).
function Server:prompt_scores(job, q)
  if q.scores then return q.scores end
  local k = math.max(job.logprobs or 0, job.prompt_lps or 0, 1)
  local ids = q.prompt_ids
  local ok, lp, top, tlp, ranks = pcall(self.engine.model.forward_top, self.engine.model, require('moonrl.model').batch({ ids }),
    k, job.temperature > 0 and job.temperature or 1.0)
  if not ok then fail(400, 'echo, prompt_logprobs: ' .. tostring(moonrl.error_text(lp)), job.echo and 'echo' or 'prompt_logprobs') end
  local sc = { texts = {}, lps = {}, tops = {}, ranks = {} }
  local parts = {}
  for i, id in ipairs(ids) do
    sc.texts[i] = self:token_text(job, id)
    parts[i] = sc.texts[i]
    if i > 1 then -- (position i - 2 of the forward predicts token i)
      local p = i - 2
      sc.lps[i], sc.ranks[i] = lp[p], ranks[p]
      local alts = {}
      for j = 0, k - 1 do alts[#alts + 1] = { top[p * k + j], tlp[p * k + j] } end
      sc.tops[i] = alts
    end
  end
  sc.text = table.concat(parts)
  if job.prompt_lps then -- vLLM's: null, then { "<id>": { logprob, rank, decoded_token } } a position
    local v = arr({ null })
    for i = 2, #ids do
      local pairs_ = { tostring(ids[i]), obj({ 'logprob', sc.lps[i], 'rank', sc.ranks[i], 'decoded_token', sc.texts[i] }) }
      for j = 1, job.prompt_lps do
        local a = sc.tops[i][j]
        if a[1] ~= ids[i] then
          pairs_[#pairs_ + 1], pairs_[#pairs_ + 2] = tostring(a[1]), obj({ 'logprob', a[2], 'rank', j,
            'decoded_token', self:token_text(job, a[1]) })
        end
      end
      v[#v + 1] = obj(pairs_)
    end
    sc.vllm = v
  end
  q.scores = sc
  return sc
end

-- A completion's logprobs with the prompt's before them (echo): the first prompt token's null,
-- the offsets running on into the completion.
function Server:echo_logprobs(job, s, pt)
  local tokens, token_lps, top, offsets = arr({}), arr({}), arr({}), arr({})
  local off = 0
  for i, t in ipairs(pt.texts) do
    tokens[i], offsets[i] = t, off
    off = off + #t
    token_lps[i] = pt.lps[i] or null
    if i > 1 and job.logprobs > 0 then
      top[i] = self:top_entry(job, t, pt.lps[i], pt.tops[i], job.logprobs)
    else
      top[i] = null
    end
  end
  if s.n_tokens > 0 then
    local c = self:logprobs_of(job, s, 0, s.n_tokens, off)
    for k = 1, #c.tokens do
      tokens[#tokens + 1], token_lps[#token_lps + 1] = c.tokens[k], c.token_logprobs[k]
      top[#top + 1], offsets[#offsets + 1] = c.top_logprobs[k], c.text_offset[k]
    end
  end
  return obj({ 'tokens', tokens, 'token_logprobs', token_lps, 'top_logprobs', top, 'text_offset', offsets })
end

-- vLLM's return_token_ids: the sample's token ids and its prompt's, into choice c; and the
-- weight versions of its tokens as spans [start, end) (moonrl's, as vLLM's token API).
function Server:token_ids_of(job, s, c)
  if s.empty then
    c.token_ids, c.prompt_token_ids, c.weight_versions = arr({}), arr(s.q.prompt_ids), arr({})
    return
  end
  local toks = self.engine:output(s.eid, s.j)
  local ids = arr({})
  for k = 0, s.n_tokens - 1 do ids[k + 1] = toks[k] end
  c.token_ids, c.prompt_token_ids = ids, arr(s.q.prompt_ids)
  local first, switches = self.engine:versions(s.eid, s.j, s.n_tokens)
  local spans, start, v = arr({}), 0, first or 0
  for _, sw in ipairs(switches or {}) do
    if sw[1] - 1 > start then spans[#spans + 1] = obj({ 'version', self:label_of(v), 'start', start, 'end', sw[1] - 1 }) end
    start, v = sw[1] - 1, sw[2]
  end
  spans[#spans + 1] = obj({ 'version', self:label_of(v), 'start', start, 'end', s.n_tokens })
  c.weight_versions = spans
end

function Server:label_of(v) return self.version_labels[tonumber(v)] or self.version_label end

-- After a step: one job's samples read, stop strings watched, text streamed; true once done.
function Server:advance_job(job)
  local eng = self.engine
  for _, s in ipairs(job.samples) do
    if not s.done then
      local toks, _, n, reason = eng:output(s.eid, s.j)
      local w = s.watch
      if n > 0 and not job.first_token then -- (time to first token: from the request's dispatch)
        job.first_token = moonrl.now()
        self.counters.ttft_sum = self.counters.ttft_sum + (job.first_token - job.t0)
        self.counters.ttft_count = self.counters.ttft_count + 1
      end
      if job.aborted and not reason then -- (/pause?mode=abort: what it has, finish_reason "abort")
        engine_mod.watch_step(w, toks, n, {}, 0)
        s.done, s.finish = true, 'abort'
        eng:stop_sample(s.eid, s.j)
      elseif engine_mod.watch_step(w, toks, n, job.stops, job.max_stop) then
        s.done, s.finish = true, 'stop'
        eng:stop_sample(s.eid, s.j)
      elseif reason then
        s.done, s.finish = true, reason
      end
      if s.done then
        s.n_tokens = w.fed
        job.remaining = job.remaining - 1
      end
      if job.stream then self:stream_sample(job, s, s.done) end
    end
  end
  if job.remaining > 0 then return false end
  self.jobs[job.key] = nil
  self:finish_job(job)
  return true
end

-- Every active job advanced; one that fails (a bug) gets a 500, the others go on.
function Server:advance()
  local still = {}
  for _, job in ipairs(self.active) do
    local ok, done = pcall(self.advance_job, self, job)
    if not ok then
      self.log('error: ' .. tostring(moonrl.error_text(done)))
      self:fail_job(job, 500, 'internal error: ' .. tostring(moonrl.error_text(done)), 'InternalServerError')
    elseif not done then
      still[#still + 1] = job
    end
  end
  self.active = still
end

-- A job ended early: its client told why (an error event ends a stream), its samples stopped.
function Server:fail_job(job, status, message, etype)
  if self.jobs[job.key] == job then self.jobs[job.key] = nil end
  if job.stream then
    self:send_event(job, obj({ 'error', obj({ 'message', message, 'type', etype, 'param', null, 'code', status }) }))
    C.mrl_http_stream_end(self.http, job.hid)
  else
    self:respond_error(job.hid, status, message, nil, etype)
  end
  pcall(self.abandon, self, job)
end

function Server:release_finished()
  local keep = {}
  for _, eid in ipairs(self.to_release) do
    if self.engine:done(eid) then self.engine:release(eid) else keep[#keep + 1] = eid end
  end
  self.to_release = keep
end

-- ---- routing -------------------------------------------------------------------------------

function Server:metrics()
  local c, st = self.counters, self.stats
  C.mrl_engine_get_stats(self.engine.handle, st)
  local hs = ffi.new('mrl_http_stats')
  C.mrl_http_get_stats(self.http, hs)
  local lines = {}
  local function put(name, v) lines[#lines + 1] = string.format('moonrl_%s %s', name, tostring(tonumber(v))) end
  put('requests_total', c.requests)
  put('request_errors_total', c.errors)
  put('requests_gone_total', c.gone)
  put('requests_timed_out_total', c.timed_out)
  put('prompt_tokens_total', c.prompt_tokens)
  put('generation_tokens_total', c.generation_tokens)
  put('requests_running', #self.active)
  put('time_to_first_token_seconds_sum', c.ttft_sum)
  put('time_to_first_token_seconds_count', c.ttft_count)
  put('requests_running_peak', c.active_peak)
  put('engine_sequences_running_peak', c.running_peak)
  for _, k in ipairs({ 'steps', 'prefill_tokens', 'decode_tokens', 'generated_tokens', 'prefix_hit_tokens', 'preemptions',
    'forks', 'kv_blocks_total', 'kv_blocks_used', 'running', 'waiting' }) do
    put('engine_' .. k, st[k])
  end
  put('http_connections_open', hs.connections_open)
  put('http_connections_total', hs.connections_total)
  put('http_rejected_total', hs.rejected_total)
  put('http_timed_out_total', hs.timed_out_total)
  put('http_evicted_total', hs.evicted_total)
  return table.concat(lines, '\n') .. '\n'
end

function Server:models()
  local list = { obj({ 'id', self.name, 'object', 'model', 'created', self.created, 'owned_by', 'moonrl', 'root', self.path,
    'parent', null, 'max_model_len', self.max_len }) }
  local names = {}
  for name in pairs(self.adapters) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do -- (as vLLM lists its LoRA modules: the base as parent)
    list[#list + 1] = obj({ 'id', name, 'object', 'model', 'created', self.created, 'owned_by', 'moonrl',
      'root', self.adapters[name].dir, 'parent', self.name, 'max_model_len', self.max_len })
  end
  return json.encode(obj({ 'object', 'list', 'data', arr(list) }))
end

local ROUTES = {
  ['/health'] = 'GET', ['/v1/models'] = 'GET', ['/metrics'] = 'GET', ['/version'] = 'GET',
  ['/v1/completions'] = 'POST', ['/v1/chat/completions'] = 'POST', ['/v1/episodes/reward'] = 'POST',
  ['/v1/episodes/next'] = 'POST', ['/v1/episodes/done'] = 'POST',
  ['/pause'] = 'POST', ['/resume'] = 'POST', ['/is_paused'] = 'GET', ['/collective_rpc'] = 'POST',
  ['/update_weight_version'] = 'POST', ['/weight_info'] = 'GET', ['/reset_prefix_cache'] = 'POST',
  ['/v1/load_lora_adapter'] = 'POST', ['/v1/unload_lora_adapter'] = 'POST',
}
-- (the weight-transfer routes: the answer's message, the body's field named in a refusal)
local TRANSFER = {
  ['/init_weight_transfer_engine'] = { 'Weight transfer initialized', 'init_info' },
  ['/start_weight_update'] = { 'Weight update started' },
  ['/update_weights'] = { 'Weights updated', 'update_info' },
  ['/finish_weight_update'] = { 'Weight update finished', 'weight_version' },
  ['/shutdown_weight_transfer_engine'] = { 'Weight transfer shut down' },
}
local CONTROL = { ['/pause'] = true, ['/resume'] = true, ['/is_paused'] = true, ['/collective_rpc'] = true,
  ['/update_weight_version'] = true, ['/weight_info'] = true, ['/reset_prefix_cache'] = true,
  ['/v1/load_lora_adapter'] = true, ['/v1/unload_lora_adapter'] = true }
for path in pairs(TRANSFER) do ROUTES[path], CONTROL[path] = 'POST', true end

local function bearer(auth) return auth and auth:match('^[Bb]earer%s+(%S+)') end

-- Training mode: the episode a request names (see the top), or nil; one the recorder does not know
-- is refused.
function Server:episode_of(body, auth)
  if not self.record then return nil end
  local id = field(body, 'user')
  local meta = field(body, 'metadata')
  if id == nil and json.is_object(meta) then id = field(meta, 'episode_id') end
  if id == nil then id = bearer(auth) end
  if id == nil then return nil end
  if type(id) ~= 'string' then bad("the episode id ('user', 'metadata.episode_id') must be a string", 'user') end
  if not self.record.known(id) then fail(404, string.format("no episode '%s' in flight", utf8_clean(id:sub(1, 80))), 'user',
    'NotFoundError') end
  return id
end

local function not_training(path)
  fail(404, string.format('no route POST %s (the server is not in training mode)', path), nil, 'NotFoundError')
end

-- The episode a /v1/episodes/* body names ("episode_id", else the API key), known to the recorder.
function Server:named_episode(body, auth)
  if not json.is_object(body) then bad('the body must be a JSON object') end
  local id = field(body, 'episode_id')
  if id == nil then id = bearer(auth) end
  if type(id) ~= 'string' then bad("'episode_id' (a string) is required", 'episode_id') end
  if not self.record.known(id) then fail(404, string.format("no episode '%s' in flight", utf8_clean(id:sub(1, 80))),
    'episode_id', 'NotFoundError') end
  return id
end

local function reward_field(body, required)
  local r = field(body, 'reward')
  if r == nil and not required then return nil end
  if type(r) ~= 'number' or r ~= r or r == math.huge or r == -math.huge then
    bad("'reward' must be a finite number", 'reward')
  end
  return r
end

-- POST /v1/episodes/reward: { "episode_id" (or the API key), "reward": a finite number }.
function Server:episode_reward(hid, body, auth)
  if not self.record then not_training('/v1/episodes/reward') end
  local id = self:named_episode(body, auth)
  local r = reward_field(body, true)
  self.record.reward(id, r)
  self:respond(hid, 200, json.encode(obj({ 'episode_id', id, 'reward', r })))
end

-- POST /v1/episodes/done: { "episode_id" (or the API key), "reward"?: x, "error"?: a string (the
-- agent failed the episode) }. The episode's later requests are refused.
function Server:episode_done(hid, body, auth)
  if not self.record then not_training('/v1/episodes/done') end
  local id = self:named_episode(body, auth)
  local r = reward_field(body, false)
  local e = field(body, 'error')
  if e ~= nil and type(e) ~= 'string' then bad("'error' must be a string", 'error') end
  self.record.done(id, r, e and utf8_clean(e:sub(1, 300)))
  self:respond(hid, 200, json.encode(obj({ 'episode_id', id, 'done', true })))
end

-- POST /v1/episodes/next: held in next_waiting until hand_out answers it.
function Server:episode_next(hid, auth)
  if not (self.record and self.record.next) then not_training('/v1/episodes/next') end
  self.next_waiting[#self.next_waiting + 1] = { hid = hid, worker = bearer(auth) }
  self:hand_out()
end

-- Answer the held /v1/episodes/next requests that record.next has an episode (or its end) for. An
-- answer that did not go out (the worker is gone) leaves its episode to the next worker.
function Server:hand_out()
  if #self.next_waiting == 0 then return end
  local still = {}
  for _, w in ipairs(self.next_waiting) do
    local e = self.record.next(w.worker)
    if e == false then
      self:respond(w.hid, 200, '{"episode_id":null}')
    elseif e == nil then
      still[#still + 1] = w
    elseif self:respond(w.hid, 200, json.encode(obj({ 'episode_id', e.id, 'record', e.record }))) then
      self.record.claim(e.id, w.worker)
    end
  end
  self.next_waiting = still
end

-- ---- the control protocol (vLLM's RL API; see the top) ---------------------------------------

local function query_field(query, key)
  for k, v in query:gmatch('([^&=]+)=([^&]*)') do if k == key then return v end end
  return nil
end

-- A request's body as JSON (a 400 for bytes that are not UTF-8, or not JSON).
local function decode_body(body)
  local at = utf8_error(body) -- JSON is UTF-8 (RFC 8259); the decoder would pass other bytes on
  if at then bad(string.format('the request body is not valid UTF-8 (byte %d)', at - 1)) end
  local ok, req = pcall(json.decode, body, 'request body')
  if not ok then bad('invalid JSON in the request body: ' .. moonrl.error_text(req)) end
  return req
end

-- A control route's body: a JSON object, none being {}.
local function json_body(body)
  if body == '' then return obj() end
  local req = decode_body(body)
  if not json.is_object(req) then bad('the body must be a JSON object') end
  return req
end

-- Cached prefixes dropped (they came from other weights), when nothing is in flight: false else.
function Server:drop_prefixes()
  if self.engine:num_unfinished() > 0 then return false end
  self:release_finished()
  if #self.to_release > 0 then return false end
  self.engine:reset()
  return true
end

-- The weights of a Hugging Face directory read into the served model, as the next version.
function Server:reload_weights(kwargs)
  if not json.is_object(kwargs) then bad("'kwargs' must be an object", 'kwargs') end
  local path = field(kwargs, 'weights_path')
  if type(path) ~= 'string' or path == '' then bad("'kwargs.weights_path' (a directory) is required", 'kwargs') end
  if self.engine.tick then fail(400, 'reload_weights: not with --tp (the ranks would need the weights too)', 'method') end
  local t0 = moonrl.now()
  local want = field(kwargs, 'crc32c') -- (moonrl's: the CRC-32C of model.safetensors as its writer computed it, hex)
  if want ~= nil then
    local okc, crc = pcall(fs.crc32c_file, path .. '/model.safetensors')
    if not okc or string.format('%08x', crc) ~= tostring(want):lower() then
      fail(400, string.format('reload_weights: %s/model.safetensors: %s', path, okc and string.format(
        'CRC-32C %08x, the writer\'s %s', crc, tostring(want)) or moonrl.error_text(crc)), 'kwargs')
    end
  end
  local ok, err = pcall(self.engine.model.read_dir, self.engine.model, path, 'the served model')
  if not ok then fail(400, 'reload_weights: ' .. tostring(moonrl.error_text(err)), 'kwargs') end
  self:weights_changed()
  self.log(string.format('weights reloaded from %s in %.2f s', path, moonrl.now() - t0))
end

-- The served model's weights changed: the next version. The requests kept in flight read the new
-- weights from their next token (their panels packed again); with none, the cached prefixes go.
function Server:weights_changed()
  if not self:drop_prefixes() then self.engine:swap_params(nil) end
  self:new_version()
end

-- The engine's samples from now on are of a new version, labelled as the weights are now.
function Server:new_version()
  self.weights_version = (self.weights_version or 0) + 1
  self.engine:set_version(self.weights_version)
  self.version_labels[self.weights_version] = self.version_label
  self.counters.weight_updates = (self.counters.weight_updates or 0) + 1
end

-- The weight-transfer routes (moonrl.serve.transfer: buckets as safetensors files). A failed call
-- is a 400 naming what; an update that failed after some of its bytes landed leaves the weights
-- labelled 'mixed' (of no version) until an update finishes.
function Server:transfer_route(path, req)
  if self.engine.tick then fail(400, path:sub(2) .. ': not with --tp (the ranks would need the weights too)') end
  self.transfer = self.transfer or require('moonrl.serve.transfer').new(self.engine.model)
  local t = self.transfer
  local ok, a, b = pcall(function()
    if path == '/init_weight_transfer_engine' then return t:init(field(req, 'init_info') or obj()) end
    if path == '/start_weight_update' then return t:start() end
    if path == '/update_weights' then return t:update(field(req, 'update_info')) end
    if path == '/shutdown_weight_transfer_engine' then return t:shutdown() end
    local v = field(req, 'weight_version')
    if v ~= nil and (type(v) ~= 'string' or v == '' or #v > 200) then
      error("'weight_version' must be a non-empty string", 0)
    end
    return t:finish()
  end)
  if not ok then
    if t.failed and self.version_label ~= 'mixed' then
      self.version_label = 'mixed'
      self:weights_changed()
    end
    bad(moonrl.error_text(a), TRANSFER[path][2])
  end
  if path == '/finish_weight_update' then
    local v = field(req, 'weight_version')
    if v then self.version_label = v end
    if a > 0 then
      self:weights_changed()
      self.log(string.format('weights updated: %d tensors, %d bytes', a, b))
    elseif self.weights_version then
      self.version_labels[self.weights_version] = self.version_label
    end
  end
  return TRANSFER[path][1]
end

-- The /pause?mode=wait requests held while the requests in flight drained.
function Server:answer_pause_waiters()
  for _, w in ipairs(self.pause_waiters) do self:respond(w, 200, '{"status":"paused"}') end
  self.pause_waiters = {}
end

function Server:control(hid, path, body, query)
  local function ok(o) return self:respond(hid, 200, json.encode(o)) end
  if path == '/is_paused' then return ok(obj({ 'is_paused', self.paused ~= nil })) end
  if path == '/weight_info' then return ok(obj({ 'weight_version', self.version_label })) end
  if path == '/pause' then
    local mode = query_field(query, 'mode') or 'wait'
    if mode ~= 'wait' and mode ~= 'keep' and mode ~= 'abort' then
      bad(string.format("mode '%s': wait, keep or abort", utf8_clean(mode:sub(1, 20))), 'mode')
    end
    self.paused = self.paused or mode
    if mode == 'abort' then
      for _, job in ipairs(self.active) do job.aborted = true end
      self:advance()
    end
    if query_field(query, 'clear_cache') == 'true' then self:drop_prefixes() end
    if mode == 'wait' and #self.active > 0 then -- answered once they are done (step)
      self.pause_waiters[#self.pause_waiters + 1] = hid
      return
    end
    return ok(obj({ 'status', 'paused' }))
  end
  if path == '/resume' then
    self.paused = nil
    self:answer_pause_waiters()
    local held = self.held
    self.held = {}
    for _, r in ipairs(held) do self:dispatch(r.hid, r.method, r.path, r.body, r.auth, r.query) end
    return ok(obj({ 'status', 'resumed' }))
  end
  local req = json_body(body)
  if path == '/update_weight_version' then
    local v = field(req, 'new_version')
    if type(v) == 'number' then v = json.number(v) end
    if type(v) ~= 'string' or v == '' or #v > 200 then bad("'new_version' (a string) is required", 'new_version') end
    self.version_label = v
    if self.weights_version then self.version_labels[self.weights_version] = v end
    return ok(obj({ 'success', true, 'new_version', v }))
  end
  if path == '/reset_prefix_cache' then return ok(obj({ 'success', self:drop_prefixes() })) end
  if path == '/v1/load_lora_adapter' then -- (vLLM answers these two in plain text)
    local name = field(req, 'lora_name')
    self:load_adapter(name, field(req, 'lora_path'))
    return self:respond(hid, 200, string.format("Success: LoRA adapter '%s' added successfully.", name), 'text/plain')
  end
  if path == '/v1/unload_lora_adapter' then
    local name = field(req, 'lora_name')
    self:unload_adapter(name)
    return self:respond(hid, 200, string.format("Success: LoRA adapter '%s' removed successfully.", name), 'text/plain')
  end
  if TRANSFER[path] then return ok(obj({ 'message', self:transfer_route(path, req) })) end
  -- /collective_rpc: the one method a trainer needs of it
  local method = field(req, 'method')
  if method ~= 'reload_weights' then
    bad(string.format("collective_rpc: method '%s' is not served (reload_weights is)", utf8_clean(tostring(method):sub(1, 40))),
      'method')
  end
  self:reload_weights(field(req, 'kwargs') or obj())
  return ok(obj({ 'results', arr({ null }) }))
end

-- Training mode: a finished request's turn to its recorder, its tokens as the engine sampled them.
function Server:record_turn(job)
  local s = job.samples[1]
  local toks, lps = self.engine:output(s.eid, s.j)
  local ids, lp = {}, {}
  for k = 0, s.n_tokens - 1 do ids[k + 1], lp[k + 1] = toks[k], lps[k] end
  local v, sw = self.engine:versions(s.eid, s.j, s.n_tokens)
  self.record.turn(job.episode, { prompt_ids = job.reqs[1].prompt_ids, ids = ids, logprobs = lp, text = utf8_clean(s.watch.text),
    finish_reason = s.finish, version = v, version_switches = sw })
end

function Server:handle(hid, method, path, body, auth, query)
  local want = ROUTES[path]
  if not want then fail(404, string.format('no route %s %s', method, path), nil, 'NotFoundError') end
  if method ~= want then fail(405, string.format('%s takes %s, not %s', path, want, method), nil, 'MethodNotAllowed') end
  if path == '/health' then return self:respond(hid, 200, '', 'text/plain') end
  if path == '/v1/models' then return self:respond(hid, 200, self:models()) end
  if path == '/metrics' then return self:respond(hid, 200, self:metrics(), 'text/plain; version=0.0.4') end
  if path == '/version' then return self:respond(hid, 200, json.encode(obj({ 'version', moonrl.version().version }))) end
  if self.draining then fail(503, 'the server is shutting down', nil, 'ServiceUnavailable') end
  if CONTROL[path] then return self:control(hid, path, body, query or '') end
  if self.paused then -- (read at /resume, in order)
    self.held[#self.held + 1] = { hid = hid, method = method, path = path, body = body, auth = auth, query = query }
    return
  end
  if path == '/v1/episodes/next' then return self:episode_next(hid, auth) end -- (its body, if any, unread)
  local req = decode_body(body)
  if path == '/v1/episodes/reward' then return self:episode_reward(hid, req, auth) end
  if path == '/v1/episodes/done' then return self:episode_done(hid, req, auth) end
  local episode = json.is_object(req) and self:episode_of(req, auth)
  if episode and (field(req, 'n') or 1) ~= 1 then bad("a request of an episode asks for one sample ('n': 1)", 'n') end
  local job = self:new_job(hid, req, path == '/v1/chat/completions', episode or nil)
  if job.remaining == 0 then return self:finish_job(job) end -- (echo alone: nothing to generate)
  job.key = tonumber(hid)
  self.jobs[job.key] = job
  self.active[#self.active + 1] = job
  self.counters.active_peak = math.max(self.counters.active_peak, #self.active)
  if job.stream then C.mrl_http_stream_begin(self.http, hid, 200, 'text/event-stream') end
end

function Server:on_request(r)
  self.counters.requests = self.counters.requests + 1
  local hid = r.id
  self:dispatch(hid, ffi.string(r.method), ffi.string(r.path), ffi.string(r.body, r.body_len),
    r.authorization ~= nil and ffi.string(r.authorization) or nil, ffi.string(r.query))
end

function Server:dispatch(hid, method, path, body, auth, query)
  local ok, err = pcall(self.handle, self, hid, method, path, body, auth, query)
  if not ok then
    if getmetatable(err) == HttpError then
      self:respond_error(hid, err.status, err.message, err.param, err.type)
    else -- a bug: the request gets a 500, the server goes on
      local msg = moonrl.error_text(err)
      self.log('error: ' .. tostring(msg))
      self:respond_error(hid, 500, 'internal error: ' .. tostring(msg))
    end
  end
end

function Server:on_gone(hid)
  local key = tonumber(hid)
  local job = self.jobs[key]
  if not job then return end
  self.jobs[key] = nil
  self.counters.gone = self.counters.gone + 1
  self:abandon(job)
  for i, j in ipairs(self.active) do
    if j == job then table.remove(self.active, i) break end
  end
end

-- ---- the loop ------------------------------------------------------------------------------

-- Poll HTTP once (waiting up to timeout_ms when nothing is ready), then take what else is ready, up
-- to 256 requests (the rest wait in the HTTP layer for the next poll, after an engine step). A
-- request taken from mrl_http_poll must be handled before the next poll frees its strings: the
-- count is checked before polling again, never after.
local MAX_REQUESTS_PER_POLL = 256
function Server:poll(timeout_ms)
  local r, got = self.req, self.got
  moonrl.check(C.mrl_http_poll(self.http, timeout_ms, r, got))
  local handled = 0
  while got[0] == 1 do
    self:on_request(r)
    handled = handled + 1
    if handled == MAX_REQUESTS_PER_POLL then break end
    moonrl.check(C.mrl_http_poll(self.http, 0, r, got))
  end
  local ng = C.mrl_http_take_gone(self.http, self.gone_ids, 64)
  while ng > 0 do
    for i = 0, ng - 1 do self:on_gone(self.gone_ids[i]) end
    ng = C.mrl_http_take_gone(self.http, self.gone_ids, 64)
  end
end

function Server:step()
  local eng = self.engine
  if #self.active == 0 then self:answer_pause_waiters() end -- (/pause?mode=wait: drained)
  -- paused: nothing steps, but requests draining for a /pause?mode=wait
  if self.paused and not (self.paused == 'wait' and #self.pause_waiters > 0) then
    self:release_finished()
    return
  end
  if eng:num_unfinished() > 0 then
    local ok, err = pcall(eng.step, eng)
    if not ok then
      -- the engine refused a step (e.g. non-finite logits): the requests in it fail, the server goes on;
      -- an engine that keeps failing with nothing left to fail is the end
      if moonrl.is_stop_request(err) then error(err, 0) end
      self.step_failures = (self.step_failures or 0) + 1
      self.log('error: engine step: ' .. tostring(moonrl.error_text(err)))
      if self.step_failures > 3 and #self.active == 0 then error(err, 0) end
      for _, job in ipairs(self.active) do
        self:fail_job(job, 500, 'generation failed: ' .. tostring(moonrl.error_text(err)), 'InternalServerError')
      end
      self.active = {}
      return
    end
    self.step_failures = 0
    C.mrl_engine_get_stats(eng.handle, self.stats)
    local running = tonumber(self.stats.running)
    if running > self.counters.running_peak then self.counters.running_peak = running end
  end
  self:advance()
  self:release_finished()
end

-- The requests past their deadline (request_timeout): a 503 (an error event on a stream), their
-- samples stopped.
function Server:expire(now)
  local late = false
  for _, job in ipairs(self.active) do
    if now > job.deadline then late = true break end
  end
  if not late then return end
  local still = {}
  for _, job in ipairs(self.active) do
    if now > job.deadline then
      self.counters.timed_out = self.counters.timed_out + 1
      self:fail_job(job, 503, string.format('the request was not finished within %s s (the server\'s --request-timeout)',
        json.number(self.request_timeout)), 'ServiceUnavailable')
    else
      still[#still + 1] = job
    end
  end
  self.active = still
end

-- Abort what is left at the end of a shutdown.
function Server:abort_all()
  for _, job in ipairs(self.active) do
    self:fail_job(job, 503, 'the server is shutting down', 'ServiceUnavailable')
  end
  self.active = {}
end

-- One turn of the loop: poll HTTP (0 ms while there is work, up to idle_ms when idle), end the
-- requests past their deadline, step the engine, answer the held /v1/episodes/next.
function Server:turn(idle_ms)
  local busy = (self.engine:num_unfinished() > 0 or #self.active > 0) and (not self.paused or #self.pause_waiters > 0)
  self:poll(busy and 0 or idle_ms)
  if #self.active > 0 then self:expire(moonrl.now()) end
  self:step()
  self:hand_out()
end

-- Serve until SIGINT / SIGTERM (or self.stop = true): then stop listening, finish the requests in
-- flight for up to shutdown_timeout seconds, answer the rest with 503, and return.
function Server:run(idle_ms)
  idle_ms = idle_ms or 50
  local deadline
  while true do
    if not self.draining and (C.mrl_stop_requested() ~= 0 or self.stop) then
      self.draining = true
      deadline = moonrl.now() + self.shutdown_timeout
      C.mrl_http_stop_listening(self.http)
      self.log(string.format('shutting down (%s): %d request(s) in flight', C.mrl_stop_requested() ~= 0 and
        ffi.string(C.mrl_stop_reason()) or 'stop', #self.active))
    end
    if self.draining and (#self.active == 0 or moonrl.now() > deadline) then break end
    self:turn(idle_ms)
    if self.engine.tick then self.engine:tick() end -- (moonrl.serve.mirror: an idle lead's word to its ranks)
  end
  self:abort_all()
  -- the abandoned requests: finished by one more step, then released
  if self.engine:num_unfinished() > 0 then self.engine:step() end
  self:release_finished()
end

function Server:close()
  if self.http ~= nil then
    C.mrl_http_close(self.http, 2000)
    self.http = nil
  end
end

return M
