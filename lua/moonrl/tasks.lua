-- moonrl.tasks: prompt sets built in code, used instead of a JSONL file (`data.task=addition`)
-- by every recipe (SFT trains on the answers, DPO prefers them to the rejected ones); their
-- held-out split is what `eval.every` measures by default.
--
--   local tasks = require('moonrl.tasks')
--   tasks.register('parity', function(o)           -- o = { seed = run.seed, cfg = the config }
--     local train, heldout = {}, {}
--     ...                                           -- records { prompt = '1011', answer = '1' }
--     return { train = train, heldout = heldout }
--   end, 'the parity of a bit string')
--   local t = tasks.load('addition', 1)            -- { train, heldout }, built once per seed
--
-- A record is { prompt = text, answer = text, meta = table|nil }: what a reward reads (and, for
-- preference recipes, rejected = text: an answer worse than answer). The
-- registry is a moonrl.registry (register(name, fn, doc), get, check, names, doc).
-- Built in:
--   addition   the default example's task: every "a+b=" with a, b < 100 (10,000 problems), its
--              200 held out chosen by the seed (examples/default.lua builds its problems with
--              it); the answer is the sum ("85"), judged by the 'exact' reward. Called directly,
--              o.rng (a moonrl.rng generator, e.g. a session's S:rng) shuffles in place of
--              a fresh one from o.seed, and o.heldout (200) sets how many are held out. Each
--              record also has rejected, the answer with the default example's flaw ("85="),
--              for preference recipes (`moonrl run dpo data.task=addition`).
local M = require('moonrl.registry').new('task')

M.register('addition', function(o)
  local rng = o.rng or require('moonrl.rng').new(o.seed or 1) -- the default example's draw generator
  local n_heldout = o.heldout or 200
  local problems = {}
  for a = 0, 99 do
    for b = 0, 99 do problems[#problems + 1] = { a = a, b = b } end
  end
  require('moonrl.rng').shuffle(problems, rng)
  local train, heldout = {}, {}
  for i, p in ipairs(problems) do
    local sum = tostring(p.a + p.b)
    local r = { prompt = p.a .. '+' .. p.b .. '=', answer = sum, rejected = sum .. '=' }
    if i <= n_heldout then heldout[#heldout + 1] = r else train[#train + 1] = r end
  end
  return { train = train, heldout = heldout }
end, '2-digit addition "37+48=" -> "85": 10,000 problems, 200 held out (the default example\'s)')

local cache = {}

-- The task's records { train, heldout }, built once per (name, seed); an unknown name is an error
-- listing the tasks.
function M.load(name, seed)
  local key = tostring(name) .. '\0' .. tostring(seed)
  if not cache[key] then
    local t = M.get(name)({ seed = seed, cfg = require('moonrl.config').current })
    if type(t) ~= 'table' or type(t.train) ~= 'table' or #t.train == 0 then
      error(string.format("task '%s' must return { train = records, heldout = records } with records", name), 2)
    end
    t.heldout = t.heldout or {}
    cache[key] = t
  end
  return cache[key]
end

return M
