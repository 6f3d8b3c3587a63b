-- moonrl.cli.cmdline: the --flag options of the commands (moonrl generate, serve, tokenize). An
-- option's value follows it (`--port 8000`) or is joined to it (`--port=8000`); a mistake is a
-- usage error that starts with the command's name.
--
--   local o = require('moonrl.cli.cmdline').parse(args, {
--     command = 'serve', usage = USAGE,                   -- printed by --help / -h (then: nil)
--     defaults = { port = 8000 },                         -- o starts as a copy
--     numbers = { ['--port'] = { 'port', true, 0, 65535 } }, -- key, integer?, least, most (optional)
--     strings = { ['--model'] = 'model' },
--     lists = { ['--stop'] = 'stop' },                    -- repeated: o.stop = { ... } ({} if none)
--     flags = { ['--chat'] = 'chat' },                    -- no value: o.chat = true
--     required = { '--model' },                           -- in this order: "serve: --model is required"
--   })
local moonrl = require('moonrl')

local M = {}

-- A number option's value: "CMD: FLAG 'S': expected an integer >= 1" (or "in LO..HI") when it is not one.
local function number(spec, cmd, flag, s)
  local v = tonumber(s)
  if not v or v ~= v or math.abs(v) == math.huge or (spec[2] and v ~= math.floor(v)) or v < spec[3] or (spec[4] and v > spec[4]) then
    moonrl.usage_error(string.format("%s: %s '%s': expected %s %s", cmd, flag, s, spec[2] and 'an integer' or 'a number',
      spec[4] and string.format('in %s..%s', spec[3], spec[4]) or ('>= ' .. spec[3])))
  end
  return v
end

-- The options of args as a table, or nil when --help printed the usage.
function M.parse(args, spec)
  local cmd, usage = spec.command, spec.usage
  local numbers, strings, lists, flags = spec.numbers or {}, spec.strings or {}, spec.lists or {}, spec.flags or {}
  local o = {}
  for k, v in pairs(spec.defaults or {}) do o[k] = v end
  for _, key in pairs(lists) do o[key] = {} end
  local i = 1
  while i <= #args do
    local a = args[i]
    local flag, inline = a:match('^(%-%-[%w-]+)=(.*)$')
    flag = flag or a
    local function value()
      if inline then return inline end
      i = i + 1
      local v = args[i]
      if v == nil then moonrl.usage_error(string.format('%s: %s needs a value\n%s', cmd, flag, usage)) end
      return v
    end
    if numbers[flag] then
      o[numbers[flag][1]] = number(numbers[flag], cmd, flag, value())
    elseif strings[flag] then
      o[strings[flag]] = value()
    elseif lists[flag] then
      local list = o[lists[flag]]
      list[#list + 1] = value()
    elseif flags[flag] and not inline then
      o[flags[flag]] = true
    elseif flag == '--help' or flag == '-h' then
      print(usage)
      return nil
    else
      moonrl.usage_error(string.format("%s: unknown option '%s'\n%s", cmd, a, usage))
    end
    i = i + 1
  end
  for _, flag in ipairs(spec.required or {}) do
    if o[strings[flag]] == nil then moonrl.usage_error(string.format('%s: %s is required\n%s', cmd, flag, usage)) end
  end
  return o
end

-- The words of a command that takes names (run directories, files) and `-o/--output FILE`, as
-- `moonrl report` and `moonrl trace merge` do: the names in order and the output file (nil when
-- not given), or nil when --help printed the usage. `cmd` starts each error; `help` is the
-- command that shows the usage ("moonrl report --help").
function M.names_and_output(args, cmd, usage, help)
  local names, out = {}, nil
  local i = 1
  while i <= #args do
    local a = args[i]
    if a == '-h' or a == '--help' then print(usage); return nil
    elseif a == '-o' or a == '--output' then
      out = args[i + 1]
      if not out or out == '' then moonrl.usage_error(cmd .. ': ' .. a .. ' needs a file name') end
      i = i + 1
    elseif a:match('^%-') then moonrl.usage_error(cmd .. ': unknown option ' .. a .. ' (' .. help .. ')')
    else names[#names + 1] = a end
    i = i + 1
  end
  return names, out
end

return M
