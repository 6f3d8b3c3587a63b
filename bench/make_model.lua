-- A model of bench/models.json with random weights (seed 1) and the default example's digit
-- tokenizer (examples/default), saved in Hugging Face format: the model that
-- bench/grpo/grpo_step.sh, bench/dist/dp_grpo.sh and bench/async/async_rl.lua measure.
--   moonrl run bench/make_model.lua preset=digits-small out=DIR [max_len=N] [vocab=N]
-- max_len: the model's max_position_embeddings in place of the preset's (bench/dist/cp.sh's long sequences);
-- vocab: its vocab_size (bench/dist/pp.sh's model whose head costs little: stages of even cost).
local moonrl = require('moonrl')
local preset = dofile(moonrl.home .. '/bench/models.lua')

local cfg = moonrl.config { preset = moonrl.config.required('string'), out = moonrl.config.required('string'),
  max_len = moonrl.config.integer(0, { min = 0 }), vocab = moonrl.config.integer(0, { min = 0 }) }
local over = {}
if cfg.max_len > 0 then over.max_position_embeddings = cfg.max_len end
if cfg.vocab > 0 then over.vocab_size = cfg.vocab end
local m = moonrl.model.new(preset(cfg.preset, next(over) and over or nil), { seed = 1 })
require('moonrl.train.models').save({ dir = cfg.out }, m, moonrl.home .. '/examples/default', cfg.out)
