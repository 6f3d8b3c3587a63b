-- moonrl.recipe: the names recipes written before the library's training stack was split up
-- used (R.start, R.pack, R.policy_step, R.model_config, ...), kept for them. Nothing in moonrl
-- uses this module; new code requires what it uses:
--   moonrl.batch              samples and the packed batch (pack, micro_batches, gather, ...)
--   moonrl.train.session      the run's session (start; S:steps, S:log, S:finish)
--   moonrl.train.step         the update step (policy_step, sft_step, supervised_step, logprobs)
--   moonrl.train.sections     the config sections recipes share (model_config, ...)
--   moonrl.train.models       loading, copying, saving models (load, clone, critic_from, adamw, save)
--   moonrl.train.prompts      text to token ids, datasets (prompt_ids, completion_ids, open_data)
--   moonrl.train.metrics      the figures of samples (stats, reward_metrics, length_metrics)
--   moonrl.train.threads      run.threads=auto
local M = {}
for _, name in ipairs({ 'moonrl.batch', 'moonrl.train.step', 'moonrl.train.sections', 'moonrl.train.models',
    'moonrl.train.prompts', 'moonrl.train.metrics', 'moonrl.train.threads' }) do
  for k, v in pairs(require(name)) do
    if type(v) == 'function' then M[k] = v end
  end
end
M.start = require('moonrl.train.session').start
function M.finish(S) return S:finish() end -- (S:finish says where the run directory is)
return M
