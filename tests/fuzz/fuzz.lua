-- The mutation driver of the fuzz targets written in Lua (tests/fuzz/targets.lua): the parsers of
-- untrusted input that live in the Lua library (chat templates, JSON, JSONL records, checkpoint
-- manifests and state). Run by tests/fuzz/fuzz.sh with the moonrl command of a sanitized build, so
-- that AddressSanitizer and UndefinedBehaviorSanitizer watch the C underneath too:
--
--   moonrl run tests/fuzz/fuzz.lua target=jinja seconds=5 seeds=tests/fuzz/corpus/jinja artifacts=DIR/
--   moonrl run tests/fuzz/fuzz.lua target=jinja input=FILE        one input, to reproduce a finding
--
-- A target gets each input (a string) and may raise only a clean error: a moonrl usage or run
-- error, a jinja render error, or a message the library wrote for the user. A Lua error of the
-- language itself ("attempt to index a nil value", "bad argument #1 to 'pairs'", ...) means the
-- input reached code that did not expect it: a finding, as is a broken property (a target's
-- assert), an input slower than `timeout` seconds, or the process dying (fuzz.sh then keeps the
-- input it was running). The input of a finding is written to ARTIFACTS/crash-HASH.
--
-- The mutations are those of tests/fuzz/driver.c in small: bytes flipped, set, inserted and
-- deleted, ranges copied within an input and from another seed, the target's dictionary tokens
-- (tests/fuzz/dict), numbers rewritten.
local moonrl = require('moonrl')
local bit = require('bit')
local cfg = moonrl.config {
  target = moonrl.config.required('string', 'the target (tests/fuzz/targets.lua)'),
  seconds = 5,
  seed = 0, -- 0: from the clock
  seeds = '', -- a directory of seed files
  artifacts = '', -- where a finding's input goes (a prefix: end it with '/')
  input = '', -- one file to run, and nothing else
  timeout = 20,
}
local fs = require('moonrl.io.fs')
local targets = dofile('tests/fuzz/targets.lua')
local target = targets[cfg.target]
if not target then moonrl.usage_error('fuzz.lua: no target ' .. cfg.target) end

-- ---- seeds and dictionary

local function read(path) return assert(fs.read(path)) end

local seeds = {}
if cfg.input ~= '' then
  seeds[1] = read(cfg.input)
