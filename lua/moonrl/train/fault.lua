-- Fault injection for the recovery tests: the faults a long run meets, caused on purpose.
-- Off unless the environment variable MOONRL_FAULT is set; it holds faults separated by ';',
-- each a kind followed by ':key=value' conditions:
--
--   kill:step=12:phase=train     SIGKILL when phase 'train' of (global) step 12 begins
--   kill:checkpoint=20:bytes=5000   SIGKILL after 5000 bytes of the checkpoint of step 20 (any
--                                checkpoint when checkpoint= is absent)
--   crash:step=7:phase=reward    SIGSEGV (a bug), likewise
--   hang:step=7:phase=generate   block forever inside C, away from every safe point
--   exit:step=7                  exit(1) at once, as a process dying of an error would
--   error:step=7:phase=reward    raise a Lua error there (a bug in a recipe or a plugin)
--   signal:step=7:sig=15         send this process SIGTERM (sig=2: SIGINT), as a pre-emption would
--   sleep:step=2:seconds=4       a slow step: busy there for that long, deaf to stops
--   nan:step=5                   make step 5's gradients NaN (before the guards look at them)
--   spike:step=5:factor=1000     multiply step 5's gradients by factor (a loss spike)
--   kl:step=5:value=9            report a KL of value at step 5 (for the KL detector)
--   slow_engine:seconds=0.02     every generation engine step of the process takes that much longer
--                                (a straggling rollout worker; rank= and attempt= apply)
--   no_shm:rank=2                this rank cannot open the shared-memory weight store (as a rank on
--                                another host cannot; rank= and attempt= apply)
--   sync_corrupt:rank=2:times=1  a rollout rank's copy of the trainers' weights gets one element
--                                wrong after a delivery (the version checksum must catch it)
--   serve_kill:requests=3        `moonrl serve` dies (SIGKILL) when its 4th generation request comes
--                                (a rollout server lost mid-run)
--
-- Conditions: step=N (the session's global step, counted over all phases), phase=NAME (a
-- phase of the recipe loop: 'step' at its start, 'end' after its log, or a run:phase name such
-- as generate, reward, train), attempt=K (only in the K-th start under a supervisor, 0 the
-- first; MOONRL_ATTEMPT), rank=R (only in rank R of a job of several: the launcher's
-- OMPI_COMM_WORLD_RANK, PMIX_RANK or SLURM_PROCID), times=N (nan, spike, kl, sync_corrupt: at most N times in a process), checkpoint=N,
-- bytes=B, factor=F, value=V, sig=S, seconds=T.
local moonrl = require('moonrl')

local M = {}

local KINDS = { kill = true, crash = true, hang = true, exit = true, error = true, signal = true, sleep = true, nan = true,
  spike = true, kl = true, slow_engine = true, no_shm = true, sync_corrupt = true, serve_kill = true }
local POINT_KINDS = { kill = true, crash = true, hang = true, exit = true, error = true, signal = true, sleep = true }

function M.parse(text)
  local list = {}
  for item in (text or ''):gmatch('[^;]+') do
    local kind, rest = item:match('^%s*([%a_]+)(.*)$')
    if not kind or not KINDS[kind] then error('MOONRL_FAULT: unknown fault in ' .. item, 0) end
    local f = { kind = kind }
    for key, value in rest:gmatch(':([%a_]+)=([^:]+)') do
      f[key] = key == 'phase' and value or tonumber(value)
      if f[key] == nil then error('MOONRL_FAULT: ' .. key .. '=' .. value .. ' is not a number', 0) end
    end
    list[#list + 1] = f
  end
  return list
end

M.faults = M.parse(os.getenv('MOONRL_FAULT'))
M.attempt = tonumber(os.getenv('MOONRL_ATTEMPT') or '0') or 0
M.rank = tonumber(os.getenv('OMPI_COMM_WORLD_RANK') or os.getenv('PMIX_RANK') or os.getenv('SLURM_PROCID') or '0') or 0

local function applies(f, step, phase)
  if f.attempt and f.attempt ~= M.attempt then return false end
  if f.rank and f.rank ~= M.rank then return false end
  if f.step and f.step ~= step then return false end
  if f.phase and f.phase ~= phase then return false end
  return true
end

local function announce(f, step, phase)
  io.stderr:write(string.format('moonrl: fault injection: %s at step %s, %s\n', f.kind, tostring(step), tostring(phase)))
  io.stderr:flush()
end

-- A point of the loop: fires kill / crash / hang / exit faults that match.
function M.point(step, phase)
  if #M.faults == 0 then return end
  for _, f in ipairs(M.faults) do
    if POINT_KINDS[f.kind] and not f.bytes and not f.checkpoint and not f.fired and applies(f, step, phase) then
      announce(f, step, phase)
      if f.kind == 'kill' then moonrl.C.mrl_fault_kill() end
      if f.kind == 'crash' then moonrl.C.mrl_fault_crash() end
      if f.kind == 'hang' then moonrl.C.mrl_fault_hang() end
      if f.kind == 'exit' then os.exit(1, false) end
      if f.kind == 'signal' then
        f.fired = true -- once per process: the stop it causes runs through this point again
        moonrl.C.mrl_fault_signal(f.sig or 15)
        -- the loop thread takes the signal and requests the stop: wait for that, raising nothing
        for _ = 1, 200 do
          if moonrl.stop_requested() then break end
          moonrl.C.mrl_sleep(0.005)
        end
      end
      if f.kind == 'sleep' then moonrl.C.mrl_fault_busy(f.seconds or 1) end
      if f.kind == 'error' then
        f.fired = true
        error(string.format('fault injection: error at step %s, %s', tostring(step), tostring(phase)), 0)
      end
    end
  end
end

-- Before a checkpoint of `step` is written: arm the byte budget when a fault asks for it.
function M.arm_checkpoint(step)
  for _, f in ipairs(M.faults) do
    if f.kind == 'kill' and f.bytes and (not f.checkpoint or f.checkpoint == step)
        and (not f.attempt or f.attempt == M.attempt) and (not f.rank or f.rank == M.rank) then
      announce(f, step, 'checkpoint write after ' .. f.bytes .. ' bytes')
      moonrl.C.mrl_fault_kill_after_bytes(f.bytes)
      return
    end
  end
end
function M.disarm() moonrl.C.mrl_fault_kill_after_bytes(-1) end

-- The gradient faults of a step: returns the matching fault of kind nan, spike or kl, if any
-- (times=N: it fires N times at most in this process).
function M.update_fault(step, kind)
  for _, f in ipairs(M.faults) do
    if f.kind == kind and applies(f, step, nil) and (f.fired or 0) < (f.times or math.huge) then
      f.fired = (f.fired or 0) + 1
      return f
    end
  end
end

-- Whether a fault of the process (no step or phase) of this kind applies: no_shm, sync_corrupt.
function M.process_fault(kind)
  for _, f in ipairs(M.faults) do
    if f.kind == kind and applies(f, nil, nil) and (f.fired or 0) < (f.times or math.huge) then
      f.fired = (f.fired or 0) + 1
      announce(f, nil, nil)
      return true
    end
  end
  return false
end

-- The fault of the process of this kind that applies (no step or phase), or nil.
function M.find(kind)
  for _, f in ipairs(M.faults) do
    if f.kind == kind and applies(f, nil, nil) then return f end
  end
end

-- The faults of the whole process, set once at start-up.
for _, f in ipairs(M.faults) do
  if f.kind == 'slow_engine' and applies(f, nil, nil) then moonrl.C.mrl_fault_slow_engine(f.seconds or 0.01) end
end

return M
