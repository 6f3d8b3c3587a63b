-- moonrl.train.manifest: what a run was made from, so that it can be made again.
--
-- Every run directory holds manifest.json, written by trainer rank 0 when the session starts
-- (a resume rewrites it, keeping the first start's `created`):
--   moonrl     version and git revision of the build
--   command    the recipe file (its path and CRC-32C), the key=value words it was given, the
--              ranks of the job (world size, rollout ranks) and the MOONRL_* environment
--   config     the resolved config (every key, defaults included); seeds are config keys
--   seeds      the config's keys named seed (a copy, for the eye)
--   inputs     the input model and data: path, and per file bytes and CRC-32C
--   code       the Lua files a run loads beside the recipe (reward plugins, --require files):
--              path and CRC-32C
--   machine    CPU model and cores, the kernels in use (ISA level, bf16 path, OpenBLAS core),
--              threads, ranks, host, CUDA devices visible
--   threads    with run.threads=auto: the count chosen, how (measured, ranks, MOONRL_THREADS,
--              checkpoint) and the seconds of a step at each count timed (moonrl.train.threads)
--
-- `moonrl run --from RUN_DIR [key=value ...]` runs the recipe again with the same words, after
-- checking that the recipe, the inputs and the code are unchanged (a changed or missing file is
-- an error naming it), into RUN_DIR-rerun (or run.dir=...), with the thread count run.threads=auto
-- chose (the bits depend on it): on the same kind of machine (the same kernels) the result is
-- bit-identical.
--
-- What --from trusts: the run directory's own files and moonrl's installation, nothing else a
-- manifest names. A run keeps a copy of its recipe file (RUN_DIR/recipe.lua, M.RECIPE_COPY), and
-- --from runs that copy; a recipe file, a --require file or a reward=FILE.lua:NAME word outside
-- the directory and the installation runs only when the command line names it again (a shared
-- run directory whose manifest was edited could otherwise run any file).
local moonrl = require('moonrl')
local ffi = require('ffi')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')
local registry = require('moonrl.registry')

local M = {}

M.FORMAT = 1
M.RECIPE_COPY = 'recipe.lua' -- the run's copy of its recipe file, in the run directory

pcall(ffi.cdef, 'char *realpath(const char *path, char *resolved); void free(void *p);')

-- The canonical absolute path of an existing file (symbolic links and .. resolved), or nil.
local function real(path)
  local p = ffi.C.realpath(path, nil)
  if p == nil then return nil end
  local out = ffi.string(p)
  ffi.C.free(p)
  return out
end

-- Whether path is root or lies under it, once both are resolved.
local function under(path, root)
  local p, r = real(path), root and real(root)
  return p ~= nil and r ~= nil and (p == r or p:sub(1, #r + 1) == r .. '/')
end

-- The Lua files the run loaded beside the recipe, in load order (those moonrl.registry loaded,
-- --require files and reward plugins, join at each write): { path = true }.
M.code_files = {}
local code_order = {}

function M.add_code(path)
  if path and not M.code_files[path] then
    M.code_files[path] = true
    code_order[#code_order + 1] = path
  end
end

-- The command of this process: set by the CLI before the recipe runs.
M.command = nil -- { recipe = path, words = { 'key=value', ... } }

-- The ranks of this job (all of them: trainers and rollout ranks), from the launcher's environment.
function M.job_size()
  return tonumber(os.getenv('OMPI_COMM_WORLD_SIZE') or os.getenv('PMIX_SIZE') or os.getenv('SLURM_NTASKS') or '1') or 1
end

-- A file's CRC-32C (hex) and size; nil when it cannot be read. The manifest is written at every
-- phase's start: a file whose size and mtime are those of a checksum taken already in this
-- process is not read again (a model of gigabytes, once per run).
local crc_seen = {}
local function crc_hex(path)
  local st = fs.stat(path)
  local key = st and string.format('%s\0%d\0%s', path, st.size, tostring(st.mtime))
  if key and crc_seen[key] then return crc_seen[key][1], crc_seen[key][2] end
  local ok, crc, size = pcall(fs.crc32c_file, path)
  if not ok then return nil end
  local hex = string.format('%08x', crc)
  if key then crc_seen[key] = { hex, size } end
  return hex, size
end

-- A file or a directory's files: path, bytes and CRC-32C of each.
function M.identity(path)
  local st = fs.stat(path)
  if not st then return json.object({ 'path', path, 'missing', true }) end
  local files = json.object()
  local names = st.is_dir and fs.list(path) or { false }
  table.sort(names, function(a, b) return tostring(a) < tostring(b) end)
  for _, name in ipairs(names) do
    local p = name and (path .. '/' .. name) or path
    local s = fs.stat(p)
    if s and s.is_file then
      local crc, size = crc_hex(p)
      files[name or path:match('[^/]*$')] = json.object({ 'bytes', size or s.size, 'crc32c', crc or json.null })
    end
  end
  return json.object({ 'path', path, 'files', files })
end

local function seeds_of(cfg, prefix, out)
  for k, v in pairs(cfg) do
    local key = prefix and (prefix .. '.' .. k) or tostring(k)
    if type(v) == 'table' then seeds_of(v, key, out)
    elseif type(k) == 'string' and k:match('seed$') then out[key] = v end
  end
  return out
end

local function cpu_model()
  local f = io.open('/proc/cpuinfo')
  if not f then return 'unknown' end
  local text = f:read('*a')
  f:close()
  local model = text:match('model name%s*:%s*([^\n]+)') or 'unknown'
  local family, mod = text:match('cpu family%s*:%s*(%d+)'), text:match('\nmodel%s*:%s*(%d+)')
  local cores = 0
  for _ in text:gmatch('\nprocessor%s*:') do cores = cores + 1 end
  if text:match('^processor%s*:') then cores = cores + 1 end
  return model, family and mod and string.format('family %s model %s', family, mod) or nil, cores
end

local function openblas_core()
  local ok, core = pcall(function()
    pcall(ffi.cdef, 'char *openblas_get_corename(void);')
    return ffi.string(ffi.C.openblas_get_corename())
  end)
  return ok and core or json.null
end

function M.machine(world_size, rollout_ranks)
  local v = moonrl.version()
  local model, family, cores = cpu_model()
  local host = io.open('/proc/sys/kernel/hostname')
  local hostname = host and host:read('*l') or 'unknown'
  if host then host:close() end
  local bf16 = pcall(function() return moonrl.C.mrl_bf16_products end) and ffi.string(moonrl.C.mrl_bf16_products())
    or json.null
  return json.object({ 'cpu', model, 'cpu_family', family or json.null, 'cores', cores, 'cpu_features', v.cpu_features,
    'kernels', v.kernels, 'bf16_products', bf16, 'fp32_products', ffi.string(moonrl.C.mrl_fp32_products()), 'openblas_core', openblas_core(), 'threads', v.threads,
    'ranks', world_size or 1, 'rollout_ranks', rollout_ranks or 0, 'host', hostname, 'cuda_devices', v.cuda_devices })
end

-- The manifest of session S (moonrl.train.session) as a JSON object.
function M.build(S, created)
  local v = moonrl.version()
  local cmd = M.command or {}
  local env = json.object()
  for _, k in ipairs({ 'MOONRL_THREADS', 'MOONRL_FAULT', 'MOONRL_ATTEMPT', 'OPENBLAS_CORETYPE' }) do
    if os.getenv(k) then env[k] = os.getenv(k) end
  end
  local recipe = json.null
  if cmd.embedded then
    recipe = json.object({ 'embedded', cmd.embedded })
  elseif cmd.recipe then
    local crc = crc_hex(cmd.recipe)
    recipe = json.object({ 'path', cmd.recipe, 'crc32c', crc or json.null })
    if S.recipe_copied then recipe.copy = M.RECIPE_COPY end
  end
  local inputs = json.object()
  for k, p in pairs(S.inputs or {}) do inputs[k] = M.identity(p) end
  for _, d in ipairs(S.datasets or {}) do
    local p = d.view and d.view.src and d.view.src.path
    if p then inputs['data.' .. d.name] = M.identity(p) end
  end
  for _, p in ipairs(registry.code_files()) do M.add_code(p) end
  local requires = json.array()
  for _, f in ipairs(cmd.requires or {}) do -- --require FILE: loaded before the recipe, part of the code
    local p = f:sub(1, 1) == '/' and f or ((os.getenv('PWD') or '.') .. '/' .. f)
    requires[#requires + 1] = p
    M.add_code(p)
  end
  local code = json.array()
  for _, p in ipairs(code_order) do
    local crc = crc_hex(p)
    code[#code + 1] = json.object({ 'path', p, 'crc32c', crc or json.null })
  end
  local rollout = S.cfg.dist and S.cfg.dist.rollout_ranks or 0
  local words = json.array()
  for i, w in ipairs(cmd.words or {}) do words[i] = w end
  return json.object({ 'format', M.FORMAT, 'created', created or os.time(), 'updated', os.time(),
    'moonrl', json.object({ 'version', v.version, 'git', v.git }),
    'command', json.object({ 'recipe', recipe, 'name', S.name, 'words', words, 'requires', requires,
      'world_size', M.job_size(),
      'rollout_ranks', rollout, 'env', env }),
    'config', S.cfg, 'seeds', seeds_of(S.cfg, nil, json.object()), 'inputs', inputs, 'code', code,
    'machine', M.machine(M.job_size(), rollout),
    'threads', S.threads and json.object({ 'chosen', S.threads.chosen, 'by', S.threads.by,
      'seconds', S.threads.seconds or json.object() }) or json.null })
end

-- Read RUN_DIR/manifest.json; a missing or corrupt one is a usage error naming the file.
function M.read(dir)
  local path = dir .. '/manifest.json'
  if not fs.exists(path) then
    moonrl.usage_error(string.format('%s: no manifest.json (not a run directory, or made before manifests)', dir))
  end
  local ok, m = pcall(json.decode, fs.read(path), path)
  if not ok then moonrl.usage_error(moonrl.error_text(m)) end
  if type(m) ~= 'table' or m.format ~= M.FORMAT or type(m.command) ~= 'table' then
    moonrl.usage_error(string.format('%s: not a moonrl manifest of format %d', path, M.FORMAT))
  end
  return m, path
end

-- Write the manifest of S into its run directory (trainer rank 0), keeping `created` of an
-- earlier start of the same run (a resume).
function M.write(S)
  local path = S.dir .. '/manifest.json'
  local recipe = M.command and M.command.recipe
  if recipe and not S.recipe_copied then -- the copy --from runs (M.rerun_command); a resume refreshes it
    local copy = S.dir .. '/' .. M.RECIPE_COPY
    S.recipe_copied = S.run:guarded_write(copy, function()
      if crc_hex(copy) ~= crc_hex(recipe) or not fs.stat(copy).is_file then fs.copy(recipe, copy) end
    end)
  end
  local created
  if fs.exists(path) then
    local ok, old = pcall(json.decode, fs.read(path), path)
    if ok and type(old) == 'table' then created = old.created end
  end
  local text = json.encode(M.build(S, created), { indent = 2 }) .. '\n'
  S.run:guarded_write(path, function()
    fs.write(path .. '.tmp', text)
    assert(os.rename(path .. '.tmp', path))
  end)
end

-- The differences between what manifest m recorded and what is there now: a list of lines.
local function changed_files(what, rec, out)
  if type(rec) ~= 'table' or not rec.path then return end
  if rec.missing then return end
  local now = M.identity(rec.path)
  if now.missing then out[#out + 1] = string.format('%s %s: missing', what, rec.path); return end
  for name, f in pairs(rec.files or {}) do
    local g = now.files[name]
    local p = (rec.path:match('[^/]*$') == name) and rec.path or (rec.path .. '/' .. name)
    if not g then out[#out + 1] = string.format('%s %s: missing', what, p)
    elseif g.bytes ~= f.bytes or g.crc32c ~= f.crc32c then
      out[#out + 1] = string.format('%s %s: changed (%s bytes, crc32c %s; recorded %s bytes, %s)', what, p,
        tostring(g.bytes), tostring(g.crc32c), tostring(f.bytes), tostring(f.crc32c))
    end
  end
end

-- recipe: the file that will run (the run's copy, or the one the command line named), checked
-- against the recipe's recorded checksum.
function M.check_unchanged(m, recipe)
  local out = {}
  local r = m.command.recipe
  if type(r) == 'table' and r.path then
    recipe = recipe or r.path
    local crc = crc_hex(recipe)
    if not crc then out[#out + 1] = 'recipe ' .. recipe .. ': missing'
    elseif crc ~= r.crc32c then out[#out + 1] = string.format('recipe %s: changed (crc32c %s, recorded %s of %s)', recipe,
      crc, tostring(r.crc32c), r.path) end
  end
  local names = {}
  for k in pairs(m.inputs or {}) do names[#names + 1] = k end
  table.sort(names)
  for _, k in ipairs(names) do changed_files('input ' .. k, m.inputs[k], out) end
  for _, c in ipairs(m.code or {}) do
    local crc = crc_hex(c.path)
    if not crc then out[#out + 1] = 'code ' .. c.path .. ': missing'
    elseif crc ~= c.crc32c then out[#out + 1] = string.format('code %s: changed (crc32c %s, recorded %s)', c.path, crc,
      tostring(c.crc32c)) end
  end
  return out
end

-- The kernels and CPU that made the run against this machine's: lines where they differ (the
-- results are bit-identical only on the same kind of machine).
function M.machine_differences(m)
  local now, was, out = M.machine(), m.machine or {}, {}
  for _, k in ipairs({ 'cpu', 'kernels', 'bf16_products', 'fp32_products', 'openblas_core' }) do
    if was[k] ~= nil and tostring(was[k]) ~= tostring(now[k]) then
      out[#out + 1] = string.format('%s: %s then, %s now', k, tostring(was[k]), tostring(now[k]))
    end
  end
  return out
end

-- The code a re-run of dir would run beside moonrl's own (see the top): the recipe file (the run's
-- copy, or the file the command line named), the --require files and reward=FILE.lua:NAME words
-- the manifest recorded, each refused unless it lies in dir or the installation or the command line
-- names it again. named: { recipe = path, requires = { path, ... } } of the command line; extra:
-- its words. Returns the recipe file to run (nil for the embedded example) and the --require files.
local function trusted_code(dir, m, path, named, extra)
  local r = m.command.recipe
  local function trusted(file) return under(file, dir) or under(file, moonrl.home) end
  local recipe
  if r.embedded then
    if named.recipe then moonrl.usage_error(string.format("%s ran the default example: give no recipe ('%s')", dir,
      named.recipe)) end
  elseif named.recipe then
    recipe = named.recipe
  elseif r.copy == M.RECIPE_COPY and (fs.stat(dir .. '/' .. r.copy) or {}).is_file then -- (a file, not a link)
    recipe = dir .. '/' .. r.copy
  else
    moonrl.usage_error(string.format('%s names the recipe %s, and %s holds no copy of it: --from runs only what ' ..
      'the run directory holds; name the recipe to run it (moonrl run --from %s %s)', path, tostring(r.path), dir, dir,
      tostring(r.path)))
  end
  local requires, mine = {}, {}
  for _, f in ipairs(named.requires or {}) do mine[real(f) or f] = f end
  for _, f in ipairs(type(m.command.requires) == 'table' and m.command.requires or {}) do
    if type(f) ~= 'string' then moonrl.usage_error(path .. ': command.requires must be a list of files') end
    if not (trusted(f) or mine[real(f) or f]) then
      moonrl.usage_error(string.format('%s: the run loaded --require %s, outside %s: name it to run it again ' ..
        '(moonrl run --from %s --require %s)', path, f, dir, dir, f))
    end
    requires[#requires + 1] = f
    mine[real(f) or f] = nil
  end
  for _, f in ipairs(named.requires or {}) do if mine[real(f) or f] then requires[#requires + 1] = f end end
  local given = {}
  for _, w in ipairs(extra or {}) do given[w:match('^([^=]*)=') or w] = true end
  for _, w in ipairs(m.command.words or {}) do
    local key, file = tostring(w):match('^([^=]*)=(.+%.lua):[%w_%.%-]+$')
    if file and not given[key] and not trusted(file) then
      moonrl.usage_error(string.format('%s: the word %s loads %s, outside %s: give it again to run it ' ..
        '(moonrl run --from %s %s)', path, w, file, dir, dir, w))
    end
  end
  return recipe, requires
end

-- `moonrl run --from DIR [RECIPE] [--require F] [key=value ...]`: the recipe path (the run's copy
-- of it, or RECIPE), the words to run it with, the manifest, and the --require files it loaded.
-- named: the recipe and --require files the command line named (see trusted_code).
function M.rerun_command(dir, extra, named)
  local m, path = M.read(dir)
  local r = m.command.recipe
  if type(r) ~= 'table' or not (r.path or r.embedded) then
    moonrl.usage_error(path .. ': the manifest names no recipe file')
  end
  local ws = m.command.words
  for _, w in ipairs(json.is_array(ws) and ws or {}) do if type(w) ~= 'string' then ws = false end end
  if ws ~= nil and not json.is_array(ws) then moonrl.usage_error(path .. ': command.words must be a list of key=value words') end
  local recipe, requires = trusted_code(dir, m, path, named or {}, extra)
  local ranks = M.job_size()
  local want = tonumber(m.command.world_size) or 1
  if ranks ~= want then
    moonrl.usage_error(string.format('%s ran on %d rank(s), this is %d: re-run it with `mpirun -n %d moonrl run --from %s`',
      dir, want, ranks, want, dir))
  end
  local v = moonrl.version()
  if r.embedded and m.moonrl and m.moonrl.git ~= v.git then
    moonrl.log('warn', '%s ran the default example of moonrl %s, this is %s: the example may have changed', dir,
      tostring(m.moonrl.git), v.git)
  end
  if m.command.env and m.command.env.MOONRL_FAULT and os.getenv('MOONRL_FAULT') ~= m.command.env.MOONRL_FAULT then
    moonrl.log('warn', '%s ran with MOONRL_FAULT=%s (fault injection): not repeated unless set again', dir,
      m.command.env.MOONRL_FAULT)
  end
  local bad = M.check_unchanged(m, recipe)
  if #bad > 0 then
    moonrl.usage_error(string.format('%s: cannot re-run: %s', dir, table.concat(bad, '; ')))
  end
  for _, d in ipairs(M.machine_differences(m)) do
    moonrl.log('warn', 're-running %s on another kind of machine (%s): the results may differ in the last bits', dir, d)
  end
  local words, has_dir = {}, false
  for _, w in ipairs(m.command.words or {}) do
    if not w:match('^run%.dir=') and not w:match('^run%.resume=') then words[#words + 1] = w end
  end
  -- run.threads=auto: the count it chose then, not a new measurement (before the extra words: a
  -- run.threads=N among them wins)
  local th = type(m.threads) == 'table' and tonumber(m.threads.chosen)
  if th and type(m.config) == 'table' and type(m.config.run) == 'table' and m.config.run.threads == 'auto' then
    moonrl.C.mrl_parallel_set_threads(0) -- the default count: the cores (or MOONRL_THREADS)
    local cores = tonumber(moonrl.C.mrl_parallel_threads())
    if th <= cores then words[#words + 1] = 'run.threads=' .. th
    else moonrl.log('warn', '%s ran on %d threads (run.threads=auto), this machine has %d: measuring again', dir, th, cores) end
  end
  for _, w in ipairs(extra or {}) do
    if w:match('^run%.dir=') then has_dir = true end
    words[#words + 1] = w
  end
  if not has_dir then words[#words + 1] = 'run.dir=' .. dir:gsub('/+$', '') .. '-rerun' end
  if r.embedded then return { embedded = r.embedded }, words, m, requires end
  return recipe, words, m, requires
end

return M
