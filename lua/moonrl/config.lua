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
-- A number key may declare its range with it (`steps = config.integer(100,
-- { min = 0 })`, `temperature = config.number(1.0, { above = 0 })`): every
-- number the run gets is finite and within its key's range, checked here
-- before any work (a usage error naming the key), and --show-config lists it.
-- Every config also has a `run` section that moonrl itself reads.
local M = {}

-- Overrides from the command line: a list of { key = 'a.b', value = 'text' }.
M.overrides = {}
M.consumed = false      -- set once a recipe declared its config
M.show_only = false     -- `moonrl run R --show-config`: print and stop

local function usage_error(msg) require('moonrl').usage_error(msg) end

-- A declared key with no default: `required(type)` must be given on the command line,
-- `optional(type)` may be (and is nil otherwise); a number's may have a range (below).
local Slot = {}
Slot.__index = Slot
local valid_types = { string = true, number = true, boolean = true, integer = true }

-- A range: `min` / `max` (inclusive) and `above` / `below` (exclusive), any of them. It is
-- declared once with the key, checked by M.merge on every value the run gets (a default, an
-- override) before any work, and listed by --show-config.
local function range_of(opts)
  local r
  for _, k in ipairs({ 'min', 'max', 'above', 'below' }) do
    if opts and opts[k] ~= nil then r = r or {}; r[k] = opts[k] end
  end
  return r
end

local function slot(kind, typ, doc, range)
  if not valid_types[typ] then error("config." .. kind .. ": type must be string, number, integer or boolean", 3) end
  return setmetatable({ kind = kind, type = typ, doc = doc, range = range_of(range) }, Slot)
end
function M.required(typ, doc, range) return slot('required', typ, doc, range) end
function M.optional(typ, doc, range) return slot('optional', typ, doc, range) end
-- A number that must be whole (steps, sizes): `integer(100)`, with a range `integer(100, { min = 1 })`;
-- the list part of opts: words it also takes (`integer(0, { 'auto', min = 0 })`: run.threads=auto).
function M.integer(default, opts)
  local w
  for _, word in ipairs(opts or {}) do w = w or {}; w[word] = true end
  return setmetatable({ kind = 'default', type = 'integer', value = default, words = w, range = range_of(opts) }, Slot)
end
-- A number with a range: `number(1.0, { above = 0 })`.
function M.number(default, range)
  return setmetatable({ kind = 'default', type = 'number', value = default, range = range_of(range) }, Slot)
end

-- The sections every recipe gets: `run` (moonrl reads it itself), `guard` (moonrl.train.guard) and
-- `dist` (below).
local function run_section()
  return {
    seed = M.integer(1, { min = 0 }),
    dir = M.optional('string', 'run directory (default runs/<recipe>-<time>)'),
    max_seconds = M.number(0, { min = 0, max = 1e9 }), -- stop cleanly after this long (0: no limit)
    threads = M.integer(0, { 'auto', min = 0 }), -- CPU threads for kernels (0: all cores; auto: measured, moonrl.train.threads)
    log_level = 'info',
    resume = 'auto',        -- auto (the latest complete checkpoint in run.dir), never, or a checkpoint's path
    checkpoint_every = M.integer(0, { min = 0 }), -- steps between checkpoints (0: only at the end and on a clean stop)
    checkpoint_minutes = M.number(30.0, { min = 0 }), -- also checkpoint when this long passed since the last (0: never)
    keep_checkpoints = M.integer(2, { min = 0 }), -- the newest K are kept (0: all)
    checkpoint_errors = 'stop',      -- a checkpoint or metrics write that fails: stop, or warn and go on
    max_shard_gb = M.number(5, { above = 0 }), -- a saved model's safetensors files at most this large (10^9 bytes a GB, as transformers' "5GB"), else sharded
    memory_budget_mb = M.number(0, { min = 0, max = 1e9 }), -- host MiB this process may hold through moonrl (0: no budget; moonrl/mem.h)
    hang_seconds = M.number(1800.0, { min = 0 }), -- under `--restarts`: no heartbeat for this long is a hang (0: no watchdog)
    progress = os.getenv('MOONRL_PROGRESS') or 'auto', -- the loops' progress on stderr: auto, live, plain, off (moonrl.io.progress)
    progress_seconds = M.number(tonumber(os.getenv('MOONRL_PROGRESS_SECONDS') or '') or 10.0, { min = 0 }), -- between plain progress lines
  }
end

