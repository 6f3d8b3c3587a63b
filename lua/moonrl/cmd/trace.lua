-- moonrl trace merge: one timeline from the traces a job's ranks left behind.
--   moonrl trace merge RUN_DIR [-o OUT.json]        (default RUN_DIR/trace.json)
--   moonrl trace merge FILE.json ... -o OUT.json
-- A job whose ranks all end together writes one merged trace.json (moonrl.train.run). When they do
-- not (a rank killed, or failing alone) each rank's timeline stays in RUN_DIR/trace-rank-R.json,
-- streamed as it ran (mrl_trace_stream), so a killed rank's file simply stops, perhaps in the
-- middle of an event. This joins them onto one clock, one process track per rank, in a file
-- that opens in Perfetto; a file's cut or corrupt lines are dropped and counted, not a reason to
-- refuse. A file that is no trace at all is an error naming it (exit status 2).
local moonrl = require('moonrl')
local fs = require('moonrl.io.fs')
local trace = require('moonrl.train.trace')

local M = {}

local USAGE = [[
usage: moonrl trace merge RUN_DIR [-o OUT.json]
       moonrl trace merge FILE.json [FILE.json ...] -o OUT.json
  joins the ranks' timelines a job left in RUN_DIR/trace-rank-R.json (a rank killed or failing
  alone) onto one clock: one Perfetto-loadable trace, one process track per rank. A killed
  rank's file may stop mid-event: its complete events are kept and the rest counted as
  dropped; phases it began and never ended are listed (where it was when it stopped).
  Default OUT: RUN_DIR/trace.json.]]

local function read(path)
  local ok, text = pcall(fs.read, path)
  if not ok then moonrl.usage_error('trace merge: cannot read ' .. path .. ': ' .. moonrl.error_text(text)) end
  return text
end

-- The inputs in a run directory: its trace-rank-R.json files, by rank.
local function rank_files(dir)
  local found = {}
  for _, name in ipairs(fs.list(dir)) do
    local r = name:match('^trace%-rank%-(%d+)%.json$')
    if r then found[#found + 1] = { path = dir .. '/' .. name, rank = tonumber(r) } end
  end
  table.sort(found, function(a, b) return a.rank < b.rank end)
  return found
end

local function merge(args)
  local names, out = require('moonrl.cli.cmdline').names_and_output(args, 'trace merge', USAGE, 'moonrl trace --help')
  if not names then return 0 end
  local inputs, dir = {}, nil
  for _, a in ipairs(names) do
    local st = fs.stat(a)
    if not st then moonrl.usage_error('trace merge: no such run directory or file: ' .. a) end
    if st.is_dir then
      if dir then moonrl.usage_error('trace merge: one run directory at a time (' .. dir .. ', ' .. a .. ')') end
      dir = a:gsub('/+$', '')
      local found = rank_files(dir)
      if #found == 0 then
        local whole = dir .. '/trace.json'
        if fs.exists(whole) then
          print(string.format('trace merge: %s holds no trace-rank-R.json: its timeline is whole already (%s)',
            dir, whole))
          return 0
        end
        moonrl.usage_error('trace merge: ' .. dir .. ' holds no trace-rank-R.json and no trace.json ' ..
          '(not a moonrl run directory, or a run that traced nothing)')
      end
      for _, f in ipairs(found) do inputs[#inputs + 1] = f.path end
    else
      inputs[#inputs + 1] = a
    end
  end
  if #inputs == 0 then moonrl.usage_error('trace merge: no run directory or trace file given (moonrl trace --help)') end
  if not out then
    if not dir then moonrl.usage_error('trace merge: with trace files (no RUN_DIR) give -o OUT.json') end
    out = dir .. '/trace.json'
    -- a trace.json that a run wrote at its end is a whole timeline: never replaced by a merge
    -- of leftovers (one written by this command, otherData.merged_from, is)
    local st = fs.stat(out)
    if st then
      local ok, r = pcall(trace.read_events, read(out), out)
      if not (ok and r.other.merged_from) then
        moonrl.usage_error(string.format('trace merge: %s exists and was not written by trace merge: ' ..
          'give -o OUT.json to write the merge elsewhere', out))
      end
    end
  end

  local texts, names = {}, {}
  for k, path in ipairs(inputs) do texts[k], names[k] = read(path), path end
  -- one file per rank: of two with the same rank (two attempts of a restarted job), the later
  local by_rank, keep = {}, {}
  for k, text in ipairs(texts) do
    local ok, r = pcall(trace.read_events, text, names[k])
    if not ok then
      moonrl.usage_error('trace merge: ' .. moonrl.error_text(r) .. (dir and ' (remove it to merge the others)' or ''))
    end
    local rank = r.other.rank
    if rank == nil then
      moonrl.usage_error(string.format('trace merge: %s is already a merged timeline (of %s ranks), not one ' ..
        "rank's trace", names[k], tostring(r.other.ranks)))
    end
    local prev = by_rank[rank]
    if prev and prev.t0 >= r.other.t0_unix_us then
      print(string.format('  %s: skipped (rank %d again, an earlier start than %s)', names[k], rank, names[prev.k]))
    else
      if prev then
        keep[prev.k] = nil
        print(string.format('  %s: skipped (rank %d again, an earlier start than %s)', names[prev.k], rank, names[k]))
      end
      by_rank[rank], keep[k] = { t0 = r.other.t0_unix_us, k = k }, true
    end
  end
  local mtexts, mnames, short = {}, {}, {}
  for k = 1, #texts do
    if keep[k] then
      mtexts[#mtexts + 1], mnames[#mnames + 1] = texts[k], names[k]
      short[#short + 1] = names[k]:match('[^/]+$')
    end
  end
  local text, info = trace.merge(mtexts, mnames, { merged_from = short })
  local wok, werr = pcall(fs.write, out, text)
  if not wok then moonrl.usage_error('trace merge: ' .. moonrl.error_text(werr)) end

  local dropped = 0
  for k, r in ipairs(info) do
    local notes = {}
    if r.dropped > 0 then
      dropped = dropped + r.dropped
      notes[#notes + 1] = string.format('%d incomplete or corrupt event%s dropped (first at line %d)', r.dropped,
        r.dropped == 1 and '' or 's', r.first_dropped)
    end
    if not r.complete then notes[#notes + 1] = 'cut short (the rank did not end: killed?)' end
    if #r.open > 0 then notes[#notes + 1] = 'never ended: ' .. table.concat(r.open, ', ') end
    print(string.format('  %s: rank %d, %d events%s', mnames[k], r.other.rank, r.events,
      #notes > 0 and ('; ' .. table.concat(notes, '; ')) or ''))
  end
  print(string.format('trace merge: %s (%d rank%s%s; open it in Perfetto, ui.perfetto.dev)', out, #info,
    #info == 1 and '' or 's', dropped > 0 and string.format(', %d event%s dropped', dropped, dropped == 1 and '' or 's')
    or ''))
  return 0
end

function M.main(args)
  local sub = args[1]
  if sub == nil or sub == '-h' or sub == '--help' or sub == 'help' then
    print(USAGE)
    return sub == nil and 2 or 0
  end
  if sub ~= 'merge' then
    moonrl.usage_error("trace: unknown subcommand '" .. sub .. "' (moonrl trace merge RUN_DIR)")
  end
  local rest = {}
  for k = 2, #args do rest[#rest + 1] = args[k] end
  return merge(rest)
end

return M
