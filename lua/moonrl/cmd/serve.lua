-- moonrl serve: an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions,
-- /v1/models, /health, /metrics) over the generation engine, with continuous batching across
-- requests. The server loop is moonrl.serve.
local moonrl = require('moonrl')

local M = {}

local USAGE = [[
usage: moonrl serve --model DIR|FILE.gguf [options]
  --model DIR            a Hugging Face model directory, or a .gguf file (converted once into MOONRL_CACHE)
  --host HOST            address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)
  --port PORT            default 8000; 0 picks a free port (printed at start)
  --served-model-name N  the model's name in the API (default: --model as given)
  --tokenizer PATH       tokenizer.json or its directory (default: the model directory)
  --chat-template FILE   a Jinja chat template (default: the model's tokenizer_config.json)
  --max-seqs N           sequences running at once (default 64)
  --max-batch-tokens N   tokens per engine step (default 2048)
  --max-model-len N      prompt + completion tokens at most (default: the model's max_position_embeddings)
  --kv-cache-mb MB       KV cache size (default 256)
  --dtype D              float32 (default) or bfloat16 (bf16 weight copies and KV cache, as model.dtype=bf16)
  --lora NAME=DIR        a PEFT LoRA adapter served beside the model: requests with "model": NAME use it
                         (repeatable; several in one batch; POST /v1/load_lora_adapter adds one later)
  --max-n N              samples of one request at most (n x prompts; default 128)
  --default-max-tokens N chat completions without max_tokens stop here (default: the context left)
  --seed S               the streams of requests that give no seed (default 0)
  --max-body-mb MB       request bodies at most (default 16; larger: 413)
  --max-connections N    open connections at most (default 1024); past it a new one replaces the
                         slowest without a complete request, else gets 503
  --header-timeout S     seconds to receive a request's whole head, from its first byte (default 60; then 408)
  --body-timeout S       seconds to receive a request's whole body, from its head (default 60; then 408)
  --keep-alive-timeout S seconds an open connection waits for its next request (default 30)
  --request-timeout S    seconds a request may take, from received to answered (default 600; then 503)
  --shutdown-timeout S   on SIGINT/SIGTERM, seconds to finish the requests in flight (default 10)
  --tp N                 tensor parallel over N ranks (started here with mpirun): each holds its
                         slices of every layer, the engines step together, rank 0 serves HTTP
  --record FILE.jsonl    training mode: the requests that name an episode (the API key, `user` or
                         metadata.episode_id; one sample each) are appended to FILE with their exact
                         prompt and completion token ids and log-probs, and POST /v1/episodes/reward
                         appends the episode's reward (docs/serving.md, "Training mode")]]

local NUMBERS = {
  ['--port'] = { 'port', true, 0, 65535 }, ['--max-seqs'] = { 'max_seqs', true, 1 },
  ['--max-batch-tokens'] = { 'max_batch_tokens', true, 1 }, ['--max-model-len'] = { 'max_model_len', true, 2 },
  ['--kv-cache-mb'] = { 'kv_cache_mb', false, 0 }, ['--max-n'] = { 'max_n', true, 1 },
  ['--default-max-tokens'] = { 'default_max_tokens', true, 1 }, ['--seed'] = { 'seed', true, 0 },
  ['--max-body-mb'] = { 'max_body_mb', false, 0 }, ['--max-connections'] = { 'max_connections', true, 1, 65000 },
  ['--shutdown-timeout'] = { 'shutdown_timeout', false, 0 },
  ['--header-timeout'] = { 'header_timeout', false, 0.1 }, ['--body-timeout'] = { 'body_timeout', false, 0.1 },
  ['--keep-alive-timeout'] = { 'keep_alive_timeout', false, 0.1 },
  ['--request-timeout'] = { 'request_timeout', false, 0.1 }, ['--tp'] = { 'tp', true, 1 },
}
local STRINGS = { ['--model'] = 'model', ['--host'] = 'host', ['--served-model-name'] = 'served_model_name',
  ['--tokenizer'] = 'tokenizer', ['--chat-template'] = 'chat_template', ['--record'] = 'record', ['--dtype'] = 'dtype' }

local function parse(args)
  return require('moonrl.cli.cmdline').parse(args, { command = 'serve', usage = USAGE, numbers = NUMBERS, strings = STRINGS,
    lists = { ['--lora'] = 'lora' },
    defaults = { host = '127.0.0.1', port = 8000, max_seqs = 64, kv_cache_mb = 256, seed = 0, max_n = 128,
      max_body_mb = 16, max_connections = 1024, shutdown_timeout = 10, header_timeout = 60, body_timeout = 60,
      keep_alive_timeout = 30, request_timeout = 600, tp = 1 },
    required = { '--model' } })
end

-- --record FILE: a recorder (moonrl.serve.server's training mode) that appends every turn and
-- reward to FILE as a JSON line; any episode id is taken (up to 200 bytes), the request's own
-- sampling kept.
local function file_recorder(path)
  local json = require('moonrl.io.json')
  local f, err = io.open(path, 'a')
  if not f then moonrl.usage_error('serve: --record: ' .. tostring(err)) end
  local turns = {}
  local function put(o)
    f:write(json.encode(o), '\n')
    f:flush()
  end
  return {
    known = function(id) return #id <= 200 end,
    sampling = function() return {} end,
    turn = function(id, t)
      turns[id] = (turns[id] or 0) + 1
      put(json.object({ 'episode_id', id, 'turn', turns[id], 'prompt_ids', json.array(t.prompt_ids), 'ids', json.array(t.ids),
        'logprobs', json.array(t.logprobs), 'text', t.text, 'finish_reason', t.finish_reason }))
    end,
    reward = function(id, r) put(json.object({ 'episode_id', id, 'reward', r })) end,
    done = function(id, r, err)
      put(json.object({ 'episode_id', id, 'done', true, 'reward', r or json.null, 'error', err or json.null }))
    end,
    close = function() f:close() end,
  }
end

local function log(msg)
  io.stderr:write('moonrl serve: ', msg, '\n')
  io.stderr:flush()
end

function M.main(args)
  local o = parse(args)
  if not o then return 0 end
  -- --tp N: this command again on N ranks (graceful: a Ctrl-C drains the requests in flight)
  local world = o.tp > 1 and require('moonrl.train.dist').world() or nil
  if world and world.size == 1 then return require('moonrl.cmd.launch').start_self('serve', o.tp, args, true) end
  if world and world.size ~= o.tp then
    moonrl.usage_error(string.format('serve: --tp %d on a job of %d ranks (it starts its own: run it alone)', o.tp,
      world.size))
  end
  local lead = not world or world.rank == 0
  local inference = require('moonrl.serve.inference')
  local m, err = inference.load(o.model, { tokenizer = o.tokenizer, template = lead, tp = world })
  if not m then moonrl.usage_error('serve: ' .. moonrl.error_text(err)) end
  local dir, model, tok = m.dir, m.model, m.tokenizer
  local dtypes = { float32 = 'fp32', fp32 = 'fp32', auto = 'fp32', bfloat16 = 'bf16', bf16 = 'bf16' }
  if o.dtype and not dtypes[o.dtype] then moonrl.usage_error(string.format('serve: --dtype %s: float32 or bfloat16', o.dtype)) end
  if o.dtype then model:set_dtype(dtypes[o.dtype]) end
  local chat = require('moonrl.chat')
  -- the chat template: the model's, or --chat-template's (with the model's bos/eos tokens)
  local tpl, tpl_err = m.template, m.template_error and moonrl.error_text(m.template_error)
  if o.chat_template then
    local f, ferr = require('moonrl.io.fs').open(o.chat_template)
    if not f then moonrl.usage_error('serve: --chat-template: ' .. ferr) end
    local text = f:read('*a')
    f:close()
    local cok, fn = pcall(chat.compile, text, o.chat_template)
    if not cok then moonrl.usage_error('serve: --chat-template: ' .. moonrl.error_text(fn)) end
    if tpl then
      tpl.fn, tpl.template = fn, text
    else
      tpl = { render = function(_, messages, extra)
        local vars = { messages = messages }
        for k, v in pairs(extra or {}) do vars[k] = v end
        return chat.render(text, vars, o.chat_template)
      end }
    end
  end
  local max_len = o.max_model_len or model.config.max_position_embeddings
  local ok, engine = pcall(moonrl.engine.new, model, { kv_cache_bytes = math.floor(o.kv_cache_mb * 2 ^ 20),
    max_seqs = o.max_seqs, max_batch_tokens = o.max_batch_tokens, max_model_len = o.max_model_len, seed = o.seed })
  if not ok then moonrl.usage_error('serve: ' .. moonrl.error_text(engine)) end
  local mirror = world and require('moonrl.serve.mirror')
  if world and not lead then -- the lead's engine calls, applied here, until it closes
    mirror.follow(engine, world)
    return 0
  end
  if world then engine = mirror.lead(engine, world) end
  local serve = require('moonrl.serve.server')
  local srv
  ok, srv = pcall(serve.new, {
    engine = engine, tokenizer = tok, template = tpl, template_error = tpl_err,
    model_name = o.served_model_name or o.model, model_path = o.model, max_model_len = max_len,
    eos_ids = inference.eos_ids(dir, model, tok), seed = o.seed, max_n = o.max_n, default_max_tokens = o.default_max_tokens,
    host = o.host, port = o.port, max_body_bytes = math.floor(o.max_body_mb * 2 ^ 20),
    max_connections = o.max_connections, shutdown_timeout = o.shutdown_timeout, log = log,
    header_timeout_s = o.header_timeout, body_timeout_s = o.body_timeout, idle_timeout_s = o.keep_alive_timeout,
    request_timeout = o.request_timeout, record = o.record and file_recorder(o.record) or nil,
  })
  if not ok then
    if world then engine:close() end
    moonrl.usage_error('serve: ' .. moonrl.error_text(srv))
  end
  for _, spec in ipairs(o.lora) do -- --lora NAME=DIR
    local name, ldir = spec:match('^([^=]+)=(.+)$')
    if not name then moonrl.usage_error(string.format("serve: --lora '%s': expected NAME=DIR", spec)) end
    local lok, lerr = pcall(srv.load_adapter, srv, name, ldir)
    if not lok then
      moonrl.usage_error(string.format('serve: --lora %s: %s', spec, moonrl.error_text(type(lerr) == 'table' and lerr.message or lerr)))
    end
  end
  local host = o.host:find(':', 1, true) and ('[' .. o.host .. ']') or o.host
  log(string.format('listening on http://%s:%d (model %s, max_model_len %d%s%s)', host, srv.port,
    o.served_model_name or o.model, max_len, tpl and '' or ', no chat template',
    o.record and ', recording episodes to ' .. o.record or ''))
  local f = require('moonrl.train.fault').find('serve_kill') -- (fault injection: a server lost mid-run)
  if f then
    local handle, seen = srv.handle, 0
    srv.handle = function(self, hid, method, path, ...)
      if path:sub(1, 4) == '/v1/' and method == 'POST' then
        seen = seen + 1
        if seen > (f.requests or 0) then
          log('fault injection: serve_kill')
          moonrl.C.mrl_fault_kill()
        end
      end
      return handle(self, hid, method, path, ...)
    end
  end
  local rok, err = pcall(srv.run, srv)
  srv:close()
  if srv.record and srv.record.close then srv.record.close() end
  if world then engine:close() end -- the other ranks' loops end
  if not rok then error(err, 0) end
  log('stopped')
  return 0
end

return M
