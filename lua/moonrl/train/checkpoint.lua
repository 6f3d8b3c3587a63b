-- Checkpoints: one directory per saved step, written so that a crash at any byte leaves every
-- earlier checkpoint intact, and verified before anything is read back from it.
--
--   RUN_DIR/checkpoints/step-000120/
--     config.json, model.safetensors    the policy in Hugging Face format (a checkpoint is a model),
--     tokenizer.json, ...               with its tokenizer files: load it, serve it, convert it
--     <name>/config.json, ...           every other model of the run (a PPO critic: critic/)
--     optimizer.safetensors             each optimizer's exp_avg and exp_avg_sq (F32, flat), its
--                                       step count in the metadata
--     state.json                        step, phase, data positions, random generators, the guards'
--                                       windows, the recipe's extra state
--     run.json                          the resolved config, moonrl's version and git revision, the
--                                       identity (path, size, mtime) of the input model and data
--     manifest.json                     written last: bytes and CRC-32C of every other file
--
-- Writing: everything goes into checkpoints/.tmp-step-000120/ (each file fsync'ed as it is
-- written), the manifest last, then the directory is fsync'ed and renamed into place and
-- checkpoints/ fsync'ed. A directory without a valid manifest is not a checkpoint.
--
--   local ckpt = require('moonrl.train.checkpoint')
--   ckpt.write(root, name, parts)   -- parts: { models = {{name=, model=, tokenizer_dir=}}, optimizers =
--                                   --   {{name=, opt=}}, state = table, run = table }; returns the
--                                   --   path and the bytes of the files the manifest lists
--   ckpt.verify(dir)                -- true, or false and a one-line reason naming the file
--   ckpt.list(root)                 -- complete-looking checkpoint names, oldest first
--   ckpt.latest(root, warn)         -- the newest checkpoint that verifies (warn(msg, dir) for each skipped)
--   ckpt.read(dir)                  -- { state = ..., run = ... } (after verify)
--   ckpt.load_model(dir, name, model), ckpt.load_optimizer(dir, name, opt)
--   ckpt.prune(root, keep)          -- remove all but the newest `keep` (0: keep all); a checkpoint a
--                                   -- resume found corrupt is set aside as step-NNNNNN.corrupt
local ffi = require('ffi')
local moonrl = require('moonrl')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')

local M = {}

M.FORMAT = 'moonrl-checkpoint'
M.VERSION = 1

local TOKENIZER_FILES = { 'tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json',
  'chat_template.jinja', 'generation_config.json', 'vocab.json', 'merges.txt' }
M.TOKENIZER_FILES = TOKENIZER_FILES

function M.dir_name(step) return string.format('step-%06d', step) end

