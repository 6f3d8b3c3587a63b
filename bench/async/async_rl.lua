-- Asynchronous RL on the default task, on this machine's two cores: seconds per GRPO step and
-- seconds until the held-out accuracy first reaches a target, for
--   sync, one process, 2 threads            (the baseline)
--   sync, 1 trainer + 1 rollout rank        (1 thread each: the ranks wait for each other)
--   one_step_off, 1 trainer + 1 rollout     (generation of batch n+1 overlaps training of n)
--   async (max_staleness=2), 1 + 1
--   one_step_off, 1 + 1, async.partial=continue (requests in flight take each new version)
--   async (max_staleness=2), 1 + 1, partial=continue; and the same streamed (async.stream=true:
--     one engine for the batches in flight, no drain at a batch's end)
--   one_step_off, 1 + 1, weights by MPI broadcast (async.weights=mpi; the others: shared memory)
--   one_step_off, one process: 1 training thread + an engine thread of 1 (async.engine_threads=1)
-- Times are of the GRPO phase only (the SFT warm-up runs on the trainer alone), with the
-- held-out evaluations (grpo.eval_every) taken out.
--   build/moonrl run bench/async/async_rl.lua [target=0.8] [steps=30] [eval_every=3]
--   build/moonrl run bench/async/async_rl.lua task=grpo [steps=8]
--     the GRPO recipe instead, on bench/dist/dp_grpo.sh's small model (bench/models.json's digits-small), 16 prompts x 8
--     samples of up to 128 tokens, the 'sevens' reward: seconds per step only (no held-out set)
local moonrl = require('moonrl')
local json = require('moonrl.io.json')
local proc = require('moonrl.io.proc')
local fs = require('moonrl.io.fs')

local opt = moonrl.config { task = 'default', target = 0.8, steps = moonrl.config.integer(30),
  eval_every = moonrl.config.integer(3) }
local exe = assert(rawget(_G, 'MOONRL_EXE'))
local mpirun
for d in (os.getenv('PATH') or ''):gmatch('[^:]+') do
  if not mpirun and fs.exists(d .. '/mpirun') then mpirun = d .. '/mpirun' end
end
local root = os.tmpname()
os.remove(root)
fs.mkdirs(root)

local task_words = {}
if opt.task == 'grpo' then
  assert(proc.run({ exe, 'run', moonrl.home .. '/bench/make_model.lua', 'preset=digits-small', 'out=' .. root .. '/model' }).ok,
    'making the model')
  local out = assert(io.open(root .. '/data.jsonl', 'w'))
  for i = 1, 16 do out:write(string.format('{"prompt": "%d+%d=", "answer": "%d"}\n', 10 + i, 30 + 2 * i, 40 + 3 * i)) end
  out:close()
  task_words = { 'run', 'tests/recipes/grpo_sevens.lua', 'model.dir=' .. root .. '/model', 'data.path=' .. root .. '/data.jsonl',
    'data.chat=false', 'reward=sevens', 'grpo.prompts=16', 'grpo.samples=8', 'grpo.max_tokens=128', 'train.lr=1e-6',
    'train.micro_batch_tokens=8192' }
  opt.steps = opt.steps == 30 and 8 or opt.steps
end

local function run(name, ranks, threads, ...)
  local d = root .. '/' .. name
  local argv = {}
  if ranks > 1 then
    argv = { mpirun, '-n', tostring(ranks), '--oversubscribe', '--bind-to', 'none', '--allow-run-as-root', '--mca', 'btl',
      'vader,self' }
  end
  argv[#argv + 1] = exe
  for _, a in ipairs(task_words) do argv[#argv + 1] = a end
  local common = opt.task == 'grpo' and { 'run.dir=' .. d, 'run.threads=' .. threads, 'grpo.steps=' .. opt.steps }
    or { 'run.dir=' .. d, 'quiet=true', 'run.threads=' .. threads, 'grpo.steps=' .. opt.steps,
      'grpo.eval_every=' .. opt.eval_every }
  for _, a in ipairs(common) do argv[#argv + 1] = a end
  for _, a in ipairs({ ... }) do argv[#argv + 1] = a end
  local r = proc.run(argv, { timeout = 1200 })
  assert(r.ok, name .. ': ' .. r.stderr)
  local secs, steps, reach, final = 0, 0, nil, nil
  local first = opt.task == 'grpo' -- the first step warms up: not counted
  for line in io.lines(d .. '/metrics.jsonl') do
    local m = json.decode(line)
    if first then first = false; goto next end
    secs = secs + m['time/step'] - (m['time/eval'] or 0)
    steps = steps + 1
    local acc = m.heldout_accuracy
    if acc then
      final = acc
      if not reach and acc >= opt.target then reach = secs end
    end
    ::next::
  end
  return { name = name, per_step = secs / steps, total = secs, reach = reach, final = final }
end

local rows = {
  run('sync, 1 process x 2 threads', 1, 2),
  run('sync, 1 trainer + 1 rollout', 2, 1, 'dist.rollout_ranks=1'),
  run('one_step_off, 1 + 1', 2, 1, 'async.mode=one_step_off', 'dist.rollout_ranks=1'),
  run('async k=2, 1 + 1', 2, 1, 'async.mode=async', 'async.max_staleness=2', 'dist.rollout_ranks=1'),
  run('one_step_off, 1 + 1, continue', 2, 1, 'async.mode=one_step_off', 'async.partial=continue', 'dist.rollout_ranks=1'),
  run('async k=2, 1 + 1, continue', 2, 1, 'async.mode=async', 'async.max_staleness=2', 'async.partial=continue',
    'dist.rollout_ranks=1'),
  run('async k=2, 1 + 1, stream', 2, 1, 'async.mode=async', 'async.max_staleness=2', 'async.partial=continue',
    'async.stream=true', 'dist.rollout_ranks=1'),
  run('one_step_off, 1 + 1, MPI weights', 2, 1, 'async.mode=one_step_off', 'async.weights=mpi', 'dist.rollout_ranks=1'),
  run('one_step_off, engine thread', 1, 1, 'async.mode=one_step_off', 'async.engine_threads=1'),
}
local base, lockstep = rows[1], rows[2]
print(string.format('%-34s %8s %10s %10s %12s %8s %10s', 'run', 's/step', 'vs 1x2', 'vs 1+1', 'reach ' .. opt.target, 'x',
  'final acc'))
for _, r in ipairs(rows) do
  print(string.format('%-34s %8.3f %10.2f %10.2f %12s %8s %10.3f', r.name, r.per_step, base.per_step / r.per_step,
    lockstep.per_step / r.per_step,
    r.reach and string.format('%.1f s', r.reach) or 'never', (r.reach and base.reach) and string.format('%.2f', base.reach / r.reach) or '-',
    r.final or 0))
end
fs.remove(root)
