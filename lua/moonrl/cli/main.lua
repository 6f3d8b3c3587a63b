-- The `moonrl` command line, called by core/cli/main.c with argv[1..].
-- Returns the process exit status: 0 success, 1 a failure in the recipe,
-- 2 a usage error (missing file, bad config), 128+signal when stopped by a
-- signal, 124 when stopped by the run's deadline.
local moonrl = require('moonrl')
local ffi = require('ffi')

local M = {}

local HELP = [[
moonrl - reinforcement-learning post-training of LLMs: a C core, recipes in Lua

usage:
  moonrl [key=value ...]            run the embedded default example (with config overrides)
  moonrl run RECIPE [key=value ...] run a recipe (a .lua file, or a name in recipes/)
  moonrl run RECIPE --show-config   list the recipe's config keys and defaults
  moonrl run RECIPE --require FILE.lua ...  run FILE.lua first (its rewards, losses, advantage
                                    estimators, tasks: moonrl.registry), its directory on the
                                    module path; reward=FILE.lua:NAME takes one reward from a file
  moonrl run --from RUN_DIR [k=v ...]  that run again (its recipe, words and inputs, checked
                                    unchanged; manifest.json) into RUN_DIR-rerun or run.dir; it
                                    runs RUN_DIR's copy of the recipe: code outside RUN_DIR and
                                    moonrl runs only when named again (RECIPE, --require F)
  moonrl run --restarts N RECIPE ...  supervise: restart a crashed or hung run from its latest
                                    checkpoint, N times at most (--backoff S, --kill-grace S)
  moonrl launch -n N [--restarts K] RECIPE [key=value ...]
                                    N ranks on this machine through mpirun (data parallel); the
                                    same recipe runs under `mpirun -n N moonrl run ...` and `srun`
  moonrl status RUN_DIR             a run's step, rate, ETA, phase, last metrics and ranks
                                    (while it runs, from another terminal)
  moonrl trace merge RUN_DIR [-o F] one trace.json from the timelines a failed job's ranks left
  moonrl version                    version, git revision, backends, CPU features
  moonrl help                       this text
  moonrl COMMAND ...                another command from lua/moonrl/cmd/ (%s)

Config keys are dotted paths into the recipe's config table (model.dir=...,
run.seed=3); each value is parsed with the type of its default. Every recipe
also has run.seed, run.dir, run.max_seconds, run.threads, run.log_level, the
checkpoint keys (run.resume=auto|never|PATH, run.checkpoint_every,
run.checkpoint_minutes, run.keep_checkpoints, run.checkpoint_errors) and the
guards (guard.*).

exit status: 0 done, 1 error, 2 usage error, 3 the guards gave up,
124 run.max_seconds, 130 SIGINT, 143 SIGTERM.

environment: MOONRL_HOME (where lua/, recipes/, plugins/ live), MOONRL_THREADS,
MOONRL_LOG (error, warn, info, debug, trace), MOONRL_PROGRESS (auto, live, plain,
off) and MOONRL_PROGRESS_SECONDS (progress on stderr; run.progress and
run.progress_seconds in a run), MOONRL_FAULT (fault injection for tests, see
lua/moonrl/train/fault.lua)
]]

-- Error lines name the rank in a job of several (mrl_log_set_rank).
local function eprint(msg) io.stderr:write('moonrl', ffi.string(moonrl.C.mrl_log_rank_tag()), ': ', msg, '\n') end

local function file_exists(path)
  local f = require('moonrl.io.fs').open(path) -- (a regular file: a FIFO there would block the open)
  if f then f:close() return true end
  return false
end

