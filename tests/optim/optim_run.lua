-- Helper of ref_optim.py (not a test by itself). Reads $OPT_IN (p0, g0..gK
-- as F32, the settings in __metadata__), runs K AdamW steps with gradient
-- clipping and a cosine schedule, and writes $OPT_OUT: final params p, the
-- state m and v, the pre-clip norms and the lrs of several schedules.
local moonrl = require('moonrl')
local ffi = require('ffi')
local optim = moonrl.optim

local st = require('moonrl.io.safetensors').open(os.getenv('OPT_IN'))
local function meta(key) return st:metadata(key) end
local function read(name) return st:read_f32(name) end

local n, steps = tonumber(meta('n')), tonumber(meta('steps'))
local no_decay = {}
for off, cnt in meta('no_decay'):gmatch('(%d+),(%d+)') do no_decay[#no_decay + 1] = { tonumber(off), tonumber(cnt) } end
local params, grads = read('p0'), ffi.new('float[?]', n)
local opt = optim.adamw{ params = params, grads = grads, n = n, lr = tonumber(meta('lr')),
  betas = { tonumber(meta('beta1')), tonumber(meta('beta2')) }, eps = tonumber(meta('eps')),
  weight_decay = tonumber(meta('weight_decay')), no_decay = no_decay }
local total = tonumber(meta('total'))
local sched = optim.schedule{ kind = 'cosine', warmup = tonumber(meta('warmup')), total = total, lr = tonumber(meta('lr')) }
local max_norm = tonumber(meta('max_norm'))

local norms = ffi.new('double[?]', steps)
for s = 0, steps - 1 do
  ffi.copy(grads, read('g' .. s), 4 * n)
  norms[s] = opt:clip_grad_norm(max_norm)
  opt:step(sched(s + 1))
end

-- schedules: lr at steps 0 .. total + 2 for each kind
local kinds = {
  { kind = 'constant', warmup = 3 }, { kind = 'linear', warmup = 3, total = total },
  { kind = 'cosine', warmup = 3, total = total }, { kind = 'cosine', warmup = 0, total = total, min_lr_ratio = 0.1 },
  { kind = 'cosine', warmup = 2, total = total, num_cycles = 1.5 },
}
local nl = total + 3
local lrs = ffi.new('double[?]', #kinds * nl)
for k, o in ipairs(kinds) do
  o.lr = 3e-4
  local f = optim.schedule(o)
  for s = 0, nl - 1 do lrs[(k - 1) * nl + s] = f(s) end
end

local w = require('moonrl.io.safetensors').writer()
local state = opt:state()
w:add('p', 'F32', { n }, params)
w:add('m', 'F32', { n }, state.m)
w:add('v', 'F32', { n }, state.v)
w:add_raw('norms', 'F64', { steps }, norms, 8 * steps)
w:add_raw('lrs', 'F64', { #kinds, nl }, lrs, 8 * #kinds * nl)
w:metadata('step', state.step)
w:write(os.getenv('OPT_OUT'))
