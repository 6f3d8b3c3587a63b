-- Recipe configuration. A recipe declares its config table with defaults:
--
--   local cfg = moonrl.config {
--     lr = 1e-6, steps = 100,
--     model = { dir = moonrl.config.required('string') },
--   }
--
-- and `moonrl run recipe.lua lr=3e-6 model.dir=/m` overrides it. Each value
-- given on the command line is parsed with the type of its default; a key
-- the recipe did not declare is an error naming the closest declared keys.
-- Every config also has a `run` section that moonrl itself reads.
local M = {}

-- Overrides from the command line: a list of { key = 'a.b', value = 'text' }.
M.overrides = {}
M.consumed = false      -- set once a recipe declared its config
M.show_only = false     -- `moonrl run R --show-config`: print and stop

local function usage_error(msg) require('moonrl').usage_error(msg) end

-- A declared key with no default: `required(type)` must be given on the
-- command line, `optional(type)` may be (and is nil otherwise).
local Slot = {}
Slot.__index = Slot
local valid_types = { string = true, number = true, boolean = true, integer = true }
local function slot(kind, typ, doc)
  if not valid_types[typ] then error("config." .. kind .. ": type must be string, number, integer or boolean", 3) end
  return setmetatable({ kind = kind, type = typ, doc = doc }, Slot)
end
function M.required(typ, doc) return slot('required', typ, doc) end
function M.optional(typ, doc) return slot('optional', typ, doc) end
-- A number that must be whole (steps, sizes): `integer(100)`; words: values it also takes
-- ({ 'auto' }: run.threads=auto).
function M.integer(default, words)
  local w
  for _, word in ipairs(words or {}) do w = w or {}; w[word] = true end
  return setmetatable({ kind = 'default', type = 'integer', value = default, words = w }, Slot)
end

-- The sections every recipe gets: `run` (moonrl reads it itself), `guard` (moonrl.train.guard) and
-- `dist` (below).
local function run_section()
  return {
    seed = M.integer(1),
    dir = M.optional('string', 'run directory (default runs/<recipe>-<time>)'),
    max_seconds = 0,        -- stop cleanly after this long (0: no limit)
    threads = M.integer(0, { 'auto' }), -- CPU threads for kernels (0: all cores; auto: measured, moonrl.recipe)
    log_level = 'info',
    resume = 'auto',        -- auto (the latest complete checkpoint in run.dir), never, or a checkpoint's path
    checkpoint_every = M.integer(0), -- steps between checkpoints (0: only at the end and on a clean stop)
    checkpoint_minutes = 30.0,       -- also checkpoint when this long passed since the last (0: never)
    keep_checkpoints = M.integer(2), -- the newest K are kept (0: all)
    checkpoint_errors = 'stop',      -- a checkpoint or metrics write that fails: stop, or warn and go on
    hang_seconds = 1800.0,  -- under `--restarts`: no heartbeat for this long is a hang (0: no watchdog)
    progress = os.getenv('MOONRL_PROGRESS') or 'auto', -- the loops' progress on stderr: auto, live, plain, off (moonrl.io.progress)
    progress_seconds = tonumber(os.getenv('MOONRL_PROGRESS_SECONDS') or '') or 10.0, -- between plain progress lines
  }
end

-- `dist`: the ranks of a job started by mpirun / srun / moonrl launch (moonrl.train.dist).
local function dist_section()
  return {
    timeout = 600.0,          -- seconds a collective may wait for the other ranks before the job fails (0: forever)
    zero = M.integer(0),      -- 1: ZeRO-1, the optimizer state sharded over the ranks
    bucket_mb = 25.0,         -- gradient all-reduce bucket size, started while the backward runs
    rollout_ranks = M.integer(0), -- the last R ranks only generate and score (moonrl.train.rollout); the others train
    gpu_transport = 'auto',   -- a GPU model's gradient sums: nccl, host (through host memory and MPI), auto (nccl where it starts)
  }
end

-- The guards' defaults (moonrl.train.guard reads them here: the config sits below the training code).
M.guard_defaults = {
  action = 'skip', grad_spike = 0.0, loss_spike = 0.0, window = 20, min_history = 5, kl_max = 0.0,
  entropy_min = 0.0, max_rollbacks = 3, max_skips = 20, lr_factor = 1.0, skip_batch = true,
}

local function guard_section()
  local d = M.guard_defaults
  return {
    action = d.action,           -- what a spike / KL / entropy detector does: skip or rollback
    grad_spike = d.grad_spike,   -- robust deviations above the recent median (0: off)
    loss_spike = d.loss_spike,
    window = M.integer(d.window), min_history = M.integer(d.min_history),
    kl_max = d.kl_max,           -- 0: off
    entropy_min = d.entropy_min, -- 0: off
    max_rollbacks = M.integer(d.max_rollbacks), -- more rollbacks than this stop the run
    max_skips = M.integer(d.max_skips),         -- more skipped updates in a row than this stop it (0: no limit)
    lr_factor = d.lr_factor,     -- the learning rate is multiplied by this at each rollback
    skip_batch = d.skip_batch,   -- a rollback does not rewind the data: the offending batch is skipped
  }
