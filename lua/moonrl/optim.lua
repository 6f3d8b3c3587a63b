-- Optimizers and learning-rate schedules.
--
--   local opt = moonrl.optim.adamw{ params = p, grads = g, n = count, lr = 1e-5,
--     betas = {0.9, 0.999}, eps = 1e-8, weight_decay = 0.01,
--     no_decay = {{offset, count}, ...} }
--   local norm = opt:clip_grad_norm(1.0)   -- pre-clip norm
--   opt:step(lr)                           -- lr optional (default: the lr given above)
--   (defer = true: the state is allocated at the first use or opt:create(), not here)
--   opt:offload()   -- (deferred, parameters on a GPU) fp32 master weights and state in host memory
--   local sched = moonrl.optim.schedule{ kind = 'cosine', warmup = 10, total = 100, lr = 1e-5 }
--   sched(step) -> lr
local moonrl = require('moonrl')
local ffi = require('ffi')
local C = moonrl.C

local M = {}

local function need_number(t, key, default, where)
  local v = t[key]
  if v == nil then v = default end
  if type(v) ~= 'number' then
    moonrl.usage_error(string.format("%s: '%s' must be a number, got %s", where, key, tostring(v)))
  end
  return v
end

local AdamW = {}
AdamW.__index = AdamW

function M.adamw(o)
  if type(o) ~= 'table' then error('optim.adamw: expected a table of options', 2) end
  local where = 'optim.adamw'
  if o.params == nil or o.grads == nil then moonrl.usage_error(where .. ": 'params' and 'grads' (float pointers) are required") end
  -- grads may be a function giving the pointer when first needed (models.adamw's: the model's
  -- gradient buffer, never made under ZeRO-2, whose shard optimizer has its own)
  local grads_fn = type(o.grads) == 'function' and o.grads or nil
  local n = need_number(o, 'n', nil, where)
  local betas = o.betas or { 0.9, 0.999 }
  local cfg = ffi.new('mrl_adamw_config', {
    lr = need_number(o, 'lr', 1e-3, where),
    beta1 = betas[1], beta2 = betas[2],
    eps = need_number(o, 'eps', 1e-8, where),
    weight_decay = need_number(o, 'weight_decay', 0.01, where),
  })
  local self = setmetatable({
    params = ffi.cast('float *', o.params), grads = not grads_fn and ffi.cast('float *', o.grads) or nil,
    grads_fn = grads_fn, n = n, lr = cfg.lr, cfg = cfg,
    options = { betas = { betas[1], betas[2] }, eps = cfg.eps, weight_decay = cfg.weight_decay },
    no_decay = o.no_decay,
    _keep = { o.params, o.grads },
    model = o.model, -- the moonrl.model whose buffer params is: told after each step (its bf16 copies)
  }, AdamW)
  if not o.defer then self:create() end
  return self
end

-- The gradient pointer (resolved once when grads was a function).
function AdamW:bind_grads()
  if not self.grads then
    self.grads = ffi.cast('float *', self.grads_fn())
    self._keep[2] = self.grads
  end
  return self.grads
end

