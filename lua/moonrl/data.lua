-- moonrl.data: datasets read from JSONL files (one JSON object a line),
-- streamed: the file is indexed once (C, one pass, 8 bytes a line; a file of
-- 64 MB or more shows how far it is) and a record is read on demand (seek +
-- read one line + decode), so files larger than memory work.
--
--   local data = require('moonrl.data')
--   local ds = data.jsonl(path, {
--     fields = { prompt = 'question', answer = 'answer' }, -- record field -> JSON key (from the recipe config);
--                                                         -- 'meta.level' reaches into nested objects
--     optional = { answer = true },   -- fields that may be missing (nil in the record)
--     on_error = 'error',             -- or 'skip': bad lines are skipped and counted
--     max_record_bytes = 16 * 2^20,   -- a longer line is a bad record, refused before it is read
--   })
--   ds:len()                 -- number of records (non-blank lines) in this view
--   ds:get(i)                -- record i (1-based, in this view's current order):
--                            --   { prompt = ..., answer = ..., data = <the whole object>, line = <file line>, row = <0-based line row> }
--                            --   with on_error = 'skip' a bad record gives nil (and counts)
--   ds:shuffled(seed)        -- a view in a random order, a new order each epoch, all from seed
--   ds:split{ fraction = 0.1 | count = n, seed = s } -> train, validation (disjoint, sorted by file order)
--   for batch in ds:batches(n [, { epochs = 1, drop_last = false }]) do ... end
--                            -- batches of n records from the current position; a batch never
--                            -- spans two epochs; epochs = math.huge streams forever
--   ds:state()  -> { epoch = e, index = i, seed = s, n = len, skipped = k }   (plain numbers and a string seed)
--   ds:restore(state)        -- continue exactly where state was taken
--   ds:stats()  -> { skipped = k, path = ... }   (k: bad records met so far, again in each epoch)
--   ds.src.on_skip = function(message) ... end   -- told of each bad record skipped
--
-- Order: epoch e of a view shuffled with seed s uses the permutation
-- mrl_data_permutation(splitmix64(s + e * 0x9e3779b97f4a7c15), n) (uint64
-- arithmetic; see core/include/moonrl/data.h: xoshiro256** seeded by
-- splitmix64, Fisher-Yates). A split uses mrl_data_permutation(splitmix64(seed
-- ~ 0x5bd1e995), n): its first `count` rows are the validation set.
--
-- Errors name the file and line: "data.jsonl:17: invalid JSON (column 9):
-- expected ',' or '}'", "data.jsonl:3: missing field 'question' (for
-- 'prompt')".
local ffi = require('ffi')
local moonrl = require('moonrl')
local json = require('moonrl.io.json')
local C = moonrl.C

local M = {}

-- The longest record (line) read, in bytes, unless opts.max_record_bytes says otherwise.
M.MAX_RECORD_BYTES = 16 * 2 ^ 20

local GOLDEN = 0x9e3779b97f4a7c15ULL

local function alloc_i64(n)
  if n == 0 then return nil end
  local p = C.mrl_mem_alloc(n * 8, C.MRL_MEM_OTHER)
  if p == nil then moonrl.check(C.MRL_ERR_NOMEM, 2) end
  return ffi.gc(ffi.cast('int64_t *', p), C.mrl_mem_free)
end

local function to_u64(seed)
  if type(seed) == 'number' then
    if seed < 0 or seed ~= math.floor(seed) then error('seed must be a non-negative integer, got ' .. seed, 3) end
    return ffi.new('uint64_t', seed)
  end
  if type(seed) == 'string' then
    local v = ffi.new('uint64_t', 0)
    for d in seed:gmatch('%d') do v = v * 10 + tonumber(d) end
    return v
  end
  return ffi.new('uint64_t', seed)
end
local function u64_string(v) return (tostring(ffi.new('uint64_t', v)):gsub('ULL$', '')) end

local function splitmix(v) return C.mrl_data_mix_seed(v) end

local function permutation(seed, n)
  local p = alloc_i64(n)
  if n > 0 then moonrl.check(C.mrl_data_permutation(seed, n, p), 2) end
  return p
end

---------------------------------------------------------------- the file

local Source = {}
Source.__index = Source

local LARGE = 64 * 2 ^ 20 -- files from this size show how far their index is (moonrl.io.progress)

local function open_source(path, opts)
  local ix = ffi.new('mrl_line_index *[1]')
  moonrl.check(C.mrl_line_index_open(path, ix), 3)
  local index = ffi.gc(ix[0], C.mrl_line_index_free)
  local size = tonumber(C.mrl_line_index_file_size(index))
  local done = ffi.new('int[1]')
  local p = size >= LARGE and require('moonrl.io.progress').new('indexing ' .. path, size, { unit = 'B' })
  while done[0] == 0 do
    local st = C.mrl_line_index_scan(index, 16 * 2 ^ 20, done)
    if st ~= 0 then
      if p then p:cancel() end
      moonrl.check(st, 3)
    end
    if p then p:update(tonumber(C.mrl_line_index_scanned(index))) end
  end
  if p then p:finish() end
  local f, err = require('moonrl.io.fs').open(path)
  if not f then error(err, 3) end
  local fields = opts.fields or {}
  local names = {}
  for name in pairs(fields) do names[#names + 1] = name end
  table.sort(names)
  local max = opts.max_record_bytes or M.MAX_RECORD_BYTES
  if type(max) ~= 'number' or max < 1 or max ~= math.floor(max) then
    error('data: max_record_bytes must be a positive integer, got ' .. tostring(max), 3)
  end
  return setmetatable({
    path = path, index = index, file = f, line = ffi.new('mrl_line'),
    n = tonumber(C.mrl_line_index_count(index)),
    fields = fields, names = names, optional = opts.optional or {}, max_bytes = max,
    skip = opts.on_error == 'skip', skipped = 0,
  }, Source)
end

-- decode row r (0-based); returns record, or nil and a message
function Source:read(r)
  local l = self.line
  C.mrl_line_index_get(self.index, r, l)
  local line, length = tonumber(l.number), tonumber(l.length)
  local where = self.path .. ':' .. line
  -- (before reading it: decoding takes many times a record's size in memory)
  if length > self.max_bytes then
    return nil, string.format('%s: the record is %d bytes, over the limit of %d (data.max_record_bytes)', where, length,
      self.max_bytes)
  end
  self.file:seek('set', tonumber(l.offset))
  local text = self.file:read(length)
  if not text or #text ~= length then
    return nil, where .. ': could not read the line (was the file changed after it was indexed?)'
  end
  local ok, obj = pcall(json.decode, text, 'record')
  if not ok then
    local col, msg = tostring(obj):match('^record:%d+:(%d+): (.*)$')
    return nil, string.format('%s: invalid JSON (column %s): %s', where, col or '?', msg or tostring(obj))
  end
  if not json.is_object(obj) then return nil, where .. ': expected a JSON object' end
  local rec = { data = obj, line = line, row = r }
  for _, name in ipairs(self.names) do
    local key = self.fields[name]
    local v = obj[key]
    if v == nil and key:find('.', 1, true) then   -- a dotted path into nested objects
      v = obj
      for part in key:gmatch('[^.]+') do
        v = type(v) == 'table' and v[part] or nil
        if v == nil then break end
      end
    end
    if v == nil and not self.optional[name] then
      return nil, string.format("%s: missing field '%s' (for '%s')", where, key, name)
    end
    rec[name] = v
  end
  return rec
end

function Source:record(r, level)
  local rec, err = self:read(r)
  if rec then return rec end
  if self.skip then
    self.skipped = self.skipped + 1
    if self.on_skip then self.on_skip(err) end
    return nil
  end
  error(err, (level or 1) + 1)
end

---------------------------------------------------------------- views

local View = {}
View.__index = View

local function new_view(src, rows, n, seed)
  return setmetatable({ src = src, rows = rows, n = n, seed = seed, epoch = 0, pos = 0 }, View)
end

function M.jsonl(path, opts)
  opts = opts or {}
  if opts.on_error ~= nil and opts.on_error ~= 'error' and opts.on_error ~= 'skip' then
    moonrl.usage_error("data: on_error must be 'error' or 'skip', got '" .. tostring(opts.on_error) .. "'")
  end
  local src = open_source(path, opts)
  return new_view(src, nil, src.n, nil)
end

-- An in-memory dataset: a view over a Lua list of records (tables, e.g. a task's: moonrl.tasks)
-- with a JSONL view's order, batches, split and state; each record read is a copy with line and
-- row (its 1-based and 0-based place in the list). opts.name: how messages name it.
function M.records(list, opts)
  local src = { path = opts and opts.name or 'records', n = #list, skipped = 0 }
  function src.record(_, r)
    local rec = {}
    for k, v in pairs(list[r + 1]) do rec[k] = v end
    rec.line, rec.row = r + 1, r
    return rec
  end
  return new_view(src, nil, #list, nil)
end

function View:len() return self.n end
function View:stats() return { skipped = self.src.skipped, path = self.src.path, lines = self.src.n } end

function View:_order()
  if not self.seed then return nil end
  if self.perm_epoch ~= self.epoch then
    local s = splitmix(self.seed + GOLDEN * ffi.new('uint64_t', self.epoch))
    self.perm = permutation(s, self.n)
    self.perm_epoch = self.epoch
  end
  return self.perm
end

-- the file row (0-based) of position i (1-based) in the current order
function View:row(i)
  if i < 1 or i > self.n or i ~= math.floor(i) then
    error(string.format('%s: record %s out of range 1..%d', self.src.path, tostring(i), self.n), 2)
  end
  local k = i - 1
  local perm = self:_order()
  if perm then k = tonumber(perm[k]) end
  if self.rows then k = tonumber(self.rows[k]) end
  return k
end

function View:get(i) return self.src:record(self:row(i), 2) end

function View:shuffled(seed)
  if seed == nil then error('shuffled(seed): a seed is required', 2) end
  local rows = self.rows
  if self.seed then   -- shuffling a shuffled view: freeze its current order first
    rows = alloc_i64(self.n)
    for i = 1, self.n do rows[i - 1] = self:row(i) end
  end
  return new_view(self.src, rows, self.n, to_u64(seed))
end

function View:split(opts)
  opts = opts or {}
  local k
  if opts.count then
    k = opts.count
  elseif opts.fraction then
    if opts.fraction < 0 or opts.fraction > 1 then error('split: fraction must be in [0, 1]', 2) end
    k = math.floor(opts.fraction * self.n + 0.5)
  else
    error('split: give fraction or count', 2)
  end
  if k < 0 or k > self.n or k ~= math.floor(k) then
    error(string.format('split: count %s out of range 0..%d', tostring(k), self.n), 2)
  end
  local perm = permutation(splitmix(bit.bxor(to_u64(opts.seed or 0), 0x5bd1e995ULL)), self.n)
  local chosen = ffi.new('uint8_t[?]', self.n)
  for i = 0, k - 1 do chosen[perm[i]] = 1 end
  local valid, train = alloc_i64(k), alloc_i64(self.n - k)
  local nv, nt = 0, 0
  for i = 0, self.n - 1 do
    -- position i of this view in its base (epoch 0 for shuffled views) order
    local r = self.rows and tonumber(self.rows[i]) or i
    if chosen[i] == 1 then valid[nv] = r; nv = nv + 1 else train[nt] = r; nt = nt + 1 end
  end
  return new_view(self.src, train, nt, nil), new_view(self.src, valid, nv, nil)
end

function View:state()
  return { epoch = self.epoch, index = self.pos, n = self.n, seed = self.seed and u64_string(self.seed) or nil,
    skipped = self.src.skipped }
end

function View:restore(st)
  if st.n ~= nil and st.n ~= self.n then
    error(string.format('restore: the state is for %d records, this dataset has %d', st.n, self.n), 2)
  end
  local want = self.seed and u64_string(self.seed) or nil
  if st.seed ~= want then
    error(string.format('restore: the state was saved with seed %s, this dataset uses %s', tostring(st.seed), tostring(want)), 2)
  end
  self.epoch, self.pos = st.epoch, st.index
  if st.skipped then self.src.skipped = st.skipped end
end

-- Iterate batches of up to n records from the current position.
function View:batches(n, opts)
  opts = opts or {}
  if type(n) ~= 'number' or n < 1 or n ~= math.floor(n) then error('batches(n): n must be a positive integer', 2) end
  local epochs = opts.epochs or 1
  local last_epoch = self.epoch + epochs - 1
  if self.pos >= self.n then last_epoch = last_epoch + 1 end
  return function()
    while true do
      if self.pos >= self.n then
        if self.epoch >= last_epoch or self.n == 0 then return nil end
        self.epoch = self.epoch + 1
        self.pos = 0
      end
      if opts.drop_last and self.n - self.pos < n then
        self.pos = self.n
      else
        local batch = {}
        while #batch < n and self.pos < self.n do
          self.pos = self.pos + 1
          local rec = self.src:record(self:row(self.pos), 2)
          if rec then batch[#batch + 1] = rec end
        end
        if #batch > 0 then return batch end
      end
    end
  end
end

return M