end

local function is_slot(v) return getmetatable(v) == Slot end
local function is_list(t)
  if type(t) ~= 'table' or is_slot(t) then return false end
  local n = 0
  for _ in pairs(t) do n = n + 1 end
  return n > 0 and n == #t
end

local function type_of(v)
  if is_slot(v) then return v.type end
  return type(v)
end

-- Flatten the declared tree into { ['a.b'] = leaf } (lists are leaves).
local function flatten(tree, prefix, out)
  for k, v in pairs(tree) do
    if type(k) ~= 'string' then error('config keys must be strings, got ' .. tostring(k), 4) end
    local key = prefix and (prefix .. '.' .. k) or k
    if type(v) == 'table' and not is_slot(v) and not is_list(v) and next(v) ~= nil then
      flatten(v, key, out)
    else
      out[key] = v
    end
  end
  return out
end

-- Edit distance, to suggest the key the user meant.
local function distance(a, b)
  local prev, cur = {}, {}
  for j = 0, #b do prev[j] = j end
  for i = 1, #a do
    cur[0] = i
    for j = 1, #b do
      local cost = a:sub(i, i) == b:sub(j, j) and 0 or 1
      cur[j] = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
    end
    prev, cur = cur, prev
  end
  return prev[#b]
end

function M.closest(key, known, limit)
  local scored = {}
  for _, k in ipairs(known) do
    local d = distance(key, k)
    local last = k:match('([^.]+)$')
    d = math.min(d, distance(key:match('([^.]+)$'), last) + 1)
    if k:find(key, 1, true) or key:find(k, 1, true) then d = math.min(d, 1) end
    scored[#scored + 1] = { k = k, d = d }
  end
  table.sort(scored, function(x, y) if x.d ~= y.d then return x.d < y.d end return x.k < y.k end)
  local out = {}
  for i = 1, math.min(limit or 3, #scored) do
    if scored[i].d <= math.max(2, math.floor(#key / 3)) then out[#out + 1] = scored[i].k end
  end
  return out
end

local booleans = { ['true'] = true, ['1'] = true, yes = true, on = true,
                   ['false'] = false, ['0'] = false, no = false, off = false }

local function parse_scalar(key, typ, text)
  if typ == 'string' then return text end
  if typ == 'number' or typ == 'integer' then
    local n = tonumber(text)
    if n == nil or n ~= n then
      usage_error(string.format("config key '%s' expects a%s %s, got '%s'", key,
        typ == 'integer' and 'n' or '', typ, text))
    end
    if typ == 'integer' and n ~= math.floor(n) then
      usage_error(string.format("config key '%s' expects an integer, got '%s'", key, text))
    end
    return n
  end
  if typ == 'boolean' then
    local b = booleans[text:lower()]
    if b == nil then
      usage_error(string.format("config key '%s' expects a boolean (true/false), got '%s'", key, text))
    end
    return b
  end
  error('unreachable type ' .. tostring(typ))
end

local function parse_value(key, declared, text)
  if is_slot(declared) and declared.words then -- run.threads=auto
    if declared.words[text] then return text end
    if tonumber(text) == nil then
      local words = {}
      for w in pairs(declared.words) do words[#words + 1] = w end
      table.sort(words)
      usage_error(string.format("config key '%s' expects an integer or %s, got '%s'", key, table.concat(words, ' or '), text))
    end
  end
  if is_list(declared) then
    local elem = type_of(declared[1])
    local out = {}
    if text ~= '' then
      for piece in (text .. ','):gmatch('([^,]*),') do out[#out + 1] = parse_scalar(key, elem, piece) end
    end
    return out
  end
  return parse_scalar(key, type_of(declared), text)
end

-- Deep copy of the declared tree, with slots resolved to their values.
local function resolve(tree)
  local out = {}
  for k, v in pairs(tree) do
    if is_slot(v) then
      out[k] = v.value -- nil for required/optional
    elseif type(v) == 'table' then
      out[k] = resolve(v)
    else
      out[k] = v
    end
  end
  return out
end

-- tree[a][b][c] = value for key 'a.b.c', making the tables on the way (also moonrl.rl's aliases).
local function set_path(tree, key, value)
  local node = tree
  local parts = {}
  for p in key:gmatch('[^.]+') do parts[#parts + 1] = p end
  for i = 1, #parts - 1 do
    node[parts[i]] = node[parts[i]] or {}
    node = node[parts[i]]
  end
  node[parts[#parts]] = value
end

local function sorted_keys(t)
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = k end
  table.sort(keys)
  return keys
end

local function describe(v)
  if is_slot(v) then
    if v.kind == 'default' then
      local words = {}
      for w in pairs(v.words or {}) do words[#words + 1] = ' or ' .. w end
      table.sort(words)
      return tostring(v.value) .. '  (integer' .. table.concat(words) .. ')'
    end
    return '<' .. v.kind .. ' ' .. v.type .. '>' .. (v.doc and ('  -- ' .. v.doc) or '')
  end
  if is_list(v) then
    local parts = {}
    for i, x in ipairs(v) do parts[i] = tostring(x) end
    return table.concat(parts, ',')
  end
  if type(v) == 'string' then return string.format('%q', v) end
  return tostring(v)
end

-- The declared tree with the sections every recipe gets; a recipe's `run` keys (run = { threads =
-- 'auto' }) change those defaults (an integer key stays one).
local function with_sections(declared)
  local tree = {}
  for k, v in pairs(declared) do tree[k] = v end
  local run = run_section()
  for k, v in pairs(tree.run or {}) do
    local d = run[k]
    if is_slot(d) and d.type == 'integer' and not is_slot(v) then v = setmetatable({ kind = 'default', type = 'integer',
      value = v, words = d.words }, Slot) end
    run[k] = v
  end
  tree.run = run
  if tree.guard == nil then tree.guard = guard_section() end
  if tree.dist == nil then tree.dist = dist_section() end
  return tree
end

-- Merge `overrides` (list of {key, value}) into `declared`; returns the
-- resolved config table. Errors are usage errors naming the key.
function M.merge(declared, overrides)
  if type(declared) ~= 'table' then error('moonrl.config expects a table of defaults', 3) end
  local tree = with_sections(declared)
  local flat = flatten(tree, nil, {})
  local known = sorted_keys(flat)
  local cfg = resolve(tree)
  local given = {}
  for _, o in ipairs(overrides) do
    local key = o.key
    -- a section with a `name` key takes a bare value as its name: reward=math is reward.name=math
    if flat[key] == nil and flat[key .. '.name'] ~= nil then key = key .. '.name' end
    local leaf = flat[key]
    if leaf == nil then
      -- a table given whole, or an unknown key
      local prefix = o.key .. '.'
      local children = {}
      for _, k in ipairs(known) do if k:sub(1, #prefix) == prefix then children[#children + 1] = k end end
      if #children > 0 then
        usage_error(string.format("config key '%s' is a section; set one of its keys: %s", o.key,
          table.concat(children, ', ', 1, math.min(#children, 6))))
      end
      local near = M.closest(o.key, known)
      usage_error(string.format("unknown config key '%s'%s", o.key,
        #near > 0 and (' (did you mean ' .. table.concat(near, ', ') .. '?)') or ''))
    end
    set_path(cfg, key, parse_value(key, leaf, o.value))
    given[key] = true
  end
  for _, k in ipairs(known) do
    local leaf = flat[k]
    if is_slot(leaf) and leaf.kind == 'required' and not given[k] then
      usage_error(string.format("config key '%s' (%s) is required: pass %s=...", k, leaf.type, k))
    end
  end
  return cfg, flat
end

-- Text listing of every key, its default and type.
function M.format(declared)
  local tree = with_sections(declared)
  local flat = flatten(tree, nil, {})
  local lines = {}
  for _, k in ipairs(sorted_keys(flat)) do lines[#lines + 1] = string.format('%-28s %s', k, describe(flat[k])) end
  return table.concat(lines, '\n')
end

-- Parse `key=value` command-line words into the override list.
function M.parse_overrides(words)
  local out = {}
  for _, w in ipairs(words) do
    local key, value = w:match('^([%w_%.%-]+)=(.*)$')
    if not key or key:find('%.%.') or key:sub(1, 1) == '.' or key:sub(-1) == '.' then
      usage_error(string.format("expected key=value, got '%s'", w))
    end
    out[#out + 1] = { key = key, value = value }
  end
  return out
end

-- moonrl.config { ... }: declare the recipe's config and get it back merged.
setmetatable(M, {
  __call = function(_, declared)
    M.consumed = true
    if M.show_only then -- before the merge: a recipe with required keys can be shown without them
      io.stdout:write(M.format(declared), '\n')
      error(setmetatable({ show_config = true }, { __tostring = function() return 'config shown' end }), 0)
    end
    local cfg = M.merge(declared, M.overrides)
    M.current = cfg
    M.apply_run(cfg.run)
    return cfg
  end,
})

-- Apply the `run` section: threads, logging, deadline.
function M.apply_run(run)
  local moonrl = require('moonrl')
  local max_threads = tonumber(moonrl.C.mrl_parallel_max_threads())
  if run.threads == 'auto' then run = setmetatable({ threads = false }, { __index = run }) end -- (R.start measures)
  if run.threads and (run.threads < 0 or run.threads > max_threads) then
    moonrl.usage_error(string.format("config key 'run.threads' must be between 0 (all cores) and %d, got %d",
      max_threads, run.threads))
  end
  if run.threads and run.threads > 0 then moonrl.C.mrl_parallel_set_threads(run.threads) end
  if run.log_level then moonrl.set_log_level(run.log_level) end
  if run.max_seconds and run.max_seconds > 0 then moonrl.check(moonrl.C.mrl_deadline_set(run.max_seconds)) end
end

M.set_path = set_path

return M
