-- Kill a run again and again and check that it still ends exactly where an uninterrupted run
-- ends. Used by tests/recipes/test_resume.lua (in the suite) and bench/checkpoint/kill_stress.lua (any
-- number of kills).
--
--   local K = dofile('tests/recipes/killer.lua')
--   local report = K.campaign({ recipe = 'recipes/grpo.lua', words = {...}, steps = 8, kills = 20,
--     seed = 1, dir = tmp })
--
-- The run is started with run.checkpoint_every=1 and run.resume=auto in one run directory; each
-- attempt but the last dies by SIGKILL at a moment picked at random from
--   * a phase of a step at or after the next one to do (MOONRL_FAULT kill:step=S:phase=P),
--   * a byte of a checkpoint write (kill:checkpoint=S:bytes=B),
--   * a time after its start (the process group is sent SIGKILL by a timer).
-- Then the final model.safetensors files must equal those of the uninterrupted run byte for byte,
-- and metrics.jsonl must hold each step once, equal to the uninterrupted run's but for timings.
local moonrl = require('moonrl')
local proc = require('moonrl.io.proc')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')

local K = {}

local exe = rawget(_G, 'MOONRL_EXE') or 'build/moonrl'
local PHASES = { 'step', 'generate', 'reward', 'train', 'end' } -- the phases of an RL step

function K.run(recipe, words, opts)
  opts = opts or {}
  local argv = { 'env', 'MOONRL_FAULT=' .. (opts.fault or '') }
  for _, e in ipairs(opts.env or {}) do argv[#argv + 1] = e end
  argv[#argv + 1] = exe
  argv[#argv + 1] = 'run'
  argv[#argv + 1] = recipe
  for _, w in ipairs(words) do argv[#argv + 1] = w end
  return proc.run(argv, { timeout = opts.timeout or 300 })
end

-- The metrics of a run directory without the keys that measure time (the episodes' env/*_seconds
-- and env/env_share too), or the process's memory
-- (its resident set: the allocator's and the OS's, not the run's math): a list, one per line.
local function timeless(rec)
  local out = json.object()
  for _, k in ipairs(json.keys(rec)) do
    if k ~= 'time' and not k:match('^time/') and not k:match('^tokens_per_s/') and not k:match('^memory/')
      and not k:match('^env/.*_seconds$') and k ~= 'env/env_share' then
      out[k] = rec[k]
    end
  end
  return json.encode(out)
end

function K.metrics(dir)
  local out = {}
  local text = fs.read(dir .. '/metrics.jsonl') or ''
  for line in text:gmatch('[^\n]+') do out[#out + 1] = timeless(json.decode(line)) end
  return out
end

function K.latest_step(dir)
  local names = require('moonrl.train.checkpoint').list(dir .. '/checkpoints')
  return #names > 0 and tonumber(names[#names]:match('%d+')) or 0
end

local function random(state, n)
  state.x = (state.x * 48271) % 2147483647
  return state.x % n
end

-- opts: recipe, words (without run.dir), steps (the run's total of global steps), kills, seed,
-- dir (scratch), models (model directories to compare: default {'model'}), file (the weights file
-- in each: default model.safetensors; a LoRA run's adapter_model.safetensors), phases (kill phases),
-- max_attempts, timer_seconds (upper bound of the timed kills, scaled by the share of steps
-- left), log (print progress).
function K.campaign(o)
  local rng = { x = (o.seed or 1) * 7919 + 17 }
  local models = o.models or { 'model' }
  local phases = o.phases or PHASES
  local ref_dir, dir = o.dir .. '/uninterrupted', o.dir .. '/killed'
  local base = { 'run.checkpoint_every=1', 'run.resume=auto' }
  for _, w in ipairs(o.words) do base[#base + 1] = w end
  local function words(d)
    local w = { 'run.dir=' .. d }
    for _, x in ipairs(base) do w[#w + 1] = x end
    return w
  end
  local t0 = moonrl.now()
  local r = K.run(o.recipe, words(ref_dir))
  if not r.ok then error('the uninterrupted run failed: ' .. r.stderr .. r.stdout, 0) end
  local clean_seconds = moonrl.now() - t0
  -- the bytes of one checkpoint: a kill inside a checkpoint write picks one of them
  local ckpt_bytes = 0
  local last = require('moonrl.train.checkpoint').list(ref_dir .. '/checkpoints')
  for _, f in pairs(json.read_file(ref_dir .. '/checkpoints/' .. last[#last] .. '/manifest.json').files) do
    ckpt_bytes = ckpt_bytes + f.bytes
  end
  local kills, attempts, log = 0, 0, {}
  local kinds = { phase = 0, checkpoint = 0, timer = 0 }
  while true do
    attempts = attempts + 1
    if attempts > (o.max_attempts or 4 * o.kills + 10) then error('too many attempts', 0) end
    local done = K.latest_step(dir)
    local fault, timeout, kind = '', 300, 'none'
    if kills < o.kills then
      -- a backstop: should the picked moment not come (a timer longer than the rest of the run),
      -- the attempt still dies, at the end of the last step, before the run can finish
      fault = string.format(';kill:step=%d:phase=end', o.steps)
      local pick = random(rng, 10)
      local step = done + 1 + random(rng, 3)
      if step > o.steps then step = o.steps end
      if pick < 5 then
        kind = 'phase'
        fault = string.format('kill:step=%d:phase=%s', step, phases[random(rng, #phases) + 1]) .. fault
      elseif pick < 8 then
        kind = 'checkpoint'
        fault = string.format('kill:checkpoint=%d:bytes=%d', step, random(rng, ckpt_bytes)) .. fault
      else
        kind = 'timer'
        timeout = 0.05 + random(rng, 1000) / 1000 * (o.timer_seconds or clean_seconds) * (o.steps - done) / o.steps
      end
    end
    local res = K.run(o.recipe, words(dir), { fault = fault, timeout = timeout })
    local killed = res.signal == 9 or res.exit_status == 137
    if res.ok then
      log[#log + 1] = string.format('attempt %d: finished (from step %d)', attempts, done)
      break
    end
    if not killed then
      error(string.format('attempt %d (%s %s) ended with status %s signal %s:\n%s%s', attempts, kind, fault,
        tostring(res.exit_status), tostring(res.signal), res.stdout, res.stderr), 0)
    end
    kills = kills + 1
    kinds[kind] = kinds[kind] + 1
    log[#log + 1] = string.format('attempt %d: from step %d, killed (%s %s)', attempts, done,
      kind, kind == 'timer' and string.format('%.2fs', timeout) or fault)
    if o.log then print(log[#log]) end
  end
  local same = {}
  for _, m in ipairs(models) do
    local a = fs.read(ref_dir .. '/' .. m .. '/' .. (o.file or 'model.safetensors'))
    local b = fs.read(dir .. '/' .. m .. '/' .. (o.file or 'model.safetensors'))
    same[m] = a ~= nil and a == b
  end
  return { kills = kills, attempts = attempts, kinds = kinds, same = same, log = log,
    metrics_ref = K.metrics(ref_dir), metrics = K.metrics(dir), dir = dir, ref_dir = ref_dir }
end

return K
