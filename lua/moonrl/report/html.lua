-- moonrl.report.html: one self-contained HTML page for one or several runs (moonrl.report.load).
--
--   local page, info = require('moonrl.report.html').page(runs)  -- info.plots: the number of plots
--
-- The page needs no network: inline CSS, inline SVG charts, and a few lines of inline JavaScript
-- that only hide and show runs (a click on a legend entry); everything is drawn without it.
-- Sections: the runs, memory (peak resident and what moonrl's buffers held, per kind and per
-- phase; also one line per run in the header), a summary of the headline metrics, a plot per numeric metric (grouped by
-- prefix, the important groups first; runs overlaid in one colour each), seconds per phase per
-- step (stacked bars, one chart per run on one scale), the events, the config (with the keys that
-- differ between runs first), the manifest.
local json = require('moonrl.io.json')
local svg = require('moonrl.report.svg')

local M = {}

local esc, fmt, finite = svg.esc, svg.fmt, svg.finite
local format, concat = string.format, table.concat

local RUN_COLORS = { '#1f77b4', '#d62728', '#2ca02c', '#ff7f0e', '#9467bd', '#8c564b', '#e377c2', '#17becf',
  '#7f7f7f', '#bcbd22' }
local PHASE_COLORS = { '#4e79a7', '#f28e2b', '#59a14f', '#e15759', '#76b7b2', '#edc948', '#b07aa1', '#ff9da7',
  '#9c755f', '#bab0ac' }

-- Groups of metrics (the prefix before the first '/'; '' for the keys without one) in the order
-- shown; the rest follow alphabetically.
local GROUP_ORDER = { 'reward', '', 'env', 'response_length', 'tokens_per_s', 'mismatch', 'engine', 'time', 'memory',
  'guard', 'async' }
local GROUP_TITLE = { [''] = 'training', time = 'time (seconds)', env = 'episodes (env/: turns, tools, limits)',
  engine = 'rollout servers (engine/: requests, weight syncs, failures, by server)' }
-- Keys shown first within their group.
local KEY_ORDER = { 'reward/mean', 'reward/std', 'accuracy', 'loss', 'kl', 'approx_kl', 'entropy', 'clip_frac',
  'grad_norm', 'lr', 'response_length/mean', 'response_length/max', 'tokens_per_s/generate', 'tokens_per_s/train',
  'time/step', 'time', 'env/turns', 'env/masked_share', 'env/env_share' }
-- The headline metrics of the summary table (those present).
local SUMMARY = { 'reward/mean', 'accuracy', 'loss', 'kl', 'approx_kl', 'entropy', 'clip_frac', 'grad_norm', 'lr',
  'response_length/mean', 'tokens_per_s/generate', 'tokens_per_s/train', 'time/step' }
-- Events drawn as lines on the plots, and events shown as trouble in the table.
local MARK_EVENTS = { skip = '#ff7f0e', rollback = '#d62728', resume = '#1f77b4', restart = '#9467bd',
  guard_stop = '#d62728' }
local BAD_EVENTS = { skip = true, rollback = true, restart = true, hang = true, exit = true, error = true,
  guard_stop = true, stop = true, unsaved = true, checkpoint_failed = true, checkpoint_skipped = true,
  data_skipped = true, reward_error = true, engine_server = true }
-- Counters in the metrics that the events section sums.
local COUNTERS = { { 'guard/skipped', 'updates skipped by the guards' }, { 'guard/rollback', 'rollbacks' },
  { 'async/dropped_stale', 'stale samples dropped' }, { 'reward/dropped_groups', 'reward groups dropped' },
  { 'data/skipped', 'data records skipped' }, { 'env/extension_failures', 'episodes whose rendering left their tokens' },
  { 'env/ended/env_error', 'episodes ended by their environment\'s error' },
  { 'env/ended/agent_error', 'episodes ended by their agent\'s error' } }
local MAX_EVENT_ROWS = 2000

local function rank_of(list)
  local r = {}
  for i, v in ipairs(list) do r[v] = i end
  return r
end
local GROUP_RANK, KEY_RANK = rank_of(GROUP_ORDER), rank_of(KEY_ORDER)

local function group_of(key)
  if key == 'time' then return 'time' end
  return key:match('^([^/]+)/') or ''
end

local function by_rank(rank)
  return function(a, b)
    local ra, rb = rank[a] or 1e9, rank[b] or 1e9
    if ra ~= rb then return ra < rb end
    return a < b
  end
end

