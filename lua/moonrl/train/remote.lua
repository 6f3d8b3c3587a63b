-- moonrl.train.remote: rollouts on inference servers in other processes, as an engine the recipe
-- generates with like its own (engine.backend, engine.urls, engine.launch; docs/engines.md).
--
--   local e = remote.new { backend = 'moonrl' | 'vllm', urls = { 'http://h:8000', ... } | launch = 'CMD {port} {model}',
--     servers = N, model_dir, model_name = 'policy', policy = model, tok, seed, request_timeout = 600,
--     retries = 2, launch_timeout = 300, sync_dir = '/dev/shm', log_dir, event = function(kind, fields) }
--   e:generate(requests, sampling)   -- as moonrl.engine's: results[i][j] = { ids, logprobs, finish_reason, text,
--                                    -- version, version_switches }
--   e:sync(label)                    -- the servers hold the policy's weights now, labelled `label` (a version)
--   e:metrics()  e:close()
--
-- Generation is tokens in, tokens out: each request's prompt goes as token ids to POST
-- /v1/completions with n samples, return_token_ids and the sampled tokens' log-probs, and comes back
-- as token ids; nothing is tokenized again. A request goes to the server with the fewest samples in
-- flight. Sampling maps to the server's: temperature, top_p, top_k (-1 for none), min_p, the stop
-- token ids (the recipe's end tokens, with ignore_eos: the server's own end token does not stop
-- it), stop strings, a seed a request. `moonrl serve` is also given the rollout sample's random
-- stream (moonrl_stream), so its samples are those moonrl's own engine draws.
--
-- Weights: the policy's are written as a Hugging Face directory under sync_dir (a fresh one a
-- version, /dev/shm by default: no disk), and each server is driven through vLLM's control
-- protocol: POST /pause?mode=wait, /collective_rpc reload_weights {weights_path}, /update_weight_version,
-- /reset_prefix_cache, /resume; then GET /weight_info must give the label. `moonrl serve` checks
-- the file's CRC-32C too. A sync happens when the policy's weights changed since the last one
-- (mrl_model_weights_generation) or the label differs (then only the label is sent).
--
-- Faults: a request whose server fails (refused, reset, timed out, a 5xx) is sent again to
-- another, up to `retries` times. A launched server that died is started again, synced to the
-- current weights, and then gets work again; a server of engine.urls that fails is left out until
-- its /health answers. Each event is logged (event kind 'engine_server').
local moonrl = require('moonrl')
local ffi = require('ffi')
local json = require('moonrl.io.json')
local proc = require('moonrl.io.proc')
local fs = require('moonrl.io.fs')
local client_mod = require('moonrl.io.http')
local safetensors = require('moonrl.io.safetensors')
local C = moonrl.C

local M = {}

local Remote = {}
Remote.__index = Remote

M.BACKENDS = { moonrl = true, vllm = true }

-- engine.launch=auto: each backend's server, {port}, {model}, {name}, {dtype} (float32 or
-- bfloat16, the policy's) and {max_len} filled in at start. vLLM: its RL routes (dev mode), the
-- log-probs under the temperature (processed_logprobs, as the trainer's), no chunked prefill (a
-- seeded request split over prefill steps fails on its CPU build), eager (no compile at each
-- start); the interop virtualenv's (./dev.sh vllm) where there is one, else vllm on the PATH.
M.LAUNCH = {
  moonrl = function() return (rawget(_G, 'MOONRL_EXE') or 'moonrl') ..
    ' serve --model {model} --port {port} --host 127.0.0.1 --served-model-name {name} --dtype {dtype}' end,
  vllm = function()
    local venv = (moonrl.home or '.') .. '/.venv-interop/bin/vllm'
    local cpu = require('moonrl.model').resolve_device('auto') == 'cpu'
    return 'env VLLM_SERVER_DEV_MODE=1 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 ' ..
      (cpu and 'VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 ' or '') .. (fs.exists(venv) and venv or 'vllm') ..
      ' serve {model} --served-model-name {name} --host 127.0.0.1 --port {port} --dtype {dtype} --max-model-len {max_len}' ..
      ' --enforce-eager --no-enable-chunked-prefill --logprobs-mode processed_logprobs'
  end,
}