elseif cfg.seeds ~= '' then
  local names = fs.list(cfg.seeds)
  table.sort(names)
  for _, name in ipairs(names) do
    if name:sub(1, 1) ~= '.' and fs.stat(cfg.seeds .. '/' .. name).is_file then seeds[#seeds + 1] = read(cfg.seeds .. '/' .. name) end
  end
end
if #seeds == 0 then seeds[1] = '' end

local tokens = {}
local dict = io.open('tests/fuzz/dict/' .. (target.dict or cfg.target) .. '.dict', 'rb')
if dict then
  for line in dict:lines() do
    local q = line:match('^[^#]-"(.*)"%s*$')
    if q then
      tokens[#tokens + 1] = q:gsub('\\x(%x%x)', function(h) return string.char(tonumber(h, 16)) end)
        :gsub('\\(.)', '%1')
    end
  end
  dict:close()
end

-- ---- mutations

local state = cfg.seed ~= 0 and cfg.seed or (os.time() * 1000 + math.floor(moonrl.now() * 1e6) % 1000)
local seed0 = state
local function rnd(n) -- 0 .. n-1 (a 48-bit linear congruential generator in doubles: exact)
  state = (state * 25214903917 + 11) % 281474976710656
  return math.floor(state / 65536) % math.max(n, 1)
end

local interesting = { '0', '-1', '1', '-0', '255', '256', '65536', '2147483647', '2147483648', '4294967296',
  '9007199254740993', '9223372036854775807', '18446744073709551616', '1e309', '-1e309', '1e-400', '0.5', 'NaN',
  'Infinity', '99999999999999999999999999999' }
local special = { '\0', '\1', '\127', '\128', '\255', '"', '\\', '{', '}', '[', ']', ',', ':', '\n', '\r', ' ', '%',
  '<', '>', '|', '~', '(', ')', '.', "'" }

local function mutate(s)
  local n = #s
  local k = rnd(12)
  local at = rnd(n + 1)
  if k == 0 and n > 0 then -- flip a bit
    local i = rnd(n) + 1
    return s:sub(1, i - 1) .. string.char(bit.bxor(s:byte(i), bit.lshift(1, rnd(8)))) .. s:sub(i + 1)
  elseif k == 1 and n > 0 then -- a random or special byte
    local i = rnd(n) + 1
    local c = rnd(2) == 0 and string.char(rnd(256)) or special[rnd(#special) + 1]
    return s:sub(1, i - 1) .. c .. s:sub(i + 1)
  elseif k == 2 then -- delete a range
    return s:sub(1, at) .. s:sub(at + 1 + rnd(rnd(4) == 0 and 64 or 8) + 1)
  elseif k == 3 then -- insert random bytes
    local t = {}
    for i = 1, rnd(8) + 1 do t[i] = string.char(rnd(256)) end
    return s:sub(1, at) .. table.concat(t) .. s:sub(at + 1)
  elseif k == 4 and n > 0 then -- copy a range of the input elsewhere
    local from = rnd(n) + 1
    local piece = s:sub(from, from + rnd(rnd(4) == 0 and 256 or 16))
    return s:sub(1, at) .. piece .. s:sub(at + 1 + (rnd(2) == 0 and #piece or 0))
  elseif k == 5 then -- a range of another seed
    local o = seeds[rnd(#seeds) + 1]
    local from = rnd(#o) + 1
    local piece = o:sub(from, from + rnd(rnd(2) == 0 and 64 or #o))
    return s:sub(1, at) .. piece .. s:sub(at + 1 + (rnd(2) == 0 and #piece or 0))
  elseif (k == 6 or k == 7) and #tokens > 0 then -- a dictionary token
    local tok = tokens[rnd(#tokens) + 1]
    return s:sub(1, at) .. tok .. s:sub(at + 1 + (rnd(4) == 0 and #tok or 0))
  elseif k == 8 then -- the number nearest a place becomes an interesting one
    local i, j = s:find('%-?%d+[%.%deE+-]*', at + 1)
    if i then return s:sub(1, i - 1) .. interesting[rnd(#interesting) + 1] .. s:sub(j + 1) end
  elseif k == 9 and n > 0 then -- cut short
    return s:sub(1, rnd(n))
  elseif k == 10 and n > 0 then -- a range repeated
    local from = rnd(n) + 1
    local piece = s:sub(from, from + rnd(8))
    return s:sub(1, from - 1) .. piece:rep(rnd(rnd(4) == 0 and 200 or 8) + 2) .. s:sub(from + #piece)
  end
  return s
end

-- ---- running

-- The Lua errors of the language and its libraries: an input that raises one reached code that
-- did not expect it. Anything else raised is a message written for the user.
local DIRTY = { 'attempt to ', 'bad argument #', 'stack overflow', 'table index is ', "invalid key to 'next'",
  'string length overflow', 'not enough memory', 'internal error', 'invalid value (at index',
  'number has no integer representation', "'for' initial value", "'for' limit", "'for' step", 'loop in gettable',
  'loop in settable', 'cannot convert', 'wrong number of arguments', 'invalid option', 'unfinished capture',
  'malformed pattern', 'invalid capture index', 'fuzz property broken' }

local function dirty(err)
  if type(err) == 'table' then
    if moonrl.is_usage_error(err) or moonrl.is_run_error(err) then return nil end
    if type(err.message) == 'string' and not err.traceback then return dirty(err.message) end
    return 'an error that is not a message: ' .. tostring(err)
  end
  if type(err) ~= 'string' then return 'an error that is not a message: ' .. tostring(err) end
  for _, pat in ipairs(DIRTY) do
    if err:find(pat, 1, true) then return err end
  end
  return nil
end

targets.dirty = dirty

local function hash(s) -- FNV-1a, 32 bits twice: the same input, the same name
  local a, b = 2166136261, 5381
  for i = 1, #s do
    local c = s:byte(i)
    a = bit.tobit(bit.bxor(a, c) * 16777619 % 4294967296)
    b = bit.tobit((b * 33 + c) % 4294967296)
  end
  return bit.tohex(a) .. bit.tohex(b)
end

local current = cfg.artifacts ~= '' and cfg.artifacts .. 'current' or nil
if cfg.artifacts:find('/') then fs.mkdirs(cfg.artifacts:match('^(.*)/')) end
local function finding(kind, input, why)
  io.stderr:write('fuzz: ', why, '\n')
  if cfg.artifacts ~= '' then
    local path = cfg.artifacts .. kind .. '-' .. hash(input)
    fs.write(path, input)
    io.stderr:write(string.format('fuzz: %s: the input (%d bytes) is in %s\n', kind, #input, path))
  end
  if current then os.remove(current) end
  os.exit(1)
end

local refused = 0 -- inputs the target refused with a clean error
local function run(input)
  -- the input on disk while it runs: if the process dies in it, fuzz.sh keeps this file
  if current then targets.put(current, input) end
  local t0 = moonrl.now()
  local traceback -- taken only for a finding: most inputs end in a clean error, and a traceback is slow
  local ok, err = xpcall(target.run, function(e)
    if dirty(e) then traceback = debug.traceback(tostring(type(e) == 'table' and (e.message or e) or e), 2) end
    return e
  end, input)
  if not ok then
    refused = refused + 1
    if traceback then finding('crash', input, 'a Lua error that is not a clean error:\n' .. traceback) end
  end
  if moonrl.now() - t0 > cfg.timeout then
    finding('timeout', input, string.format('an input ran %.1f s (more than timeout=%g)', moonrl.now() - t0, cfg.timeout))
  end
  if target.cleanup then target.cleanup() end
end

if target.setup then target.setup() end
local t0 = moonrl.now()
for _, s in ipairs(seeds) do run(s) end
local t_seeds = moonrl.now() - t0
local runs = 0
if cfg.input == '' then
  local stop = moonrl.now() + cfg.seconds
  print(string.format('fuzz: seed %d (rerun the same inputs with seed=%d)', seed0, seed0))
  -- The one feedback there is: mutants the target accepted (no error at all) are kept, up to 256,
  -- and mutated further a third of the time. Most mutants of a structured text are refused by
  -- its parser; those that are not reach the code behind it.
  local accepted = {}
  while moonrl.now() < stop do
    local s = (#accepted > 0 and rnd(3) == 0) and accepted[rnd(#accepted) + 1] or seeds[rnd(#seeds) + 1]
    for _ = 1, rnd(3) == 0 and rnd(4) + 1 or 1 do s = mutate(s) end
    local before = refused
    run(s)
    if refused == before then accepted[#accepted < 256 and #accepted + 1 or rnd(256) + 1] = s end
    runs = runs + 1
  end
end
if target.teardown then target.teardown() end
if current then os.remove(current) end
local t = moonrl.now() - t0 - t_seeds
if cfg.input ~= '' then
  print('fuzz: the input ran without a finding')
else
  print(string.format('fuzz: %d seeds in %.1f s, then %d mutated inputs in %.1f s (%.0f/s, %d%% refused): no finding',
    #seeds, t_seeds, runs, t, t > 0 and runs / t or 0, math.floor(100 * refused / math.max(1, runs + #seeds))))
end
