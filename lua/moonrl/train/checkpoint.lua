-- Checkpoints: one directory per saved step, written so that a crash at any byte leaves every
-- earlier checkpoint intact, and verified before anything is read back from it.
--
--   RUN_DIR/checkpoints/step-000120/
--     config.json, model.safetensors    the policy in Hugging Face format (a checkpoint is a model),
--                                       past parts.max_shard_bytes model-0000K-of-0000N.safetensors
--                                       and model.safetensors.index.json instead
--     tokenizer.json, ...               with its tokenizer files: load it, serve it, convert it
--     <name>/config.json, ...           every other model of the run (a PPO critic: critic/)
--     optimizer.safetensors             each optimizer's exp_avg and exp_avg_sq (F32, flat), its
--                                       step count in the metadata (one process, plain data parallel)
--     optimizer.rank-00001-of-00004.safetensors
--                                       or, when the ranks shard the state (dist.zero=1), one file a
--                                       rank: its contiguous range of each exp_avg and exp_avg_sq
--                                       (F32, flat), and in the metadata <name>.offset, <name>.total
--                                       (the range's place in the whole), <name>.step, rank, world_size
--     optimizer.tp-00001-of-00002.safetensors
--                                       or, under tensor parallel (dist.tp), one file a slot of the
--                                       group: the state of its slices, in its buffer's layout
--     state.json                        step, phase, data positions, random generators, the guards'
--                                       windows, the recipe's extra state
--     run.json                          the resolved config, moonrl's version and git revision, the
--                                       identity (path, size, mtime) of the input model and data
--     manifest.json                     written last: bytes and CRC-32C of every other file
--
-- Writing: everything goes into checkpoints/.tmp-step-000120/ (each file fsync'ed as it is
-- written), the manifest last, then the directory is fsync'ed and renamed into place and
-- checkpoints/ fsync'ed. A directory without a valid manifest is not a checkpoint. With ranks
-- (parts.world), rank 0 makes the directory, then every rank writes its optimizer shard while
-- rank 0 writes the rest, and after each part the ranks agree (an all-gather of their errors):
-- a failure on any rank fails the checkpoint on every rank, and rank 0 writes the manifest (its
-- own stat and CRC-32C of each file: run.dir is shared by the ranks) only once every shard is
-- complete. Reading: each rank reads, of the files of whatever world size wrote them, only the
-- pieces that overlap its own range (M.load_optimizer), so N ranks resume on M.
--
--   local ckpt = require('moonrl.train.checkpoint')
--   ckpt.write(root, name, parts)   -- parts: { models = {{name=, model=, tokenizer_dir=}}, optimizers =
--                                   --   {{name=, opt=}}, state = table, run = table, max_shard_bytes =
--                                   --   the models' safetensors limit (nil: 5 GB), world = the ranks'
--                                   --   World (every rank calls; nil: one process), sharded = each
--                                   --   rank's opt:state() is its shard }; returns the path and (rank
--                                   --   0) the bytes of the files the manifest lists
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

local function is_map(v) return json.is_object(v) or (json.is_array(v) and #v == 0) end -- ({} is written as [])
local function is_int(v, lo, hi)
  return type(v) == 'number' and v == math.floor(v) and v >= lo and v <= (hi or 2 ^ 53)
end

M.FORMAT = 'moonrl-checkpoint'
M.VERSION = 2 -- 2: optimizer state in one file per rank when sharded (1: always one file; still read)

local TOKENIZER_FILES = { 'tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json',
  'chat_template.jinja', 'generation_config.json', 'vocab.json', 'merges.txt' }
M.TOKENIZER_FILES = TOKENIZER_FILES

function M.dir_name(step) return string.format('step-%06d', step) end

-- Save a model as a Hugging Face directory with the tokenizer files beside it (each written
-- atomically and fsync'ed), its weights in shards of at most max_shard_bytes (nil: transformers'
-- 5 GB; Model:save). Shared with the final save of a run (moonrl.train.models.save).
function M.save_model(model, dir, tokenizer_dir, max_shard_bytes)
  fs.mkdirs(dir)
  if model:lora() then -- LoRA: the adapters (PEFT's files), and the base they apply to by path and checksums
    model:save_lora(dir, { base = model.source_file or model.source_dir })
    fs.write(dir .. '/' .. M.LORA_BASE, json.encode(M.base_identity(model), { indent = 1 }) .. '\n')
  else
    model:save(dir, max_shard_bytes)
  end
  if tokenizer_dir then
    for _, name in ipairs(TOKENIZER_FILES) do
      local from = tokenizer_dir .. '/' .. name
      if fs.stat(from) then fs.copy(from, dir .. '/' .. name) end
    end
  end
end

-- A LoRA model's base, beside its adapters: { path, files = { name = crc32c } } of the base's
-- config and weight files (their checksums taken once a model).
M.LORA_BASE = 'lora_base.json'
function M.base_identity(model)
  if not model._base_identity then
    local dir, files = model.source_dir, json.object()
    if not dir then error('LoRA: the model has no base directory (source_dir) to name in its checkpoint', 0) end
    if model.source_file then -- a quantized base: the .gguf file it was read from
      dir = model.source_file:match('^(.*)/[^/]*$') or '.'
      files[model.source_file:match('[^/]*$')] = fs.crc32c_file(model.source_file)
    end
    for _, name in ipairs(model.source_file and {} or fs.list(dir)) do
      if name == 'config.json' or name:match('%.safetensors$') or name == 'model.safetensors.index.json' then
        files[name] = fs.crc32c_file(dir .. '/' .. name)
      end
    end
    model._base_identity = json.object({ 'path', dir, 'files', files })
  end
  return model._base_identity
end

-- The base a LoRA checkpoint (dir) names, checked against its checksums: its path; an error
-- naming the file that is missing or changed.
function M.lora_base(dir)
  local id = json.read_file(dir .. '/' .. M.LORA_BASE)
  for name, crc in pairs(id.files) do
    local path = id.path .. '/' .. name
    if not fs.exists(path) then error(string.format('%s: the base model\'s %s is missing', dir, path), 0) end
    if fs.crc32c_file(path) ~= crc then
      error(string.format('%s: the base model\'s %s changed since the checkpoint (CRC-32C %08x, was %08x)', dir, path,
        fs.crc32c_file(path), crc), 0)
    end
  end
  return id.path
end

-- The optimizer shard file of rank `rank` of `size`.
function M.shard_file(rank, size) return string.format('optimizer.rank-%05d-of-%05d.safetensors', rank, size) end
-- The optimizer files of tensor-parallel slot `rank` of `size` (its slices' state) and pipeline
-- stage `stage` of `stages` (its layers'; nil: none): this prefix and .safetensors, or under ZeRO
-- its shards', prefix.rank-RRRRR-of-NNNNN.safetensors.
function M.tp_prefix(rank, size, stage, stages)
  local p = stage and string.format('optimizer.pp-%05d-of-%05d', stage, stages) or 'optimizer'
  return size > 1 and string.format('%s.tp-%05d-of-%05d', p, rank, size) or p
end

-- world: the ranks, when each opt:state() is this rank's shard (offset, total: where it lies).
local function write_optimizers(path, optimizers, world)
  local w = require('moonrl.io.safetensors').writer()
  for _, o in ipairs(optimizers) do
    local s = o.opt:state()
    w:add(o.name .. '.exp_avg', 'F32', { s.n }, s.m)
    w:add(o.name .. '.exp_avg_sq', 'F32', { s.n }, s.v)
    w:metadata(o.name .. '.step', tostring(s.step))
    -- what the state is of, in Hugging Face coordinates (Model:slices of its range): a run of
    -- another mesh reads its part of it (M.load_optimizer)
    -- (LoRA: the adapters' state, read by range: no mesh slices an adapter)
    if o.opt.model and not o.opt.lora then w:metadata(o.name .. '.slices', json.encode(o.opt.model:slices(s.offset or 0, s.n))) end
    if world then
      w:metadata(o.name .. '.offset', tostring(s.offset))
      w:metadata(o.name .. '.total', tostring(s.total))
    end
  end
  if world then
    w:metadata('rank', tostring(world.rank))
    w:metadata('world_size', tostring(world.size))
  end
  w:metadata('format', M.FORMAT)
  w:write(path)
end

-- Run fn on this rank, then agree with the others (world: nil or one process, nothing to agree):
-- when fn failed on any rank, every rank raises the first failure, naming its rank, so none goes
-- on to a manifest over a missing file or waits for a rank that gave up. (A rank killed outright
-- leaves the others in the all-gather until dist.timeout or the launcher ends the job: no
-- manifest is written, the earlier checkpoints are intact.)
local function together(world, fn)
  local ok, err = pcall(fn)
  if not world or world.size == 1 then
    if not ok then error(err, 0) end
    return
  end
  local errs = world:gather_strings(ok and '' or moonrl.error_text(err))
  for r, e in ipairs(errs) do
    if e ~= '' then error(string.format('rank %d: %s', r - 1, e), 0) end
  end
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

-- Rank 0's last part: the manifest over every file the ranks wrote (each complete: M.write_parts
-- agreed first), then the directory renamed into place. Returns the bytes listed.
local function finish(root, name, parts, p)
  local final = root .. '/' .. name
  local tmp = root .. '/.tmp-' .. name
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
  return bytes
end

function M.write(root, name, parts)
  local lead = (not parts.world or parts.world.rank == 0) and (not parts.tp or parts.tp.rank == 0) -- (it alone shows the progress)
  local progress = require('moonrl.io.progress')
  local p = lead and progress.new('checkpoint ' .. name, #(parts.models or {}) + 2, { unit = 'part' })
  local ok, path, bytes = pcall(M.write_parts, root, name, parts, p)
  if not ok then
    if p then p:cancel() end
    error(path, 0)
  end
  if p then p:finish(progress.bytes(bytes)) end
  return path, bytes
end

-- M.write's work; p: its progress on rank 0 (a part: each model, the optimizers and small files,
-- the checksums).
-- parts.tp: tensor parallel, { world = the group, rank = this rank's slot, all = every rank }:
-- with plain data parallel the ranks of the first group call M.write (each its data-parallel
-- group's rank 0), with ZeRO (parts.sharded) every rank; the first rank leads, the first group
-- gathers and writes the models (mrl_model_save_dir, a collective of the group; a ZeRO-3 model's
-- gathers take every rank, the first group's rank 0 writing), and each rank writes its slot's
-- optimizer state (M.tp_prefix: whole, or its ZeRO shard of it).
function M.write_parts(root, name, parts, p)
  local world = parts.world
  local tp = parts.tp
  local lead = (not world or world.rank == 0) and (not tp or tp.rank == 0)
  local final = root .. '/' .. name
  local tmp = root .. '/.tmp-' .. name
  local optimizers = parts.optimizers and #parts.optimizers > 0 and parts.optimizers
  local function make_tmp()
    if not lead then return end
    fs.mkdirs(root)
    fs.remove(tmp) -- the remains of a write that was interrupted
    fs.mkdirs(tmp)
  end
  if tp then -- once the lead has made tmp: the first group's models, each slot's optimizer state
    local callers = parts.sharded and tp.all or tp.world
    together(callers, make_tmp)
    together(tp.world, function()
      for i, m in ipairs(parts.models or {}) do -- (sharded, ZeRO-3: every rank is in the gathers, the first group's rank 0 writes)
        if m.model:shard() or not world or world.rank == 0 then
          M.save_model(m.model, i == 1 and tmp or (tmp .. '/' .. m.name), lead and m.tokenizer_dir or nil,
            parts.max_shard_bytes)
          if p then p:update(i) end
        end
      end
      if not optimizers then return end
      local o = optimizers[1].opt
      local prefix = tmp .. '/' .. (o.tp_prefix or M.tp_prefix(tp.rank, tp.world.size))
      if not parts.sharded then write_optimizers(prefix .. '.safetensors', optimizers)
      elseif o.shard_writes ~= false then -- (hybrid sharding: the first group's ranks)
        local index, count = o.shard_index or world.rank, o.shard_count or world.size
        write_optimizers(prefix .. M.shard_file(index, count):sub(#'optimizer' + 1), optimizers,
          { rank = index, size = count })
      end
    end)
    if parts.sharded then together(callers, function() end) end -- every file written before the checksums
    if not lead then return final, 0 end
    fs.write(tmp .. '/state.json', json.encode(parts.state or {}, { indent = 1 }) .. '\n')
    fs.write(tmp .. '/run.json', json.encode(parts.run or {}, { indent = 1 }) .. '\n')
    return final, finish(root, name, parts, p)
  end
  together(world, make_tmp)
  -- a sharded model (dist.zero=3) is gathered by every rank, rank 0 writing it: a part of its
  -- own, so that every rank is in its gathers (a failed write on rank 0 still gathers to the end)
  together(world, function()
    for i, m in ipairs(parts.models or {}) do
      if m.model:shard() then
        M.save_model(m.model, i == 1 and tmp or (tmp .. '/' .. m.name), lead and m.tokenizer_dir or nil,
          parts.max_shard_bytes)
      end
    end
  end)
  together(world, function()
    if optimizers and parts.sharded then -- one file a shard (hybrid sharding: written by the first group's ranks)
      local o = optimizers[1].opt
      local index, count = o.shard_index or world.rank, o.shard_count or world.size
      if o.shard_writes ~= false then
        write_optimizers(tmp .. '/' .. M.shard_file(index, count), optimizers, { rank = index, size = count })
      end
    end
    if not lead then return end
    for i, m in ipairs(parts.models or {}) do
      -- the first model is the policy, at the top: the checkpoint loads as a model
      if not m.model:shard() then
        M.save_model(m.model, i == 1 and tmp or (tmp .. '/' .. m.name), m.tokenizer_dir, parts.max_shard_bytes)
      end
      p:update(i)
    end
    if optimizers and not parts.sharded then write_optimizers(tmp .. '/optimizer.safetensors', optimizers) end
    fs.write(tmp .. '/state.json', json.encode(parts.state or {}, { indent = 1 }) .. '\n')
    fs.write(tmp .. '/run.json', json.encode(parts.run or {}, { indent = 1 }) .. '\n')
  end)
  local bytes
  together(world, function()
    if lead then bytes = finish(root, name, parts, p) end
  end)
  return final, bytes
end

-- Why the path rel (a manifest's file name) is not a file of its own inside dir, or nil: it must
-- be relative, without '..' or empty parts, and reach its file through directories, never
-- symbolic links (a manifest listing ../../etc/hostname once had that file read).
function M.outside(dir, rel)
  if type(rel) ~= 'string' or rel == '' or rel:sub(1, 1) == '/' or rel:find('\0', 1, true) then
    return 'is not a relative path'
  end
  local at = dir
  local parts = {}
  for part in (rel .. '/'):gmatch('([^/]*)/') do parts[#parts + 1] = part end
  for i, part in ipairs(parts) do
    if part == '' or part == '.' or part == '..' then return 'reaches outside the checkpoint' end
    at = at .. '/' .. part
    if i < #parts and not fs.is_dir(at) then return 'reaches outside the checkpoint (through ' .. at .. ')' end
  end
  return nil
end

-- true, or false and why (one line naming the file).
function M.verify(dir)
  local mpath = dir .. '/manifest.json'
  local text = fs.read(mpath)
  if not text then return false, mpath .. ': missing (the checkpoint was never completed)' end
  local ok, m = pcall(json.decode, text, mpath)
  if not ok then return false, tostring(m) end
  if type(m) ~= 'table' or m.format ~= M.FORMAT or not is_map(m.files) then
    return false, mpath .. ': not a moonrl checkpoint manifest'
  end
  if type(m.version) ~= 'number' or m.version > M.VERSION then
    return false, mpath .. ': format version ' .. tostring(m.version) .. ' is newer than this moonrl reads (' .. M.VERSION .. ')'
  end
  for _, rel in ipairs(json.keys(m.files)) do
    local want, path = m.files[rel], dir .. '/' .. rel
    local outside = M.outside(dir, rel)
    if outside then return false, string.format('%s: the file %q %s', mpath, rel, outside) end
    if not (json.is_object(want) and is_int(want.bytes, 0) and type(want.crc32c) == 'string') then
      return false, string.format('%s: the entry of %q is not { bytes, crc32c }', mpath, rel)
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
  return true -- what state.json and run.json hold is checked by the resume (M.check_state): refused, not skipped
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

-- ---- what a resume takes from a checkpoint, checked before it is used ---------------------------
-- A checkpoint verifies against its manifest, but both may have been edited, or written by
-- something else: state.json and run.json are checked field by field against what this moonrl
-- writes (types and ranges), and against the run (its datasets' sizes, its metrics.jsonl), so
-- that a step of -5, a data position past the end or a string for a number is refused naming the
-- field, never an internal error or a run that goes on from nonsense.

local function show(v)
  if type(v) == 'string' then return string.format('%q', v) end
  if type(v) == 'table' then return json.is_array(v) and 'a list' or 'an object' end
  return tostring(v)
end
local function bad(file, field, want, v)
  return string.format('%s: %s must be %s, got %s', file, field, want, show(v))
end

-- The fields of state.json: name, what it must be, whether a checkpoint may lack it (older ones).
local STATE_FIELDS = {
  { 'step', 'int', false }, { 'phase_step', 'int', false }, { 'metrics_bytes', 'int', true },
  { 'metrics_lines', 'int', true }, { 'rollbacks', 'int', true }, { 'skips', 'int', true },
  { 'skips_in_row', 'int', true }, { 'lr_scale', 'scale', true }, { 'phase', 'name', true },
  { 'reason', 'string', true }, { 'phases_done', 'names', true }, { 'data', 'map', true }, { 'rngs', 'map', true },
  { 'extra', 'map', true }, { 'memo', 'map', true }, { 'guard', 'map', true },
}
local WANT = { int = 'an integer >= 0', scale = 'a number > 0', name = 'a string or null', string = 'a string',
  names = 'a list of strings', map = 'an object', list = 'a list of finite numbers' }
local function fits(kind, v)
  if kind == 'int' then return is_int(v, 0) end
  if kind == 'scale' then return type(v) == 'number' and v > 0 and v < math.huge end
  if kind == 'name' then return type(v) == 'string' or v == json.null end
  if kind == 'string' then return type(v) == 'string' end
  if kind == 'map' then return is_map(v) end
  if kind == 'names' or kind == 'list' then
    if not json.is_array(v) then return false end
    for _, x in ipairs(v) do
      if kind == 'names' and type(x) ~= 'string' then return false end
      if kind == 'list' and not (type(x) == 'number' and x == x and math.abs(x) < math.huge) then return false end
    end
    return true
  end
end

-- nil, or why a checkpoint's { state, run } (M.read) cannot be resumed from: "state.json: step
-- must be an integer >= 0, got -5".
function M.check_state(saved)
  local s, r = saved.state, saved.run
  if not json.is_object(s) then return 'state.json: not a JSON object' end
  if not json.is_object(r) then return 'run.json: not a JSON object' end
  for _, f in ipairs(STATE_FIELDS) do
    local v = s[f[1]]
    if not (v == nil and f[3]) and not fits(f[2], v) then return bad('state.json', f[1], WANT[f[2]], v) end
  end
  if s.phase_step > s.step then
    return string.format('state.json: phase_step %d is past step %d (the steps of every phase)', s.phase_step, s.step)
  end
  for _, name in ipairs(json.keys(s.data or {})) do -- each dataset's position (its size: M.check_positions)
    local d, at = s.data[name], 'data.' .. name
    if not json.is_object(d) then return bad('state.json', at, WANT.map, d) end
    for _, k in ipairs({ 'epoch', 'index', 'n', 'skipped' }) do
      if not ((d[k] == nil and k ~= 'epoch' and k ~= 'index') or is_int(d[k], 0)) then
        return bad('state.json', at .. '.' .. k, WANT.int, d[k])
      end
    end
    if d.seed ~= nil and not (type(d.seed) == 'string' and d.seed:match('^%d+$')) then
      return bad('state.json', at .. '.seed', 'a string of digits', d.seed)
    end
  end
  for _, name in ipairs(json.keys(s.rngs or {})) do -- moonrl.rng: a Lehmer generator's state
    if not is_int(s.rngs[name], 0, 2147483646) then
      return bad('state.json', 'rngs.' .. name, 'an integer in 0..2147483646', s.rngs[name])
    end
  end
  for _, k in ipairs({ 'grad_norm', 'loss' }) do
    local w = s.guard and s.guard[k]
    if w ~= nil and not fits('list', w) then return bad('state.json', 'guard.' .. k, WANT.list, w) end
  end
  local th = s.memo and s.memo.threads -- run.threads=auto's count (moonrl.train.threads)
  if th ~= nil and not (json.is_object(th) and is_int(th.chosen, 1, tonumber(moonrl.C.mrl_parallel_max_threads()))) then
    return bad('state.json', 'memo.threads.chosen', 'a thread count', json.is_object(th) and th.chosen or th)
  end
  if type(r.recipe) ~= 'string' then return bad('run.json', 'recipe', WANT.string, r.recipe) end
  if r.config ~= nil and not is_map(r.config) then return bad('run.json', 'config', WANT.map, r.config) end
  if r.git ~= nil and type(r.git) ~= 'string' then return bad('run.json', 'git', WANT.string, r.git) end
  return nil
end

-- nil, or why the data positions of state (state.json's data) do not fit the run's datasets
-- (datasets: the session's { name, view } list): a position past the end, another size.
function M.check_positions(state, datasets)
  for _, d in ipairs(datasets) do
    local p = state.data and state.data[d.name]
    if p then
      local n, at = d.view.n, 'data.' .. d.name
      if p.n ~= nil and p.n ~= n then
        return string.format('state.json: %s.n is %d, the dataset has %d records (another file?)', at, p.n, n)
      end
      if p.index > n then
        return string.format('state.json: %s.index %d is past the end of the dataset (%d records)', at, p.index, n)
      end
    end
  end
  return nil
end

-- The lines in the first `bytes` bytes of a file (all of it without bytes; 0 when it is absent),
-- read a MiB at a time.
function M.count_lines(path, bytes)
  local f = io.open(path, 'rb')
  if not f then return 0 end
  local n, left = 0, bytes or math.huge
  while left > 0 do
    local chunk = f:read(math.min(left, 2 ^ 20))
    if not chunk then break end
    left = left - #chunk
    n = n + select(2, chunk:gsub('\n', ''))
  end
  f:close()
  return n
end

-- nil, or why cutting the run's metrics.jsonl (path) back to state.metrics_bytes, as a resume does
-- to drop the lines of the steps it redoes, does not fit: past the end of the file, or keeping
-- another number of lines than the checkpoint had written (state.metrics_lines: a length of 0
-- would drop the metrics of every step before the checkpoint). Returns the lines kept too.
function M.check_metrics(path, state)
  local bytes = state.metrics_bytes
  local f = bytes and io.open(path, 'rb')
  if not f then return nil end -- nothing to cut
  local size = f:seek('end')
  if bytes > size then
    f:close()
    return string.format('state.json: metrics_bytes %d is past the end of %s (%d bytes: cut or replaced since)',
      bytes, path, size)
  end
  f:close()
  local lines = M.count_lines(path, bytes)
  if state.metrics_lines and lines ~= state.metrics_lines then
    return string.format('state.json: metrics_bytes %d keeps %d lines of %s, the checkpoint was written after %d',
      bytes, lines, path, state.metrics_lines)
  end
  return nil, lines
end

-- Copy a checkpoint's weights into an existing model (same config, checked tensor by tensor).
function M.load_model(dir, name, model, is_policy)
  local at = is_policy and dir or (dir .. '/' .. name)
  if not model:lora() and fs.exists(at .. '/' .. M.LORA_BASE) then
    -- adapters over a base (a run that went on to train LoRA after training the whole model): the
    -- base first, then the adapters made as the checkpoint's
    local base = M.lora_base(at)
    model:read_dir(base, name .. ' (LoRA base)')
    model.source_dir = base
  end
  model:read_dir(at, name)
end

-- The pieces of an optimizer's saved state, in order: { st, path, offset, count } each holding
-- elements [offset, offset + count) of the whole (n of them) m and v; and the step count. From
-- optimizer.safetensors (one piece), or from the shard files of the ranks that wrote it, checked
-- to be every rank's of one world size and to tile [0, n) in order.
local function optimizer_pieces(dir, name, n, prefix)
  local safetensors = require('moonrl.io.safetensors')
  local key = name .. '.exp_avg'
  local function open(path)
    local st = safetensors.open(path)
    if not st:has(key) then error(string.format('%s: no state for optimizer %s', path, name), 0) end
    local step = tonumber(st:metadata(name .. '.step'))
    if not step then error(string.format('%s: no step count for optimizer %s', path, name), 0) end
    return st, step
  end
  prefix = prefix or 'optimizer' -- (tensor parallel: this slot's files, M.tp_prefix)
  local whole = dir .. '/' .. prefix .. '.safetensors'
  if fs.stat(whole) then
    local st, step = open(whole)
    local count = st:info(key).numel
    if count ~= n then error(string.format('%s: optimizer %s has %d parameters here, %d in the checkpoint', whole, name, n, count), 0) end
    return { { st = st, path = whole, offset = 0, count = n } }, step
  end
  local ranks, size = {}, nil
  local pattern = '^' .. prefix:gsub('%p', '%%%0') .. '%.rank%-(%d+)%-of%-(%d+)%.safetensors$'
  for _, f in ipairs(fs.list(dir)) do
    local r, of = f:match(pattern)
    if r then
      r, of = tonumber(r), tonumber(of)
      if size and of ~= size then error(string.format('%s/%s: a shard of %d ranks beside shards of %d', dir, f, of, size), 0) end
      size, ranks[r + 1] = of, f
    end
  end
  if not size and prefix ~= 'optimizer' then
    error(string.format('%s: missing, nor its shards (a checkpoint of another dist.tp, or none of it)', whole), 0)
  end
  if not size then error(string.format('%s: no optimizer.safetensors nor optimizer shards (optimizer %s)', dir, name), 0) end
  local pieces, step, at = {}, nil, 0
  for r = 1, size do
    if not ranks[r] then
      error(string.format('%s/%s%s: missing (the shards are of %d ranks)', dir, prefix,
        M.shard_file(r - 1, size):sub(#'optimizer' + 1), size), 0)
    end
    local path = dir .. '/' .. ranks[r]
    local st, s = open(path)
    local offset, total = tonumber(st:metadata(name .. '.offset')), tonumber(st:metadata(name .. '.total'))
    if total ~= n then
      error(string.format('%s: %s.total is %s, optimizer %s has %d parameters here', path, name, tostring(total), name, n), 0)
    end
    if offset ~= at then
      error(string.format('%s: %s.offset is %s, the shards before it end at %d', path, name, tostring(offset), at), 0)
    end
    if step and s ~= step then error(string.format('%s: %s.step is %d, rank 0 has %d', path, name, s, step), 0) end
    local count = st:info(key).numel
    pieces[r], step, at = { st = st, path = path, offset = offset, count = count }, s, at + count
  end
  if at ~= n then error(string.format('%s: the shards of optimizer %s end at %d of %d', dir .. '/' .. ranks[size], name, at, n), 0) end
  return pieces, step
end

-- Elements [first, first + count) of the saved m and v into m[0..count) and v[0..count): of each
-- piece, the part that overlaps that range alone is read.
local function read_pieces(pieces, name, first, count, m, v)
  for _, pc in ipairs(pieces) do
    local a, b = math.max(first, pc.offset), math.min(first + count, pc.offset + pc.count)
    if a < b then
      pc.st:read_f32_range(name .. '.exp_avg', a - pc.offset, b - a, m + (a - first))
      pc.st:read_f32_range(name .. '.exp_avg_sq', a - pc.offset, b - a, v + (a - first))
    end
  end
end

-- The checkpoint's optimizer files that say what their state of optimizer `name` is of (their
-- .slices): { {st, path, slices}, ... }, and the step count, checked to be the same in all.
local function sliced_files(dir, name)
  local safetensors = require('moonrl.io.safetensors')
  local out, step = {}, nil
  for _, f in ipairs(fs.list(dir)) do
    if f:match('^optimizer.*%.safetensors$') then
      local path = dir .. '/' .. f
      local st = safetensors.open(path)
      local text = st:metadata(name .. '.slices')
      if text then
        local s = tonumber(st:metadata(name .. '.step'))
        if not s then error(string.format('%s: no step count for optimizer %s', path, name), 0) end
        if step and s ~= step then error(string.format('%s: %s.step is %d, %s has %d', path, name, s, out[1].path, step), 0) end
        out[#out + 1], step = { st = st, path = path, slices = json.decode(text, path .. ': ' .. name .. '.slices') }, s
      end
    end
  end
  return out, step
end

-- Elements [first, first + count) of model's m and v from the files (sliced_files): each file's
-- slices placed in model's layout (Model:slice_plan: whatever the mesh that wrote them, a tensor-
-- parallel rank or a pipeline stage taking its part), the parts in the range read. Every element
-- must be found (a tied head's two copies give the same one twice).
local function read_sliced(files, name, model, first, count, m, v)
  local has, got = {}, ffi.new('uint8_t[?]', math.max(count, 1))
  for _, view in ipairs(model:views()) do has[view.name] = true end
  for _, f in ipairs(files) do
    for _, c in ipairs(model:slice_plan(f.slices, function(n) return has[n] end)) do
      local a, b = math.max(c.to, first), math.min(c.to + c.count, first + count)
      if a < b then
        f.st:read_f32_range(name .. '.exp_avg', c.at + a - c.to, b - a, m + (a - first))
        f.st:read_f32_range(name .. '.exp_avg_sq', c.at + a - c.to, b - a, v + (a - first))
        ffi.fill(got + (a - first), b - a, 1)
      end
    end
  end
  for i = 0, count - 1 do
    if got[i] == 0 then
      error(string.format('%s: the optimizer state of %s has no element %d of this rank\'s %d (the checkpoint\'s files ' ..
        'do not cover this model)', files[1] and files[1].path or 'checkpoint', name, first + i, count), 0)
    end
  end
end

-- An optimizer's state from a checkpoint. Its files say what they hold (.slices): this rank takes
-- its part of each, so a run resumes whatever its mesh (dist.tp, dist.pp, dist.cp, dist.zero and
-- the ranks may differ from the run that wrote it); a checkpoint without them is read by range
-- from this rank's prefix's files (the mesh that wrote it).
function M.load_optimizer(dir, name, opt)
  local n = opt.n
  local files, fstep = {}, nil
  if opt.model and not opt.lora then files, fstep = sliced_files(dir, name) end
  if #files > 0 then
    local model = opt.model
    if opt.sharded then
      opt:load_range(function(first, count, m, v) read_sliced(files, name, model, first, count, m, v) end, fstep)
      return
    end
    local m, v = ffi.new('float[?]', n), ffi.new('float[?]', n)
    read_sliced(files, name, model, 0, n, m, v)
    opt:load_state({ m = m, v = v, n = n, step = fstep })
    return
  end
  local pieces, step = optimizer_pieces(dir, name, n, opt.tp_prefix)
  if opt.sharded then -- ZeRO-1 (moonrl.train.dist): this rank's range of m and v, nothing else of the files
    opt:load_range(function(first, count, m, v) read_pieces(pieces, name, first, count, m, v) end, step)
    return
  end
  local m, v = ffi.new('float[?]', n), ffi.new('float[?]', n)
  read_pieces(pieces, name, 0, n, m, v)
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
