-- The fuzz targets in Lua, run by tests/fuzz/fuzz.lua: name -> { run = function(input), setup,
-- cleanup, dict }. run feeds one input to one parser of the Lua library and uses what it gives
-- back the way moonrl does; it may raise a clean error (the input refused), and asserts the
-- properties every input must keep with check() (a broken one is a finding).
local moonrl = require('moonrl')
local json = require('moonrl.io.json')
local fs = require('moonrl.io.fs')

local M = {}

-- Write a file fast (no fsync: fs.write's atomic write would dominate a run).
function M.put(path, text)
  local f = assert(io.open(path, 'wb'))
  f:write(text)
  f:close()
end

-- M.dirty(err): the message of an error that is a finding, or nil (fuzz.lua sets it)

local function check(cond, what)
  if not cond then error('fuzz property broken: ' .. what, 2) end
end

local tmp -- this process's scratch directory
local function scratch()
  if not tmp then
    tmp = os.tmpname()
    os.remove(tmp)
    fs.mkdirs(tmp)
  end
  return tmp
end
local function teardown() if tmp then fs.remove(tmp) end end

-- ---- chat templates (moonrl.text.jinja): a template is untrusted (it comes with a downloaded model)

-- the conversations of tests/chat/cases.json, rendered with each template
local cases
local LIMITS = { steps = 20000, string = 65536, text = 1048576, range = 1000, depth = 20 }
M.jinja = {
  setup = function()
    cases = json.decode(fs.read('tests/chat/cases.json'), 'tests/chat/cases.json')
  end,
  run = function(src)
    local jinja = require('moonrl.text.jinja')
    local render = jinja.compile(src, 'fuzz.jinja')
    -- two conversations a template: the input's length picks them (the same each time it runs)
    for _, i in ipairs({ #src % #cases + 1, (#src * 7 + 3) % #cases + 1 }) do
      local vars = {}
      for k, v in pairs(cases[i].vars) do vars[k] = v end
      local ok, out = pcall(render, vars, { limits = LIMITS, now = 1700000000 })
      check(not ok or type(out) == 'string', 'a render gives a string')
      if not ok then error(out, 0) end
    end
  end,
}

-- ---- tokenizer_config.json: its chat_template (a string, or a list of named ones), bos / eos
M.tokenizer_config = {
  dict = 'json',
  setup = scratch,
  teardown = teardown,
  run = function(text)
    M.put(scratch() .. '/tokenizer_config.json', text)
    local tpl = require('moonrl.chat').load(scratch())
    check(type(tpl.bos_token) == 'string' and type(tpl.eos_token) == 'string', 'bos and eos tokens are strings')
    tpl:render({ { role = 'user', content = 'Hi' } }, { add_generation_prompt = true, now = 1700000000 })
  end,
}

-- ---- JSON (moonrl.io.json): decode, and what it decodes encodes and decodes back the same
M.json_lua = {
  dict = 'json',
  run = function(text)
    local v = json.decode(text, 'fuzz.json')
    local once = json.encode(v)
    local ok, again = pcall(json.decode, once, 'encoded')
    check(ok, 'what encode writes decodes: ' .. tostring(again))
    check(json.encode(again) == once, 'encode(decode(encode(v))) == encode(v)')
    json.encode(v, { indent = 2, sort_keys = true })
  end,
}

-- ---- JSONL records (moonrl.data): a dataset file, each record's fields as a recipe reads them
M.jsonl = {
  dict = 'json',
  setup = scratch,
  teardown = teardown,
  run = function(text)
    local path = scratch() .. '/data.jsonl'
    M.put(path, text)
    local data = require('moonrl.data')
    local fields = { prompt = 'question', answer = 'answer', level = 'meta.level' }
    local ds = data.jsonl(path, { fields = fields, optional = { answer = true, level = true }, on_error = 'skip' })
    local n = ds:len()
    for batch in ds:shuffled(7):batches(3) do
      for _, rec in ipairs(batch) do check(rec.prompt ~= nil and json.is_object(rec.data), 'a record has its fields') end
    end
    local st = ds:state()
    ds:restore(json.decode(json.encode(st), 'state'))
    if n > 1 then
      local train, valid = ds:split({ fraction = 0.5, seed = 3 })
      check(train:len() + valid:len() == n, 'a split keeps every record')
    end
    -- on_error = 'error': the first bad record is a clean error naming its line (the input is
    -- still accepted: it reached the end)
    local strict = data.jsonl(path, { fields = fields, optional = { answer = true, level = true } })
    local ok, err = pcall(function() for i = 1, strict:len() do strict:get(i) end end)
    if not ok and M.dirty(err) then error(err, 0) end
  end,
}

-- ---- checkpoints (moonrl.train.checkpoint, moonrl.train.session): a run resumes from a checkpoint
-- directory, which may come from elsewhere (copied, downloaded, edited by hand)

-- A real checkpoint, written once by a session of a run with a dataset, a generator, memos and extra
-- state (no model: the weights are the safetensors targets'); returns the checkpoint's directory.
local session_decl = { steps = 4 }
local function open_session(dir, resume)
  local config = require('moonrl.config')
  local cfg = config.merge(session_decl, { { key = 'run.dir', value = dir }, { key = 'run.resume', value = resume },
    { key = 'run.progress', value = 'off' }, { key = 'run.checkpoint_every', value = '2' } })
  local S = require('moonrl.train.session').open(cfg, { name = 'fuzz', silent = true, total_steps = 4 })
  local data = require('moonrl.data')
  S.view = S:dataset('train', data.jsonl(scratch() .. '/data.jsonl', { fields = { prompt = 'question' } }):shuffled(1))
  S:rng('sample', 5)
  return S
end

local ckpt_dir
local function make_checkpoint()
  if ckpt_dir then return ckpt_dir end
  local lines = {}
  for i = 1, 10 do lines[i] = json.encode({ question = 'q' .. i }) end
  M.put(scratch() .. '/data.jsonl', table.concat(lines, '\n') .. '\n')
  local S = open_session(scratch() .. '/run0', 'never')
  for step in S:steps(4) do
    S:memo('first', function() return json.array({ 1, 'two', json.null }) end)
    S.extra.step = step
    for _ in S.view:batches(3) do break end
  end
  S:close('finished')
  moonrl.run_exit_hooks(true)
  ckpt_dir = scratch() .. '/run0/checkpoints/step-000002'
  return ckpt_dir
end

-- The manifest of dir rewritten to match its files (verify then passes; the state is what is fuzzed).
local function write_manifest(dir)
  local ckpt = require('moonrl.train.checkpoint')
  local files = json.object()
  for _, rel in ipairs(fs.list(dir)) do
    if rel ~= 'manifest.json' then
      local crc, size = fs.crc32c_file(dir .. '/' .. rel)
      files[rel] = json.object({ 'bytes', size, 'crc32c', string.format('%08x', crc) })
    end
  end
  M.put(dir .. '/manifest.json', json.encode(json.object({ 'format', ckpt.FORMAT, 'version', ckpt.VERSION,
    'name', 'step-000002', 'step', 2, 'files', files }), { indent = 1 }))
end

-- manifest.json: verified (each file's size and CRC-32C), and the newest good checkpoint found
M.manifest = {
  dict = 'json',
  setup = make_checkpoint,
  teardown = teardown,
  run = function(text)
    local ckpt = require('moonrl.train.checkpoint')
    M.put(ckpt_dir .. '/manifest.json', text)
    local ok, why = ckpt.verify(ckpt_dir)
    check(ok == true or (ok == false and type(why) == 'string'), 'verify says true, or false and why')
    local latest = ckpt.latest(scratch() .. '/run0/checkpoints', function(msg) check(type(msg) == 'string', 'a warning') end)
    check(latest == nil or type(latest) == 'string', 'latest is a path or nil')
  end,
}

-- state.json and run.json (the input: the two texts, between them the line SEPARATOR), resumed
-- from: the run's recipe and config checked, the step, phase, data positions, generators, guards,
-- memos and extra state put back, and one step run from there.
local SEPARATOR = '\n--- run.json ---\n'
M.SEPARATOR = SEPARATOR
local resumed, quiet_print = 0, function() end
M.checkpoint = {
  dict = 'json',
  setup = function()
    make_checkpoint()
    M.resume_dir = scratch() .. '/resume'
    fs.remove(M.resume_dir)
    fs.mkdirs(M.resume_dir)
    for _, name in ipairs(fs.list(ckpt_dir)) do fs.copy(ckpt_dir .. '/' .. name, M.resume_dir .. '/' .. name) end
  end,
  teardown = teardown,
  run = function(input)
    local at = input:find(SEPARATOR, 1, true)
    M.put(M.resume_dir .. '/state.json', at and input:sub(1, at - 1) or input)
    if at then M.put(M.resume_dir .. '/run.json', input:sub(at + #SEPARATOR)) end
    write_manifest(M.resume_dir)
    resumed = resumed + 1
    local print0 = print
    print = quiet_print -- the session's "resuming from ..." line, once an input
    local ok, err = pcall(function()
      local S = open_session(scratch() .. '/resumed-' .. resumed, M.resume_dir)
      local step = S:steps(4)
      if step() then S.extra.more = true end
      S:close('finished')
    end)
    print = print0
    if not ok then error(err, 0) end
  end,
  cleanup = function()
    moonrl.run_exit_hooks(true) -- (a session an error left open closes)
    fs.remove(scratch() .. '/resumed-' .. resumed)
  end,
}

return M
