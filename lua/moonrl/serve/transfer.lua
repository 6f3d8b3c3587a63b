-- moonrl.serve.transfer: the weight-transfer session of vLLM's RL API on a served model, with
-- safetensors files as the transport (what `moonrl serve` answers /init_weight_transfer_engine,
-- /start_weight_update, /update_weights and /finish_weight_update with; docs/serving.md).
--
--   local t = transfer.new(model)      -- the served moonrl.model
--   t:init(init_info)                  -- {backend = 'shm'}: the one transport served
--   t:start()                          -- a new update: buckets may come
--   t:update(update_info)              -- {names, dtype_names, shapes, path, crc32c?}: one bucket
--   t:finish()  -> tensors, bytes      -- the update is over; the weights changed if tensors > 0
--
-- vLLM's NCCL backend sends a bucket's bytes over a collective and its /update_weights carries
-- only their names, dtypes and shapes; here the same request also names a safetensors file (in
-- /dev/shm: no disk) that holds exactly those tensors, with its CRC-32C. A bucket is checked
-- whole (the file's CRC, each tensor's name, dtype, shape and the served model's) before any of
-- its bytes is copied, so a refused bucket changes nothing. An update may name any subset of the
-- model's tensors (the others keep their values): the trainer sends only those that changed.
-- A bucket that fails after others of the same update were applied leaves the weights of no
-- version: the session says so (failed) until a new update starts.
local moonrl = require('moonrl')
local json = require('moonrl.io.json')
local fs = require('moonrl.io.fs')
local safetensors = require('moonrl.io.safetensors')

local M = {}

local Transfer = {}
Transfer.__index = Transfer

M.BACKENDS = { shm = true }

-- torch's dtype names (what vLLM's dtype_names hold) against safetensors'.
local DTYPES = { float32 = 'F32', bfloat16 = 'BF16', float16 = 'F16' }

function M.new(model)
  return setmetatable({ model = model, backend = nil, active = false, failed = nil, tensors = 0, bytes = 0 }, Transfer)
end

local function list(info, key, n)
  local v = info[key]
  if type(v) ~= 'table' or (n and #v ~= n) then
    error(string.format("'update_info.%s' must be a list%s", key, n and string.format(' of %d (as names)', n) or ''), 0)
  end
  return v
end

function Transfer:init(info)
  if not json.is_object(info) then error("'init_info' must be an object", 0) end
  local b = info.backend
  if b == nil or b == json.null then b = 'shm' end
  if not M.BACKENDS[b] then
    error(string.format("init_info.backend '%s' is not served: shm (safetensors files named by path) is", tostring(b):sub(1, 40)), 0)
  end
  self.backend = b
end

function Transfer:start()
  if not self.backend then error('start_weight_update: call /init_weight_transfer_engine first', 0) end
  if self.active then error('start_weight_update: an update is already active (call /finish_weight_update first)', 0) end
  self.active, self.failed, self.tensors, self.bytes = true, nil, 0, 0
end

-- One bucket: checked whole, then copied into the served model's parameters.
local function bucket(self, info)
  if not json.is_object(info) then error("'update_info' must be an object", 0) end
  local names = list(info, 'names')
  local dtypes, shapes = list(info, 'dtype_names', #names), list(info, 'shapes', #names)
  local path = info.path
  if type(path) ~= 'string' or path == '' then
    error("'update_info.path' (the safetensors file holding the bucket) is required: the shm backend reads the bytes there", 0)
  end
  local want = info.crc32c
  if want ~= nil and want ~= json.null then
    local ok, crc = pcall(fs.crc32c_file, path)
    if not ok then error(string.format('update_weights: %s: %s', path, moonrl.error_text(crc)), 0) end
    if string.format('%08x', crc) ~= tostring(want):lower() then
      error(string.format("update_weights: %s: CRC-32C %08x, the sender's %s", path, crc, tostring(want):sub(1, 20)), 0)
    end
  end
  local ok, st = pcall(safetensors.open, path)
  if not ok then error('update_weights: ' .. moonrl.error_text(st), 0) end
  local views = {}
  for _, v in ipairs(self.model:views()) do views[v.name] = v end
  local plan, seen = {}, {}
  for i, name in ipairs(names) do
    if type(name) ~= 'string' then error(string.format('update_info.names[%d] must be a string', i - 1), 0) end
    if seen[name] then error(string.format("update_info.names: '%s' twice", name:sub(1, 200)), 0) end
    seen[name] = true
    local v = views[name]
    if not v then error(string.format("update_weights: the served model has no tensor '%s'", name:sub(1, 200)), 0) end
    local dt = DTYPES[dtypes[i]]
    if not dt then
      error(string.format("update_info.dtype_names[%d] '%s': float32, bfloat16 or float16", i - 1, tostring(dtypes[i]):sub(1, 40)), 0)
    end
    local shape = shapes[i]
    if type(shape) ~= 'table' or table.concat(shape, ',') ~= table.concat(v.shape, ',') then
      error(string.format('update_weights: %s has shape [%s] in the served model, update_info.shapes[%d] says [%s]', name,
        table.concat(v.shape, ','), i - 1, type(shape) == 'table' and table.concat(shape, ','):sub(1, 80) or tostring(shape)), 0)
    end
    if not st:has(name) then error(string.format('update_weights: %s holds no tensor %s', path, name), 0) end
    local fi = st:info(name)
    if fi.dtype ~= dt or table.concat(fi.shape, ',') ~= table.concat(v.shape, ',') then
      error(string.format('update_weights: %s: %s is %s [%s] in the file, update_info says %s [%s]', path, name, fi.dtype,
        table.concat(fi.shape, ','), dt, table.concat(v.shape, ',')), 0)
    end
    plan[#plan + 1] = { v = v, bytes = fi.bytes }
  end
  if st:count() ~= #names then
    error(string.format('update_weights: %s holds %d tensors, update_info names %d', path, st:count(), #names), 0)
  end
  -- checked: copied (a GPU model's through its host copy)
  local p = self.model:read_params()
  for i, x in ipairs(plan) do
    self.tensors, self.bytes = self.tensors + 1, self.bytes + x.bytes
    st:read_f32(names[i], p + x.v.offset)
  end
  self.model:write_params(p)
end

-- A bucket into the update. Refused whole when it does not check; once some bytes of this update
-- landed, any failure fails the update.
function Transfer:update(info)
  if not self.active then error('update_weights: call /start_weight_update first', 0) end
  if self.failed then error('update_weights: this update already failed (' .. self.failed .. '); start a new one', 0) end
  local ok, err = pcall(bucket, self, info)
  if ok then return end
  err = moonrl.error_text(err)
  if self.tensors > 0 then self.failed = err end
  error(err, 0)
end

-- The update is over: the tensors and bytes it changed. A failed one is refused (its weights are
-- of no version); the session is closed either way.
function Transfer:finish()
  if not self.active then error('finish_weight_update: no update is active (call /start_weight_update first)', 0) end
  self.active = false
  if self.failed then error('finish_weight_update: the update failed (' .. self.failed .. ')', 0) end
  return self.tensors, self.bytes
end

function Transfer:shutdown()
  if self.active then error('shutdown_weight_transfer_engine: an update is active', 0) end
  self.backend = nil
end

return M