local function extra_commands()
  local names = {}
  local ok, list = pcall(require('moonrl.io.fs').list, moonrl.home .. '/lua/moonrl/cmd')
  for _, file in ipairs(ok and list or {}) do
    local n = file:match('^(.-)%.lua$')
    if n then names[#names + 1] = n end
  end
  return names
end

local function print_version()
  local v = moonrl.version()
  print(string.format('moonrl %s (git %s)', v.version, v.git))
  print('backends: ' .. v.backends)
  if v.cuda_built then -- the model, its training step and the engine (model.device=cuda); tests/gpu/run.sh on a GPU
    print(string.format('cuda: built (model.device=cuda: training step and engine, cuBLASLt; checked against the CPU ' ..
      'on an emulated GPU, tests/gpu/emu), %d device(s) visible', v.cuda_devices))
  end
  print('cpu features: ' .. v.cpu_features)
  print(string.format('cpu kernels: built for %s; using %s on this CPU', v.kernels_built, v.kernels))
  print('bf16 products: ' .. ffi.string(moonrl.C.mrl_bf16_products()) .. string.format(
    ' (model.dtype: fp32 by default; bf16 computes with these; auto is %s on this CPU for models of ' ..
    'hidden size >= %d, fp32 below)', moonrl.model.resolve_dtype('auto'), moonrl.model.BF16_MIN_HIDDEN))
  print('fp32 products: ' .. ffi.string(moonrl.C.mrl_fp32_products()) ..
    ' (MOONRL_FP32_GEMM=openblas|onednn overrides; moonrl doctor says whether they match the CPU)')
  print('threads: ' .. v.threads)
  print('luajit: ' .. (jit and jit.version or '?'))
  print('home: ' .. moonrl.home)
end

-- Find a recipe: a path as given, else recipes/NAME(.lua) under the home.
local function find_recipe(name)
  if file_exists(name) then return name end
  for _, cand in ipairs({ moonrl.home .. '/recipes/' .. name, moonrl.home .. '/recipes/' .. name .. '.lua' }) do
    if file_exists(cand) then return cand end
  end
  return nil
end

-- Run a loaded chunk as the recipe, mapping every way it can end to an exit
-- status and one clear message.
-- requires: the files of --require FILE.lua, run first (moonrl.registry.require_file: their
-- directory on package.path; a missing file or an error in one is a usage error naming it).
-- --show-config with model.dir and model.lora.rank given: the adapters' trainable share (from the
-- model's config alone), or why it cannot be counted.
local function show_lora(config, declared)
  local ok, cfg = pcall(config.merge, declared or {}, config.overrides or {})
  local l = ok and type(cfg.model) == 'table' and cfg.model.lora
  if type(l) ~= 'table' or (l.rank or 0) <= 0 or not cfg.model.dir then return end
  local lok, line = pcall(function() -- (a .gguf file: its converted directory)
    return require('moonrl.model').lora_share(require('moonrl.io.gguf').resolve(cfg.model.dir),
      { rank = l.rank, alpha = l.alpha, targets = l.targets })
  end)
  print(lok and line or ('model.lora: ' .. moonrl.error_text(line)))
end

local function run_chunk(chunk, label, overrides, show_config, requires)
  if requires and #requires > 0 then
    local recipe = chunk
    chunk = function(...)
      for _, f in ipairs(requires) do require('moonrl.registry').require_file(f) end
      return recipe(...)
    end
  end
  local config = require('moonrl.config')
  config.overrides = overrides
  config.consumed = false
  config.show_only = show_config
  moonrl.C.mrl_signals_install()
  local traceback
  local ok, err = xpcall(chunk, function(e)
    if type(e) == 'table' then return e end
    traceback = debug.traceback(tostring(e), 2)
    return e
  end)
  -- a session saves what it can (a checkpoint, the model on a clean stop) and closes its files
  moonrl.run_exit_hooks(ok, err)
  require('moonrl.train.dist').shutdown(ok)
  if ok then
    if not config.consumed and (#overrides > 0 or show_config) then
      eprint(string.format("error: %s declares no config (moonrl.config{...}), so '%s' cannot be set",
        label, overrides[1] and overrides[1].key or '--show-config'))
      return 2
    end
    return type(err) == 'number' and err or 0 -- a command's main may return its exit status
  end
  if type(err) == 'table' and err.show_config then
    show_lora(config, err.declared)
    return 0
  end
  if moonrl.is_usage_error(err) then
    eprint('error: ' .. err.message)
    return 2
  end
  if moonrl.is_run_error(err) then
    eprint('error: ' .. err.message)
    return 1
  end
  -- run.memory_budget_mb refused an allocation after start-up (the optimizer's state, a step's
  -- activations): the config's error as at start-up, one line and exit 2, not a traceback
  if type(err) == 'string' and err:find('past run.memory_budget_mb', 1, true) then
    eprint('error: ' .. moonrl.error_text(err))
    return 2
  end
  if require('moonrl.train.guard').is_guard_stop(err) then
    eprint('error: ' .. err.message)
    return 3
  end
  if moonrl.is_stop_request(err) then
    eprint(string.format('stopped (%s) at a safe point', err.reason))
    if err.code > 0 then return 128 + err.code end
    return 124
  end
  io.stderr:write('moonrl', ffi.string(moonrl.C.mrl_log_rank_tag()), ': error in ', label, ': ', traceback or tostring(err), '\n')
  return 1
end

-- `moonrl run` flags of the supervisor (moonrl.cli.supervisor), each with a number.
local SUPERVISOR_FLAGS = { ['--restarts'] = 'restarts', ['--backoff'] = 'backoff', ['--kill-grace'] = 'kill_grace' }

local function cmd_run(args)
  local name, words, show_config, sup, from, requires = nil, {}, false, {}, nil, {}
  local i = 1
  while i <= #args do
    local a = args[i]
    local flag = SUPERVISOR_FLAGS[a]
    if a == '--show-config' then show_config = true
    elseif a == '--from' then -- a run directory's recipe and words again (moonrl.train.manifest)
      from = args[i + 1]
      if not from then eprint('error: --from expects a run directory') return 2 end
      i = i + 1
    elseif a == '-h' or a == '--help' then name = nil; break
    elseif a == '--require' or a:match('^%-%-require=') then -- user Lua run before the recipe
      local f = a:match('^%-%-require=(.+)$') or args[i + 1]
      if not f then eprint('error: --require expects a Lua file') return 2 end
      if a == '--require' then i = i + 1 end
      requires[#requires + 1] = f
    elseif flag then
      local v = tonumber(args[i + 1])
      if not v or not (v >= 0 and v < math.huge) or (flag == 'restarts' and v ~= math.floor(v)) then -- (1e309: inf)
        eprint(string.format('error: %s expects a %s >= 0, got %s', a, flag == 'restarts' and 'whole number' or 'number',
          tostring(args[i + 1])))
        return 2
      end
      sup[flag] = v
      i = i + 1
    elseif not name and not a:match('^[%w_%.%-]+=') then name = a
    else words[#words + 1] = a end
    i = i + 1
  end
  if from then
    -- the run's own copy of its recipe, or the recipe and --require files named here (the code
    -- --from runs outside the directory must be named: moonrl.train.manifest, "What --from trusts")
    local named = { recipe = name and find_recipe(name), requires = requires }
    if name and not named.recipe then
      eprint(string.format("error: recipe '%s' not found (no such file, and no recipes/%s.lua)", name, name))
      return 2
    end
    local ok, rpath, rwords, _, rrequires = pcall(require('moonrl.train.manifest').rerun_command, from, words, named)
    if not ok then
      eprint('error: ' .. moonrl.error_text(rpath))
      return 2
    end
    name, words, requires = rpath, rwords, rrequires -- (its --require files, then any others named here)
    if type(name) == 'table' then -- the embedded default example
      require('moonrl.train.manifest').command = { embedded = 'default', words = words, requires = requires }
      local ok2, overrides = pcall(require('moonrl.config').parse_overrides, words)
      if not ok2 then eprint('error: ' .. tostring(overrides)) return 2 end
      return run_chunk(package.preload['moonrl.default_example'], 'examples/default.lua', overrides, show_config, requires)
    end
  end
  if not name then
    eprint('usage: moonrl run [--restarts N] RECIPE [key=value ...] [--show-config]\n' ..
      '       moonrl run --from RUN_DIR [key=value ...]   (that run again: moonrl.train.manifest)')
    return 2
  end
  local path = find_recipe(name)
  if not path then
    eprint(string.format("error: recipe '%s' not found (no such file, and no recipes/%s.lua)", name, name))
    return 2
  end
  if sup.restarts and not show_config then
    local child_words = { name }
    for _, f in ipairs(requires) do child_words[#child_words + 1] = '--require=' .. f end
    for _, w in ipairs(words) do child_words[#child_words + 1] = w end
    local ok, status = pcall(require('moonrl.cli.supervisor').run, child_words, { restarts = sup.restarts,
      backoff = sup.backoff, kill_grace = sup.kill_grace, recipe = path })
    if ok then return status end
    if moonrl.is_usage_error(status) then eprint('error: ' .. status.message) return 2 end
    eprint('supervisor error: ' .. tostring(status))
    return 1
  end
  local chunk, err = loadfile(path)
  if not chunk then
    eprint('error: ' .. tostring(err))
    return 2
  end
  local ok, overrides = pcall(require('moonrl.config').parse_overrides, words)
  if not ok then
    eprint('error: ' .. tostring(overrides))
    return 2
  end
  arg = { [0] = path }
  local abs = path:sub(1, 1) == '/' and path or ((os.getenv('PWD') or '.') .. '/' .. path)
  require('moonrl.train.manifest').command = { recipe = abs, words = words, requires = requires }
  return run_chunk(chunk, path, overrides, show_config, requires)
end

function M.main(args)
  local cmd = args[1]
  local requires = {}
  while args[1] == '--require' or (args[1] or ''):match('^%-%-require=') do -- `moonrl --require F.lua [k=v ...]`
    local a = table.remove(args, 1)
    requires[#requires + 1] = a:match('^%-%-require=(.+)$') or table.remove(args, 1)
    if not requires[#requires] then eprint('error: --require expects a Lua file') return 2 end
    cmd = args[1]
  end
  if cmd == nil or cmd:match('^[%w_%.%-]+=') then
    -- the default example, with key=value overrides if any (`moonrl grpo.steps=60`)
    local ok, overrides = pcall(require('moonrl.config').parse_overrides, args)
    if not ok then
      eprint('error: ' .. tostring(overrides))
      return 2
    end
    local chunk = package.preload['moonrl.default_example']
    require('moonrl.train.manifest').command = { embedded = 'default', words = args, requires = requires }
    return run_chunk(chunk, 'examples/default.lua', overrides, false, requires)
  end
  if #requires > 0 and cmd ~= 'run' then
    eprint('error: --require goes with `moonrl run RECIPE --require FILE.lua` (or before key=value words)')
    return 2
  end
  if cmd == 'help' or cmd == '--help' or cmd == '-h' then
    io.stdout:write(string.format(HELP, table.concat(extra_commands(), ', ')))
    return 0
  end
  if cmd == 'version' or cmd == '--version' then
    print_version()
    return 0
  end
  local rest = {}
  for i = 2, #args do rest[#rest + 1] = args[i] end
  for k = #requires, 1, -1 do table.insert(rest, 1, '--require=' .. requires[k]) end -- `moonrl --require F run ...`
  if cmd == 'run' then return cmd_run(rest) end
  if cmd == 'launch' then return require('moonrl.cmd.launch').main(rest) end
  if cmd:match('%.lua$') then return cmd_run(args) end
  if cmd:match('^[%w_]+$') and file_exists(moonrl.home .. '/lua/moonrl/cmd/' .. cmd .. '.lua') then
    local mod = require('moonrl.cmd.' .. cmd)
    return run_chunk(function() return mod.main(rest) end, 'moonrl ' .. cmd, {}, false)
  end
  eprint(string.format("error: unknown command '%s' (try 'moonrl help')", cmd))
  return 2
end

return M
