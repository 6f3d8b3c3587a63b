-- Render a chat template many times with moonrl.chat; prints microseconds a render.
-- usage: moonrl run bench/chat/chat_render.lua   (env: TEMPLATE, CASE, N)
local chat = require('moonrl.chat')
local json = require('moonrl.io.json')
local moonrl = require('moonrl')
local f = assert(io.open(os.getenv('TEMPLATE'), 'rb')); local src = f:read('*a'); f:close()
local case
for _, c in ipairs(json.read_file('tests/chat/cases.json')) do if c.name == os.getenv('CASE') then case = c end end
local vars = case.vars
vars.now = 1750000000
local n = tonumber(os.getenv('N'))
local out = chat.render(src, vars)
local t0 = moonrl.now()
for _ = 1, n do out = chat.render(src, vars) end
print(string.format('%.3f', (moonrl.now() - t0) / n * 1e6))