-- The union of the runs' metric keys, as { { group, { key, ... } }, ... } in display order.
local function groups(runs)
  local seen, by = {}, {}
  for _, r in ipairs(runs) do
    for _, k in ipairs(r.keys) do
      if not seen[k] then
        seen[k] = true
        local g = group_of(k)
        by[g] = by[g] or {}
        table.insert(by[g], k)
      end
    end
  end
  local names = {}
  for g in pairs(by) do names[#names + 1] = g end
  table.sort(names, by_rank(GROUP_RANK))
  local out = {}
  for _, g in ipairs(names) do
    table.sort(by[g], by_rank(KEY_RANK))
    out[#out + 1] = { g, by[g] }
  end
  return out
end

local function points(run, key)
  local s, out = run.series[key], {}
  if not s then return out end
  for _, step in ipairs(run.steps) do
    local v = s[step]
    if v ~= nil then out[#out + 1] = { step, v } end
  end
  return out
end

local function stats(pts)
  local lo, hi, bad = math.huge, -math.huge, 0
  for _, p in ipairs(pts) do
    if finite(p[2]) then
      if p[2] < lo then lo = p[2] end
      if p[2] > hi then hi = p[2] end
    else bad = bad + 1 end
  end
  return { first = pts[1] and pts[1][2], last = pts[#pts] and pts[#pts][2], min = lo <= hi and lo or nil,
           max = lo <= hi and hi or nil, nonfinite = bad, n = #pts }
end

local function markers(runs)
  local out = {}
  for _, r in ipairs(runs) do
    for _, e in ipairs(r.events) do
      local color = MARK_EVENTS[e.event]
      if color and e.step then
        out[#out + 1] = { x = e.step, color = color, cls = r.cls,
                          label = format('%s: %s at step %s', r.name, e.event, fmt(e.step)) }
      end
    end
  end
  return out
end

local CSS = [[
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;margin:0;color:#222;background:#fff}
header{padding:14px 24px;border-bottom:1px solid #ddd;background:#f7f7f9}
h1{font-size:20px;margin:0 0 6px}h2{font-size:17px;margin:28px 0 10px;border-bottom:1px solid #eee;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 8px;color:#444}main{padding:0 24px 40px}
nav a{margin-right:14px;color:#1f5fa8;text-decoration:none}
table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #e2e2e2;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f5;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums}
.grid{display:flex;flex-wrap:wrap;gap:14px}
.card{border:1px solid #e4e4e8;border-radius:6px;padding:6px 8px;background:#fff}
.card h4{margin:0 0 2px;font-size:13px;font-weight:600;font-family:ui-monospace,Menlo,Consolas,monospace}
.card .sub{font-size:11.5px;color:#666;margin-top:2px;max-width:380px}
svg.plot{display:block;background:#fff}
svg .frame{fill:none;stroke:#bbb}svg .grid{stroke:#eee;stroke-width:1}
svg text{font:10.5px system-ui,sans-serif;fill:#555}svg .yl{text-anchor:end}svg .xl{text-anchor:middle}
svg .axis{text-anchor:end;fill:#888}svg .empty{text-anchor:middle;fill:#999;font-size:13px}
svg .marker{stroke-width:1.2;stroke-dasharray:3 3;opacity:.8}
.legend span{display:inline-block;margin-right:16px;cursor:pointer;user-select:none}
.legend i{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:5px;vertical-align:-1px}
.legend .off{opacity:.35;text-decoration:line-through}
.memhead{margin-top:4px;font-size:13px}.memhead b{font-variant-numeric:tabular-nums}
.membar{display:flex;width:420px;height:14px;border:1px solid #ccc;background:#fafafa;margin:2px 0}
.membar i{display:block;height:100%}
.note{background:#fff8e1;border:1px solid #f0d98c;padding:6px 10px;border-radius:4px;margin:8px 0}
.empty-msg{background:#f4f4f6;border:1px dashed #bbb;padding:14px;border-radius:4px;color:#444}
tr.bad td{background:#fff0f0}tr.warn td{background:#f0f6ff}
pre{background:#f7f7f9;border:1px solid #e4e4e8;padding:8px;overflow:auto;max-height:480px;font-size:12px}
code,.mono{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px}
details{margin:6px 0}summary{cursor:pointer;font-weight:600}
]]

local JS = [[
document.querySelectorAll('.legend span[data-run]').forEach(function(el){
  el.addEventListener('click',function(){
    var c='hide-'+el.dataset.run;document.body.classList.toggle(c);el.classList.toggle('off');});});
]]

local function legend(runs, with_toggle)
  local o = { '<div class="legend">' }
  for _, r in ipairs(runs) do
    o[#o + 1] = format('<span data-run="%s" title="%s"><i style="background:%s"></i>%s</span>', with_toggle and r.cls or '',
      esc(r.dir), r.color, esc(r.name))
  end
  o[#o + 1] = '</div>'
  return concat(o)
end

local function time_text(t)
  if not t then return '' end
  return os.date('%Y-%m-%d %H:%M:%S', math.floor(t))
end

local function meta_field(r, k)
  local v = r.meta and r.meta[k]
  if v == nil or v == json.null then return '' end
  return tostring(v)
end

-- Flatten a config table to { { 'a.b', 'text' }, ... } sorted by key.
local function flat_config(t, prefix, out)
  out = out or {}
  if type(t) ~= 'table' or t == json.null then return out end
  local keys = json.is_object(t) and json.keys(t) or {}
  if not json.is_object(t) then for i = 1, #t do keys[#keys + 1] = i end end
  for _, k in ipairs(keys) do
    local v = t[k]
    local key = prefix and (prefix .. '.' .. tostring(k)) or tostring(k)
    if type(v) == 'table' and v ~= json.null and (json.is_object(v) or (#v > 0 and type(v[1]) == 'table')) then
      flat_config(v, key, out)
    else
      out[#out + 1] = { key, type(v) == 'string' and v or json.encode(v) }
    end
  end
  if not prefix then table.sort(out, function(a, b) return a[1] < b[1] end) end
  return out
end

-- What a run trained: LoRA adapters (its 'lora' event: the rank and the trainable share) or the whole model.
local function trained(r)
  for _, e in ipairs(r.events) do
    if e.event == 'lora' then
      local f = {}
      for _, kv in ipairs(e.fields) do f[kv[1]] = kv[2] end
      local share = tonumber(f.share)
      if share then return format('LoRA rank %s: %s parameters (%.2f%%)', f.rank or '?', f.trainable or '?', 100 * share) end
    end
  end
  return 'the whole model'
end

local function section_runs(o, runs)
  o[#o + 1] = '<h2 id="runs">Runs</h2><table><tr><th>run</th><th>directory</th><th>recipe</th><th>moonrl</th>' ..
    '<th>git</th><th>backends</th><th>ranks</th><th>trained</th><th>steps</th><th>wall time</th><th>events</th></tr>'
  for _, r in ipairs(runs) do
    local steps = #r.steps == 0 and 'none' or
      format('%d (%s-%s)', #r.steps, fmt(r.steps[1]), fmt(r.steps[#r.steps]))
    local t = r.series.time and r.steps[#r.steps] and r.series.time[r.steps[#r.steps]]
    o[#o + 1] = format('<tr><td><i style="display:inline-block;width:10px;height:10px;background:%s"></i> %s</td>' ..
      '<td class="mono">%s</td><td>%s</td><td>%s</td><td class="mono">%s</td><td>%s</td><td class="num">%s</td>' ..
      '<td>%s</td><td>%s</td><td class="num">%s</td><td class="num">%d</td></tr>', r.color, esc(r.name), esc(r.dir),
      esc(meta_field(r, 'recipe')), esc(meta_field(r, 'moonrl')), esc(meta_field(r, 'git')), esc(meta_field(r, 'backends')),
      esc(meta_field(r, 'world_size')), esc(trained(r)), steps, t and finite(t) and format('%.1f s', t) or '', #r.events)
  end
  o[#o + 1] = '</table>'
  for _, r in ipairs(runs) do
    for _, n in ipairs(r.notes) do o[#o + 1] = format('<div class="note">%s</div>', esc(n)) end
    if #r.steps == 0 then
      o[#o + 1] = format('<div class="empty-msg">%s has no metrics: %s. The run has not logged a step yet, or it ' ..
        'stopped before its first step.</div>', esc(r.name),
        r.series and r.has_metrics_file and 'metrics.jsonl holds no record' or 'there is no metrics.jsonl')
    end
  end
end

-- ---- memory: the memory/* metrics (MiB) of moonrl.train.run (core/base/mem.c) ----------------------
-- What moonrl's buffers hold, by kind, in the order shown; 'other' is every other allocation.
local MEM_KINDS = { { 'params', 'parameters' }, { 'grads', 'gradients' }, { 'optim', 'optimizer state' },
  { 'activations', 'activations' }, { 'kv_cache', 'KV cache' }, { 'other', 'other' } }
local MEM_COLORS = { params = '#4e79a7', grads = '#f28e2b', optim = '#59a14f', activations = '#e15759',
  kv_cache = '#b07aa1', other = '#bab0ac' }

-- Several ranks and a sharded state (docs/observability.md): the largest rank's resident peak, and
-- the parts of a sharded model's memory; rows shown where a run logged them.
local MEM_PARTS = { { 'max_rank_peak_mb', 'peak resident, the largest rank' },
  { 'params_shard_mb', 'parameters: the shard of a rank' }, { 'params_gathered_peak_mb', 'parameters: gathered at once, at most' },
  { 'grads_windows_peak_mb', 'gradient windows, at most' }, { 'engine_copy_mb', 'the engine copy of the policy' } }

local function mib(x)
  if not (x and finite(x)) then return '-' end
  if x >= 1024 then return format('%.2f GiB', x / 1024) end
  if x >= 100 then return format('%.0f MiB', x) end
  if x >= 1 then return format('%.1f MiB', x) end
  if x == 0 then return '0' end
  return format(x * 1024 >= 10 and '%.0f KiB' or '%.1f KiB', x * 1024)
end

-- The largest value of a metric over the steps, and its step (nil when the run has none).
local function peak(r, key)
  local s, best, at = r.series[key], nil, nil
  if not s then return nil end
  for _, step in ipairs(r.steps) do
    local v = s[step]
    if v and finite(v) and (not best or v > best) then best, at = v, step end
  end
  return best, at
end

-- A run's memory: peak resident set (memory/rss_peak_mb, else memory/rss_mb) and at which step,
-- the peak of what moonrl allocated (memory/peak_mb), the most each kind held at a logged step,
-- and per phase (memory/phase/NAME/...) its peaks, largest resident first. nil without memory/*.
local function memory_of(r)
  if r.mem ~= nil then return r.mem or nil end
  local m = { kinds = {}, phases = {} }
  m.rss, m.rss_step = peak(r, 'memory/rss_peak_mb')
  if not m.rss then m.rss, m.rss_step = peak(r, 'memory/rss_mb') end
  m.accounted = peak(r, 'memory/peak_mb')
  local any = m.rss or m.accounted
  for _, k in ipairs(MEM_KINDS) do
    local v = peak(r, 'memory/' .. k[1] .. '_mb')
    m.kinds[k[1]] = v
    any = any or v
  end
  m.parts = {}
  for _, k in ipairs(MEM_PARTS) do m.parts[k[1]] = peak(r, 'memory/' .. k[1]) end
  -- (one process logs its own peak as the largest rank's: nothing to add)
  if m.parts.max_rank_peak_mb == m.rss then m.parts.max_rank_peak_mb = nil end
  local seen = {}
  for _, key in ipairs(r.keys) do
    local name = key:match('^memory/phase/(.+)/rss_peak_mb$') or key:match('^memory/phase/(.+)/peak_mb$')
    if name and not seen[name] then
      seen[name] = true
      m.phases[#m.phases + 1] = { name = name, rss = peak(r, 'memory/phase/' .. name .. '/rss_peak_mb'),
        accounted = peak(r, 'memory/phase/' .. name .. '/peak_mb') }
    end
  end
  table.sort(m.phases, function(a, b)
    if (a.rss or -1) ~= (b.rss or -1) then return (a.rss or -1) > (b.rss or -1) end
    return a.name < b.name
  end)
  r.mem = any and m or false
  return r.mem or nil
end

-- One line per run for the header: the peak resident set and the split.
local function memory_headline(runs)
  local o = {}
  for _, r in ipairs(runs) do
    local m = memory_of(r)
    if m then
      local parts = {}
      for _, k in ipairs(MEM_KINDS) do
        if k[1] ~= 'other' and m.kinds[k[1]] then parts[#parts + 1] = format('%s <b>%s</b>', k[2], mib(m.kinds[k[1]])) end
      end
      o[#o + 1] = format('<div class="memhead">%smemory: peak resident <b>%s</b>%s; held %s</div>', #runs > 1 and
        format('<span style="color:%s">%s</span> ', r.color, esc(r.name)) or '', mib(m.rss),
        m.rss_step and format(' (step %s)', fmt(m.rss_step)) or '', #parts > 0 and concat(parts, ', ') or '-')
    end
  end
  return concat(o)
end

local function section_memory(o, runs)
  local with = {}
  for _, r in ipairs(runs) do if memory_of(r) then with[#with + 1] = r end end
  if #with == 0 then return end
  o[#o + 1] = '<h2 id="memory">Memory</h2><p>Peak resident: the largest resident set of the process at a logged ' ..
    'step (memory/rss_peak_mb). Held: the most each kind of moonrl buffer held at a logged step; peak allocated: ' ..
    'the most moonrl had allocated at once (memory/peak_mb).</p>'
  o[#o + 1] = '<table><tr><th></th>'
  for _, r in ipairs(with) do
    o[#o + 1] = format('<th><i style="display:inline-block;width:10px;height:10px;background:%s"></i> %s</th>', r.color,
      esc(r.name))
  end
  o[#o + 1] = '</tr>'
  local function row(label, cell)
    local cells = { format('<tr><td>%s</td>', label) }
    for _, r in ipairs(with) do cells[#cells + 1] = format('<td class="num">%s</td>', cell(memory_of(r))) end
    o[#o + 1] = concat(cells) .. '</tr>'
  end
  row('<b>peak resident</b>', function(m)
    return format('<b>%s</b>%s', mib(m.rss), m.rss_step and format(' (step %s)', fmt(m.rss_step)) or '')
  end)
  row('peak allocated by moonrl', function(m) return mib(m.accounted) end)
  for _, k in ipairs(MEM_PARTS) do
    local any = false
    for _, r in ipairs(with) do any = any or memory_of(r).parts[k[1]] ~= nil end
    if any then
      row(format('%s <span class="mono">(memory/%s)</span>', esc(k[2]), k[1]), function(m) return mib(m.parts[k[1]]) end)
    end
  end
  for _, k in ipairs(MEM_KINDS) do
    row(format('<i style="display:inline-block;width:10px;height:10px;background:%s"></i> %s', MEM_COLORS[k[1]], k[2]),
      function(m) return mib(m.kinds[k[1]]) end)
  end
  local phases, seen = {}, {}
  for _, r in ipairs(with) do
    for _, p in ipairs(memory_of(r).phases) do
      if not seen[p.name] then seen[p.name] = true; phases[#phases + 1] = p.name end
    end
  end
  for _, name in ipairs(phases) do
    row(format('phase <span class="mono">%s</span>: peak resident / allocated', esc(name)), function(m)
      for _, p in ipairs(m.phases) do
        if p.name == name then return format('%s / %s', mib(p.rss), mib(p.accounted)) end
      end
      return ''
    end)
  end
  o[#o + 1] = '</table>'
  -- the split as a bar per run, all on one scale (the largest total held)
  local top = 0
  for _, r in ipairs(with) do
    local sum = 0
    for _, k in ipairs(MEM_KINDS) do sum = sum + (memory_of(r).kinds[k[1]] or 0) end
    top = math.max(top, sum)
  end
  if top > 0 then
    for _, r in ipairs(with) do
      local m, bars = memory_of(r), {}
      for _, k in ipairs(MEM_KINDS) do
        local v = m.kinds[k[1]]
        if v and v > 0 then
          bars[#bars + 1] = format('<i style="width:%.2f%%;background:%s" title="%s %s"></i>', 100 * v / top,
            MEM_COLORS[k[1]], k[2], mib(v))
        end
      end
      o[#o + 1] = format('<div><span style="color:%s">%s</span>: held by kind<div class="membar">%s</div></div>', r.color,
        esc(r.name), concat(bars))
    end
  end
end

local function section_summary(o, runs)
  local rows = {}
  for _, k in ipairs(SUMMARY) do
    for _, r in ipairs(runs) do
      if r.series[k] then rows[#rows + 1] = k; break end
    end
  end
  if #rows == 0 then return end
  o[#o + 1] = '<h2 id="summary">Summary</h2><table><tr><th>metric</th>'
  for _, r in ipairs(runs) do
    o[#o + 1] = format('<th><i style="display:inline-block;width:10px;height:10px;background:%s"></i> %s: last ' ..
      '(first, min-max)</th>', r.color, esc(r.name))
  end
  o[#o + 1] = '</tr>'
  for _, k in ipairs(rows) do
    o[#o + 1] = format('<tr><td class="mono"><a href="#m-%s">%s</a></td>', esc(k), esc(k))
    for _, r in ipairs(runs) do
      local st = stats(points(r, k))
      if st.n == 0 then o[#o + 1] = '<td></td>'
      else
        o[#o + 1] = format('<td class="num"><b>%s</b> (%s, %s-%s)</td>', fmt(st.last), fmt(st.first),
          st.min and fmt(st.min) or '-', st.max and fmt(st.max) or '-')
      end
    end
    o[#o + 1] = '</tr>'
  end
  o[#o + 1] = '</table>'
end

local function section_metrics(o, runs, info)
  o[#o + 1] = '<h2 id="metrics">Metrics against step</h2>'
  local gs = groups(runs)
  if #gs == 0 then
    o[#o + 1] = '<div class="empty-msg">No metrics to plot: no run here has a numeric metric in metrics.jsonl.</div>'
    return
  end
  local marks = markers(runs)
  local x0, x1 = math.huge, -math.huge -- every plot on the same step axis
  for _, r in ipairs(runs) do
    if #r.steps > 0 then x0, x1 = math.min(x0, r.steps[1]), math.max(x1, r.steps[#r.steps]) end
  end
  if #marks > 0 then
    o[#o + 1] = '<p>Dashed lines: skips (orange), rollbacks (red), resumes (blue), restarts (purple); hover for details.</p>'
  end
  for _, g in ipairs(gs) do
    local name = GROUP_TITLE[g[1]] or g[1]
    o[#o + 1] = format('<h3 id="g-%s">%s <small>(%d)</small></h3><div class="grid">', esc(g[1] == '' and 'training' or g[1]),
      esc(name), #g[2])
    for _, key in ipairs(g[2]) do
      local series, subs = {}, {}
      for _, r in ipairs(runs) do
        local pts = points(r, key)
        if #pts > 0 then
          series[#series + 1] = { name = r.name, color = r.color, cls = r.cls, points = pts }
          local st = stats(pts)
          subs[#subs + 1] = format('%s%s last %s, min %s, max %s%s', #runs > 1 and ('<b style="color:' .. r.color .. '">' ..
            esc(r.name) .. '</b>: ') or '', st.n == 1 and ' one step:' or '', fmt(st.last), st.min and fmt(st.min) or '-',
            st.max and fmt(st.max) or '-', st.nonfinite > 0 and format(', <b>%d non-finite</b>', st.nonfinite) or '')
        end
      end
      o[#o + 1] = format('<div class="card" id="m-%s"><h4>%s</h4>', esc(key), esc(key))
      o[#o + 1] = svg.line_plot({ title = key, series = series, markers = marks, x0 = x0, x1 = x1 })
      o[#o + 1] = format('<div class="sub">%s</div></div>', concat(subs, '<br>'))
      info.plots = info.plots + 1
    end
    o[#o + 1] = '</div>'
  end
end

-- The phases of a run: the time/NAME keys but time/step, and 'other' (the rest of time/step).
local function phase_parts(r, colors)
  local parts = {}
  for _, k in ipairs(r.keys) do
    local name = k:match('^time/(.+)$')
    if name and name ~= 'step' and not name:find('/') then
      if not colors[name] then
        colors.n = colors.n + 1
        colors[name] = PHASE_COLORS[(colors.n - 1) % #PHASE_COLORS + 1]
      end
      parts[#parts + 1] = { name = name, color = colors[name], values = r.series[k] }
    end
  end
  local total = r.series['time/step']
  if total and #parts > 0 then
    local other, big = {}, 0
    for _, s in ipairs(r.steps) do
      local t = total[s]
      if t and finite(t) then
        local sum = 0
        for _, p in ipairs(parts) do
          local v = p.values[s]
          if v and finite(v) then sum = sum + v end
        end
        other[s] = math.max(t - sum, 0)
        if other[s] > big then big = other[s] end
      end
    end
    if big > 0 then parts[#parts + 1] = { name = 'other', color = '#c7c7c7', values = other } end
  elseif total then
    parts[#parts + 1] = { name = 'step', color = PHASE_COLORS[1], values = total }
  end
  return parts
end

local function section_phases(o, runs, info)
  o[#o + 1] = '<h2 id="phases">Seconds per phase per step</h2>'
  local colors, charts, top = { n = 0 }, {}, 0
  for _, r in ipairs(runs) do
    local parts = phase_parts(r, colors)
    if #parts > 0 and #r.steps > 0 then
      charts[#charts + 1] = { r, parts }
      for _, s in ipairs(r.steps) do
        local t = 0
        for _, p in ipairs(parts) do
          local v = p.values[s]
          if v and finite(v) and v > 0 then t = t + v end
        end
        if t > top then top = t end
      end
    end
  end
  if #charts == 0 then
    o[#o + 1] = '<div class="empty-msg">No phase timings: the metrics hold no time/PHASE keys.</div>'
    return
  end
  o[#o + 1] = '<p>Each bar is one step (the mean of a bin of steps when there are many): the seconds of each phase ' ..
    '(time/PHASE in metrics.jsonl); "other" is the rest of time/step.</p><div class="legend">'
  local seen = {}
  for _, c in ipairs(charts) do
    for _, p in ipairs(c[2]) do
      if not seen[p.name] then
        seen[p.name] = true
        o[#o + 1] = format('<span><i style="background:%s"></i>%s</span>', p.color, esc(p.name))
      end
    end
  end
  o[#o + 1] = '</div><div class="grid">'
  for _, c in ipairs(charts) do
    local r = c[1]
    o[#o + 1] = format('<div class="card %s"><h4 style="color:%s">%s</h4>', r.cls, r.color, esc(r.name))
    o[#o + 1] = svg.stacked_bars({ title = 'seconds per phase: ' .. r.name, steps = r.steps, parts = c[2], top = top })
    local sums = {}
    for _, p in ipairs(c[2]) do
      local s = 0
      for _, st in ipairs(r.steps) do
        local v = p.values[st]
        if v and finite(v) then s = s + v end
      end
      sums[#sums + 1] = format('%s %.2f s', esc(p.name), s)
    end
    o[#o + 1] = format('<div class="sub">total: %s</div></div>', concat(sums, ', '))
    info.plots = info.plots + 1
  end
  o[#o + 1] = '</div>'
end

local function section_events(o, runs)
  o[#o + 1] = '<h2 id="events">Events</h2>'
  local multi = #runs > 1
  -- counts per kind, and the counters of the metrics
  o[#o + 1] = '<table><tr><th>run</th><th>events by kind</th><th>from the metrics</th></tr>'
  for _, r in ipairs(runs) do
    local count, kinds = {}, {}
    for _, e in ipairs(r.events) do
      if not count[e.event] then kinds[#kinds + 1] = e.event; count[e.event] = 0 end
      count[e.event] = count[e.event] + 1
    end
    table.sort(kinds)
    local ks = {}
    for _, k in ipairs(kinds) do ks[#ks + 1] = format('%s%s %d%s', BAD_EVENTS[k] and '<b>' or '', esc(k), count[k],
      BAD_EVENTS[k] and '</b>' or '') end
    local cs = {}
    for _, c in ipairs(COUNTERS) do
      local s = r.series[c[1]]
      if s then
        local sum, nsteps = 0, 0
        for _, st in ipairs(r.steps) do
          local v = s[st]
          if v and finite(v) and v ~= 0 then sum = sum + v; nsteps = nsteps + 1 end
        end
        cs[#cs + 1] = format('%s: %s%s', c[2], fmt(sum), nsteps > 0 and format(' (in %d steps)', nsteps) or '')
      end
    end
    o[#o + 1] = format('<tr><td>%s</td><td>%s</td><td>%s</td></tr>', esc(r.name),
      #ks > 0 and concat(ks, ', ') or (r.has_events_file and 'none' or 'no events.jsonl'), concat(cs, '<br>'))
  end
  o[#o + 1] = '</table>'
  local rows = {}
  for _, r in ipairs(runs) do
    for _, e in ipairs(r.events) do rows[#rows + 1] = { r, e } end
  end
  if #rows == 0 then return end
  if multi then table.sort(rows, function(a, b) return (a[2].time or 0) < (b[2].time or 0) end) end
  o[#o + 1] = format('<table><tr>%s<th>time</th><th>step</th><th>event</th><th>details</th></tr>',
    multi and '<th>run</th>' or '')
  for i, row in ipairs(rows) do
    if i > MAX_EVENT_ROWS then
      o[#o + 1] = format('<tr><td colspan="5">... %d more events (see events.jsonl)</td></tr>', #rows - MAX_EVENT_ROWS)
      break
    end
    local r, e = row[1], row[2]
    local det = {}
    for _, kv in ipairs(e.fields) do det[#det + 1] = format('<span class="mono">%s=</span>%s', esc(kv[1]), esc(kv[2])) end
    local cls = BAD_EVENTS[e.event] and ' class="bad"' or (MARK_EVENTS[e.event] and ' class="warn"' or '')
    o[#o + 1] = format('<tr%s>%s<td>%s</td><td class="num">%s</td><td><b>%s</b></td><td>%s</td></tr>', cls,
      multi and format('<td style="color:%s">%s</td>', r.color, esc(r.name)) or '', time_text(e.time),
      e.step and fmt(e.step) or '', esc(e.event), concat(det, ' &nbsp; '))
  end
  o[#o + 1] = '</table>'
end

local function section_config(o, runs)
  o[#o + 1] = '<h2 id="config">Config</h2>'
  local flats, all, seen = {}, {}, {}
  for i, r in ipairs(runs) do
    local map = {}
    local cfg = r.meta and r.meta.config
    for _, kv in ipairs(flat_config(cfg)) do
      map[kv[1]] = kv[2]
      if not seen[kv[1]] then seen[kv[1]] = true; all[#all + 1] = kv[1] end
    end
    flats[i] = map
  end
  table.sort(all)
  if #runs > 1 and #all > 0 then
    local diff = {}
    for _, k in ipairs(all) do
      for i = 2, #runs do
        if flats[i][k] ~= flats[1][k] then diff[#diff + 1] = k; break end
      end
    end
    o[#o + 1] = format('<h3>Keys that differ (%d of %d)</h3>', #diff, #all)
    if #diff > 0 then
      o[#o + 1] = '<table><tr><th>key</th>'
      for _, r in ipairs(runs) do o[#o + 1] = format('<th style="color:%s">%s</th>', r.color, esc(r.name)) end
      o[#o + 1] = '</tr>'
      for _, k in ipairs(diff) do
        local row = { format('<tr><td class="mono">%s</td>', esc(k)) }
        for i = 1, #runs do row[#row + 1] = format('<td class="mono">%s</td>', esc(flats[i][k] or '(absent)')) end
        o[#o + 1] = concat(row) .. '</tr>'
      end
      o[#o + 1] = '</table>'
    end
  end
  for i, r in ipairs(runs) do
    if not r.meta then
      o[#o + 1] = format('<p>%s: no config.json.</p>', esc(r.name))
    else
      local n = 0
      for _ in pairs(flats[i]) do n = n + 1 end
      o[#o + 1] = format('<details%s><summary>%s: config.json (%d keys)</summary><table>', #runs == 1 and ' open' or '',
        esc(r.name), n)
      for _, kv in ipairs(flat_config(r.meta.config)) do
        o[#o + 1] = format('<tr><td class="mono">%s</td><td class="mono">%s</td></tr>', esc(kv[1]), esc(kv[2]))
      end
      o[#o + 1] = '</table></details>'
    end
  end
end

local function section_manifest(o, runs)
  o[#o + 1] = '<h2 id="manifest">Manifest</h2>'
  for _, r in ipairs(runs) do
    if r.manifest then
      o[#o + 1] = format('<details open><summary>%s: manifest.json</summary><pre>%s</pre></details>', esc(r.name),
        esc(json.encode(r.manifest, { indent = 2 })))
    else
      o[#o + 1] = format('<p>%s: no manifest.json in %s.</p>', esc(r.name), esc(r.dir))
    end
  end
end

-- Give each run a colour, a CSS class and a unique display name.
local function label(runs)
  local used = {}
  for i, r in ipairs(runs) do
    r.color = RUN_COLORS[(i - 1) % #RUN_COLORS + 1]
    r.cls = 'run-' .. i
    local name = r.name
    if used[name] then name = name .. ' (' .. i .. ')' end
    used[name] = true
    r.name = name
  end
end

function M.page(runs)
  label(runs)
  local info = { plots = 0 }
  local title = #runs == 1 and ('moonrl report: ' .. runs[1].name) or format('moonrl report: %d runs', #runs)
  local o = { '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
    format('<title>%s</title>', esc(title)), '<meta name="viewport" content="width=device-width,initial-scale=1">',
    '<style>', CSS }
  for _, r in ipairs(runs) do o[#o + 1] = format('body.hide-%s .%s{display:none}', r.cls, r.cls) end
  o[#o + 1] = '</style></head><body>'
  o[#o + 1] = format('<header><h1>%s</h1><div>generated %s by moonrl report</div>%s%s', esc(title),
    os.date('%Y-%m-%d %H:%M:%S'), legend(runs, #runs > 1), memory_headline(runs))
  local has_mem = false
  for _, r in ipairs(runs) do has_mem = has_mem or memory_of(r) ~= nil end
  o[#o + 1] = '<nav><a href="#runs">runs</a>' .. (has_mem and '<a href="#memory">memory</a>' or '') ..
    '<a href="#summary">summary</a><a href="#metrics">metrics</a>' ..
    '<a href="#phases">phases</a><a href="#events">events</a><a href="#config">config</a><a href="#manifest">manifest</a></nav></header><main>'
  section_runs(o, runs)
  section_memory(o, runs)
  section_summary(o, runs)
  section_metrics(o, runs, info)
  section_phases(o, runs, info)
  section_events(o, runs)
  section_config(o, runs)
  section_manifest(o, runs)
  o[#o + 1] = '</main><script>' .. JS .. '</script></body></html>\n'
  return concat(o, '\n'), info
end

return M