-- `dist`: the ranks of a job started by mpirun / srun / moonrl launch (moonrl.train.dist).
local function dist_section()
  return {
    timeout = M.number(600.0, { min = 0 }), -- seconds a collective may wait for the other ranks before the job fails (0: forever)
    offload = 'none', -- optimizer: a GPU model's fp32 master weights and AdamW state in host memory, stepped there
    offload_chunk_mb = M.number(64.0, { above = 0 }), -- dist.offload's pipeline: the gradients and weights copied in chunks of this size while the CPU steps the one before
    shard_group = M.integer(0, { min = 0 }), -- hybrid sharding (dist.zero=2, 3): the state sharded within groups of this many consecutive ranks, replicated across them (0: over all)
    tp = M.integer(1, { min = 1 }), -- tensor parallel: groups of this many consecutive ranks each hold slices of every layer (Megatron's split); data parallel over the groups
    sequence_parallel = false, -- with dist.tp: the residual stream and the norms on each rank's share of the tokens (Megatron's sequence parallel)
    cp = M.integer(1, { min = 1 }), -- context parallel (Ulysses): groups of this many ranks (of one dist.tp slot) split each batch's tokens, all-to-alls around attention; data parallel over the groups
    pp = M.integer(1, { min = 1 }), -- pipeline parallel: the layers split into this many stages (ranks of one dist.tp slot and dist.cp share), micro-batches under 1F1B; data parallel over the pipelines
    pp_layers = '', -- with dist.pp: each stage's layer count, e.g. '10,12,12,10' (empty: balanced by a layer's and the head's cost)
    zero = M.integer(0, { min = 0, max = 3 }), -- 1: ZeRO-1, the optimizer state sharded over the ranks; 2: ZeRO-2, the gradients too; 3: ZeRO-3, the parameters too
    bucket_mb = M.number(25.0, { above = 0 }), -- gradient all-reduce bucket size, started while the backward runs
    rollout_ranks = M.integer(0, { min = 0 }), -- the last R ranks only generate and score (moonrl.train.rollout); the others train
    rollout_tp = M.integer(1, { min = 1 }), -- the rollout ranks in tensor-parallel groups of this many: each holds its slices, the engines of a group generate together
    gpu_transport = 'auto',   -- a GPU model's gradient sums: nccl, host (through host memory and MPI), auto (nccl where it starts)
  }
end

-- `guard`: the guards' settings (moonrl.train.guard); these defaults are also the guards' own.
M.guard_defaults = {
  action = 'skip', grad_spike = 0.0, loss_spike = 0.0, window = 20, min_history = 5, kl_max = 0.0,
  entropy_min = 0.0, max_rollbacks = 3, max_skips = 20, lr_factor = 1.0, skip_batch = true,
}

