-- Multi-turn episodes: generation throughput with tool calls that take 0.1-1 s, and the cost of
-- agent programs through the training server.
--   1. moonrl.train.episodes (the engine decodes the other episodes while a tool runs, each
--      episode's next turn starts when its tool returns) against the same episodes run turn by
--      turn in lockstep (every episode's turn generated, then every tool call at once, the next
--      turn after the slowest: a batch generate loop with the tools gathered, as multi-turn
--      rollouts without overlap run), on the same engine with its prefix cache, the same tool
--      times (drawn from the seed) and the same tokens (no end token: every turn max_tokens long).
--   2. the same episodes without tool time, in-process (an environment in Lua) against agent
--      programs (moonrl.train.agents: a `python3` of the standard library an episode, or two
--      such programs as workers (agent.workers=2) playing every episode on threads, its turns
--      over HTTP to the training server), the same turns and tokens.
--   MOONRL_THREADS=1 build/moonrl run bench/agents/overlap.lua [episodes=32] [turns=4] [tokens=32] [rounds=2]
-- The figures: seconds, and generated tokens a second, of each side in each round, and the ratios.
local moonrl = require('moonrl')
local env = require('moonrl.env')
local episodes = require('moonrl.train.episodes')
local agents = require('moonrl.train.agents')
local rng_mod = require('moonrl.rng')
local fs = require('moonrl.io.fs')

local cfg = moonrl.config { episodes = moonrl.config.integer(32, { min = 1 }), turns = moonrl.config.integer(4, { min = 1 }),
  tokens = moonrl.config.integer(32, { min = 1 }), rounds = moonrl.config.integer(2, { min = 1 }),
  group = moonrl.config.integer(4, { min = 1 }) }
local E, TURNS, TOK, G = cfg.episodes, cfg.turns, cfg.tokens, cfg.group

local tok = moonrl.tokenizer.load('examples/agent')
local model = moonrl.model.new({ model_type = 'llama', vocab_size = tok.vocab_size, hidden_size = 256,
  intermediate_size = 768, num_hidden_layers = 4, num_attention_heads = 4, num_key_value_heads = 2,
  max_position_embeddings = 1024, tie_word_embeddings = true, bos_token_id = 1, eos_token_id = 2 }, { seed = 1 })
local engine = moonrl.engine.new(model, { kv_cache_bytes = 256 * 2 ^ 20, seed = 1 })
local sampling = { temperature = 1.0, max_tokens = TOK, eos_ids = {} }

local records = {}
for i = 1, math.floor(E / G) do records[i] = { prompt = i .. '*' .. i .. '=', prompt_index = i - 1 } end
for _, r in ipairs(records) do r.prompt_ids = tok:encode(r.prompt) end

-- each tool call's seconds, by (episode, turn): drawn once, the same for both sides
local draw = rng_mod.new(7)
local seconds = {}
for e = 1, #records * G do
  seconds[e] = {}
  for k = 1, TURNS do seconds[e][k] = 0.1 + 0.9 * draw:int(1001) / 1000 end
end
local function episode_index(ep) return (ep.record.prompt_index) * G + ep.index + 1 end

-- the tool: waits its seconds, giving way (env.pause) as a tool polling a process would
env.register('bench_tool', {
  reset = function(_, r) return { { role = 'user', content = r.prompt } } end,
  step = function(ep, turn)
    local t_end = moonrl.now() + seconds[episode_index(ep)][turn.n]
    while moonrl.now() < t_end do env.pause() end
    return { { role = 'tool', content = '7=' } }, nil, turn.n >= TURNS
  end })
env.register('bench_no_tool', {
  reset = function(_, r) return { { role = 'user', content = r.prompt } } end,
  step = function(_, turn) return { { role = 'tool', content = '7=' } }, nil, turn.n >= TURNS end })

local function overlapped(name)
  local t0 = moonrl.now()
  local samples = episodes.run({ engine = engine, tok = tok, env = env.get(name), records = records, group = G,
    sampling = sampling, step = 1, seed = 1, concurrency = 1000, limits = { max_turns = TURNS, max_tokens = 100000 } })
  local n = 0
  for _, s in ipairs(samples) do for _, m in ipairs(s.loss_mask) do n = n + m end end
  return moonrl.now() - t0, n
end

-- lockstep: every live episode's turn (one request each, on the engine's prefix cache), then all
-- the tools at once (the slowest decides), then the next turn
local function lockstep()
  local t0 = moonrl.now()
  engine:reset()
  local seqs = {}
  for i, r in ipairs(records) do
    for j = 0, G - 1 do
      local s = {}
      for k, id in ipairs(r.prompt_ids) do s[k] = id end
      seqs[#seqs + 1] = { ids = s, i = i, j = j }
    end
  end
  local obs = tok:encode('7=', { add_special = false })
  local n = 0
  for k = 1, TURNS do
    local reqs = {}
    for e, s in ipairs(seqs) do
      reqs[e] = engine:add({ prompt_ids = s.ids, n = 1, max_tokens = TOK, prompt_index = s.i - 1, first_sample = (k - 1) * G + s.j },
        sampling)
    end
    while engine:step() > 0 do end
    local slowest = 0
    for e, s in ipairs(seqs) do
      local toks, _, m = engine:output(reqs[e], 0)
      for q = 0, m - 1 do s.ids[#s.ids + 1] = toks[q] end
      n = n + m
      engine:release(reqs[e])
      slowest = math.max(slowest, seconds[e][k])
    end
    moonrl.sleep(slowest) -- the tools, gathered
    if k < TURNS then for _, s in ipairs(seqs) do for _, id in ipairs(obs) do s.ids[#s.ids + 1] = id end end end
  end
  return moonrl.now() - t0, n
end

-- the agent program: the same turns over HTTP, its prompts the token ids so far
local dir = 'build/bench_agents_' .. tostring(os.time())
fs.mkdirs(dir)
fs.write(dir .. '/agent.py', string.format([==[
import json, os, threading, urllib.request
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
def post(path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req))
def play(ids, named):
    for turn in range(%d):
        out = post("/completions", dict(named, prompt=ids, max_tokens=%d, logprobs=1, return_tokens_as_token_ids=True))
        ids = ids + [int(t.split(":")[1]) for t in out["choices"][0]["logprobs"]["tokens"]] + %s
def worker():
    while True:
        got = post("/episodes/next", {})
        if got["episode_id"] is None: return
        play(got["record"]["prompt_ids"], {"user": got["episode_id"]})
        post("/episodes/done", {"episode_id": got["episode_id"]})
if os.environ.get("MOONRL_WORKER_ID"):
    ts = [threading.Thread(target=worker) for _ in range(int(os.environ["MOONRL_AGENT_CONCURRENCY"]))]
    for t in ts: t.start()
    for t in ts: t.join()
else:
    play(json.loads(os.environ["MOONRL_RECORD"])["prompt_ids"], {})
]==], TURNS, TOK, '[' .. table.concat(tok:encode('7=', { add_special = false }), ', ') .. ']'))

-- workers = 0: a program an episode; else that many programs, each playing many episodes on threads
local function through_agents(workers)
  local t0 = moonrl.now()
  local samples = agents.run({ engine = engine, tok = tok, records = records, group = G, sampling = sampling, step = 1,
    seed = 1, command = '/usr/bin/python3 ' .. dir .. '/agent.py', concurrency = 64, workers = workers, max_seconds = 600 })
  local n = 0
  for _, s in ipairs(samples) do
    assert(s.episode.reason == 'done', s.episode.error)
    for _, m in ipairs(s.loss_mask) do n = n + m end
  end
  return moonrl.now() - t0, n
end

local cpu = (fs.read('/proc/cpuinfo') or ''):match('model name%s*:%s*([^\n]+)') or '?'
print(string.format('CPU: %s; %d episodes (%d prompts x %d), %d turns of %d tokens; threads %s', cpu, #records * G, #records,
  G, TURNS, TOK, os.getenv('MOONRL_THREADS') or 'default'))
print(string.format('%-8s %-34s %9s %12s', 'round', 'side', 'seconds', 'tokens/s'))
local sums = {}
local function row(round, name, secs, n)
  print(string.format('%-8d %-34s %9.2f %12.0f', round, name, secs, n / secs))
  sums[name] = (sums[name] or 0) + secs
end
for round = 1, cfg.rounds do
  row(round, 'tools 0.1-1 s, overlapped', overlapped('bench_tool'))
  row(round, 'tools 0.1-1 s, lockstep', lockstep())
  row(round, 'no tool time, in-process', overlapped('bench_no_tool'))
  row(round, 'no tool time, agent programs', through_agents(0))
  row(round, 'no tool time, 2 agent workers', through_agents(2))
end
print(string.format('lockstep / overlapped: %.2fx the time; agent programs / in-process: %.2fx the time; '
  .. '2 agent workers / in-process: %.2fx the time',
  sums['tools 0.1-1 s, lockstep'] / sums['tools 0.1-1 s, overlapped'],
  sums['no tool time, agent programs'] / sums['no tool time, in-process'],
  sums['no tool time, 2 agent workers'] / sums['no tool time, in-process']))
fs.remove(dir)
