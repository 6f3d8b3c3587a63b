-- moonrl report: one self-contained HTML page (inline SVG plots and CSS, nothing fetched) from
-- one run directory, or a comparison of several on the same axes.
--   moonrl report RUN_DIR [-o report.html]      (default RUN_DIR/report.html)
--   moonrl report A B C [-o report.html]        (default ./report.html)
-- Bad input (not a run directory, a line of metrics.jsonl that is not JSON) is one line naming
-- the file and the line, exit status 2.
local moonrl = require('moonrl')
local fs = require('moonrl.io.fs')

local M = {}

local USAGE = [[
usage: moonrl report RUN_DIR [RUN_DIR ...] [-o OUT.html]
  writes one self-contained HTML page: a plot per metric of metrics.jsonl against step (several
  runs overlaid, one colour each), seconds per phase per step, the events, the config and the
  manifest. Default OUT: RUN_DIR/report.html for one run, ./report.html for several.]]

function M.main(args)
  local dirs, out = require('moonrl.cli.cmdline').names_and_output(args, 'report', USAGE, 'moonrl report --help')
  if not dirs then return 0 end
  if #dirs == 0 then moonrl.usage_error('report: no run directory given (moonrl report --help)') end

  local load, html = require('moonrl.report.load'), require('moonrl.report.html')
  local runs = {}
  for _, d in ipairs(dirs) do
    -- a bug here is one line too, never a traceback: the input is what a user gave
    local ok, run = pcall(load.run_dir, d)
    if not ok then
      if moonrl.is_usage_error(run) then error(run, 0) end
      moonrl.run_error(string.format('report: cannot read the run in %s: %s', d, tostring(run)))
    end
    runs[#runs + 1] = run
  end
  local ok, page, info = pcall(html.page, runs)
  if not ok then moonrl.run_error('report: cannot build the page: ' .. tostring(page)) end
  out = out or (#dirs == 1 and (dirs[1]:gsub('/+$', '') .. '/report.html') or 'report.html')
  local wok, werr = pcall(fs.write, out, page)
  if not wok then moonrl.usage_error('report: ' .. moonrl.error_text(werr)) end
  local steps = 0
  for _, r in ipairs(runs) do steps = steps + #r.steps end
  local function n(k, what) return string.format('%d %s%s', k, what, k == 1 and '' or 's') end
  print(string.format('report: %s (%s, %s, %s)', out, n(#runs, 'run'), n(steps, 'step'), n(info.plots, 'plot')))
  return 0
end

return M