local function guard_section()
  local d = M.guard_defaults
  return {
    action = d.action,           -- what a spike / KL / entropy detector does: skip or rollback
    grad_spike = M.number(d.grad_spike, { min = 0 }), -- robust deviations above the recent median (0: off)
    loss_spike = M.number(d.loss_spike, { min = 0 }),
    window = M.integer(d.window, { min = 1 }), min_history = M.integer(d.min_history, { min = 1 }),
    kl_max = M.number(d.kl_max, { min = 0 }),           -- 0: off
    entropy_min = M.number(d.entropy_min, { min = 0 }), -- 0: off
    max_rollbacks = M.integer(d.max_rollbacks, { min = 0 }), -- more rollbacks than this stop the run
    max_skips = M.integer(d.max_skips, { min = 0 }),         -- more skipped updates in a row than this stop it (0: no limit)
    lr_factor = M.number(d.lr_factor, { above = 0, max = 1 }), -- the learning rate is multiplied by this at each rollback
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

-- ---- ranges --------------------------------------------------------------------------------

local function num_text(x)
  if x == math.floor(x) and math.abs(x) < 1e15 then return string.format('%d', x) end
  return tostring(x)
end

-- A range's bound: 1e9 rather than 1000000000 (where the short form is exact).
local function bound_text(x)
  local short = string.format('%g', x)
  if math.abs(x) >= 1e6 and tonumber(short) == x then return (short:gsub('e%+0*', 'e')) end
  return num_text(x)
end

-- "in [0, 1)", ">= 1", "in 0..1024", "0 or 1": how --show-config, the docs and errors say a range.
function M.range_text(r, integer)
  if not r then return nil end
  local num_text = bound_text
  local lo, hi = r.min or r.above, r.max or r.below
  if lo and hi then
    if integer and r.min and r.max then
      if r.max == r.min + 1 then return num_text(r.min) .. ' or ' .. num_text(r.max) end
      return 'in ' .. num_text(r.min) .. '..' .. num_text(r.max)
    end
    return string.format('in %s%s, %s%s', r.min and '[' or '(', num_text(lo), num_text(hi), r.max and ']' or ')')
  end
  if lo then return (r.min and '>= ' or '> ') .. num_text(lo) end
  return (r.max and '<= ' or '< ') .. num_text(hi)
end

local function in_range(r, v)
  return not r or ((r.min == nil or v >= r.min) and (r.above == nil or v > r.above) and
    (r.max == nil or v <= r.max) and (r.below == nil or v < r.below))
end

-- Integers beyond 2^53 are not whole numbers a double can count to (1e300 steps is inf steps).
local MAX_INTEGER = 2 ^ 53

-- A number the run gets for key (a default, an override, from the environment): finite, whole
-- where the key is an integer, in the key's range; else a usage error naming the key.
local function check_number(key, leaf, v)
  local integer = type_of(leaf) == 'integer'
  if v ~= v or v == math.huge or v == -math.huge then
    usage_error(string.format("config key '%s' must be a finite number, got %s", key, tostring(v)))
  end
  if integer and (v ~= math.floor(v) or math.abs(v) > MAX_INTEGER) then
    usage_error(string.format("config key '%s' must be an integer%s, got %s", key,
      math.abs(v) > MAX_INTEGER and ' of at most 2^53' or '', tostring(v)))
  end
  local r = is_slot(leaf) and leaf.range
  if not in_range(r, v) then
    usage_error(string.format("config key '%s' must be %s, got %s", key, M.range_text(r, integer), num_text(v)))
  end
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
    -- 1e309 reads as inf: a deadline that has passed, a loop that never ends, a NaN seed
    if typ == 'number' and (n == math.huge or n == -math.huge) then
      usage_error(string.format("config key '%s' expects a finite number, got '%s'", key, text))
    end
    if typ == 'integer' and (n ~= math.floor(n) or n == math.huge or n == -math.huge) then
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

local function get_path(tree, key)
  local node = tree
  for p in key:gmatch('[^.]+') do
    if type(node) ~= 'table' then return nil end
    node = node[p]
  end
  return node
end

local function sorted_keys(t)
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = k end
  table.sort(keys)
  return keys
end

local function describe(v)
  if is_slot(v) then
    local range = v.range and ('  ' .. M.range_text(v.range, v.type == 'integer')) or ''
    if v.kind == 'default' then
      local words = {}
      for w in pairs(v.words or {}) do words[#words + 1] = ' or ' .. w end
      table.sort(words)
      return tostring(v.value) .. '  (' .. v.type .. table.concat(words) .. ')' .. range
    end
    return '<' .. v.kind .. ' ' .. v.type .. '>' .. range .. (v.doc and ('  -- ' .. v.doc) or '')
  end
  if is_list(v) then
    local parts = {}
    for i, x in ipairs(v) do parts[i] = tostring(x) end
    return table.concat(parts, ',')
  end
  if type(v) == 'string' then return string.format('%q', v) end
  return tostring(v)
end

M.is_slot = is_slot

-- A recipe's value v over a declared one d (a parent recipe's, a shared section's): a plain value
-- for a typed key keeps its type, words and range (`grpo = { steps = 30 }` stays an integer >= 0);
-- a slot of the same type without a range takes d's. Anything else replaces d.
function M.over(d, v)
  if not is_slot(d) then return v end
  if is_slot(v) then
    if v.type ~= d.type or v.range or not d.range then return v end
    local c = setmetatable({}, Slot)
    for k, x in pairs(v) do c[k] = x end
    c.range = d.range
    return c
  end
  local numeric = d.type == 'integer' or d.type == 'number'
  if not numeric or not (type(v) == 'number' or (d.words and d.words[v])) then return v end
  return setmetatable({ kind = 'default', type = d.type, value = v, words = d.words, range = d.range }, Slot)
end

-- The declared tree with the sections every recipe gets; a recipe's `run` keys (run = { threads =
-- 'auto' }) change those defaults (a key keeps its type and range: M.over).
local function with_sections(declared)
  local tree = {}
  for k, v in pairs(declared) do tree[k] = v end
  local run = run_section()
  for k, v in pairs(tree.run or {}) do run[k] = M.over(run[k], v) end
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
  -- every number the run gets, given or not, is finite and in its key's range: checked here,
  -- before any work, so that no recipe checks its own
  for _, k in ipairs(known) do
    local v = get_path(cfg, k)
    if type(v) == 'number' then check_number(k, flat[k], v) end
  end
  return cfg, flat, given
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
      -- (declared: what `moonrl run` shows more of, e.g. the trainable share of model.lora)
      error(setmetatable({ show_config = true, declared = declared }, { __tostring = function() return 'config shown' end }), 0)
    end
    local cfg, _, given = M.merge(declared, M.overrides)
    M.current, M.given = cfg, given -- (given: the keys set on the command line, by name)
    M.apply_run(cfg.run)
    return cfg
  end,
})

-- Apply the `run` section: threads, logging, deadline, memory budget.
function M.apply_run(run)
  local moonrl = require('moonrl')
  local max_threads = tonumber(moonrl.C.mrl_parallel_max_threads())
  if run.threads == 'auto' then run = setmetatable({ threads = false }, { __index = run }) end -- (session.start measures)
  if run.threads and (run.threads < 0 or run.threads > max_threads) then
    moonrl.usage_error(string.format("config key 'run.threads' must be between 0 (all cores) and %d, got %d",
      max_threads, run.threads))
  end
  if run.threads and run.threads > 0 then moonrl.C.mrl_parallel_set_threads(run.threads) end
  if run.log_level then moonrl.set_log_level(run.log_level) end
  if run.max_seconds and run.max_seconds > 0 then moonrl.check(moonrl.C.mrl_deadline_set(run.max_seconds)) end
  -- before the model loads: its weights are the first thing the budget refuses
  moonrl.check(moonrl.C.mrl_mem_set_budget(math.floor((run.memory_budget_mb or 0) * 2 ^ 20), 'run.memory_budget_mb'))
end

M.set_path, M.get_path = set_path, get_path

return M
