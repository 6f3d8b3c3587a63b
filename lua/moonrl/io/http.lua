-- moonrl.io.http: many HTTP requests in flight to a few servers, their answers taken by
-- polling from one thread (the C client of moonrl/http_client.h: a keep-alive pool per host,
-- deadlines, the keep-alive race retried once; plain HTTP only).
--
--   local client = require('moonrl.io.http')
--   local c = client.open({ max_connections_per_host = 16 })
--   local id = c:post('http://127.0.0.1:8000/v1/completions', json_text, { timeout = 60 })
--   local id2 = c:request({ host = '10.0.0.2', port = 30000, method = 'POST', path = '/generate',
--                           headers = { Authorization = 'Bearer k' }, body = text, timeout = 60 })
--   while c:pending() > 0 do
--     local r = c:poll(50)   -- nil, or { id, status, body, error, seconds } in any order
--     if r and r.error then ... end   -- status 0: connection refused, timed out, ...
--   end
--   local r = c:fetch({ url = 'http://127.0.0.1:8000/health', timeout = 5 })  -- one, waited for
--   c:close()
local moonrl = require('moonrl')
local ffi = require('ffi')
local C = moonrl.C

local M = {}

local Client = {}
Client.__index = Client

-- 'http://host[:port][/path]' -> host, port, path (path '/' when none; an IPv6 host in brackets
-- comes without them). Raises on anything else (https among it: no TLS here).
function M.parse_url(url)
  local rest = type(url) == 'string' and url:match('^[Hh][Tt][Tt][Pp]://(.*)$')
  if not rest then error(string.format('http client: %q is not an http:// URL', tostring(url)), 2) end
  local authority, path = rest:match('^([^/?#]*)(.*)$')
  if path == '' then path = '/' elseif path:sub(1, 1) ~= '/' then path = '/' .. path end
  local host, port = authority:match('^%[([^%]]+)%]:?(%d*)$')
  if not host then host, port = authority:match('^([^:]+):?(%d*)$') end
  if not host or host == '' then error(string.format('http client: no host in %q', url), 2) end
  port = port ~= '' and tonumber(port) or 80
  return host, port, path
end

-- o: { max_connections_per_host (64), connect_timeout (seconds, 10; 0: none),
--      max_response_bytes (256 MiB) }
function M.open(o)
  o = o or {}
  local cfg = ffi.new('mrl_httpc_config')
  C.mrl_httpc_config_default(cfg)
  if o.max_connections_per_host then cfg.max_connections_per_host = o.max_connections_per_host end
  if o.connect_timeout then cfg.connect_timeout_s = o.connect_timeout end
  if o.max_response_bytes then cfg.max_response_bytes = o.max_response_bytes end
  local h = ffi.new('mrl_httpc *[1]')
  moonrl.check(C.mrl_httpc_open(cfg, h), 2)
  return setmetatable({ handle = ffi.gc(h[0], C.mrl_httpc_close), id = ffi.new('int64_t[1]'),
    resp = ffi.new('mrl_httpc_response'), got = ffi.new('int[1]'), kept = {} }, Client)
end

-- headers: nil, a string of "Name: value\r\n" lines, or a table { Name = value } (sent in name
-- order)
local function header_lines(headers)
  if headers == nil or type(headers) == 'string' then return headers end
  local names = {}
  for k in pairs(headers) do names[#names + 1] = k end
  table.sort(names)
  local out = {}
  for i, k in ipairs(names) do out[i] = k .. ': ' .. tostring(headers[k]) .. '\r\n' end
  return table.concat(out)
end

-- Queue a request; returns its id. r: { url, or host + port + path; method (GET, or POST with a
-- body); headers; body (a string); timeout (seconds, the whole request; nil or 0: none) }.
-- Raises on bad arguments only: a request that fails comes back from poll with its error.
function Client:request(r)
  local host, port, path = r.host, r.port, r.path
  if r.url then host, port, path = M.parse_url(r.url) end
  local body = r.body
  local method = r.method or (body and 'POST' or 'GET')
  moonrl.check(C.mrl_httpc_request(self.handle, host, port or 80, method, path or '/', header_lines(r.headers), body,
    body and #body or 0, r.timeout or 0, self.id), 2)
  return tonumber(self.id[0])
end

function Client:post(url, body, o)
  o = o or {}
  return self:request({ url = url, body = body, method = 'POST', headers = o.headers, timeout = o.timeout })
end

function Client:get(url, o)
  o = o or {}
  return self:request({ url = url, method = 'GET', headers = o.headers, timeout = o.timeout })
end

-- The next finished request, waiting up to timeout_ms (0 or nil: not at all): { id, status (0
-- for a transport failure), body, error (nil, or what failed), seconds }, or nil.
function Client:poll(timeout_ms)
  if #self.kept > 0 then return table.remove(self.kept, 1) end
  return self:take(timeout_ms or 0)
end

-- One response from the C client (waiting up to timeout_ms), as a table; nil when none came.
function Client:take(timeout_ms)
  moonrl.check(C.mrl_httpc_poll(self.handle, timeout_ms, self.resp, self.got), 2)
  if self.got[0] == 0 then return nil end
  local r = self.resp
  return { id = tonumber(r.id), status = r.status, body = ffi.string(r.body, r.body_len),
    error = r.error ~= nil and ffi.string(r.error) or nil, seconds = r.seconds }
end

-- One request, waited for: its response (as poll gives it). Others that finish meanwhile are kept
-- for poll. wait: seconds at most (default: the request's timeout + 1, else 60); past it the
-- request is cancelled and nil returned with 'timed out'.
function Client:fetch(r, wait)
  local id = self:request(r)
  local deadline = moonrl.now() + (wait or (r.timeout and r.timeout > 0 and r.timeout + 1) or 60)
  local early = {}
  while moonrl.now() < deadline do
    local resp = self:take(10)
    if resp then
      if resp.id == id then
        for _, e in ipairs(early) do self.kept[#self.kept + 1] = e end
        return resp
      end
      early[#early + 1] = resp
    end
  end
  for _, e in ipairs(early) do self.kept[#self.kept + 1] = e end
  C.mrl_httpc_cancel(self.handle, id)
  return nil, 'timed out'
end

-- No response for id will come (its connection, if it has one, is closed).
function Client:cancel(id)
  for i, e in ipairs(self.kept) do
    if e.id == id then
      table.remove(self.kept, i)
      return
    end
  end
  C.mrl_httpc_cancel(self.handle, id)
end

-- Requests whose response poll has not handed over yet.
function Client:pending() return tonumber(C.mrl_httpc_pending(self.handle)) + #self.kept end

-- { requests_total, connections_total, retried_total, failed_total, timed_out_total,
--   connections_open, pending }
function Client:stats()
  local s = ffi.new('mrl_httpc_stats')
  C.mrl_httpc_get_stats(self.handle, s)
  return { requests_total = tonumber(s.requests_total), connections_total = tonumber(s.connections_total),
    retried_total = tonumber(s.retried_total), failed_total = tonumber(s.failed_total),
    timed_out_total = tonumber(s.timed_out_total), connections_open = s.connections_open,
    pending = s.pending + #self.kept }
end

-- Closes every connection; pending requests are dropped. Twice is fine.
function Client:close()
  if self.handle then
    C.mrl_httpc_close(ffi.gc(self.handle, nil))
    self.handle = nil
  end
end

return M