-- Save a model as a Hugging Face directory with the tokenizer files beside it (each written
-- atomically and fsync'ed). Shared with the final save of a run (moonrl.train.models.save).
function M.save_model(model, dir, tokenizer_dir)
  fs.mkdirs(dir)
  model:save(dir)
  if tokenizer_dir then
    for _, name in ipairs(TOKENIZER_FILES) do
      local from = tokenizer_dir .. '/' .. name
      if fs.stat(from) then fs.copy(from, dir .. '/' .. name) end
    end
  end
end

local function write_optimizers(path, optimizers)
  local w = require('moonrl.io.safetensors').writer()
  for _, o in ipairs(optimizers) do
    local s = o.opt:state()
    w:add(o.name .. '.exp_avg', 'F32', { s.n }, s.m)
    w:add(o.name .. '.exp_avg_sq', 'F32', { s.n }, s.v)
    w:metadata(o.name .. '.step', tostring(s.step))
  end
  w:metadata('format', M.FORMAT)
  w:write(path)
end

-- Every regular file under dir, as paths relative to it, sorted.
local function files_under(dir, prefix, out)
  out = out or {}
  for _, name in ipairs(fs.list(dir)) do
    local rel = prefix and (prefix .. '/' .. name) or name
    local st = fs.stat(dir .. '/' .. name)
    if st and st.is_dir then files_under(dir .. '/' .. name, rel, out)
    elseif st and st.is_file then out[#out + 1] = rel end
  end
  return out
end

local function sync_dirs(dir)
  for _, name in ipairs(fs.list(dir)) do
    if fs.is_dir(dir .. '/' .. name) then sync_dirs(dir .. '/' .. name) end
  end
  fs.sync_dir(dir)
end

function M.write(root, name, parts)
  local p = require('moonrl.io.progress').new('checkpoint ' .. name, #(parts.models or {}) + 2, { unit = 'part' })
  local ok, path, bytes = pcall(M.write_parts, root, name, parts, p)
  if not ok then p:cancel(); error(path, 0) end
  p:finish(require('moonrl.io.progress').bytes(bytes))
  return path, bytes
end

-- M.write's work; p: its progress (a part: each model, the optimizers and small files, the checksums).
function M.write_parts(root, name, parts, p)
  fs.mkdirs(root)
  local final = root .. '/' .. name
  local tmp = root .. '/.tmp-' .. name
  fs.remove(tmp) -- the remains of a write that was interrupted
  fs.mkdirs(tmp)
  for i, m in ipairs(parts.models or {}) do
    -- the first model is the policy, at the top: the checkpoint loads as a model
    M.save_model(m.model, i == 1 and tmp or (tmp .. '/' .. m.name), m.tokenizer_dir)
    p:update(i)
  end
  if parts.optimizers and #parts.optimizers > 0 then write_optimizers(tmp .. '/optimizer.safetensors', parts.optimizers) end
  fs.write(tmp .. '/state.json', json.encode(parts.state or {}, { indent = 1 }) .. '\n')
  fs.write(tmp .. '/run.json', json.encode(parts.run or {}, { indent = 1 }) .. '\n')
  p:update(#(parts.models or {}) + 1, 'checksums')
  local files, bytes = json.object(), 0
  for _, rel in ipairs(files_under(tmp)) do
    local crc, size = fs.crc32c_file(tmp .. '/' .. rel)
    files[rel] = json.object({ 'bytes', size, 'crc32c', string.format('%08x', crc) })
    bytes = bytes + size
  end
  local manifest = json.object({ 'format', M.FORMAT, 'version', M.VERSION, 'name', name,
    'step', parts.state and parts.state.step or json.null, 'files', files })
  fs.write(tmp .. '/manifest.json', json.encode(manifest, { indent = 1 }) .. '\n')
  sync_dirs(tmp)
  if fs.stat(final) then fs.remove(final) end -- a checkpoint of this step from before a rollback
  fs.rename(tmp, final)
  return final, bytes
end

-- What a resume reads of state.json and run.json has the shape session.lua expects, or false and
-- why: a checkpoint from elsewhere (copied, edited by hand) whose checksums match can still hold
-- anything. Every key is checked for its type; the values themselves are the run's.
local function whole(v) return type(v) == 'number' and v >= 0 and v == math.floor(v) and v < 2 ^ 53 end
local function object(v) return json.is_object(v) or (type(v) == 'table' and getmetatable(v) == nil and next(v) == nil) end
local function list_of(v, ok)
  if type(v) ~= 'table' or not (json.is_array(v) or next(v) == nil) then return false end
  for _, x in ipairs(v) do if not ok(x) then return false end end
  return true
end
local function string_(v) return type(v) == 'string' end
local function number(v) return type(v) == 'number' and v == v and v > -math.huge and v < math.huge end
local function each_value(v, ok)
  if not object(v) then return false end
  for _, x in pairs(v) do if not ok(x) then return false end end
  return true
end
local function data_position(v) -- a moonrl.data view's state()
  return object(v) and whole(v.epoch) and whole(v.index) and (v.n == nil or whole(v.n)) and
    (v.seed == nil or string_(v.seed)) and (v.skipped == nil or whole(v.skipped))
end
local function guard_windows(v)
  return object(v) and (v.grad_norm == nil or list_of(v.grad_norm, number)) and (v.loss == nil or list_of(v.loss, number))
end
local function optional(ok) return function(v) return v == nil or ok(v) end end
local STATE_KEYS = { -- key, check, what it must be
  { 'step', whole, 'a whole number' }, { 'phase_step', whole, 'a whole number' },
  { 'phase', optional(function(v) return string_(v) or v == json.null end), 'a string or null' },
  { 'phases_done', optional(function(v) return list_of(v, string_) end), 'a list of strings' },
  { 'metrics_bytes', optional(whole), 'a whole number' }, { 'memo', optional(object), 'an object' },
  { 'extra', optional(object), 'an object' },
  { 'data', optional(function(v) return each_value(v, data_position) end),
    'an object of data positions ({epoch, index, n, seed, skipped})' },
  { 'rngs', optional(function(v) return each_value(v, whole) end), 'an object of whole numbers' },
  { 'guard', optional(guard_windows), 'an object of number lists (grad_norm, loss)' },
  { 'lr_scale', optional(function(v) return number(v) and v > 0 end), 'a number > 0' },
  { 'rollbacks', optional(whole), 'a whole number' }, { 'skips', optional(whole), 'a whole number' },
  { 'skips_in_row', optional(whole), 'a whole number' },
}
local RUN_KEYS = { { 'recipe', string_, 'a string' }, { 'config', optional(object), 'an object' },
  { 'git', optional(string_), 'a string' } }

local function check_keys(path, v, keys)
  if not object(v) then return false, path .. ': not a JSON object' end
  for _, k in ipairs(keys) do
    if not k[2](v[k[1]]) then return false, string.format("%s: '%s' must be %s", path, k[1], k[3]) end
  end
  return true
end

function M.check_saved(dir)
  for _, f in ipairs({ { 'state.json', STATE_KEYS }, { 'run.json', RUN_KEYS } }) do
    local path = dir .. '/' .. f[1]
    local ok, v = pcall(json.read_file, path)
    if not ok then return false, tostring(v) end
    local good, why = check_keys(path, v, f[2])
    if not good then return false, why end
  end
  return true
end

-- true, or false and why (one line naming the file).
function M.verify(dir)
  local mpath = dir .. '/manifest.json'
  local text = fs.read(mpath)
  if not text then return false, mpath .. ': missing (the checkpoint was never completed)' end
  local ok, m = pcall(json.decode, text, mpath)
  if not ok then return false, tostring(m) end
  if type(m) ~= 'table' or m.format ~= M.FORMAT or not object(m.files) then
    return false, mpath .. ': not a moonrl checkpoint manifest'
  end
  if type(m.version) ~= 'number' or m.version > M.VERSION then
    return false, mpath .. ': format version ' .. tostring(m.version) .. ' is newer than this moonrl reads (' .. M.VERSION .. ')'
  end
  for _, rel in ipairs(json.keys(m.files)) do
    local want, path = m.files[rel], dir .. '/' .. rel
    if type(want) ~= 'table' or not whole(want.bytes) or type(want.crc32c) ~= 'string' then
      return false, string.format("%s: the entry of '%s' must be {bytes = a whole number, crc32c = a string}", mpath, rel)
    end
    -- a file of this directory: no absolute path, no '..' (verify reads what the manifest names)
    if rel:sub(1, 1) == '/' or ('/' .. rel .. '/'):find('/../', 1, true) then
      return false, string.format("%s: '%s' is not a path inside the checkpoint", mpath, rel)
    end
    local st = fs.stat(path)
    if not st or not st.is_file then return false, path .. ': missing (listed in the manifest)' end
    if st.size ~= want.bytes then
      return false, string.format('%s: %d bytes, the manifest says %d (truncated or changed)', path, st.size, want.bytes)
    end
    local crc = fs.crc32c_file(path)
    if string.format('%08x', crc) ~= want.crc32c then
      return false, string.format('%s: checksum %08x, the manifest says %s (corrupt)', path, crc, tostring(want.crc32c))
    end
  end
  for _, need in ipairs({ 'state.json', 'run.json' }) do
    if not m.files[need] then return false, mpath .. ': lists no ' .. need end
  end
  return M.check_saved(dir)
end

-- Names of the directories that look like checkpoints (step-NNNNNN), oldest first.
function M.list(root)
  if not fs.is_dir(root) then return {} end
  local out = {}
  for _, name in ipairs(fs.list(root)) do
    if name:match('^step%-%d+$') and fs.is_dir(root .. '/' .. name) then out[#out + 1] = name end
  end
  table.sort(out, function(a, b) return tonumber(a:match('%d+')) < tonumber(b:match('%d+')) end)
  return out
end

-- The newest checkpoint that verifies; every one skipped is reported through warn(message).
function M.latest(root, warn)
  local names = M.list(root)
  for i = #names, 1, -1 do
    local dir = root .. '/' .. names[i]
    local ok, why = M.verify(dir)
    if ok then return dir end
    if warn then warn(string.format('checkpoint %s skipped: %s', dir, why), dir) end
  end
  return nil
end

function M.read(dir)
  return { state = json.read_file(dir .. '/state.json'), run = json.read_file(dir .. '/run.json') }
end

-- Copy a checkpoint's weights into an existing model (same config, checked tensor by tensor).
function M.load_model(dir, name, model, is_policy)
  local mdir = is_policy and dir or (dir .. '/' .. name)
  local st = require('moonrl.io.safetensors').open(mdir)
  local p = model:read_params() -- host memory (a GPU model's: a copy, written back below)
  for _, v in ipairs(model:views()) do
    if not st:has(v.name) then error(string.format('%s: checkpoint has no tensor %s for model %s', mdir, v.name, name), 0) end
    local info = st:info(v.name)
    if info.numel ~= v.numel then
      error(string.format('%s: tensor %s has %d elements, model %s has %d (a different model config)', mdir, v.name,
        info.numel, name, v.numel), 0)
    end
    st:read_f32(v.name, p + v.offset)
  end
  model:write_params(p)
end

function M.load_optimizer(dir, name, opt)
  local path = dir .. '/optimizer.safetensors'
  local st = require('moonrl.io.safetensors').open(path)
  local key = name .. '.exp_avg'
  if not st:has(key) then error(string.format('%s: no state for optimizer %s', path, name), 0) end
  local n = st:info(key).numel
  if n ~= opt.n then error(string.format('%s: optimizer %s has %d parameters here, %d in the checkpoint', path, name, opt.n, n), 0) end
  local m, v = ffi.new('float[?]', n), ffi.new('float[?]', n)
  st:read_f32(key, m)
  st:read_f32(name .. '.exp_avg_sq', v)
  local step = tonumber(st:metadata(name .. '.step'))
  if not step then error(string.format('%s: no step count for optimizer %s', path, name), 0) end
  opt:load_state({ m = m, v = v, n = n, step = step })
end

-- Keep the newest `keep` checkpoints (0 keeps all); remove interrupted writes too.
function M.prune(root, keep)
  if not fs.is_dir(root) then return end
  for _, name in ipairs(fs.list(root)) do
    if name:match('^%.tmp%-') then fs.remove(root .. '/' .. name) end
  end
  if not keep or keep <= 0 then return end
  local names = M.list(root)
  for i = 1, #names - keep do fs.remove(root .. '/' .. names[i]) end
end

-- ---- what a checkpoint records of the run ------------------------------------------------------

-- Flatten a config into { ['a.b'] = json text of the leaf }.
local function flat_config(t, prefix, out)
  out = out or {}
  for k, v in pairs(t) do
    local key = prefix and (prefix .. '.' .. tostring(k)) or tostring(k)
    if type(v) == 'table' and not json.is_array(v) then flat_config(v, key, out)
    else out[key] = json.encode(v) end
  end
  return out
end

-- The keys whose values differ between a checkpoint's config and this run's (free: the keys a
-- resumed run may change), as "key (old -> new)", sorted.
function M.config_changes(old, new, free)
  local a, b = flat_config(old), flat_config(new)
  local out = {}
  for k, v in pairs(b) do
    if not free[k] and a[k] ~= v then out[#out + 1] = string.format('%s (%s -> %s)', k, a[k] or 'absent', v) end
  end
  for k, v in pairs(a) do
    if not free[k] and b[k] == nil then out[#out + 1] = string.format('%s (%s -> absent)', k, v) end
  end
  table.sort(out)
  return out
end

-- The identity of an input file or directory a checkpoint records: path, and size and mtime of
-- each file in it (cheap: moonrl.train.manifest's has their checksums).
function M.input_identity(path)
  if not path then return nil end
  local st = fs.stat(path)
  if not st then return json.object({ 'path', path, 'missing', true }) end
  local files = json.object()
  local names = st.is_dir and fs.list(path) or { false }
  for _, name in ipairs(names) do
    local p = name and (path .. '/' .. name) or path
    local s = fs.stat(p)
    if s and s.is_file then files[name or path:match('[^/]*$')] = json.object({ 'bytes', s.size, 'mtime', s.mtime }) end
  end
  return json.object({ 'path', path, 'files', files })
end

return M
