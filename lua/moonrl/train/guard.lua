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

M.defaults = require('moonrl.config').guard_defaults -- the guard section's defaults, declared with the config's

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

return M
