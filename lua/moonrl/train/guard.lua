-- Guards: look at an update before it is applied, and say whether to apply it, skip it, or roll
-- the run back to its last good checkpoint.
--
--   local g = require('moonrl.train.guard').new(cfg.guard)
--   local verdict, why = g:check({ loss = .., grad_norm = .., kl = .., entropy = .. } [, detectors])
--   -- detectors = false: the non-finite checks only
--   -- verdict: 'apply' | 'skip' | 'rollback'; why = { detector =, value =, limit = } when not 'apply'
--   g:accept(m)          -- after an applied update: its values join the windows
--   g:state(), g:restore(state)   -- the windows, for checkpoints
--
-- Detectors (cfg.guard keys):
--   non-finite loss or gradient norm   always: the update is skipped (the optimizer never sees it)
--   grad_spike = k     grad norm above median + k robust deviations of the last `window` applied
--   loss_spike = k     updates (robust deviation = max(1.4826 * MAD, 5% of |median|, 1e-12));
--                      0 turns a detector off; nothing fires before `min_history` values
--   kl_max = x         the update's KL above x (0: off)
--   entropy_min = x    the update's entropy below x (0: off)
-- A spike, KL or entropy detection does `action` ('skip' or 'rollback'). A value the recipe does
-- not report (no KL in SFT) is not checked. More than max_skips skipped updates in a row (0: no
-- limit), or more than max_rollbacks rollbacks, stop the run (moonrl.train.session).
local M = {}

local G = {}
G.__index = G

M.defaults = require('moonrl.config').guard_defaults

function M.new(cfg)
  cfg = cfg or {}
  local o = {}
  for k, v in pairs(M.defaults) do o[k] = cfg[k] == nil and v or cfg[k] end
  if o.action ~= 'skip' and o.action ~= 'rollback' then
    require('moonrl').usage_error("guard.action must be 'skip' or 'rollback', got '" .. tostring(o.action) .. "'")
  end
  if o.window < 1 then require('moonrl').usage_error('guard.window must be >= 1') end
  return setmetatable({ cfg = o, windows = { grad_norm = {}, loss = {} } }, G)
end

local function finite(x) return type(x) == 'number' and x == x and x ~= math.huge and x ~= -math.huge end
M.finite = finite

local function median(sorted)
  local n = #sorted
  if n % 2 == 1 then return sorted[(n + 1) / 2] end
  return 0.5 * (sorted[n / 2] + sorted[n / 2 + 1])
end

-- The spike limit of a window: median + k robust deviations (nil while the window is short).
local function spike_limit(values, k, min_history)
  if k <= 0 or #values < min_history then return nil end
  local s = {}
  for i, v in ipairs(values) do s[i] = v end
  table.sort(s)
  local med = median(s)
  local dev = {}
  for i, v in ipairs(s) do dev[i] = math.abs(v - med) end
  table.sort(dev)
  local scale = math.max(1.4826 * median(dev), 0.05 * math.abs(med), 1e-12)
  return med + k * scale
end

function G:check(m, detectors)
  local c = self.cfg
  for _, key in ipairs({ 'loss', 'grad_norm' }) do
    if m[key] ~= nil and not finite(m[key]) then
      return 'skip', { detector = 'nonfinite_' .. key, value = m[key] }
    end
  end
  if detectors == false then return 'apply' end
  local function detected(detector, value, limit) return c.action, { detector = detector, value = value, limit = limit } end
  for _, d in ipairs({ { 'grad_norm', 'grad_spike' }, { 'loss', 'loss_spike' } }) do
    local v = m[d[1]]
    local limit = v ~= nil and spike_limit(self.windows[d[1]], c[d[2]], c.min_history)
    if limit and v > limit then return detected(d[2], v, limit) end
  end
  if c.kl_max > 0 and m.kl ~= nil and (not finite(m.kl) or m.kl > c.kl_max) then return detected('kl_max', m.kl, c.kl_max) end
  if c.entropy_min > 0 and m.entropy ~= nil and m.entropy < c.entropy_min then
    return detected('entropy_min', m.entropy, c.entropy_min)
  end
  return 'apply'
end

