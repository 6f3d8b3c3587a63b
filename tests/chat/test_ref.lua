-- Chat templates against Python jinja2 rendering the way transformers does.
-- run_ref.sh renders every template in templates/ on every case in
-- cases.json with /usr/bin/python3 (ref_chat.py) and points MOONRL_CHAT_REF
-- at the result; this file renders the same with moonrl.chat and compares
-- byte for byte. A raise_exception() must raise the same message; any other
-- Python failure must be an error here too.
local t = require('moonrl.testing')
local json = require('moonrl.io.json')
local chat = require('moonrl.chat')

local ref_path = assert(os.getenv('MOONRL_CHAT_REF'), 'MOONRL_CHAT_REF is not set (run through run_ref.sh)')
local dir = 'tests/chat/'
local refs = json.read_file(ref_path)
local cases = {}
for _, c in ipairs(json.read_file(dir .. 'cases.json')) do cases[c.name] = c end
local sources = {}

local function first_diff(a, b)
  for i = 1, math.max(#a, #b) do
    if a:sub(i, i) ~= b:sub(i, i) then
      return string.format('first difference at byte %d: expected %q, got %q', i, a:sub(i, i + 40), b:sub(i, i + 40))
    end
  end
end

for _, r in ipairs(refs) do
  t.test(r.template .. ' / ' .. r.case, function()
    local src = sources[r.template]
    if not src then
      local f = assert(io.open(dir .. r.template, 'rb'))
      src = f:read('*a'); f:close()
      sources[r.template] = src
    end
    local case = cases[r.case]
    local vars = {}
    for k, v in pairs(case.vars) do vars[k] = v end
    vars.now = case.now or 1750000000
    local ok, out = pcall(chat.render, src, vars, r.template)
    if r.output then
      if not ok then error('raised: ' .. tostring(out)) end
      if out ~= r.output then error(first_diff(r.output, out)) end
    elseif r.raised then
      t.eq(ok, false, 'raised')
      t.truthy(tostring(out):find(r.raised, 1, true), 'message ' .. tostring(out) .. ' contains ' .. r.raised)
    else
      t.eq(ok, false, 'fails like Python (' .. r.error .. ')')
    end
  end)
end

t.done()
