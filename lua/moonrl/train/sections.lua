-- moonrl.train.sections: the config sections recipes share, declared once, and the checks of
-- their values that need no model (usage errors before any work).
--
--   local sections = require('moonrl.train.sections')
--   cfg = moonrl.config { model = sections.model_config(), data = sections.data_config { prompt = 'prompt' },
--     train = sections.train_config { lr = 1e-5 }, engine = sections.engine_config(),
--     reward = sections.reward_config('math'), async = sections.async_config(), eval = sections.eval_config(),
--     moe = sections.moe_config() }
--   sections.rl_config()   -- what every RL recipe's config has (moonrl.rl merges a recipe's over it)
-- Each key's meaning is in docs/recipes.md.
local moonrl = require('moonrl')
local config = require('moonrl.config')

local M = {}

-- defaults with over's keys (a plain number keeps the default's type and range: config.over)
local function with(defaults, over)
  for k, v in pairs(over or {}) do defaults[k] = config.over(defaults[k], v) end
  return defaults
end

-- model.dtype: fp32 | bf16 | auto (moonrl.model, "precision"); model.device: cpu | cuda | cuda:N |
-- auto (moonrl.model, "the device"). session.start applies both to the policy.
-- model.lora: LoRA adapters trained instead of the whole model (rank 0: off; docs/lora.md).
function M.model_config()
  return { dir = config.required('string', 'Hugging Face model directory'),
           tokenizer = config.optional('string', 'tokenizer directory (default model.dir)'),
           dtype = 'fp32', device = 'cpu', lora = M.lora_config() }
end

function M.lora_config()
  return { rank = config.integer(0, { min = 0, max = 4096 }), alpha = config.number(32, { above = 0 }),
    targets = 'all-linear', dropout = config.number(0, { min = 0, below = 1 }),
    dir = config.optional('string', 'a PEFT adapter directory to start from (its rank, alpha and targets)'),
    save_merged = false,
    quantized_base = false } -- a .gguf model.dir's Q4_0/Q4_1/Q8_0 matrices kept as blocks (QLoRA)
end

