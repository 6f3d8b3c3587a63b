-- The seeds of the checkpoint targets (called by tests/fuzz/make_seeds.py): the files of a real
-- checkpoint, written by the session the targets resume (tests/fuzz/targets.lua).
--   moonrl run tests/fuzz/make_seeds.lua corpus=tests/fuzz/corpus
local moonrl = require('moonrl')
local cfg = moonrl.config { corpus = moonrl.config.required('string') }
local fs = require('moonrl.io.fs')
local targets = dofile('tests/fuzz/targets.lua')
targets.checkpoint.setup()
local dir = targets.resume_dir
for _, t in ipairs({ 'checkpoint', 'manifest' }) do fs.mkdirs(cfg.corpus .. '/' .. t) end
fs.write(cfg.corpus .. '/checkpoint/gen-state-run', fs.read(dir .. '/state.json') .. targets.SEPARATOR ..
  fs.read(dir .. '/run.json'))
fs.write(cfg.corpus .. '/checkpoint/gen-state-only', fs.read(dir .. '/state.json'))
fs.write(cfg.corpus .. '/manifest/gen-manifest.json', fs.read(dir .. '/manifest.json'))
targets.checkpoint.teardown()
