-- moonrl.report.load: read a run directory into plain tables for the report.
--
--   local load = require('moonrl.report.load')
--   local run = load.run_dir(DIR)   -- a usage error naming the file (and line) on bad input
--
-- run = {
--   dir, name,                        -- the path given and its last component
--   meta,                             -- config.json as decoded (recipe, moonrl, git, ..., config), or nil
--   manifest,                         -- manifest.json decoded, or nil when the run has none
--   steps = { 1, 2, ... },            -- the steps of metrics.jsonl in file order
--   series = { [key] = { [step] = x } },  -- numeric metrics, nested objects flattened with '/'
--   keys = { 'reward/mean', ... },    -- every numeric key, sorted
--   events = { { event =, time =, step =, fields = { {k, v}, ... } }, ... },
--   notes = { 'text', ... },          -- what the page should say about the input (a cut last line)
-- }
-- A metric value may be NaN or +-inf (JSON NaN / Infinity); null and strings are skipped; true and
-- false count as 1 and 0. A record logged twice for one step (a resumed run) keeps the last.
local moonrl = require('moonrl')
local fs = require('moonrl.io.fs')
local json = require('moonrl.io.json')

local M = {}

local function fail(fmt, ...) moonrl.usage_error('report: ' .. string.format(fmt, ...)) end

-- The text of a JSON decode error without its "json:1:COL:" prefix, as "MSG (column COL)".
local function printable(s)
  return (s:gsub('[%z\1-\31\127-\255]', function(c) return string.format('\\x%02x', c:byte()) end))
end

local function json_error(err)
  local col, msg = tostring(err):match('^json:%d+:(%d+): (.*)$')
  if col then return string.format('%s (column %s)', printable(msg), col) end
  return printable(tostring(err))
end

-- Flatten a decoded JSON object into out[key] = number.
local function flatten(obj, prefix, out)
  for _, k in ipairs(json.keys(obj)) do
    local v = obj[k]
    local key = prefix and (prefix .. '/' .. tostring(k)) or tostring(k)
    if type(v) == 'table' and v ~= json.null then
      if json.is_object(v) then flatten(v, key, out)
      else -- an array: its items by index
        for i, x in ipairs(v) do
          if type(x) == 'number' then out[key .. '/' .. (i - 1)] = x
          elseif type(x) == 'table' and json.is_object(x) then flatten(x, key .. '/' .. (i - 1), out) end
        end
      end
    elseif type(v) == 'number' then out[key] = v
    elseif type(v) == 'boolean' then out[key] = v and 1 or 0 end
  end
  return out
end
M.flatten = flatten

-- Each line of a JSONL file, decoded: calls fn(obj, lineno). A line that is not a JSON object is
-- an error naming the file and the line, except a last line without its newline (a run still
-- writing it): that one is skipped and returned as a note.
local function read_jsonl(path, fn)
  local text, err = fs.read(path)
  if not text then fail('cannot read %s', tostring(err)) end
  local lineno, pos, note = 0, 1, nil
  while pos <= #text do
    local nl = text:find('\n', pos, true)
    local line = text:sub(pos, (nl or #text + 1) - 1)
    lineno = lineno + 1
    pos = (nl or #text) + 1
    if line:find('%S') then
      local ok, obj = pcall(json.decode, line)
      if not ok and not nl then
        note = string.format('%s:%d: the last line is incomplete (a run still writing it?) and was left out', path, lineno)
      elseif not ok then
        fail('%s:%d: not valid JSON: %s', path, lineno, json_error(obj))
      elseif not json.is_object(obj) then
        fail('%s:%d: expected a JSON object, got %s', path, lineno, json.is_array(obj) and 'an array' or type(obj))
      else
        fn(obj, lineno)
      end
    end
  end
  return note
end

local function read_json(path)
  local text, err = fs.read(path)
  if not text then fail('cannot read %s', tostring(err)) end
  local ok, obj = pcall(json.decode, text)
  if not ok then
    local line, col, msg = tostring(obj):match('^json:(%d+):(%d+): (.*)$')
    if line then fail('%s:%s: not valid JSON: %s (column %s)', path, line, printable(msg), col) end
    fail('%s: not valid JSON: %s', path, printable(tostring(obj)))
  end
  if not json.is_object(obj) then fail('%s: expected a JSON object', path) end
  return obj
end

local RUN_FILES = { 'config.json', 'metrics.jsonl', 'events.jsonl' }

function M.run_dir(dir)
  if not fs.exists(dir) then fail('%s: no such directory', dir) end
  if not fs.is_dir(dir) then fail('%s is not a directory (give a run directory)', dir) end
  local has = {}
  for _, f in ipairs(RUN_FILES) do has[f] = fs.exists(dir .. '/' .. f) end
  if not (has['config.json'] or has['metrics.jsonl'] or has['events.jsonl']) then
    fail('%s is not a moonrl run directory (it holds no config.json, metrics.jsonl or events.jsonl)', dir)
  end
  local run = { dir = dir, name = dir:gsub('/+$', ''):match('([^/]+)$') or dir, steps = {}, series = {}, keys = {},
                events = {}, notes = {}, has_metrics_file = has['metrics.jsonl'], has_events_file = has['events.jsonl'] }
  if has['config.json'] then run.meta = read_json(dir .. '/config.json') end
  if fs.exists(dir .. '/manifest.json') then run.manifest = read_json(dir .. '/manifest.json') end

  if has['metrics.jsonl'] then
    local path = dir .. '/metrics.jsonl'
    local seen = {}
    local note = read_jsonl(path, function(obj, lineno)
      local step = obj.step
      if type(step) ~= 'number' or step ~= step or math.abs(step) == math.huge then
        fail('%s:%d: the record has no numeric "step"', path, lineno)
      end
      if not seen[step] then seen[step] = true; run.steps[#run.steps + 1] = step end
      for k, v in pairs(flatten(obj, nil, {})) do
        if k ~= 'step' then
          local s = run.series[k]
          if not s then s = {}; run.series[k] = s; run.keys[#run.keys + 1] = k end
          s[step] = v
        end
      end
    end)
    if note then run.notes[#run.notes + 1] = note end
    table.sort(run.steps)
    table.sort(run.keys)
  end

  if has['events.jsonl'] then
    local note = read_jsonl(dir .. '/events.jsonl', function(obj)
      local e = { event = tostring(obj.event or '?'), time = type(obj.time) == 'number' and obj.time or nil,
                  step = type(obj.step) == 'number' and obj.step or nil, fields = {} }
      for _, k in ipairs(json.keys(obj)) do
        if k ~= 'event' and k ~= 'time' and k ~= 'step' and k ~= 'pid' then
          local v = obj[k]
          e.fields[#e.fields + 1] = { k, type(v) == 'table' and json.encode(v) or tostring(v) }
        end
      end
      run.events[#run.events + 1] = e
    end)
    if note then run.notes[#run.notes + 1] = note end
  end
  return run
end

return M