-- The data section: path, the record fields (JSON keys) given, and on_error: 'stop' (a bad
-- record is an error naming the file and line) or 'skip' (skipped and counted in data/skipped);
-- max_record_bytes: a longer line is such a bad record, refused before it is read (decoding
-- takes several times a record's size in memory).
function M.data_config(fields)
  return with({ path = config.required('string', 'JSONL dataset'), on_error = 'stop',
    -- (at most a Lua string's longest)
    max_record_bytes = config.integer(require('moonrl.data').MAX_RECORD_BYTES, { min = 1, max = 2 ^ 31 - 1 }) }, fields)
end

-- The data section of a recipe that also learns from a task (moonrl.tasks): data.path (JSONL)
-- or data.task, with the record fields; M.check_data says when neither is given.
function M.task_data_config(fields)
  local d = M.data_config(fields)
  d.path = config.optional('string', 'JSONL dataset (or data.task)')
  d.task = config.optional('string', 'a task from moonrl.tasks instead of data.path: ' ..
    table.concat(require('moonrl.tasks').names(), ', '))
  return d
end

function M.train_config(over)
  return with({ lr = config.number(1e-6, { min = 0 }), schedule = 'constant', warmup = config.integer(0, { min = 0 }),
    weight_decay = config.number(0.0, { min = 0 }), max_grad_norm = config.number(1.0, { above = 0 }),
    micro_batch_tokens = config.integer(4096, { min = 1 }) }, over)
end

-- engine.cuda_graphs: a GPU engine replays its decode steps as CUDA graphs (moonrl.engine);
-- engine.kv_cache_dtype: auto (bf16 with model.dtype=bf16, else fp32), fp32 or bf16. The ranges
-- are the engine's own bounds (core/engine/engine.c), here to be named before the model loads.
function M.engine_config(over)
  return with({ kv_cache_mb = config.integer(512, { min = 1 }),
    max_batch_tokens = config.integer(2048, { min = 1, max = 2 ^ 24 }), max_seqs = config.integer(256, { min = 1, max = 2 ^ 20 }),
    block_size = config.integer(16, { min = 1, max = 4096 }), cuda_graphs = true, kv_cache_dtype = 'auto',
    mla_cache = 'latent', -- a deepseek_v3 model's cache: latent (the absorbed form) or expanded (moonrl.engine)
    mtp = false, -- speculative decoding with the model's multi-token prediction layer as the draft (moonrl.engine)
    pack_weights = true, -- the CPU's weight panels, a copy of the matrices (false: read in place; a quantized base never packs)
    -- rollouts on servers in other processes (moonrl.train.remote): vllm, or moonrl with urls or launch
    backend = 'moonrl', urls = config.optional('string', 'servers to generate on: http://host:port, comma-separated'),
    launch = config.optional('string', 'a server command with {port} ({model}, {name}) started engine.servers times; auto: the backend\'s'),
    servers = config.integer(1, { min = 1, max = 1024 }), request_timeout = config.number(600, { above = 0 }),
    retries = config.integer(2, { min = 0 }), launch_timeout = config.number(300, { above = 0 }),
    sync_dir = '/dev/shm', weight_sync = 'auto', sync_dtype = 'auto', bucket_mb = config.number(512, { above = 0 }),
    lora_merged = false, -- model.lora: generate from a copy with the adapters merged in (docs/lora.md)
  }, over)
end

-- The reward section: its name in the registry (`reward=math` sets it), what a failing reward
-- does (drop: its group is dropped and counted; zero: it scores 0; stop: an error), the seconds
-- each sample may take (0: no limit) and, under that limit, the samples scored at once (each in a
-- forked worker, moonrl.rewards).
function M.reward_config(name)
  return { name = name, on_error = 'drop', timeout = config.number(30.0, { min = 0 }),
    workers = config.integer(16, { min = 1 }) }
end

-- The sandbox section: how rewards that run code (reward=code) use the sandbox (docs/sandbox.md):
-- the warm pool (pool: one started Python interpreter forks each run; false: a sandbox a run),
-- runs at once (concurrency; 0: 2 a CPU), each test case's seconds (case_timeout_s), each run's
-- limits (wall_s, 0: its cases' times and 5 s; memory_mb, procs, tmpfs_mb, output_kb), network
-- (none or loopback: its own) and partial credit (the fraction of tests passed, else all or
-- nothing).
function M.sandbox_config()
  return { pool = true, concurrency = config.integer(0, { min = 0, max = 4096 }),
    case_timeout_s = config.number(2.0, { min = 0.01, max = 3600 }), wall_s = config.number(0.0, { min = 0, max = 86400 }),
    memory_mb = config.integer(512, { min = 4 }), procs = config.integer(64, { min = 1, max = 65536 }),
    tmpfs_mb = config.integer(64, { min = 1 }), output_kb = config.integer(1024, { min = 1 }), network = 'none',
    partial = false }
end

function M.check_choice(key, value, choices)
  for _, c in ipairs(choices) do if value == c then return end end
  moonrl.usage_error(string.format("config key '%s' must be one of %s, got '%s'", key, table.concat(choices, ', '),
    tostring(value)))
end

-- Usage errors before any work: an unknown data.task, or neither data.path nor data.task.
function M.check_data(cfg)
  local d, tasks = cfg.data, require('moonrl.tasks')
  if not d then return end
  if d.task ~= nil then tasks.check(d.task, 'data.task')
  elseif d.path == nil then
    moonrl.usage_error(string.format("config key 'data.path' (string) is required: pass data.path=... or data.task=NAME " ..
      '(tasks: %s)', table.concat(tasks.names(), ', ')))
  end
end

-- The counts of a step against the memory, before any work: a step holds `count` sequences of up
-- to `tokens` tokens each in Lua (token ids, log-probs, masks: M.SEQUENCE_BYTES and M.TOKEN_BYTES
-- each, a low estimate), and a count that needs more than the memory available is a usage error
-- naming key (grpo.prompts=1e9 once ran to 3.1 GB before "not enough memory").
M.TOKEN_BYTES, M.SEQUENCE_BYTES = 16, 1024
function M.check_batch_memory(key, count, tokens)
  local need = count * (tokens * M.TOKEN_BYTES + M.SEQUENCE_BYTES)
  local avail = tonumber(moonrl.C.mrl_mem_available())
  if avail > 0 and need > avail then
    local bytes = require('moonrl.io.progress').bytes
    moonrl.usage_error(string.format("config key '%s': a step would hold %.0f sequences of up to %d tokens, about %s, " ..
      'more than the %s of memory available', key, count, tokens, bytes(need), bytes(avail)))
  end
end

-- The reward by name, looked up now: a wrong name is a usage error listing the rewards.
function M.check_reward(cfg)
  if type(cfg.reward) ~= 'table' then return end
  local ok, err = pcall(require('moonrl.rewards').get, cfg.reward.name)
  if not ok then moonrl.usage_error('reward: ' .. moonrl.error_text(err)) end
end

-- async: where and when the rollouts run (moonrl.train.rollout), every RL recipe's and the default
-- example's.
function M.async_config()
  return {
    mode = 'sync',                      -- sync | one_step_off | async
    max_staleness = config.integer(1, { min = 0 }), -- versions a sample may lag the weights it trains (async: the queue depth)
    stale = 'drop',                     -- a staler sample: drop, or downweight (advantage * stale_weight)
    stale_weight = config.number(0.5, { min = 0, max = 1 }),
    -- off-policy corrections on the engine's log-probs (moonrl.algo.correction)
    correction = 'auto',                -- auto (tis off-policy, none in sync) | none | tis | tis_seq | mis_token | mis_seq | mis_geo
    correction_clip = config.number(2.0, { above = 0 }), -- C of truncated importance sampling
    correction_lower = config.number(0.0, { min = 0 }), -- MIS bounds (0: the defaults, 1/upper and 2 (1.01 geometric))
    correction_upper = config.number(0.0, { min = 0 }),
    -- AReaL's decoupled PPO (proximal policy = the trainer before the update): auto (on in
    -- async mode, where samples lag up to max_staleness versions; one_step_off keeps the tis
    -- correction alone) | true | false
    decoupled = 'auto',
    -- in-flight requests when a new version is published: finish with the weights they started
    -- with (the fixed schedule: deterministic) | continue with the new ones from the next token
    -- (PipelineRL: their KV cache kept as it is; each token's version recorded); the latter needs
    -- rollout ranks on trainer rank 0's host, or engine_threads
    partial = 'finish',
    -- rollout ranks: one engine for every batch in flight, never reset: a batch's requests are
    -- queued as soon as the staleness bound allows (up to max_staleness + 1 batches at once)
    -- and each batch goes to the trainers when its last group is done, while the others go on
    -- (AReaL-style streaming, with partial=continue); false: a batch at a time
    stream = false,
    -- what a stream hands the trainers: 'batch' (each batch the prompts it drew, when its last
    -- group is done) | 'group' (one rollout rank: each group is drawn, generated and scored on
    -- its own, and a batch is the first groups to finish: AReaL's streaming; a slow group lands
    -- in a later batch, staler)
    stream_unit = 'batch',
    weights = 'auto',                   -- rollout ranks get weights: auto (shared memory on trainer 0's host, else MPI) | shm | mpi
    -- rollout ranks in bf16 (model.dtype=bf16), by MPI: after a version, send only the elements
    -- whose bf16 value changed (positions and values), a whole version every full_sync_every
    -- versions and after a checksum that differs
    weights_delta = false,
    full_sync_every = config.integer(10, { min = 1 }),
    engine_threads = config.integer(0, { min = 0, max = 1024 }), -- one process: N >= 1 generates the next batch on an engine thread of N threads
                                        -- while this step trains (run.threads for training); 0: between steps
    behav_cap = config.number(0.0, { min = 0 }), -- decoupled: cap of the behaviour weight π_prox/μ (0: none)
  }
end

-- How many batches ahead of training the rollouts run (the staleness of a batch).
function M.lag(cfg)
  local a = cfg.async
  if not a or a.mode == 'sync' then return 0 end
  if a.mode == 'one_step_off' then return 1 end
  return a.max_staleness
end

-- Whether the policy loss is AReaL's decoupled PPO. auto: in async mode, where the truncated
-- importance weights on the engine's log-probs alone kept less of the sync run's gain on the
-- default example than decoupled PPO did (bench/RESULTS.md, "Async RL"; docs/distributed.md).
function M.decoupled(cfg)
  local d = cfg.async and cfg.async.decoupled
  if d == 'auto' then return cfg.async.mode == 'async' end
  return d == 'true' or d == true
end

-- Whether the config asks for held-out evaluations (eval.every > 0): moonrl.train.evaluation's
-- wanted, and the session's check that a pipeline stage (no engine) is not asked for them.
function M.eval_wanted(cfg) return cfg.eval ~= nil and cfg.eval.every > 0 end

-- eval: held-out accuracy (moonrl.train.evaluation). every: steps between evaluations (0: off); data / task: the held-out set (see the top);
-- prompts: at most this many (0: all); max_tokens: the answer's budget (0: the recipe's).
function M.eval_config()
  return { every = config.integer(0, { min = 0 }), data = config.optional('string', 'held-out JSONL (data.* fields)'),
    task = config.optional('string', 'a task whose held-out split is evaluated'), prompts = config.integer(0, { min = 0 }),
    max_tokens = config.integer(0, { min = 0 }),
    -- lm-evaluation-harness against the policy as it trains (moonrl.train.evaluation.harness)
    harness = config.optional('string', 'lm-evaluation-harness tasks (comma-separated) run against the policy'),
    harness_every = config.integer(0, { min = 0 }),
    harness_command = config.optional('string', 'the lm_eval program (default: the interop virtualenv\'s, else lm_eval)'),
    harness_include = config.optional('string', 'a directory of task files (lm_eval --include_path)'),
    harness_limit = config.integer(0, { min = 0 }), harness_timeout = config.number(3600, { above = 0 }) }
end

-- The keys an RL recipe's own section (grpo.*, ppo.*, rlvr.*, the default example's grpo.*) may
-- declare, with their types and ranges, declared once here: moonrl.rl gives each key a recipe's
-- section has this type and range (the default stays the recipe's: config.over). A key of one
-- recipe alone (ppo.gamma) has its range where that recipe declares it.
local ALGORITHM_KEYS = {
  steps = config.integer(nil, { min = 0 }), prompts = config.integer(nil, { min = 1 }),
  samples = config.integer(nil, { min = 1 }), max_tokens = config.integer(nil, { min = 1 }),
  temperature = config.number(nil, { above = 0 }), top_p = config.number(nil, { above = 0, max = 1 }),
  top_k = config.integer(nil, { min = 0 }), epochs = config.integer(nil, { min = 1 }),
  clip = config.number(nil, { min = 0, below = 1 }), clip_low = config.number(nil, { min = 0, below = 1 }),
  clip_high = config.number(nil, { min = 0 }), kl_coef = config.number(nil, { min = 0 }),
}

function M.typed_algorithm(section)
  for k, v in pairs(section or {}) do
    if ALGORITHM_KEYS[k] then section[k] = config.over(ALGORITHM_KEYS[k], v) end
  end
  return section
end

-- The keys a resumed run may change (an evaluation changes no state the run resumes from).
M.EVAL_KEYS = { 'eval.every', 'eval.data', 'eval.task', 'eval.prompts', 'eval.max_tokens' }

-- What every RL recipe's config has (moonrl.rl merges a recipe's config over it).
function M.rl_config()
  return {
    model = M.model_config(),
    data = M.task_data_config { prompt = 'prompt', answer = 'answer', chat = true, system = '' },
    reward = M.reward_config('math'), -- a name in the reward registry (moonrl.rewards), or FILE.lua:NAME
    sandbox = M.sandbox_config(), -- (reward=code's runs)
    env = M.env_config(), -- multi-turn episodes (env=NAME)
    agent = M.agent_config(), -- episodes played by agent programs (agent.command)
    reward_model = { dir = config.optional('string', 'a ...ForSequenceClassification checkpoint (reward=reward_model)') },
    train = M.train_config { lr = 1e-6 },
    engine = M.engine_config(),
    async = M.async_config(),
    eval = M.eval_config(),
    moe = M.moe_config(),
    save = true,
  }
end

-- What every supervised recipe's config has (moonrl.rl's rl.supervised merges a recipe's over it):
-- the evaluation judges held-out answers with the reward (exact by default), on an engine made only
-- when eval.every > 0; moe.expert_parallel splits a qwen3_moe policy's experts over the ranks.
function M.supervised_config()
  return {
    model = M.model_config(),
    data = M.task_data_config { chat = false }, -- chat: wrap the prompt in the model's chat template
    train = M.train_config { steps = config.integer(100, { min = 0 }), lr = 1e-5, max_length = config.integer(1024, { min = 2 }) },
    eval = M.eval_config(),
    reward = M.reward_config('exact'),
    sandbox = M.sandbox_config(), -- (the evaluation's reward=code)
    engine = M.engine_config { kv_cache_mb = 128 },
    moe = { expert_parallel = false },
    save = true,
    quiet = false, -- no step lines
  }
end

-- env: multi-turn episodes (moonrl.env, moonrl.train.episodes). name: the environment (env=NAME, or
-- FILE.lua:NAME; unset: single-turn rollouts); tools: the tools offered (comma-separated; default the
-- environment's own); the limits of an episode: max_turns (model turns), max_tokens (its tokens after
-- the first prompt, the model's and the environment's), max_seconds (its clock, 0: none),
-- max_step_seconds (an environment step that pauses past it ends the episode, 0: none);
-- concurrency: environment calls in flight at once; extension: keep | split (when the template's
-- rendering of the conversation is not the episode's tokens: go on with the exact tokens, or
-- start a new sample from the rendering); tool_format: auto | hermes | llama3 (how tool calls are
-- written); template: chat (the model's chat template, with data.chat) | plain (the messages'
-- contents one after another: tokenizers without a template); enable_thinking: the template
-- variable of that name (Qwen3's), when set; credit: episode (one advantage an episode, the
-- section's estimator over the episodes' scores) | turn (each turn its discounted return from it,
-- normalised against the same turn of the group: moonrl.rl's turn_advantages); discount: the
-- per-turn discount of credit=turn.
function M.env_config()
  return { name = config.optional('string', 'an environment (moonrl.env) or FILE.lua:NAME: multi-turn episodes'),
    tools = config.optional('string', 'the tools offered, comma-separated (default: the environment\'s)'),
    max_turns = config.integer(8, { min = 1 }), max_tokens = config.integer(1024, { min = 1 }),
    max_seconds = config.number(0, { min = 0 }), max_step_seconds = config.number(60, { min = 0 }),
    concurrency = config.integer(64, { min = 1 }), extension = 'keep', tool_format = 'auto', template = 'chat',
    enable_thinking = config.optional('boolean', 'the chat template\'s enable_thinking (Qwen3): unset, the template\'s default'),
    credit = 'episode', discount = config.number(1.0, { min = 0, max = 1 }) }
end

-- agent: episodes played by agent programs in any language through an OpenAI-compatible server
-- in training mode (moonrl.train.agents). command: run by /bin/sh once an episode (unset: none),
-- or workers (> 0) times a rollout, each playing the episodes it asks for; concurrency: episodes
-- at once; max_seconds: an episode's time (its agent killed past it, the episode failed).
function M.agent_config()
  return { command = config.optional('string', 'an agent program run once an episode (OPENAI_BASE_URL, OPENAI_API_KEY set)'),
    concurrency = config.integer(16, { min = 1 }), workers = config.integer(0, { min = 0 }),
    max_seconds = config.number(300, { above = 0 }) }
end

-- The env section checked at start-up (names, choices): nil when no environment is asked for.
function M.check_env(cfg)
  local e = cfg.env
  if cfg.agent and cfg.agent.command then
    if e and e.name then moonrl.usage_error("config keys 'env.name' and 'agent.command': one of them (an environment in Lua, or agent programs)") end
    if cfg.async and cfg.async.stream then
      moonrl.usage_error("config key 'async.stream': agent programs (agent.command) run on their own server loop, not in a stream")
    end
    return nil
  end
  if not (e and e.name) then return nil end
  local def = require('moonrl.env').check(e.name, 'env.name')
  local choices = { extension = { keep = true, split = true }, tool_format = { auto = true, hermes = true, llama3 = true },
    template = { chat = true, plain = true }, credit = { episode = true, turn = true } }
  for key, ok in pairs(choices) do
    if not ok[e[key]] then
      local list = {}
      for k in pairs(ok) do list[#list + 1] = k end
      table.sort(list)
      moonrl.usage_error(string.format("config key 'env.%s': '%s' is not one of %s", key, tostring(e[key]),
        table.concat(list, ', ')))
    end
  end
  if e.tools then
    local tools = require('moonrl.tools')
    for name in e.tools:gmatch('[^,%s]+') do
      local ok, err = pcall(tools.get, name)
      if not ok then moonrl.usage_error("config key 'env.tools': " .. moonrl.error_text(err)) end
    end
  end
  if cfg.async and cfg.async.stream then
    moonrl.usage_error("config key 'async.stream': multi-turn episodes (env.name) run turn by turn on their own engine loop, not in a stream")
  end
  return def
end

-- moe (a qwen3_moe policy): routing_replay: the engine records the experts each token went to
-- and the update's forwards replay them (R3: the trainer runs the experts the tokens were sampled
-- with, its router's weights still trained; model.h, mrl_batch.routing); aux_loss_coef: the
-- load-balancing loss's coefficient in the backward (default: the model config's
-- router_aux_loss_coef when its output_router_logits is set, else 0, as Transformers; 0 turns it
-- off). Both are logged every step under moe/ (aux_loss, aux_coef, replayed, routing_mismatch).
-- expert_parallel: the trainer ranks (under dist.tp: the data-parallel groups) split every sparse
-- layer's experts between them, each running its block on all the ranks' tokens (model.h,
-- mrl_model_set_expert_parallel; a rank keeps all its weights, so the engine, checkpoints and
-- saving are as without; one rank: no-op).
function M.moe_config()
  return { routing_replay = false, expert_parallel = false,
    aux_loss_coef = config.optional('number', 'load-balancing loss coefficient (default: the model config)', { min = 0 }) }
end

return M
