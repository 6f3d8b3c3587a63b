-- moonrl.io.http (the C client of moonrl/http_client.h) against the server of moonrl serve
-- (moonrl/http.h) in the same process: each poll of the client goes with one of the server, which
-- answers /echo with "<method> <content type> <authorization> <body>", /hold never.
local t = require('moonrl.testing')
local ffi = require('ffi')
local moonrl = require('moonrl')
local client = require('moonrl.io.http')
local C = moonrl.C

local Server = {}
Server.__index = Server

local function server()
  local h = ffi.new('mrl_http *[1]')
  moonrl.check(C.mrl_http_open('127.0.0.1', 0, nil, h))
  return setmetatable({ handle = h[0], port = tonumber(C.mrl_http_port(h[0])), req = ffi.new('mrl_http_request'),
    got = ffi.new('int[1]'), held = {} }, Server)
end

function Server:serve()
  while true do
    moonrl.check(C.mrl_http_poll(self.handle, 0, self.req, self.got))
    if self.got[0] == 0 then return end
    local q = self.req
    local path = ffi.string(q.path)
    if path == '/echo' then
      local out = table.concat({ ffi.string(q.method), ffi.string(q.content_type), ffi.string(q.authorization),
        ffi.string(q.body, q.body_len) }, ' ')
      C.mrl_http_respond(self.handle, q.id, 200, 'text/plain', out, #out)
    elseif path == '/hold' then
      self.held[#self.held + 1] = q.id
    else
      C.mrl_http_respond(self.handle, q.id, 404, nil, '{}', 2)
    end
  end
end

function Server:close() C.mrl_http_close(self.handle, 100) end

-- poll both until the client hands over a response (5 s at most)
local function next_response(c, srv)
  local deadline = moonrl.now() + 5
  while moonrl.now() < deadline do
    if srv then srv:serve() end
    local r = c:poll(1)
    if r then return r end
  end
end

t.test('client: parse_url', function()
  local h, p, path = client.parse_url('http://127.0.0.1:8000/v1/completions')
  t.eq(h, '127.0.0.1'); t.eq(p, 8000); t.eq(path, '/v1/completions')
  h, p, path = client.parse_url('HTTP://example.org')
  t.eq(h, 'example.org'); t.eq(p, 80); t.eq(path, '/')
  h, p, path = client.parse_url('http://[::1]:30000/generate?x=1')
  t.eq(h, '::1'); t.eq(p, 30000); t.eq(path, '/generate?x=1')
  t.raises(function() client.parse_url('https://a/') end, 'not an http:// URL')
  t.raises(function() client.parse_url('http://:80/') end, 'no host')
end)

t.test('client: round trips, headers, fetch', function()
  local srv = server()
  local c = client.open()
  local base = 'http://127.0.0.1:' .. srv.port
  local id = c:get(base .. '/echo')
  t.truthy(id > 0)
  t.eq(c:pending(), 1)
  local r = next_response(c, srv)
  t.eq(r.id, id); t.eq(r.status, 200); t.eq(r.error, nil); t.eq(r.body, 'GET   ')
  id = c:post(base .. '/echo', '{"a": 1}', { headers = { Authorization = 'Bearer k1' }, timeout = 5 })
  r = next_response(c, srv)
  t.eq(r.id, id); t.eq(r.body, 'POST application/json Bearer k1 {"a": 1}')
  id = c:request({ host = '127.0.0.1', port = srv.port, path = '/echo', body = 'x\0y',
    headers = 'Content-Type: text/plain\r\n' })
  r = next_response(c, srv)
  t.eq(r.body, 'POST text/plain  x\0y')
  r = next_response(c, srv) -- nothing more
  t.eq(r, nil)
  id = c:get(base .. '/missing')
  r = next_response(c, srv)
  t.eq(r.status, 404); t.eq(r.body, '{}')
  local s = c:stats()
  t.eq(s.requests_total, 4); t.eq(s.connections_total, 1); t.eq(s.pending, 0)
  -- bad arguments raise; a failed request does not
  t.raises(function() c:request({ host = '127.0.0.1', port = 0, path = '/' }) end, 'port 0')
  t.raises(function() c:get(base .. '/', { headers = { Host = 'x' } }) end, 'Host')
  t.raises(function() c:get(base .. '/', { headers = { X = 'a\nb' } }) end, 'header')
  c:close()
  c:close()
  srv:close()
end)

t.test('client: many in flight over a small pool, in any order', function()
  local srv = server()
  local c = client.open({ max_connections_per_host = 3 })
  local want = {}
  for i = 1, 60 do
    local body = 'n=' .. i
    want[c:post('http://127.0.0.1:' .. srv.port .. '/echo', body, { timeout = 10 })] = 'POST application/json  ' .. body
  end
  t.eq(c:pending(), 60)
  local n = 0
  while c:pending() > 0 do
    local r = next_response(c, srv)
    t.truthy(r, 'a response')
    t.eq(r.body, want[r.id], 'the body of ' .. r.id)
    want[r.id] = nil
    n = n + 1
  end
  t.eq(n, 60)
  t.eq(next(want), nil)
  local s = c:stats()
  t.eq(s.connections_total, 3); t.eq(s.connections_open, 3); t.eq(s.failed_total, 0)
  c:close()
  srv:close()
end)

t.test('client: refused, timed out, cancelled', function()
  local srv = server()
  local gone = server() -- a port nothing listens on once it is closed
  local dead_port = gone.port
  gone:close()
  local c = client.open()
  local id = c:get('http://127.0.0.1:' .. dead_port .. '/')
  local r = next_response(c, srv)
  t.eq(r.id, id); t.eq(r.status, 0); t.eq(r.error, 'connection refused'); t.eq(r.body, '')
  local base = 'http://127.0.0.1:' .. srv.port
  id = c:get(base .. '/hold', { timeout = 0.2 })
  r = next_response(c, srv)
  t.eq(r.id, id); t.eq(r.error, 'timed out')
  t.truthy(r.seconds >= 0.2 and r.seconds < 2, 'seconds ' .. r.seconds)
  id = c:get(base .. '/hold')
  local t0 = moonrl.now()
  while #srv.held < 2 and moonrl.now() < t0 + 5 do
    srv:serve()
    t.eq(c:poll(1), nil)
  end
  t.eq(#srv.held, 2)
  c:cancel(id)
  t.eq(c:pending(), 0)
  -- fetch: one request waited for, the others' responses kept for poll
  local other = c:get(base .. '/echo') -- answered once the server is polled again, after the fetch
  local early = c:get(base .. '/hold', { timeout = 0.1 })
  r = c:fetch({ url = base .. '/hold', timeout = 0.3 })
  t.eq(r.error, 'timed out')
  t.eq(c:pending(), 2)
  local got = {}
  for _ = 1, 2 do
    local x = next_response(c, srv)
    got[x.id] = x
  end
  t.eq(got[early].error, 'timed out')
  t.eq(got[other].status, 200)
  t.eq(c:pending(), 0)
  c:close()
  srv:close()
end)

t.done()