-- A port no one listens on now (the kernel's choice for port 0, released at once).
local function free_port()
  local cfg = ffi.new('mrl_http_config')
  C.mrl_http_config_default(cfg)
  local h = ffi.new('mrl_http *[1]')
  moonrl.check(C.mrl_http_open('127.0.0.1', 0, cfg, h))
  local port = tonumber(C.mrl_http_port(h[0]))
  C.mrl_http_close(h[0], 0)
  return port
end

local function tail(path, n)
  local text = fs.exists(path) and fs.read(path) or ''
  return text:sub(-(n or 1500))
end

function M.new(o)
  if not M.BACKENDS[o.backend] then
    moonrl.usage_error(string.format("engine.backend=%s: moonrl or vllm", tostring(o.backend)))
  end
  local self = setmetatable({ backend = o.backend, remote = true, name = o.model_name or 'policy', policy = o.policy,
    tok = o.tok, seed = o.seed or 0, request_timeout = o.request_timeout or 600, retries = o.retries or 2,
    launch_timeout = o.launch_timeout or 300, model_dir = o.model_dir, event = o.event or function() end,
    log_dir = o.log_dir, servers = {}, client = client_mod.open({ max_connections_per_host = 256 }), deferred = {},
    jobs = {}, probes = {}, affine = setmetatable({}, { __mode = 'k' }), model = o.policy,
    counters = { requests = 0, retries = 0, restarts = 0, failures = 0, syncs = 0, sync_seconds = 0, sync_bytes = 0,
      sync_tensors = 0, tokens = 0, affine = 0, affine_moved = 0 }, syncs = 0 }, Remote)
  self.eos_ids = o.eos_ids
  -- how weights go: transfer (buckets through the weight-transfer routes, only the tensors that
  -- changed) where the server takes files there (moonrl serve), else reload_weights of a directory
  local ws = o.weight_sync or 'auto'
  if ws == 'auto' then ws = o.backend == 'moonrl' and 'transfer' or 'reload' end
  if ws ~= 'transfer' and ws ~= 'reload' then moonrl.usage_error(string.format('engine.weight_sync=%s: auto, transfer or reload', ws)) end
  if ws == 'transfer' and o.backend == 'vllm' then
    moonrl.usage_error("engine.weight_sync=transfer: vLLM's weight-transfer backends move the bytes over NCCL or CUDA IPC, " ..
      'which the trainer does not drive; with vLLM the weights go by reload_weights (engine.weight_sync=reload)')
  end
  local sd = o.sync_dtype or 'auto'
  if sd == 'auto' then sd = 'float32' end -- (exact: a bf16 model's norms and embeddings are read in fp32)
  if sd ~= 'float32' and sd ~= 'bfloat16' then moonrl.usage_error(string.format('engine.sync_dtype=%s: auto, float32 or bfloat16', sd)) end
  if ws == 'reload' and o.sync_dtype and o.sync_dtype ~= 'auto' then
    moonrl.usage_error('engine.sync_dtype: the buckets of engine.weight_sync=transfer only (reload sends the saved model)')
  end
  self.weight_sync, self.sync_dtype, self.bucket_bytes = ws, sd, math.max(1, math.floor((o.bucket_mb or 512) * 2 ^ 20))
  -- the versions a run killed before its end left behind (its process gone) go first
  for _, name in ipairs(fs.is_dir(o.sync_dir or '/dev/shm') and fs.list(o.sync_dir or '/dev/shm') or {}) do
    local pid = name:match('^moonrl%-sync%-(%d+)%-')
    if pid and not fs.exists('/proc/' .. pid) then pcall(fs.remove, (o.sync_dir or '/dev/shm') .. '/' .. name) end
  end
  self.sync_root = string.format('%s/moonrl-sync-%d-%x', o.sync_dir or '/dev/shm', tonumber(C.mrl_process_id()),
    math.random(0, 0xffffff))
  if o.launch == 'auto' then o.launch = M.LAUNCH[o.backend]() end
  -- LoRA: the servers hold the base (model_dir, never reloaded) and the policy's adapters, sent as a
  -- PEFT directory each version (/v1/load_lora_adapter, replaced in place) and named by requests
  local lora = self.policy:lora()
  if lora then
    self.lora_name = self.name .. '-lora'
    if self.untie then moonrl.usage_error('model.lora with engine.backend=vllm: a tied model is served untied by vLLM, ' ..
      'which the adapters of the tied base do not match yet') end
    if o.backend == 'vllm' and o.launch then -- (vLLM serves adapters when asked at launch)
      o.launch = o.launch:gsub('^env ', 'env VLLM_ALLOW_RUNTIME_LORA_UPDATING=True ') ..
        string.format(' --enable-lora --max-loras 1 --max-lora-rank %d', lora.rank)
    end
  end
  -- vLLM's reload_weights keeps a tied model's old output layer (it reloads the embedding only):
  -- it is served, and sent, an untied copy with lm_head.weight written out (moonrl serve reads either)
  self.untie = o.backend == 'vllm' and self.policy.config.tie_word_embeddings and true or false
  if o.launch and self.untie then
    self.serve_dir = self.sync_root .. '/v0'
    self:write_version(self.serve_dir)
    for _, f in ipairs({ 'tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'generation_config.json',
      'tokenizer.model', 'vocab.json', 'merges.txt' }) do
      if self.model_dir and fs.exists(self.model_dir .. '/' .. f) then fs.copy(self.model_dir .. '/' .. f, self.serve_dir .. '/' .. f) end
    end
  end
  if o.launch then
    if not o.launch:find('{port}', 1, true) then
      moonrl.usage_error("engine.launch: the command must hold {port} (where the server listens; {model}: the model's directory)")
    end
    for k = 1, o.servers or 1 do self.servers[k] = { k = k, launch = o.launch } end
    local ok, err = pcall(function()
      for _, s in ipairs(self.servers) do self:start(s) end
      for _, s in ipairs(self.servers) do self:wait_healthy(s) end
    end)
    if not ok then self:close(); error(err, 0) end
  else
    for k, url in ipairs(o.urls or {}) do
      client_mod.parse_url(url) -- (an http:// URL, or an error naming it)
      self.servers[k] = { k = k, url = url:gsub('/+$', ''):gsub('/v1$', '') }
    end
    if #self.servers == 0 then moonrl.usage_error('engine.urls: no server (a list of http://host:port)') end
    -- (one that does not answer is left out until it does; none answering is the end)
    local up, last = 0, nil
    for _, s in ipairs(self.servers) do
      local ok, err = pcall(self.wait_healthy, self, s)
      if ok then up = up + 1 else
        last = err
        self.event('engine_server', { server = s.url, what = 'down', message = moonrl.error_text(err) })
      end
    end
    if up == 0 then error(last, 0) end
    -- the name they serve the model under (GET /v1/models): theirs, whatever it is
    for _, s in ipairs(self.servers) do
      local r = s.healthy and self.client:fetch({ url = s.url .. '/v1/models', timeout = 10 })
      local ok, body = pcall(json.decode, r and r.status == 200 and r.body or 'null', s.url .. '/v1/models')
      local id = ok and type(body) == 'table' and type(body.data) == 'table' and body.data[1] and body.data[1].id
      if type(id) == 'string' then self.name = id break end
    end
  end
  return self
end

-- ---- the servers ---------------------------------------------------------------------------

-- Start launched server s: its command with {port}, {model} and {name} filled in, its output in
-- log_dir, killed with this process (setpriv's parent-death signal, where there is setpriv).
function Remote:start(s)
  s.port = free_port()
  s.url = 'http://127.0.0.1:' .. s.port
  local cmd = s.launch:gsub('{port}', tostring(s.port)):gsub('{model}', self.serve_dir or self.model_dir or '')
    :gsub('{name}', self.name):gsub('{dtype}', self.policy:dtype() == 'bf16' and 'bfloat16' or 'float32')
    :gsub('{max_len}', tostring(self.policy.config.max_position_embeddings or 2048))
  s.log = self.log_dir and string.format('%s/server-%d.log', self.log_dir, s.k) or '/dev/null'
  local guard = fs.exists('/usr/bin/setpriv') and 'setpriv --pdeathsig KILL ' or ''
  s.proc = proc.spawn({ '/bin/sh', '-c', string.format('exec %s%s >> %s 2>&1', guard, cmd, s.log) }, { max_output = 4096 })
  s.healthy, s.version, s.gen, s.inflight, s.held, s.transfer = false, nil, nil, 0, nil, nil
  s.epoch = (s.epoch or 0) + 1 -- (a request sent to an earlier run of it fails nothing of this one)
end

-- Whether s's GET /health answers 200 within timeout seconds; then it is healthy, nothing in flight.
function Remote:probe(s, timeout)
  local r = self.client:fetch({ url = s.url .. '/health', timeout = timeout })
  if not (r and r.status == 200) then return false end
  s.healthy, s.inflight = true, 0
  return true
end

-- Wait for s's GET /health to answer 200 (launch_timeout); a launched one that exits meanwhile is an error.
function Remote:wait_healthy(s)
  local deadline = moonrl.now() + self.launch_timeout
  while moonrl.now() < deadline do
    moonrl.check_stop()
    if s.proc and s.proc:done() then
      local r = s.proc:wait()
      s.proc = nil
      moonrl.run_error(string.format('engine server %d (%s) exited with status %s before it was healthy:\n%s', s.k,
        s.url, tostring(r.exit_status), tail(s.log)))
    end
    if self:probe(s, 5) then return true end
    moonrl.sleep(0.2)
  end
  moonrl.run_error(string.format('engine server %d (%s): no healthy /health within engine.launch_timeout (%g s)%s', s.k,
    s.url, self.launch_timeout, s.log and ':\n' .. tail(s.log) or ''))
end

-- A server that failed: a launched one that has exited is started again and synced; one of
-- engine.urls is left out until its /health answers.
function Remote:server_failed(s, why)
  self.counters.failures = self.counters.failures + 1
  s.healthy, s.held, s.transfer = false, nil, nil -- (what it holds is not known any more)
  self.event('engine_server', { server = s.url, what = 'failed', message = why })
  if s.proc then
    if not s.proc:done() then
      -- (a launched server that answers 5xx or hangs: killed and started again)
      s.proc:kill()
    else
      s.proc:wait()
    end
    s.proc = nil
    self.counters.restarts = self.counters.restarts + 1
    self:start(s)
    self:wait_healthy(s)
    self.event('engine_server', { server = s.url, what = 'restarted' })
    if self.gen then self:push({ s }, self.label) end
  end
end

-- Servers that are down but answer /health again are synced and back.
function Remote:revive()
  for _, s in ipairs(self.servers) do
    if not s.healthy and not s.proc and (not s.next_probe or moonrl.now() >= s.next_probe) then
      s.next_probe = moonrl.now() + 2
      if self:probe(s, 2) then
        if self.gen then self:push({ s }, self.label) end
        self.event('engine_server', { server = s.url, what = 'back' })
      end
    end
  end
end

-- ---- weights -------------------------------------------------------------------------------

-- Each of the servers' answer to path (a POST of body, or a GET), all at once; a failure raises,
-- naming the server.
function Remote:all(servers, path, body, timeout)
  local ids = {}
  for _, s in ipairs(servers) do
    ids[self.client:request({ url = s.url .. path, method = body and 'POST' or 'GET', body = body and json.encode(body) or nil,
      timeout = timeout or self.request_timeout })] = s
  end
  local out, failed = {}, {}
  local left = #servers
  while left > 0 do
    local r = self.client:poll(50)
    if r and ids[r.id] then
      local s = ids[r.id]
      left = left - 1
      if r.status ~= 200 then
        failed[#failed + 1] = { s = s, why = string.format('%s %s: %s', path, r.status == 0 and 'failed' or ('answered ' .. r.status),
          r.error or r.body:sub(1, 500)) }
      else
        local ok, v = pcall(json.decode, r.body ~= '' and r.body or 'null', s.url .. path)
        out[s] = ok and v or r.body
      end
    elseif r then
      self.deferred[#self.deferred + 1] = r -- (a generation request's: for generate's loop)
    end
  end
  if #failed > 0 then
    moonrl.run_error(string.format('engine server %d (%s): %s', failed[1].s.k, failed[1].s.url, failed[1].why))
  end
  return out
end

-- The policy's weights as a Hugging Face directory; untied (self.untie): its config says so and
-- lm_head.safetensors holds the output layer (the embedding's copy).
function Remote:write_version(dir)
  fs.mkdirs(dir)
  self.policy:save(dir)
  if not self.untie then return end
  local cfg = json.decode(fs.read(dir .. '/config.json'), dir .. '/config.json')
  cfg.tie_word_embeddings = false
  fs.write(dir .. '/config.json', json.encode(cfg))
  local p = self.policy:read_params()
  for _, v in ipairs(self.policy:views()) do
    if v.name == 'model.embed_tokens.weight' then
      local w = require('moonrl.io.safetensors').writer()
      w:add('lm_head.weight', 'F32', v.shape, p + v.offset)
      w:metadata('format', 'pt')
      w:write(dir .. '/lm_head.safetensors')
    end
  end
end

-- The policy's weights into servers, labelled: written once a version (a fresh directory), then
-- each server paused, reloaded, labelled, its cache dropped, resumed, and its label checked.
function Remote:push(servers, label)
  local t0 = moonrl.now()
  local gen
  if self.lora_name then gen = self:push_lora(servers, label)
  elseif self.weight_sync == 'transfer' then gen = self:push_transfer(servers, label)
  else gen = self:push_reload(servers, label) end
  local info = self:all(servers, '/weight_info')
  for _, s in ipairs(servers) do
    local got = type(info[s]) == 'table' and info[s].weight_version
    if got ~= tostring(label) then
      moonrl.run_error(string.format("engine server %d (%s) holds weights '%s' after the update to '%s'", s.k, s.url,
        tostring(got), tostring(label)))
    end
    s.version, s.gen, s.held = tostring(label), gen, self.crcs
  end
  self.counters.syncs = self.counters.syncs + 1
  self.counters.sync_seconds = self.counters.sync_seconds + (moonrl.now() - t0)
end

-- The policy's weights as they are now in a directory of their own, written once a version by
-- write(dir), which returns the bytes it wrote (the last version's directory removed). Returns
-- the weights' generation.
function Remote:write_once(write)
  local gen = self.policy:weights_generation()
  if self.written_gen ~= gen then
    self.syncs = self.syncs + 1
    local dir = string.format('%s/v%d', self.sync_root, self.syncs)
    local bytes = write(dir)
    if self.written_dir then pcall(fs.remove, self.written_dir) end
    self.written_dir, self.written_gen = dir, gen
    self.counters.sync_bytes = self.counters.sync_bytes + (bytes or 0)
  end
  return gen
end

-- path with body on every server between a pause and a resume, then the label and a dropped cache.
function Remote:update_paused(servers, label, path, body)
  self:all(servers, '/pause?mode=wait', json.object())
  self:all(servers, path, body)
  self:all(servers, '/update_weight_version', { new_version = tostring(label) })
  self:all(servers, '/reset_prefix_cache', json.object())
  self:all(servers, '/resume', json.object())
end

function Remote:push_reload(servers, label)
  local gen = self:write_once(function(dir)
    self:write_version(dir)
    local crc, bytes = fs.crc32c_file(dir .. '/model.safetensors')
    self.written_crc = crc
    return bytes
  end)
  local kwargs = json.object({ 'weights_path', self.written_dir, 'is_checkpoint_format', true })
  if self.backend == 'moonrl' then kwargs.crc32c = string.format('%08x', self.written_crc) end
  self:update_paused(servers, label, '/collective_rpc', json.object({ 'method', 'reload_weights', 'kwargs', kwargs }))
  return gen
end

-- LoRA: the adapters as a PEFT directory (once a version, a fresh one), loaded into each server in
-- place of the last (/v1/load_lora_adapter, vLLM's and moonrl serve's), between a pause and a resume.
function Remote:push_lora(servers, label)
  local gen = self:write_once(function(dir)
    self.policy:save_lora(dir, { base = self.model_dir })
    self.counters.sync_tensors = self.counters.sync_tensors + #self.policy:lora_views()
    local st = fs.stat(dir .. '/adapter_model.safetensors')
    return st and st.size
  end)
  self:update_paused(servers, label, '/v1/load_lora_adapter', json.object({ 'lora_name', self.lora_name,
    'lora_path', self.written_dir, 'load_inplace', true }))
  return gen
end

-- ---- weights by transfer: buckets of the tensors that changed ----------------------------------

-- Each tensor's CRC-32C over its fp32 values p (read_params'): what changed since the last version sent.
function Remote:tensor_crcs(p)
  local out = {}
  for _, v in ipairs(self.policy:views()) do out[v.name] = tonumber(C.mrl_crc32c(0, p + v.offset, 4 * v.numel)) end
  return out
end

-- The tensors of views (their values in p, read_params') as safetensors files of about
-- bucket_bytes each under dir, in buffer order, as sync_dtype: { {path, crc, bytes, names,
-- dtype_names, shapes}, ... }.
function Remote:write_buckets(dir, views, p)
  fs.mkdirs(dir)
  local st_dtype, size = self.sync_dtype == 'bfloat16' and 'BF16' or 'F32', self.sync_dtype == 'bfloat16' and 2 or 4
  local out, cur = {}, nil
  local function flush()
    local path = string.format('%s/bucket-%d.safetensors', dir, #out + 1)
    cur.w:metadata('format', 'pt')
    cur.w:write(path)
    local crc, bytes = fs.crc32c_file(path)
    out[#out + 1] = { path = path, crc = crc, bytes = bytes, names = cur.names, dtype_names = cur.dtypes, shapes = cur.shapes }
    cur = nil
  end
  for _, v in ipairs(views) do
    cur = cur or { w = safetensors.writer(), names = {}, dtypes = {}, shapes = {}, bytes = 0 }
    cur.w:add(v.name, st_dtype, v.shape, p + v.offset)
    local k = #cur.names + 1
    cur.names[k], cur.dtypes[k], cur.shapes[k] = v.name, self.sync_dtype, v.shape
    cur.bytes = cur.bytes + size * v.numel
    if cur.bytes >= self.bucket_bytes then flush() end
  end
  if cur then flush() end
  return out
end

-- The policy's weights into servers by the weight-transfer routes, labelled. A version is written
-- once: the tensors that changed since the last version (self.crcs) in buckets; those that did
-- not, only when a server needs them (one that does not hold the last version: started again,
-- back from down). Each server: paused, its update started, the buckets it needs, finished with
-- the label, its cache dropped, resumed, its label checked.
function Remote:push_transfer(servers, label)
  local gen = self.policy:weights_generation()
  local p -- (a GPU policy's read_params is a copy to the host: one a sync)
  if self.written_gen ~= gen then
    p = self.policy:read_params()
    local crcs = self:tensor_crcs(p)
    local changed, same = {}, {}
    for _, v in ipairs(self.policy:views()) do
      local list = (self.crcs and self.crcs[v.name] == crcs[v.name]) and same or changed
      list[#list + 1] = v
    end
    self.syncs = self.syncs + 1
    local dir = string.format('%s/v%d', self.sync_root, self.syncs)
    local buckets = self:write_buckets(dir .. '/changed', changed, p)
    if self.written_dir then pcall(fs.remove, self.written_dir) end
    self.written_dir, self.written_gen = dir, gen
    self.prev_crcs, self.crcs = self.crcs, crcs
    self.changed, self.same_views, self.same = buckets, same, nil
    for _, b in ipairs(buckets) do self.counters.sync_bytes = self.counters.sync_bytes + b.bytes end
    self.counters.sync_tensors = self.counters.sync_tensors + #changed
  end
  -- the servers that need this version (all), and of them those that need every tensor (fresh)
  local fresh, all = {}, {}
  for _, s in ipairs(servers) do
    if s.held ~= self.crcs then
      all[#all + 1] = s
      if not (s.held and s.held == self.prev_crcs) then fresh[#fresh + 1] = s end
    end
    s.held = nil -- (until its label is checked)
  end
  if #fresh > 0 and not self.same then
    self.same = self:write_buckets(self.written_dir .. '/same', self.same_views, p or self.policy:read_params())
  end
  local function bucket(b)
    return { update_info = { names = b.names, dtype_names = b.dtype_names, shapes = b.shapes, path = b.path,
      crc32c = string.format('%08x', b.crc) } }
  end
  self:all(servers, '/pause?mode=wait', json.object())
  local new = {}
  for _, s in ipairs(all) do if not s.transfer then new[#new + 1] = s end end
  if #new > 0 then self:all(new, '/init_weight_transfer_engine', { init_info = { backend = 'shm' } }) end
  if #all > 0 then
    self:all(all, '/start_weight_update', json.object())
    for _, b in ipairs(self.changed) do self:all(all, '/update_weights', bucket(b)) end
    for _, b in ipairs(#fresh > 0 and self.same or {}) do self:all(fresh, '/update_weights', bucket(b)) end
    self:all(all, '/finish_weight_update', { weight_version = label })
  end
  for _, s in ipairs(new) do s.transfer = true end
  self:all(servers, '/update_weight_version', { new_version = label })
  self:all(servers, '/reset_prefix_cache', json.object())
  self:all(servers, '/resume', json.object())
  return gen
end

-- The servers hold the policy's weights as they are now, labelled `label` (the rollout's version:
-- the updates before the batch). Only the label goes when the weights are those of the last sync.
function Remote:sync(label)
  label = tostring(label)
  self:revive()
  local up = {}
  for _, s in ipairs(self.servers) do if s.healthy then up[#up + 1] = s end end
  if #up == 0 then moonrl.run_error('engine: no server is up (' .. self:where() .. ')') end
  local gen = self.policy:weights_generation()
  if self.gen == gen then
    if self.label ~= label then
      self:all(up, '/update_weight_version', { new_version = label })
      for _, s in ipairs(up) do s.version = label end
    end
  else
    self:push(up, label)
  end
  self.gen, self.label = gen, label
end

-- The servers hold the policy's weights as they are now: for callers other than the rollouts, which
-- label what they sync (an evaluation after an update, lm-evaluation-harness). The label 'g<N>'
-- names the weights' generation; the next rollout's sync gives them its version.
function Remote:sync_current()
  local gen = self.policy:weights_generation()
  if self.gen ~= gen then self:sync('g' .. gen) end
end

function Remote:where()
  local w = {}
  for _, s in ipairs(self.servers) do w[#w + 1] = s.url .. (s.healthy and '' or ' (down)') end
  return table.concat(w, ', ')
end

-- ---- generation ----------------------------------------------------------------------------

local function num(x) return type(x) == 'number' and x or nil end

-- The completions body of request q (see the top).
function Remote:body(q, o)
  local eos = o.eos_ids or self.eos_ids or {}
  local stop_ids = {}
  for _, id in ipairs(eos) do stop_ids[#stop_ids + 1] = id end
  for _, id in ipairs(o.stop_ids or {}) do stop_ids[#stop_ids + 1] = id end
  local greedy = (o.temperature or 1) == 0
  -- (vLLM takes one greedy sample a request: the others are its copies, as moonrl's engine's are)
  local n = (greedy and self.backend == 'vllm') and 1 or (q.n or 1)
  local b = json.object({ 'model', self.lora_name or self.name, 'prompt', json.array(q.prompt_ids), 'n', n,
    'max_tokens', q.max_tokens or o.max_tokens or 16, 'temperature', o.temperature or 1.0, 'top_p', o.top_p or 1.0,
    'top_k', (o.top_k or 0) > 0 and o.top_k or -1, 'min_p', o.min_p or 0, 'logprobs', o.top_logprobs or 0,
    'return_token_ids', true, 'ignore_eos', true, 'stop_token_ids', json.array(stop_ids), 'skip_special_tokens', false })
  if o.stop and #o.stop > 0 then b.stop = json.array(o.stop) end
  local pi = q.prompt_index or (q.i - 1)
  if self.backend == 'moonrl' then
    b.seed, b.moonrl_stream = self.seed, json.array({ o.step or 0, pi, q.first_sample or 0 })
  elseif not greedy then
    -- (one seed a request: the same samples whichever server draws them)
    b.seed = (self.seed * 1000003 + (o.step or 0) * 7919 + pi * 131 + (q.first_sample or 0)) % 2 ^ 31
  end
  return json.encode(b)
end

-- The server that takes the next request: the one its episode's last turn went to while it is up
-- (its prefix is in that server's cache), else the fewest samples in flight among the healthy ones.
function Remote:pick(job)
  local home = job and job.affinity and self.affine[job.affinity]
  if home and home.healthy then return home end
  local best
  for _, s in ipairs(self.servers) do
    if s.healthy and (not best or s.inflight < best.inflight) then best = s end
  end
  return best
end

function Remote:send(job)
  local s = self:pick(job)
  while not s do
    self:revive()
    s = self:pick(job)
    if not s then
      if moonrl.now() > job.deadline then moonrl.run_error('engine: no server is up (' .. self:where() .. ')') end
      moonrl.check_stop()
      moonrl.sleep(0.5)
    end
  end
  if s.version ~= self.label then self:push({ s }, self.label) end -- (one that came back meanwhile)
  job.server, job.epoch, job.tries, job.label = s, s.epoch, job.tries + 1, self.label
  if job.affinity then -- (an episode's turn: on the server of its last one, else counted as moved)
    local home = self.affine[job.affinity]
    if home == s then self.counters.affine = self.counters.affine + 1
    elseif home then self.counters.affine_moved = self.counters.affine_moved + 1 end
    self.affine[job.affinity] = s
  end
  s.inflight = s.inflight + job.n
  local id = self.client:request({ url = s.url .. '/v1/completions', method = 'POST', body = job.body,
    timeout = self.request_timeout })
  self.jobs[id] = job
  job.t0 = moonrl.now()
  self.counters.requests = self.counters.requests + 1
  s.requests = (s.requests or 0) + 1
end

-- ---- the servers' own figures (GET /metrics) ------------------------------------------------

-- The series read off a server's Prometheus text, moonrl serve's or vLLM's: time to first token
-- (cumulative sum and count), sequences waiting for the engine and running (gauges).
local SERIES = {
  ttft_sum = { 'moonrl_time_to_first_token_seconds_sum', 'vllm:time_to_first_token_seconds_sum' },
  ttft_count = { 'moonrl_time_to_first_token_seconds_count', 'vllm:time_to_first_token_seconds_count' },
  waiting = { 'moonrl_engine_waiting', 'vllm:num_requests_waiting' },
  running = { 'moonrl_engine_running', 'vllm:num_requests_running' },
}

-- Prometheus text: each series' value, summed over its label sets, by name.
function M.prometheus(text)
  local out = {}
  for line in text:gmatch('[^\n]+') do
    if line:sub(1, 1) ~= '#' then
      local name, v = line:gsub('%b{}', ''):match('^([%w_:]+)%s+(%S+)')
      v = tonumber(v)
      if name and v then out[name] = (out[name] or 0) + v end
    end
  end
  return out
end

-- Server s's figures: its queue's and batch's peaks since the last metrics(), its TTFT counters.
function Remote:read_figures(s, text)
  local p = M.prometheus(text)
  local function get(key)
    for _, name in ipairs(SERIES[key]) do if p[name] then return p[name] end end
  end
  s.queue_peak = math.max(s.queue_peak or 0, get('waiting') or 0)
  s.running_peak = math.max(s.running_peak or 0, get('running') or 0)
  s.ttft_sum, s.ttft_count = get('ttft_sum') or s.ttft_sum, get('ttft_count') or s.ttft_count
end

-- While a batch generates: each healthy server's /metrics read every 0.25 s (one at a time each).
function Remote:watch()
  local now = moonrl.now()
  if now < (self.next_watch or 0) then return end
  self.next_watch = now + 0.25
  for _, s in ipairs(self.servers) do
    if s.healthy and not s.probe then
      s.probe = self.client:request({ url = s.url .. '/metrics', timeout = 5 })
      self.probes[s.probe] = s
    end
  end
end

-- A generation response: its samples, or the request sent again elsewhere.
function Remote:on_response(r)
  local probed = self.probes[r.id]
  if probed then
    self.probes[r.id], probed.probe = nil, nil
    if r.status == 200 then self:read_figures(probed, r.body) end
    return
  end
  local job = self.jobs[r.id]
  if not job then return end
  self.jobs[r.id] = nil
  local s = job.server
  local current = job.epoch == s.epoch
  if current then s.inflight = s.inflight - job.n end
  local why
  if r.status == 200 then
    local ok, body = pcall(json.decode, r.body, s.url .. ' completion')
    if ok and type(body) == 'table' and type(body.choices) == 'table' then
      local ok2, err = pcall(self.take, self, job, body)
      if ok2 then return end
      why = moonrl.error_text(err)
    else
      why = 'an answer that is not a completion: ' .. r.body:sub(1, 200)
    end
  elseif r.status == 0 or r.status >= 500 or r.status == 429 or r.status == 408 then
    why = r.error or string.format('%d: %s', r.status, r.body:sub(1, 300))
    if current and s.healthy then self:server_failed(s, why) end
  else -- the request itself: no other server will take it either
    moonrl.run_error(string.format('engine server %d (%s) refused a request (%d): %s', s.k, s.url, r.status, r.body:sub(1, 500)))
  end
  if job.tries > self.retries then
    moonrl.run_error(string.format('engine: a request failed %d times; the last, on %s: %s', job.tries, s.url, why))
  end
  self.counters.retries = self.counters.retries + 1
  self:send(job)
end

-- A completion's choices into job.results (one list of samples, by choice index).
function Remote:take(job, body)
  local list = {}
  for _, c in ipairs(body.choices) do
    local ids, lp = c.token_ids, c.logprobs and c.logprobs.token_logprobs
    if type(ids) ~= 'table' then error('no token_ids in a choice (the server must take return_token_ids)', 0) end
    if type(lp) ~= 'table' or #lp ~= #ids then error(string.format('%s log-probs for %d tokens', type(lp) == 'table' and #lp or 'no', #ids), 0) end
    local smp = { ids = {}, logprobs = {}, finish_reason = c.finish_reason == 'length' and 'length' or 'stop' }
    for k = 1, #ids do smp.ids[k], smp.logprobs[k] = ids[k], num(lp[k]) or -9999 end
    local spans = c.weight_versions
    local label = type(spans) == 'table' and spans[1] and spans[1].version or job.server.version
    if label ~= job.label then
      error(string.format("a sample of weights '%s' where '%s' was expected", tostring(label), tostring(job.label)), 0)
    end
    smp.version = tonumber(label)
    if type(spans) == 'table' and #spans > 1 then
      error(string.format('a sample across %d weight versions (the servers were updated during a batch)', #spans), 0)
    end
    if job.o.tokenizer then smp.text = job.o.tokenizer:decode(smp.ids, { skip_special = true }) end
    if job.o.top_logprobs and job.o.top_logprobs > 0 then smp.top_logprobs = self:top_of(c, job.o.top_logprobs) end
    self.counters.tokens = self.counters.tokens + #ids
    job.server.tokens = (job.server.tokens or 0) + #ids
    list[(num(c.index) or #list) + 1] = smp
  end
  if #list == 1 and job.n > 1 and job.copies then
    for j = 2, job.n do
      local c = {}
      for k, v in pairs(list[1]) do c[k] = type(v) == 'table' and { unpack(v) } or v end
      list[j] = c
    end
  end
  if #list ~= job.n then error(string.format('%d samples where %d were asked', #list, job.n), 0) end
  job.results = list
  job.server.seconds = (job.server.seconds or 0) + (moonrl.now() - job.t0)
end

-- The top_logprobs of a completions choice (keys "token_id:N" with return_tokens_as_token_ids, or
-- token texts), as moonrl.engine gives them: { { {id, logprob}, ... k }, ... a token }.
function Remote:top_of(c, k)
  local out = {}
  for i, t in ipairs(c.logprobs.top_logprobs or {}) do
    local alts = {}
    for key, v in pairs(t) do
      local id = tonumber(tostring(key):match('^token_id:(%d+)$')) or (self.tok and self.tok:token_to_id(key))
      if id then alts[#alts + 1] = { id, v } end
    end
    table.sort(alts, function(a, b) return a[2] > b[2] end)
    while #alts > k do alts[#alts] = nil end
    out[i] = alts
  end
  return out
end

-- requests, opts as moonrl.engine's generate. Inside a coroutine with e.background set, the
-- requests go out and the coroutine yields (the servers generate while the caller trains); the
-- results are collected once it is resumed.
function Remote:generate(requests, opts)
  opts = opts or {}
  if self:running() and self.on_busy then self.on_busy() end -- (a batch in the background: collected first)
  self:sync_current()
  local jobs = {}
  local deadline = moonrl.now() + self.request_timeout * (self.retries + 1)
  for i, q in ipairs(requests) do
    q.i = i
    if type(q.prompt_ids) ~= 'table' then error('engine (remote): request ' .. i .. ' needs prompt_ids', 2) end
    jobs[i] = { n = q.n or 1, body = self:body(q, opts), tries = 0, o = opts, deadline = deadline,
      copies = (opts.temperature or 1) == 0 and self.backend == 'vllm' }
    self:send(jobs[i])
  end
  if self.background and coroutine.running() then coroutine.yield() end
  local function done()
    for _, j in ipairs(jobs) do if not j.results then return false end end
    return true
  end
  while not done() do
    moonrl.check_stop()
    self:step()
  end
  local results = {}
  for i, j in ipairs(jobs) do results[i] = j.results end
  return results
end

-- ---- a request at a time (moonrl.train.episodes: a turn a request) ---------------------------

-- A request of one sample sent now ({prompt_ids, max_tokens?, prompt_index, first_sample,
-- affinity?}: affinity keeps the requests that give it, an episode's turns, on one server); its
-- handle for output, versions and release. step() takes the answers in.
function Remote:add(q, sampling)
  if type(q.prompt_ids) ~= 'table' then error('engine (remote): add needs prompt_ids', 2) end
  if not self:running() then self:sync_current() end
  local job = { n = 1, body = self:body(q, sampling or {}), tries = 0, o = sampling or {}, affinity = q.affinity,
    deadline = moonrl.now() + self.request_timeout * (self.retries + 1) }
  self:send(job)
  return job
end

-- The answers that came (waiting up to 20 ms for one), and the servers' figures; a request past
-- its deadline (engine.request_timeout for each of its tries) is an error.
function Remote:step()
  local r = table.remove(self.deferred, 1) or self.client:poll(20)
  if r then self:on_response(r) end
  self:watch()
  local now = moonrl.now()
  for _, job in pairs(self.jobs) do
    if now > job.deadline then moonrl.run_error('engine: a request not answered within engine.request_timeout') end
  end
end

-- A request's sample once answered: tokens and log-probs (0-based, as moonrl.engine's), their
-- count and the finish reason; before: nil, nil, 0, nil.
function Remote:output(job, _)
  local smp = job.results and job.results[1]
  if not smp then return nil, nil, 0, nil end
  if not job.out then
    local toks, lps = {}, {}
    for k = 1, #smp.ids do toks[k - 1], lps[k - 1] = smp.ids[k], smp.logprobs[k] end
    job.out = { toks, lps }
  end
  return job.out[1], job.out[2], #smp.ids, smp.finish_reason
end

function Remote:versions(job, _, _) return job.results and job.results[1].version, nil end
function Remote:release(_) end
-- (a request on a server runs to its end: an episode past env.max_seconds ends when its turn comes back)
function Remote:stop_sample(_, _) end

-- (what moonrl.engine has that rollouts call: nothing to do for servers elsewhere)
function Remote:reset() end
function Remote:running() return next(self.jobs) ~= nil end
function Remote:num_unfinished() return 0 end
function Remote:use_weights() end
function Remote:record_routing(on)
  if on then moonrl.usage_error('moe.routing_replay: not with an engine in other processes (engine.backend, engine.urls)') end
end

-- The engine's metrics since the last call (a step's): requests, tokens, retries, failures,
-- restarts, weight syncs and their seconds, bytes and tensors, the servers up, the mean time to
-- first token and the peak queue (sequences waiting in a server's engine while the batch ran);
-- and by server (server<k>/): requests, tokens, the mean seconds a request took, ttft,
-- queue_peak, running_peak. The servers' own figures come from their GET /metrics.
function Remote:metrics()
  local c, last = self.counters, self.last or {}
  local m = {}
  for k, v in pairs(c) do m[k] = v - (last[k] or 0) end
  self.last = {}
  for k, v in pairs(c) do self.last[k] = v end
  local healthy = {}
  for _, s in ipairs(self.servers) do if s.healthy then healthy[#healthy + 1] = s end end
  local ok, figures = pcall(self.all, self, healthy, '/metrics', nil, 5) -- (their counters as the step ends)
  if ok then for s, text in pairs(figures) do if type(text) == 'string' then self:read_figures(s, text) end end end
  local up, tsum, tcount, qpeak = 0, 0, 0, 0
  for _, s in ipairs(self.servers) do
    if s.healthy then up = up + 1 end
    local r, t, sec = s.requests or 0, s.tokens or 0, s.seconds or 0
    local pr = s.last or { 0, 0, 0, 0, 0 }
    -- (a server started again counts from 0)
    local dsum, dcount = (s.ttft_sum or 0) - pr[4], (s.ttft_count or 0) - pr[5]
    if dcount < 0 then dsum, dcount = s.ttft_sum or 0, s.ttft_count or 0 end
    m['server' .. s.k] = { requests = r - pr[1], tokens = t - pr[2],
      request_seconds = r > pr[1] and (sec - pr[3]) / (r - pr[1]) or 0, ttft = dcount > 0 and dsum / dcount or 0,
      queue_peak = s.queue_peak or 0, running_peak = s.running_peak or 0 }
    tsum, tcount, qpeak = tsum + dsum, tcount + dcount, math.max(qpeak, s.queue_peak or 0)
    s.last = { r, t, sec, s.ttft_sum or 0, s.ttft_count or 0 }
    s.queue_peak, s.running_peak = 0, 0
  end
  m.servers, m.servers_up = #self.servers, up
  m.ttft, m.queue_peak = tcount > 0 and tsum / tcount or 0, qpeak
  return m
end

function Remote:close()
  for _, s in ipairs(self.servers) do
    if s.proc then
      s.proc:kill()
      s.proc = nil
    end
  end
  if self.client then self.client:close() end
  if self.sync_root and fs.exists(self.sync_root) then pcall(fs.remove, self.sync_root) end
end

return M
