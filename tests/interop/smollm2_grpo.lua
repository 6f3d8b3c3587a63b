-- GRPO on the real SmolLM2-135M-Instruct (examples/grpo_smollm2.lua) with its rollouts and
-- held-out evaluations on vllm serve (engine.backend=vllm engine.launch=auto), against the same
-- run on moonrl's own engine: the held-out accuracy rises on both, every sample is of the version
-- the schedule says, the trainer/engine log-prob mismatch stays within bound, and the whole step's
-- time on each is printed (bench/RESULTS.md, "Rollout servers"). Run by tests/interop/vllm.sh;
-- skipped (77) without the interop virtualenv or the model file.
--
--   MODEL=FILE.gguf|DIR (default: the file ./dev.sh fetch-model fetches), STEPS (default 20)
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local fs = require('moonrl.io.fs')
local U = dofile('tests/recipes/util.lua')

local exe = assert(rawget(_G, 'MOONRL_EXE'), 'needs the moonrl executable')
local model = os.getenv('MODEL') or ((os.getenv('MOONRL_CACHE') or ((os.getenv('HOME') or '') .. '/.cache/moonrl')) ..
  '/models/SmolLM2-135M-Instruct.Q4_1.gguf')
if not fs.exists((moonrl.home or '.') .. '/.venv-interop/bin/vllm') or not fs.exists(model) then
  print('skipped: needs .venv-interop/bin/vllm (./dev.sh vllm) and ' .. model .. ' (./dev.sh fetch-model)')
  os.exit(77)
end
local steps = tonumber(os.getenv('STEPS') or '20')
local dir = U.tmpdir('smollm2_vllm')

local function run(name, ...)
  local d = dir .. '/' .. name
  local t0 = moonrl.now()
  U.run_ranks(exe, 0, 'examples/grpo_smollm2.lua', { 'model.dir=' .. model, 'grpo.steps=' .. steps,
    'eval.every=' .. math.max(1, math.floor(steps / 2)), 'run.dir=' .. d, ... }, { timeout = 3600 })
  local acc = U.events(d, 'heldout_accuracy')[1]
  local recs = U.records(d)
  local sum = 0
  for _, r in ipairs(recs) do sum = sum + r['time/step'] end
  return { dir = d, acc = acc, recs = recs, step = sum / #recs, wall = moonrl.now() - t0 }
end

t.test('GRPO on SmolLM2 through vLLM learns as on moonrl\'s engine', function()
  local own = run('moonrl')
  local vllm = run('vllm', 'engine.backend=vllm', 'engine.launch=auto', 'engine.launch_timeout=600')
  for _, x in ipairs({ { 'moonrl engine', own }, { 'vllm serve', vllm } }) do
    local name, r = x[1], x[2]
    print(string.format('  %-13s held-out accuracy %.1f%% as it comes, %.1f%% before GRPO -> %.1f%% after %d steps; ' ..
      'mean step %.2f s; run %.0f s', name, 100 * r.acc.base, 100 * r.acc.before, 100 * r.acc.after, steps, r.step, r.wall))
    t.truthy(r.acc.after > r.acc.before, name .. ': the held-out accuracy rises')
  end
  print(string.format('  a GRPO step through vLLM takes %.2fx the time of one on moonrl\'s engine', vllm.step / own.step))
  local worst, syncs = 0, 0
  for i, r in ipairs(vllm.recs) do
    local samples = 0
    for k, v in pairs(r) do if k:match('^async/staleness/') then samples = samples + v end end
    t.eq(r['async/staleness/0'], samples, 'every sample of version step - 1 at step ' .. i)
    worst = math.max(worst, r['mismatch/max_abs'])
    syncs = syncs + (r['engine/sync_seconds'] or 0)
  end
  -- (bf16 on both sides: the bound of the in-process engine's own bf16 mismatch, with room)
  local own_worst = 0
  for _, r in ipairs(own.recs) do own_worst = math.max(own_worst, r['mismatch/max_abs']) end
  print(string.format('  mismatch max |trainer - engine| log-prob: vLLM %.3g, moonrl %.3g; weight sync %.1f%% of the steps',
    worst, own_worst, 100 * syncs / (vllm.step * #vllm.recs)))
  t.truthy(worst < math.max(1.0, 4 * own_worst), 'the mismatch within bound: ' .. worst)
end)

fs.remove(dir)
t.done()
