-- The generation engine (core/include/moonrl/engine.h): continuous batching
-- over a paged KV cache, on the model's own parameter buffer (no copy: after
-- an optimizer step the next generate sees the new weights).
--
--   local engine = moonrl.engine.new(model, { kv_cache_bytes = 64 * 2^20, block_size = 16,
--     max_batch_tokens = 2048, max_seqs = 256, seed = 1 })
--   local results = engine:generate({ { prompt_ids = {1, 5, 9}, n = 8 }, { prompt = 'Hi', n = 1 } },
--     { temperature = 1.0, top_k = 0, top_p = 1.0, min_p = 0, max_tokens = 64, eos_ids = {2},
--       stop_ids = {}, stop = {'\n\n'}, tokenizer = tok, step = step })
--   results[i][j] = { ids = {...}, logprobs = {...}, finish_reason = 'stop' | 'length', text = '...' }
--   (opts.top_logprobs = k, at most 20: also top_logprobs = { { {id, logprob}, ... k }, ... } a token)
--   engine:stats()  -- steps, prefill/decode tokens, preemptions, prefix hits, KV blocks
--   engine:set_adapter(k, ad)  -- LoRA adapter set ad served in slot k: requests with adapter = k use it
--
-- Asynchronous RL (engine.h):
--   engine:swap_params(buf, n)  -- read the weights from buf (float cdata of model.n_params; nil: the
--                                  model's own) from the next step on, keeping the requests in flight and
--                                  their K/V (an in-flight weight update, e.g. from opts.on_text); the old
--                                  buffer is free to reuse once it returns, buf is kept alive by the engine
--   engine:run_async(threads)   -- run the requests queued (through the C API: generate queues and runs its
--                                  own) on a background thread with `threads` OpenMP threads of its own;
--                                  every other call on the engine raises "engine busy" until engine:wait()
--                                  (which raises the run's error, if any); engine:running() is true until then
--   engine:use_weights(w)       -- read a weight store's versions (moonrl/weight_store.h; nil: the model's own
--                                  buffer again): w = { store, reader, min_version (wait for a version at
--                                  least this and read it in place; nil: keep the buffer read now, as
--                                  w.version), timeout (s, 0: none), follow (take newer versions between
--                                  steps, the requests in flight kept) }. While it is in use each result
--                                  carries version (its first token's) and version_switches = { {k, v}, ... }
--                                  (token k, 1-based, and those after it sampled with version v)
--   engine:stream(threads)      -- one engine for many coroutines' requests, never reset (see "a stream"
--                                  below): moonrl.train.rollout's async.stream
--   engine.background = N       -- inside a coroutine, generate runs the engine on a background thread of N
--                                  threads and yields until the caller resumes it (moonrl.train.rollout overlaps
--                                  the next batch with training so); engine.on_busy() is called when generate
--                                  finds a background run still in progress
--
-- Routing replay (mixture of experts, engine.h): engine:record_routing(true), or opts.record_routing
-- to M.new, makes every later request keep the experts each of its tokens went to; each result then
-- carries routing = int16_t cdata [(prompt + ids) positions * sparse layers * num_experts_per_tok]
-- (-1 where a position never ran: cached prompt prefixes, the last token), which the trainer's
-- forward replays (model:forward's opts.routing; moonrl.batch packs it, moe.routing_replay).
--
-- opts.on_text = function(i, j, piece) (with a tokenizer) is called between steps with each new
-- piece of sample j of request i's text, as the streaming decoder completes it (stop strings cut).
--
-- opts.eos_ids defaults to the model's eos_token_id ({} for none); a text prompt is encoded without
-- special tokens added (render chat templates first); the EOS / stop token is kept in ids.
-- Each call starts by resetting the engine (requests and cached prefixes; the weights may have changed).
-- Sample j of request i draws from the random stream (seed, step, prompt_index = i - 1 unless the
-- request gives prompt_index, j - 1): the same samples whatever the batch or the cache size.
-- logprobs are under softmax(logits / temperature) over the whole vocabulary (temperature 1 when
-- greedy): what the trainer's forward gives for the same tokens (moonrl.engine.mismatch compares).
local moonrl = require('moonrl')
local ffi = require('ffi')
local C = moonrl.C

local M = {}

local Engine = {}
Engine.__index = Engine

local function opt_int(opts, key, lo, where)
  local v = opts[key]
  if v == nil then return nil end
  if type(v) ~= 'number' or v ~= math.floor(v) or v < lo then
    error(string.format('%s: %s must be an integer >= %d (got %s)', where, key, lo, tostring(v)), 3)
  end
  return v
end

-- opts: kv_cache_bytes, block_size, max_batch_tokens, max_seqs, max_model_len, prefix_caching
-- (default true), pack_weights (default true: the layers' matrices copied as weight panels at the
-- start of each generate call, see engine.h; false reads them in place), cuda_graphs (default true:
-- a GPU engine replays its decode steps as CUDA graphs), kv_cache_dtype ('auto' (default): bf16
-- when the model is bf16, else fp32; 'fp32'; 'bf16': see engine.h), mla_cache (a deepseek_v3 model:
-- 'latent' (default), the latent cache and the absorbed form, or 'expanded': engine.h), mtp (default false:
-- speculative decoding with the model's multi-token prediction layer as the draft, engine.h), seed (default 0).
function M.new(model, opts)
  opts = opts or {}
  if type(model) ~= 'table' or model.handle == nil then error('engine.new: expected a moonrl.model object', 2) end
  local cfg = ffi.new('mrl_engine_config')
  C.mrl_engine_config_default(cfg)
  local w = 'engine.new'
  cfg.kv_cache_bytes = opt_int(opts, 'kv_cache_bytes', 1, w) or cfg.kv_cache_bytes
  cfg.block_size = opt_int(opts, 'block_size', 1, w) or cfg.block_size
  cfg.max_num_batched_tokens = opt_int(opts, 'max_batch_tokens', 1, w) or cfg.max_num_batched_tokens
  cfg.max_num_seqs = opt_int(opts, 'max_seqs', 1, w) or cfg.max_num_seqs
  cfg.max_model_len = opt_int(opts, 'max_model_len', 2, w) or cfg.max_model_len
  for _, key in ipairs({ 'prefix_caching', 'pack_weights', 'cuda_graphs', 'mtp' }) do
    local v = opts[key]
    if v ~= nil and type(v) ~= 'boolean' then
      error(string.format('%s: %s must be true or false (got %s)', w, key, tostring(v)), 2)
    end
    if v ~= nil then cfg[key] = v and 1 or 0 end
  end
  local mla = { latent = C.MRL_MLA_LATENT, expanded = C.MRL_MLA_EXPANDED }
  if opts.mla_cache ~= nil then
    cfg.mla_cache = mla[opts.mla_cache] or error(string.format(
      "%s: mla_cache must be 'latent' or 'expanded' (got %s)", w, tostring(opts.mla_cache)), 2)
  end
  local kv_dtypes = { auto = C.MRL_KV_AUTO, fp32 = C.MRL_KV_FP32, bf16 = C.MRL_KV_BF16 }
  if opts.kv_cache_dtype ~= nil then
    cfg.kv_cache_dtype = kv_dtypes[opts.kv_cache_dtype] or error(string.format(
      "%s: kv_cache_dtype must be 'auto', 'fp32' or 'bf16' (got %s)", w, tostring(opts.kv_cache_dtype)), 2)
  end
  local h = ffi.new('mrl_engine *[1]')
  moonrl.check(C.mrl_engine_create(model.handle, cfg, h), 2)
  -- the engine borrows the model: keep it alive with the engine
  local e = setmetatable({ handle = ffi.gc(h[0], C.mrl_engine_free), model = model, seed = opts.seed or 0,
    pack_weights = cfg.pack_weights ~= 0, mtp = cfg.mtp ~= 0 }, Engine)
  if opts.record_routing then e:record_routing(true) end
  return e
end

-- Keep each later request's routing (see the top of the file); a dense model has none to keep.
function Engine:record_routing(on)
  moonrl.check(C.mrl_engine_record_routing(self.handle, on and 1 or 0), 2)
  self.routing_width = on and self.model:num_moe_layers() * (self.model.config.num_experts_per_tok or 0) or nil
  if self.routing_width == 0 then self.routing_width = nil end
end

-- Sample j of request req: its routing (int16_t cdata) and number of positions.
local out_positions = ffi.new('int64_t[1]')
local function routing(self, req, j)
  moonrl.check(C.mrl_engine_get_output_routing(self.handle, req, j, nil, 0, out_positions), 3)
  local n = tonumber(out_positions[0]) * self.routing_width
  local r = ffi.new('int16_t[?]', n)
  moonrl.check(C.mrl_engine_get_output_routing(self.handle, req, j, r, n, out_positions), 3)
  return r
end

local function int_array(list, what)
  local n = list and #list or 0
  local arr = ffi.new('int32_t[?]', math.max(n, 1))
  for i = 1, n do
    local v = list[i]
    if type(v) ~= 'number' or v ~= math.floor(v) then
      error(string.format('engine:generate: %s[%d] is not an integer (%s)', what, i, tostring(v)), 5)
    end
    arr[i - 1] = v
  end
  return arr, n
end

local function sampling_params(opts)
  local p = ffi.new('mrl_sampling_params')
  p.temperature = opts.temperature or 1.0
  p.top_k = opts.top_k or 0
  p.top_p = opts.top_p or 1.0
  p.min_p = opts.min_p or 0
  return p
end

local FINISH = { [C.MRL_FINISH_LENGTH] = 'length', [C.MRL_FINISH_EOS] = 'stop', [C.MRL_FINISH_STOP] = 'stop',
  [C.MRL_FINISH_CALLER] = 'stop' }

local out_tokens, out_lps = ffi.new('const int32_t *[1]'), ffi.new('const float *[1]')
local out_n, out_reason = ffi.new('int[1]'), ffi.new('int[1]')

local function output(self, req, j)
  moonrl.check(C.mrl_engine_get_output(self.handle, req, j, out_tokens, out_lps, out_n, out_reason), 3)
  return out_tokens[0], out_lps[0], out_n[0], out_reason[0]
end

-- Per sample of the stop-string pass: its stream decoder, the text so far,
-- how many of its tokens were fed, whether a stop string ended it.
local function new_watch(tok)
  return { stream = tok:stream({ skip_special = true }), text = '', fed = 0, sent = 0 }
end

-- Feed sample w its new tokens; returns true when a stop string appeared
-- (w.text is then cut before it).
local function watch_step(w, toks, n, stops, max_stop)
  while w.fed < n do
    local piece = w.stream:step(toks[w.fed])
    w.fed = w.fed + 1
    if piece ~= '' then
      local from = math.max(1, #w.text - max_stop + 2)
      w.text = w.text .. piece
      local cut
      for _, s in ipairs(stops) do
        local at = w.text:find(s, from, true)
        if at and (not cut or at < cut) then cut = at end
      end
      if cut then
        w.text = w.text:sub(1, cut - 1)
        return true
      end
    end
  end
  return false
end

-- The weights versions of a sample's n tokens: its first token's, and the switches after it.
local out_versions = ffi.new('const int64_t *[1]')
local function versions(self, req, j, n)
  moonrl.check(C.mrl_engine_get_output_versions(self.handle, req, j, out_versions), 3)
  local v = out_versions[0]
  if n == 0 then return tonumber(C.mrl_engine_version(self.handle)), nil end
  local first, switches, last = tonumber(v[0]), nil, v[0]
  for k = 1, n - 1 do
    if v[k] ~= last then
      last = v[k]
      switches = switches or {}
      switches[#switches + 1] = { k + 1, tonumber(last) }
    end
  end
  return first, switches
end

-- The options generate checks once per call: stop strings, eos ids, sampling parameters.
local function call_options(self, opts)
  local tok = opts.tokenizer
  local stops = opts.stop or {}
  if type(stops) == 'string' then stops = { stops } end
  local max_stop = 0
  for _, s in ipairs(stops) do
    if type(s) ~= 'string' or s == '' then error('engine:generate: stop strings must be non-empty strings', 3) end
    max_stop = math.max(max_stop, #s)
  end
  if #stops > 0 and not tok then error('engine:generate: stop strings need opts.tokenizer', 3) end
  if opts.on_text and not tok then error('engine:generate: on_text needs opts.tokenizer', 3) end
  local eos = opts.eos_ids
  if eos == nil then
    local id = self.model.config.eos_token_id
    eos = (id and id >= 0) and { id } or {}
  end
  return { tok = tok, stops = stops, max_stop = max_stop, on_text = opts.on_text, eos = eos,
    top_logprobs = opts.top_logprobs or 0 }
end

-- Queue the requests (see generate); returns the job: { reqs = { {id, n}, ... } }. Nothing is
-- queued when one request is bad.
local function submit(self, requests, opts, o)
  local eos_arr, n_eos = int_array(o.eos, 'eos_ids')
  local stop_arr, n_stop = int_array(opts.stop_ids or {}, 'stop_ids')
  local r = ffi.new('mrl_engine_request')
  r.params = sampling_params(opts)
  r.eos_ids, r.n_eos, r.stop_ids, r.n_stop = eos_arr, n_eos, stop_arr, n_stop
  r.seed, r.step = opts.seed or self.seed, opts.step or 0
  local max_tokens = opts.max_tokens or 64
  local id_out = ffi.new('int[1]')
  local reqs = {}
  for i, q in ipairs(requests) do
    local ids = q.prompt_ids
    if ids == nil and q.prompt ~= nil then
      if not o.tok then error('engine:generate: request ' .. i .. ' has a prompt text but no opts.tokenizer', 3) end
      ids = o.tok:encode(q.prompt, { add_special = false })
    end
    if type(ids) ~= 'table' then error('engine:generate: request ' .. i .. ' needs prompt_ids (or prompt)', 3) end
    local arr, n = int_array(ids, 'prompt_ids')
    r.prompt, r.prompt_len = arr, n
    r.n = q.n or 1
    r.max_new_tokens = q.max_tokens or max_tokens
    r.prompt_index = q.prompt_index or (i - 1)
    r.first_sample = q.first_sample or 0
    r.top_logprobs = opts.top_logprobs or 0
    r.adapter = q.adapter or opts.adapter or 0
    local st = C.mrl_engine_add_request(self.handle, r, id_out)
    if st ~= 0 then
      local msg = moonrl.last_error()
      if self.streaming then -- the requests before it: finished at the next step, never read
        for _, q in ipairs(reqs) do
          for j = 0, q.n - 1 do C.mrl_engine_stop_sample(self.handle, q.id, j) end
        end
      else
        C.mrl_engine_reset(self.handle) -- ignore: nothing ran yet (the requests before it dropped)
      end
      error(string.format('engine:generate: request %d: %s', i, msg), 3)
    end
    reqs[i] = { id = id_out[0], n = r.n }
  end
  return { reqs = reqs }
end

-- The engine's steps until the job is done, watching its samples' text for stop strings and
-- feeding on_text.
local function run_watched(self, job, o)
  local watches, stops, max_stop, on_text = {}, o.stops, o.max_stop, o.on_text
  local unf = ffi.new('int[1]')
  for i, q in ipairs(job.reqs) do
    watches[i] = {}
    for j = 1, q.n do watches[i][j] = new_watch(o.tok) end
  end
  repeat
    moonrl.check_stop()
    moonrl.check(C.mrl_engine_step(self.handle, unf), 3)
    for i, q in ipairs(job.reqs) do
      for j = 1, q.n do
        local w = watches[i][j]
        if not w.done then
          local toks, _, n, reason = output(self, q.id, j - 1)
          if watch_step(w, toks, n, stops, max_stop) then
            w.stopped = true
            w.done = true
            moonrl.check(C.mrl_engine_stop_sample(self.handle, q.id, j - 1), 3)
          elseif reason ~= 0 then
            w.done = true
          end
          if on_text then -- hold back what could still become a stop string
            local upto = w.done and #w.text or #w.text - math.max(max_stop - 1, 0)
            if upto > w.sent then
              on_text(i, j, w.text:sub(w.sent + 1, upto))
              w.sent = upto
            end
          end
        end
      end
    end
  until unf[0] == 0
  job.watches = watches
end

-- The job's results (see the top of the file); release: free its requests in the engine.
local function collect(self, job, o, release)
  local results = {}
  for i, q in ipairs(job.reqs) do
    local list = {}
    for j = 1, q.n do
      local toks, lps, n, reason = output(self, q.id, j - 1)
      local ids, lp = {}, {}
      for k = 0, n - 1 do
        ids[k + 1] = toks[k]
        lp[k + 1] = lps[k]
      end
      local s = { ids = ids, logprobs = lp, finish_reason = FINISH[reason] or 'stop' }
      if o.top_logprobs > 0 then s.top_logprobs = self:top_logprobs(q.id, j - 1, n) end
      if self.weights then s.version, s.version_switches = versions(self, q.id, j - 1, n) end
      if self.routing_width then s.routing = routing(self, q.id, j - 1) end
      local w = job.watches and job.watches[i][j]
      if w then
        s.text = w.text
        if w.stopped then s.finish_reason = 'stop' end
      elseif o.tok then
        s.text = o.tok:decode(ids, { skip_special = true })
      end
      list[j] = s
    end
    results[i] = list
    if release then moonrl.check(C.mrl_engine_release(self.handle, q.id), 3) end
  end
  return results
end

-- requests: list of { prompt_ids = {...} | prompt = 'text', n = samples (1), prompt_index = i - 1,
-- first_sample = 0 (the stream index of the first sample),
-- max_tokens = opts.max_tokens }. See the top of the file for opts and results.
function Engine:generate(requests, opts)
  opts = opts or {}
  if type(requests) ~= 'table' then error('engine:generate: expected a list of requests', 2) end
  local o = call_options(self, opts)
  if self.streaming and coroutine.running() then return self.streaming:generate(requests, opts, o) end
  if self:running() and self.on_busy then self.on_busy() end -- a background batch: finished first
  moonrl.check(C.mrl_engine_reset(self.handle), 2) -- the weights may have changed since the last call
  local job = submit(self, requests, opts, o)
  if #o.stops > 0 or o.on_text then
    run_watched(self, job, o)
  elseif self.background and coroutine.running() then
    self:run_async(self.background)
    coroutine.yield()
    self:wait()
  else
    moonrl.check(C.mrl_engine_run(self.handle), 2)
  end
  return collect(self, job, o, false)
end

-- ---- a stream: one engine for many callers' requests, never reset ---------------------------
-- Engine:stream() returns a driver; while engine.streaming is set, generate inside a coroutine
-- queues its requests on the engine as it runs (no reset: other coroutines' requests go on) and
-- yields; the driver steps the engine (here, or on a background thread while this thread does
-- something else) and resumes the coroutine once its requests are done. moonrl.train.rollout streams
-- batches so on rollout ranks (async.stream). Stop strings and on_text need the watched loop
-- of a plain generate: not in a stream.
local Stream = {}
Stream.__index = Stream

function Engine:stream(threads)
  local st = setmetatable({ engine = self, threads = threads or 1 }, Stream)
  self.streaming = st
  return st
end

function Stream:generate(requests, opts, o)
  local e = self.engine
  if #o.stops > 0 or o.on_text then
    error('engine:generate: stop strings and on_text are not available in a stream (async.stream)', 3)
  end
  self:idle()
  local job = submit(e, requests, opts, o)
  job.o = o
  coroutine.yield(job)
  local results = collect(e, job, o, true)
  self:background() -- the others' requests go on while the caller scores these
  return results
end

-- The engine back on this thread (a background run paused and joined).
function Stream:idle()
  local e = self.engine
  if e:running() then
    C.mrl_engine_pause(e.handle)
    e:wait()
  end
end

-- Generate in the background while this thread does something else (until idle()).
function Stream:background()
  local e = self.engine
  if not e:running() and C.mrl_engine_num_unfinished(e.handle) > 0 then e:run_async(self.threads) end
end

-- Whether a job a coroutine yielded is done (the engine on this thread).
function Stream:done(job)
  self:idle()
  for _, q in ipairs(job.reqs) do
    if C.mrl_engine_request_done(self.engine.handle, q.id) ~= 1 then return false end
  end
  return true
end

-- One step of the engine, on this thread.
function Stream:step()
  self:idle()
  moonrl.check_stop()
  moonrl.check(C.mrl_engine_step(self.engine.handle, nil), 2)
end

-- Every request dropped and the engine reset; generate is a plain call again.
function Stream:close()
  local e = self.engine
  self:idle()
  moonrl.check(C.mrl_engine_reset(e.handle), 2)
  e.streaming = nil
end

-- ---- a long-running engine (a server): requests come and go, never a reset ----------------
-- engine:add(q, opts) queues one prompt's samples (q as a generate request: prompt_ids, n,
-- max_tokens, prompt_index, first_sample; opts as generate's: sampling knobs, eos_ids, stop_ids,
-- seed, step) and returns its id; a bad request raises and queues nothing, the requests in
-- flight go on. engine:step() runs one step and returns the samples not finished;
-- engine:output(id, j) gives sample j's (0-based) tokens and log-probs (cdata, valid until the
-- next step), their count and finish reason ('length', 'stop', nil while it runs);
-- engine:stop_sample(id, j) finishes a sample at the next step; engine:done(id) is true once
-- every sample of the request has finished; engine:release(id) frees a finished request's
-- outputs (a server that runs for days does not grow); engine:versions(id, j, n) its tokens'
-- weight versions (with use_weights). moonrl serve and the multi-turn episodes
-- (moonrl.train.episodes) drive an engine so: a request's K/V stays cached after release, so the
-- next turn's request, whose prompt extends it, computes only the new tokens.
-- M.new_watch(tok) / M.watch_step(w, toks, n, stops, max_stop): the stop-string watcher of
-- generate (a sample's streaming decoder and its text; true when a stop string appeared).
M.new_watch, M.watch_step = new_watch, watch_step

function Engine:add(q, opts)
  opts = opts or {}
  if type(q) ~= 'table' or type(q.prompt_ids) ~= 'table' then error('engine:add: expected { prompt_ids = {...} }', 2) end
  local eos = opts.eos_ids
  if eos == nil then
    local id = self.model.config.eos_token_id
    eos = (id and id >= 0) and { id } or {}
  end
  local eos_arr, n_eos = int_array(eos, 'eos_ids')
  local stop_arr, n_stop = int_array(opts.stop_ids or {}, 'stop_ids')
  local arr, n = int_array(q.prompt_ids, 'prompt_ids')
  local r = ffi.new('mrl_engine_request')
  r.prompt, r.prompt_len = arr, n
  r.n = q.n or 1
  r.max_new_tokens = q.max_tokens or opts.max_tokens or 64
  r.params = sampling_params(opts)
  r.eos_ids, r.n_eos, r.stop_ids, r.n_stop = eos_arr, n_eos, stop_arr, n_stop
  local seed = opts.seed or self.seed
  r.seed = seed < 0 and ffi.cast('uint64_t', ffi.cast('int64_t', seed)) or seed
  r.step = opts.step or 0
  r.prompt_index = q.prompt_index or 0
  r.first_sample = q.first_sample or 0
  r.top_logprobs = opts.top_logprobs or 0
  r.adapter = q.adapter or opts.adapter or 0
  local id_out = ffi.new('int[1]')
  moonrl.check(C.mrl_engine_add_request(self.handle, r, id_out), 2)
  return id_out[0]
end

-- LoRA adapters served beside the weights (engine.h, mrl_engine_set_adapter): slot k (1 .. 64)
-- holds ad (moonrl.model's Model:new_adapter / load_adapter; nil empties it); a request with
-- adapter = k (a generate or add request's field, or opts.adapter for all) is computed with it.
function Engine:set_adapter(slot, ad)
  moonrl.check(C.mrl_engine_set_adapter(self.handle, slot, ad and ad.handle or nil), 2)
  self._adapters = self._adapters or {}
  self._adapters[slot] = ad -- (kept alive while served)
end

local step_unf = ffi.new('int[1]')
function Engine:step()
  moonrl.check(C.mrl_engine_step(self.handle, step_unf), 2)
  return step_unf[0]
end

function Engine:output(id, j)
  local toks, lps, n, reason = output(self, id, j)
  return toks, lps, n, reason ~= 0 and (FINISH[reason] or 'stop') or nil
end

-- Sample j's (0-based) top_logprobs (opts.top_logprobs of generate / add, at most 20): for each
-- of its first n generated tokens a list { {id, logprob}, ... } of the most likely tokens, best
-- first, under the distribution of the sampled token's logprob (engine.h); nil when none asked.
local top_ids, top_lps, top_n = ffi.new('const int32_t *[1]'), ffi.new('const float *[1]'), ffi.new('int[1]')
function Engine:top_logprobs(id, j, n)
  moonrl.check(C.mrl_engine_get_output_top_logprobs(self.handle, id, j, top_ids, top_lps, top_n), 2)
  local k = top_n[0]
  if k == 0 then return nil end
  if not n then n = select(3, output(self, id, j)) end
  local out = {}
  for t = 0, n - 1 do
    local row = {}
    for i = 0, k - 1 do row[i + 1] = { top_ids[0][t * k + i], top_lps[0][t * k + i] } end
    out[t + 1] = row
  end
  return out
end

function Engine:stop_sample(id, j) moonrl.check(C.mrl_engine_stop_sample(self.handle, id, j), 2) end

function Engine:done(id) return C.mrl_engine_request_done(self.handle, id) == 1 end

-- Sample j's weight versions (with engine:use_weights or set_version): its first token's, and the
-- switches of the later ones ({ {k, v}, ... }, as generate's results carry them); nil else.
function Engine:versions(id, j, n)
  if not (self.weights or self.versioned) then return nil end
  return versions(self, id, j, n)
end

-- Every request dropped and every cached prefix forgotten (what generate does first): the weights
-- changed, or a long-running caller starts over.
function Engine:reset() moonrl.check(C.mrl_engine_reset(self.handle), 2) end

function Engine:release(id) moonrl.check(C.mrl_engine_release(self.handle, id), 2) end

function Engine:num_unfinished() return tonumber(C.mrl_engine_num_unfinished(self.handle)) end

-- Use another parameter buffer with the model's layout (float cdata of
-- model.n_params), e.g. one that receives weights by broadcast; nil: the engine's home buffer
-- (set_home; else the model's own).
function Engine:attach_params(buf, n)
  if buf == nil and self.home_copy then
    moonrl.check(C.mrl_engine_attach_copy(self.handle, self.home_copy), 2)
    return
  end
  if buf == nil then buf, n = self.home, self.home_n end
  moonrl.check(C.mrl_engine_attach_params(self.handle, buf, buf and (n or self.model.n_params) or 0), 2)
end

-- The buffer the engine reads when no other is attached (a sharded model's whole copy: the
-- model's own buffer holds only a shard); attached now.
function Engine:set_home(buf, n)
  self.home, self.home_n, self.home_copy = buf, n, nil
  self:attach_params(buf, n)
end

-- The same with a sharded bf16 model's compute copy (model.h's mrl_model_copy: moonrl.train.dist's
-- compute_copy): its bf16 copies and panels read as they are, kept referenced here.
function Engine:set_home_copy(copy)
  self.home, self.home_n, self.home_copy = nil, nil, copy
  self:attach_params(nil)
end

-- In-flight weight update: see the top of the file. The engine reads buf in place: keep it referenced.
function Engine:swap_params(buf, n)
  moonrl.check(C.mrl_engine_swap_params(self.handle, buf, buf and (n or self.model.n_params) or 0), 2)
  self.swapped = buf
end

-- The version recorded with the tokens sampled from now on (engine.h: mrl_engine_set_version).
function Engine:set_version(v)
  moonrl.check(C.mrl_engine_set_version(self.handle, v), 2)
  self.versioned = true
end

-- Where the weights come from (see the top of the file).
local acq_params, acq_version, acq_flags = ffi.new('const float *[1]'), ffi.new('int64_t[1]'), ffi.new('int[1]')
function Engine:use_weights(w)
  local h = self.handle
  if not w then
    if self.weights then
      local old = self.weights
      self.weights = nil
      moonrl.check(C.mrl_engine_follow(h, nil, 0), 2)
      self:attach_params(nil) -- (its home buffer) before the store's slot is let go
      C.mrl_weight_store_release(old.store, old.reader)
    end
    return
  end
  if w.min_version then
    moonrl.check(C.mrl_weight_store_acquire(w.store, w.reader, w.min_version, w.timeout or 0, acq_params, acq_version,
      acq_flags), 2)
    moonrl.check(C.mrl_engine_attach_params(h, acq_params[0], self.model.n_params), 2)
    moonrl.check(C.mrl_engine_set_version(h, acq_version[0]), 2)
  else
    moonrl.check(C.mrl_engine_set_version(h, w.version or 0), 2)
  end
  moonrl.check(C.mrl_engine_follow(h, w.follow and w.store or nil, w.reader or 0), 2)
  self.weights = w
end

-- Background run of the queued requests (see the top of the file).
function Engine:run_async(threads)
  if type(threads) ~= 'number' or threads ~= math.floor(threads) or threads < 1 then
    error('engine:run_async: threads must be an integer >= 1 (got ' .. tostring(threads) .. ')', 2)
  end
  moonrl.check(C.mrl_engine_run_async(self.handle, threads), 2)
end

function Engine:wait() moonrl.check(C.mrl_engine_wait(self.handle), 2) end

function Engine:running() return C.mrl_engine_running(self.handle) ~= 0 end

function Engine:stats()
  local s = ffi.new('mrl_engine_stats')
  C.mrl_engine_get_stats(self.handle, s)
  local t = {}
  for _, k in ipairs({ 'steps', 'prefill_tokens', 'decode_tokens', 'generated_tokens', 'prefix_hit_tokens',
    'preemptions', 'forks', 'kv_blocks_total', 'kv_blocks_used', 'kv_blocks_free', 'kv_block_size', 'kv_bytes_per_token',
    'spec_drafts', 'spec_accepted', 'running',
    'waiting', 'finished' }) do
    t[k] = tonumber(s[k])
  end
  return t
end

-- Mismatch between the engine's and the trainer's log-probs of the same
-- tokens (two lists of numbers, or float arrays with n): mean and max |d|, and
-- NeMo-RL's token_mult_prob_error = mean exp(|d|) (1 when they agree).
function M.mismatch(a, b, n)
  n = n or #a
  if type(a) == 'table' and type(b) == 'table' and #b ~= n then
    error('engine.mismatch: lists of ' .. n .. ' and ' .. #b .. ' log-probs', 2)
  end
  local off = type(a) == 'table' and 1 or 0
  local offb = type(b) == 'table' and 1 or 0
  local sum, max, mult = 0, 0, 0
  for i = 0, n - 1 do
    local d = math.abs(a[i + off] - b[i + offb])
    sum = sum + d
    if d > max then max = d end
    mult = mult + math.exp(d)
  end
  if n == 0 then return { mean_abs = 0, max_abs = 0, token_mult_prob_error = 1, n = 0 } end
  return { mean_abs = sum / n, max_abs = max, token_mult_prob_error = mult / n, n = n }
end

return M