function G:accept(m)
  for key, list in pairs(self.windows) do
    local v = m[key]
    if finite(v) then
      list[#list + 1] = v
      if #list > self.cfg.window then table.remove(list, 1) end
    end
  end
end

function G:state()
  local json = require('moonrl.io.json')
  return { grad_norm = json.array({ unpack(self.windows.grad_norm) }), loss = json.array({ unpack(self.windows.loss) }) }
end

function G:restore(st)
  self.windows = { grad_norm = {}, loss = {} }
  for key in pairs(self.windows) do
    for i, v in ipairs(st and st[key] or {}) do self.windows[key][i] = v end
  end
end


-- ---- the session's guarded update -------------------------------------------------------------
-- Methods of the run's session (moonrl.train.session installs them): S:update applies an update
-- through the guards (and the fault injection of moonrl.train.fault), S:rollback goes back to
-- the newest checkpoint of the loop's phase.

local ffi = require('ffi')
local moonrl = require('moonrl')
local C = moonrl.C
local ckpt = require('moonrl.train.checkpoint')
local fault = require('moonrl.train.fault')
local fs = require('moonrl.io.fs')

-- Raised when the guards give up (more rollbacks than guard.max_rollbacks): exit status 3, and a
-- supervisor does not restart the run (it would meet the same values again).
local GuardStop = {}
GuardStop.__index = GuardStop
GuardStop.__tostring = function(e) return e.message end
M.GuardStop = GuardStop
function M.is_guard_stop(e) return getmetatable(e) == GuardStop end

local GS = {}
M.session_methods = GS


local function poison_grads(opt)
  -- the NaN arithmetic makes (a byte fill would make NaNs whose payload LuaJIT could misread);
  -- a GPU's gradients are written from a host array of them
  local nan = 0 / 0
  -- the gradients this rank holds (a ZeRO-2 rank: its shard)
  local grads, n
  if opt.grad_span then grads, n = opt:grad_span()
  else grads, n = opt.bind_grads and opt:bind_grads() or opt.grads, opt.n end
  local on_gpu = C.mrl_device_of(grads).kind ~= C.MRL_DEVICE_CPU
  local g = on_gpu and ffi.new('float[?]', n) or grads
  for i = 0, n - 1 do g[i] = nan end
  if on_gpu then moonrl.check(C.mrl_device_memcpy(grads, g, 4 * n)) end
end

-- Look at an update (m: loss, grad_norm, and kl / entropy when the recipe has them) before
-- opt:step(lr) applies it. Returns true when it was applied; else m.guard says why.
function GS:update(opt, lr, m, opts)
  local detectors = not (opts and opts.detectors == false)
  m.guard = m.guard or {}
  if type(m.loss) == 'number' then
    self.last_loss = m.loss
    if self.progress then self.progress.extra = string.format('loss %.4g', m.loss) end
  end
  if self.pending_rollback then m.guard.skipped = 1; return false end
  local step = self.global_step
  if fault.update_fault(step, 'nan') then poison_grads(opt); m.grad_norm = opt:grad_norm() end
  local spike = fault.update_fault(step, 'spike')
  if spike then
    opt:scale_grad(spike.factor or 1000)
    m.grad_norm = m.grad_norm * (spike.factor or 1000)
  end
  local klf = fault.update_fault(step, 'kl')
  if klf then m.kl = klf.value end
  local verdict, why = self.guard:check(m, detectors)
  if verdict == 'apply' then
    opt:step((lr or opt.lr) * self.lr_scale)
    if self.lr_scale ~= 1 then m.lr = (lr or opt.lr) * self.lr_scale end
    local sum = opt.param_sum and opt:param_sum() or require('moonrl.train.ops').sum(opt.params, opt.n)
    if M.finite(sum) then
      if detectors then self.guard:accept(m) end
      self.skips_in_row = 0
      return true
    end
    verdict, why = 'rollback', { detector = 'nonfinite_params', value = sum }
  end
  why.step = step
  if verdict == 'rollback' then why.checkpoint = self:rollback_target() end
  if verdict == 'rollback' and not why.checkpoint then
    if why.detector == 'nonfinite_params' then
      error(setmetatable({ message = string.format('guard: the parameters are not finite after the update of step %d, ' ..
        'and there is no checkpoint to roll back to', step) }, GuardStop), 0)
    end
    why.note = 'no checkpoint to roll back to: skipped'
    verdict = 'skip'
  end
  if verdict == 'skip' then
    self.skips, self.skips_in_row = self.skips + 1, self.skips_in_row + 1
    m.guard.skipped = 1
    self:event('skip', why)
    local limit = self.cfg.guard.max_skips
    if limit > 0 and self.skips_in_row > limit then
      error(setmetatable({ message = string.format('guard: %d updates in a row skipped (guard.max_skips=%d), the last ' ..
        'by %s at step %d (value %s)', self.skips_in_row, limit, why.detector, step, tostring(why.value)) }, GuardStop), 0)
    end
    return false
  end
  m.guard.rollback = 1
  self.pending_rollback = why
  return false
end

-- The checkpoint a rollback goes back to: the newest that verifies, if it is of this phase (a
-- checkpoint of an earlier phase holds another phase's optimizer).
function GS:rollback_target()
  local w = self.world
  local dir
  if w.rank == 0 then
    dir = ckpt.latest(self.ckpt_root, function(msg) moonrl.log('warn', '%s', msg) end)
    if dir and ckpt.read(dir).state.phase ~= self.loop_phase then dir = nil end
  end
  if w.size > 1 then dir = w:broadcast_string(dir or ''); if dir == '' then dir = nil end end
  return dir
end

function GS:rollback()
  local why = self.pending_rollback
  self.pending_rollback = nil
  local g = self.cfg.guard
  local rollbacks = self.rollbacks + 1
  if rollbacks > g.max_rollbacks then
    self:event('guard_stop', why)
    error(setmetatable({ message = string.format('guard: %s at step %d (value %s, limit %s) after %d rollbacks ' ..
      '(guard.max_rollbacks=%d): stopping', why.detector, why.step, tostring(why.value), tostring(why.limit),
      self.rollbacks, g.max_rollbacks) }, GuardStop), 0)
  end
  local dir = why.checkpoint -- found (and verified) when the detector fired
  local saved = ckpt.read(dir)
  local lr_scale = self.lr_scale * g.lr_factor
  local skips = self.skips
  self:restore(dir, saved.state, { keep_data = g.skip_batch })
  self.rollbacks, self.lr_scale, self.skips = rollbacks, lr_scale, skips
  if self.run.metrics then -- (rank 0's: the other ranks of a job keep no metrics file)
    self.run.metrics:flush()
    fs.truncate(self.run.dir .. '/metrics.jsonl', saved.state.metrics_bytes)
  end
  why.to_step, why.rollbacks, why.lr_scale = saved.state.step, rollbacks, lr_scale
  self:event('rollback', why)
  if self.rollouts then self.rollouts:rollback() end -- the batches generated since go too
end

return M