-- Optimizer offload (dist.offload=optimizer): a deferred AdamW over a GPU model's buffers keeps
-- its fp32 master weights, a host copy of the gradients and its state (m, v) in host memory, and
-- steps there with the CPU's kernel: each step copies the gradients over, updates the master
-- weights and copies them back into the GPU's parameters (the model's compute copy). The GPU
-- holds the parameters and gradients only. The copies overlap the update: in chunks of
-- chunk_floats (default 16M, 64 MB), the next chunk's gradients come over while the CPU steps this
-- one, and each stepped chunk goes back while it steps the next (optim.h's mrl_offload). Call
-- before the state exists.
function AdamW:offload(chunk_floats)
  if self.handle then error('optim.adamw: offload() after the state exists', 2) end
  self.offloaded = true
  self.offload_chunk = chunk_floats or 16 * 2 ^ 20
  return self
end

-- The state (2n floats) is allocated here. With o.defer the first call that needs it does it (or
-- this one): ZeRO-1 takes shards of a deferred optimizer, whose whole state then never exists.
function AdamW:create()
  if self.handle then return self end
  local out = ffi.new('mrl_adamw *[1]')
  if self.offloaded then -- the master weights, a gradient buffer and the state in host memory
    local o = ffi.new('mrl_offload *[1]')
    moonrl.check(C.mrl_offload_create(self.params, self:bind_grads(), self.n, self.cfg,
      math.max(1, math.floor(self.offload_chunk)), o), 3)
    self.offload_handle = ffi.gc(o[0], C.mrl_offload_free)
    self.handle = C.mrl_offload_adamw(o[0]) -- (the offload's, freed with it)
  else
    moonrl.check(C.mrl_adamw_create(self.params, self:bind_grads(), self.n, self.cfg, out), 3)
    self.handle = ffi.gc(out[0], C.mrl_adamw_free)
  end
  if self.no_decay and #self.no_decay > 0 then self:set_no_decay(self.no_decay) end
  return self
end

-- ranges: {{offset, count}, ...} of elements that get no weight decay.
function AdamW:set_no_decay(ranges)
  self.no_decay = ranges
  if not self.handle then return end -- (create applies them)
  local flat = ffi.new('int64_t[?]', 2 * #ranges)
  for i, r in ipairs(ranges) do
    flat[2 * i - 2] = r[1] or r.offset
    flat[2 * i - 1] = r[2] or r.count
  end
  moonrl.check(C.mrl_adamw_set_no_decay(self.handle, flat, #ranges), 2)
end

-- An AdamW with the same settings over elements [offset, offset + count) of the same buffers
-- (a rank's shard under ZeRO-1), or with grads (count floats) of its own (ZeRO-2's shard);
-- no_decay: ranges relative to offset. This one is left as it is (a deferred one stays without
-- state).
-- An offloaded one's shard is offloaded too: each rank's host memory holds 1/N of the master
-- weights and state (ZeRO-Offload).
function AdamW:shard(offset, count, no_decay, grads)
  local o = self.options
  local s = M.adamw({ params = self.params + offset, grads = grads or self:bind_grads() + offset, n = count, lr = self.lr,
    betas = o.betas, eps = o.eps, weight_decay = o.weight_decay, no_decay = no_decay, model = self.model,
    defer = self.offloaded })
  if self.offloaded then s:offload(self.offload_chunk):create() end
  return s
end

function AdamW:step(lr)
  self:create()
  if self.offloaded then -- the gradients over, the update on the host, the weights back: overlapped
    moonrl.check(C.mrl_offload_step(self.offload_handle, lr or -1), 2)
    if self.model then self.model:trained() end
    return
  end
  moonrl.check(C.mrl_adamw_step(self.handle, lr or -1), 2)
  if self.model then self.model:trained() end -- a bf16 model converts its copies before their next use
end

local norm_out = ffi.new('double[1]')
function AdamW:clip_grad_norm(max_norm)
  moonrl.check(C.mrl_grad_clip_norm(self:bind_grads(), self.n, max_norm, norm_out), 2)
  return norm_out[0]
end

function AdamW:grad_norm()
  moonrl.check(C.mrl_grad_norm(self:bind_grads(), self.n, norm_out), 2)
  return norm_out[0]
end

function AdamW:zero_grad() moonrl.check(C.mrl_grad_zero(self:bind_grads(), self.n), 2) end
function AdamW:scale_grad(s) moonrl.check(C.mrl_grad_scale(self:bind_grads(), self.n, s), 2) end
function AdamW:steps() return self.handle and tonumber(C.mrl_adamw_steps(self.handle)) or 0 end

-- {m = float*, v = float*, n = count, step = t, bytes = size of m and v}:
-- the optimizer's own buffers (save them for a checkpoint); host copies of them when the
-- parameters are on a GPU (the state is there too).
function AdamW:state()
  self:create()
  local s = ffi.new('mrl_adamw_state')
  moonrl.check(C.mrl_adamw_get_state(self.handle, s), 2)
  local n = tonumber(s.n)
  local m, v = s.m, s.v
  if C.mrl_device_of(m).kind ~= C.MRL_DEVICE_CPU then
    m, v = ffi.new('float[?]', n), ffi.new('float[?]', n)
    moonrl.check(C.mrl_device_memcpy(m, s.m, 4 * n), 2)
    moonrl.check(C.mrl_device_memcpy(v, s.v, 4 * n), 2)
  end
  return { m = m, v = v, n = n, step = tonumber(s.step), bytes = tonumber(s.bytes) }
end

-- Restore from a table like state()'s (m, v: float pointers holding n floats each).
function AdamW:load_state(s)
  self:create()
  moonrl.check(C.mrl_adamw_load_state(self.handle, ffi.cast('const float *', s.m), ffi.cast('const float *', s.v),
    s.n or self.n, s.step), 2)
  -- offloaded: the master weights are the model's as restored with it (a checkpoint's, a rollback's)
  if self.offloaded then moonrl.check(C.mrl_offload_pull(self.offload_handle), 2) end
end

-- Learning-rate schedules, the formulas of transformers'
-- get_{constant,linear,cosine}_schedule_with_warmup (cosine also with
-- min_lr_ratio as get_cosine_with_min_lr_schedule_with_warmup).
local function warmup_factor(step, warmup)
  return step / math.max(1, warmup)
end

local factors = {
  constant = function(step, o)
    if step < o.warmup then return warmup_factor(step, o.warmup) end
    return 1.0
  end,
  linear = function(step, o)
    if step < o.warmup then return warmup_factor(step, o.warmup) end
    return math.max(0.0, (o.total - step) / math.max(1, o.total - o.warmup))
  end,
  cosine = function(step, o)
    if step < o.warmup then return warmup_factor(step, o.warmup) end
    local progress = (step - o.warmup) / math.max(1, o.total - o.warmup)
    local f = 0.5 * (1.0 + math.cos(math.pi * o.num_cycles * 2.0 * progress))
    if o.min_lr_ratio then f = f * (1.0 - o.min_lr_ratio) + o.min_lr_ratio end
    return math.max(0.0, f)
  end,
}

function M.schedule(o)
  if type(o) ~= 'table' then error('optim.schedule: expected a table of options', 2) end
  local where = 'optim.schedule'
  local kind = o.kind or 'constant'
  local factor = factors[kind]
  if not factor then moonrl.usage_error(where .. ": kind must be 'constant', 'linear' or 'cosine', got '" .. tostring(kind) .. "'") end
  local s = {
    warmup = need_number(o, 'warmup', 0, where),
    total = need_number(o, 'total', 0, where),
    num_cycles = need_number(o, 'num_cycles', 0.5, where),
    min_lr_ratio = o.min_lr_ratio,
  }
  local lr = need_number(o, 'lr', nil, where)
  if s.warmup < 0 then moonrl.usage_error(where .. ': warmup must be >= 0') end
  if kind ~= 'constant' and s.total <= 0 then moonrl.usage_error(where .. ": 'total' (steps) must be > 0 for " .. kind) end
  if s.min_lr_ratio ~= nil and (type(s.min_lr_ratio) ~= 'number' or kind ~= 'cosine') then
    moonrl.usage_error(where .. ': min_lr_ratio must be a number and is only for cosine')
  end
  return function(step) return lr * factor(step, s) end
end

return M
