-- eval.harness: lm-evaluation-harness's tasks run against the policy as it trains, through an
-- OpenAI-compatible server on the run's own engine (moonrl.train.evaluation.harness), with a
-- stand-in for lm_eval (tests/recipes/fake_lm_eval.py: it asks for an echoed prompt's log-probs,
-- as local-completions does, and writes lm_eval's results file): the scores land in metrics.jsonl
-- as eval/harness/<task>/<metric>, every eval.harness_every steps; they are the policy's log-probs
-- at that step; a harness that fails is an event and the run goes on. (lm-eval itself:
-- tests/interop/lm_eval_check.py.)
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local U = dofile('tests/recipes/util.lua')
local train = require('moonrl.train.step')

local dir = U.tmpdir('harness')
local model_dir = U.tiny_model(dir .. '/tiny')
local recs = {}
for i, p in ipairs(U.additions(40, 3)) do recs[i] = { question = p.prompt, answer = p.answer } end
local data = U.write_jsonl(dir .. '/rl.jsonl', recs)
local FAKE = 'python3 ' .. moonrl.home .. '/tests/recipes/fake_lm_eval.py'

local function grpo(d, ...)
  return U.run_recipe('tests/recipes/grpo_sevens.lua', { 'model.dir=' .. model_dir, 'data.path=' .. data,
    'data.prompt=question', 'data.chat=false', 'reward=sevens', 'train.lr=1e-2', 'grpo.steps=4', 'grpo.prompts=4',
    'grpo.samples=4', 'grpo.max_tokens=6', 'run.threads=1', 'eval.harness=taskA,taskB', 'eval.harness_every=2',
    'eval.harness_command=' .. FAKE, 'run.dir=' .. dir .. '/' .. d, ... })
end

t.test('eval.harness: the tasks\' scores every eval.harness_every steps, on the policy of that step', function()
  local out = grpo('run')
  local recs_ = U.records(out.dir)
  t.eq(recs_[1]['eval/harness/taskA/acc'], nil, 'not at step 1')
  local a2, a4 = recs_[2]['eval/harness/taskA/acc'], recs_[4]['eval/harness/taskA/acc']
  t.truthy(type(a2) == 'number' and type(a4) == 'number', 'at steps 2 and 4')
  t.eq(recs_[2]['eval/harness/taskB/acc'], a2, 'each task')
  t.eq(recs_[2]['eval/harness/taskA/prompts'], 1)
  t.eq(recs_[2]['eval/harness/taskA/acc_stderr'], nil, 'no stderr')
  t.truthy(a2 ~= a4, 'the weights moved between them')
  -- the score is the log-likelihood of the final policy (step 4's update done before its evaluation)
  local m = moonrl.model.load(out.dir .. '/model')
  local lp = train.logprobs(m, { { prompt_ids = { 1 }, ids = { 5, 6, 7, 8 } } }, 4096, { temperature = 1.0 })
  local sum = 0
  for k = 1, 4 do sum = sum + lp[1][k] end
  t.near(a4, sum, 1e-4, 'the final policy\'s log-likelihood')
  t.truthy(require('moonrl.io.fs').exists(out.dir .. '/harness/step-2'), 'lm_eval\'s output in the run directory')
end)

t.test('a harness that fails is an event; the run goes on', function()
  local ok = pcall(function()
    local f = io.open(dir .. '/fail.sh', 'w')
    f:write('#!/bin/sh\nFAKE_LM_EVAL_EXIT=3 exec ' .. FAKE .. ' "$@"\n')
    f:close()
  end)
  t.truthy(ok)
  local out = U.run_recipe('tests/recipes/grpo_sevens.lua', { 'model.dir=' .. model_dir, 'data.path=' .. data,
    'data.prompt=question', 'data.chat=false', 'reward=sevens', 'grpo.steps=2', 'grpo.prompts=4', 'grpo.samples=4',
    'grpo.max_tokens=6', 'run.threads=1', 'eval.harness=taskA', 'eval.harness_every=1',
    'eval.harness_command=sh ' .. dir .. '/fail.sh', 'run.dir=' .. dir .. '/fails' })
  t.eq(#U.records(out.dir), 2, 'both steps')
  local ev = U.events(out.dir, 'harness_error')
  t.eq(#ev, 2)
  t.truthy(ev[1].message:find('status 3', 1, true) and ev[1].message:find('failing on purpose', 1, true), ev[1].message)
end)

require('moonrl.io.fs').remove(dir)
t.done()
