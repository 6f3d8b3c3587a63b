-- moonrl.report.svg: inline SVG charts for the report (no JavaScript needed to draw them).
--
--   svg.line_plot{ title =, series = { { name =, color =, cls =, points = { {x, y}, ... } }, ... },
--                  markers = { { x =, color =, label = }, ... }, x0 =, x1 = (the step axis; default: the data's) }
--                  -> SVG text
--   svg.stacked_bars{ title =, steps = { ... }, parts = { { name =, color =, values = { [step] = s } }, ... },
--                     top = the least y range (to share one scale between runs) }
--   svg.fmt(x), svg.esc(s)
-- Non-finite values break a line and are drawn as marks on the top (NaN, +inf) or bottom (-inf)
-- edge; a series of a few points also gets a dot per point, with its value in a <title> tooltip.
local M = {}

local format, concat, floor, huge = string.format, table.concat, math.floor, math.huge

local W, H = 380, 210
local ML, MR, MT, MB = 58, 12, 12, 30 -- margins: left (y labels), right, top, bottom (x labels)
M.W, M.H = W, H

function M.esc(s)
  return (tostring(s):gsub('[&<>"]', { ['&'] = '&amp;', ['<'] = '&lt;', ['>'] = '&gt;', ['"'] = '&quot;' }))
end
local esc = M.esc

local function finite(x) return x == x and x ~= huge and x ~= -huge end
M.finite = finite

function M.fmt(x)
  if type(x) ~= 'number' then return tostring(x) end
  if x ~= x then return 'NaN' end
  if x == huge then return 'inf' end
  if x == -huge then return '-inf' end
  local a = math.abs(x)
  if a ~= 0 and (a < 1e-3 or a >= 1e6) then return format('%.3e', x) end
  return format('%.5g', x)
end
local fmt = M.fmt

-- About n "nice" ticks (1, 2, 5 times a power of ten) covering [lo, hi].
local function ticks(lo, hi, n)
  local span = hi - lo
  local raw = span / n
  local mag = 10 ^ floor(math.log10(raw))
  local step = mag
  for _, m in ipairs({ 1, 2, 5, 10 }) do
    step = m * mag
    if span / step <= n then break end
  end
  local out = {}
  local t = math.ceil(lo / step - 1e-9) * step
  while t <= hi + step * 1e-9 and #out < 20 do
    out[#out + 1] = math.abs(t) < step * 1e-9 and 0 or t
    t = t + step
  end
  return out
end

local function tick_label(t)
  local a = math.abs(t)
  if a ~= 0 and (a < 1e-3 or a >= 1e5) then return (format('%.1e', t):gsub('%.0e', 'e')) end
  return format('%.6g', t)
end

-- The range of xs and of the finite ys over every series; a flat range is widened.
local function ranges(series)
  local x0, x1, y0, y1 = huge, -huge, huge, -huge
  for _, s in ipairs(series) do
    for _, p in ipairs(s.points) do
      if p[1] < x0 then x0 = p[1] end
      if p[1] > x1 then x1 = p[1] end
      local y = p[2]
      if finite(y) then
        if y < y0 then y0 = y end
        if y > y1 then y1 = y end
      end
    end
  end
  if x0 > x1 then x0, x1 = 0, 1 end
  if x0 == x1 then x0, x1 = x0 - 1, x1 + 1 end
  local any = y0 <= y1
  if not any then y0, y1 = 0, 1 end
  if y0 == y1 then
    local pad = math.abs(y0) * 0.1
    if pad == 0 then pad = 1 end
    y0, y1 = y0 - pad, y1 + pad
  else
    local pad = (y1 - y0) * 0.05
    y0, y1 = y0 - pad, y1 + pad
  end
  return x0, x1, y0, y1, any
end

-- At most about 2 * buckets points: per bucket of consecutive points, its min and its max (so
-- spikes survive), in step order. Non-finite points are always kept.
local function thin(points, buckets)
  if #points <= buckets * 2 then return points end
  local size = math.ceil(#points / buckets)
  local out = {}
  for b = 1, #points, size do
    local lo, hi
    for i = b, math.min(b + size - 1, #points) do
      local p = points[i]
      if not finite(p[2]) then out[#out + 1] = p
      else
        if not lo or p[2] < lo[2] then lo = p end
        if not hi or p[2] > hi[2] then hi = p end
      end
    end
    if lo then
      if lo == hi then out[#out + 1] = lo
      elseif lo[1] < hi[1] then out[#out + 1] = lo; out[#out + 1] = hi
      else out[#out + 1] = hi; out[#out + 1] = lo end
    end
  end
  return out
end

-- A plot's frame: the <svg> opened (class cls, titled), the scales of x0..x1 and y0..y1 onto the
-- plot area, the axes with their grid and ticks. Returns the output list, sx, sy and the plot
-- area's width and height.
local function frame(title, cls, x0, x1, y0, y1)
  local pw, ph = W - ML - MR, H - MT - MB
  local function sx(x) return ML + (x - x0) / (x1 - x0) * pw end
  local function sy(y) return MT + (y1 - y) / (y1 - y0) * ph end
  local o = { format('<svg xmlns="http://www.w3.org/2000/svg" class="%s" viewBox="0 0 %d %d" width="%d" height="%d" ' ..
    'role="img" aria-label="%s">', cls, W, H, W, H, esc(title)), format('<title>%s</title>', esc(title)) }
  o[#o + 1] = format('<rect x="%d" y="%d" width="%d" height="%d" class="frame"/>', ML, MT, pw, ph)
  for _, t in ipairs(ticks(y0, y1, 4)) do
    local y = sy(t)
    o[#o + 1] = format('<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" class="grid"/>', ML, W - MR, y, y)
    o[#o + 1] = format('<text x="%d" y="%.1f" class="yl">%s</text>', ML - 4, y + 3.5, tick_label(t))
  end
  for _, t in ipairs(ticks(x0, x1, 5)) do
    local x = sx(t)
    o[#o + 1] = format('<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" class="grid"/>', x, x, MT, H - MB)
    o[#o + 1] = format('<text x="%.1f" y="%d" class="xl">%s</text>', x, H - MB + 14, tick_label(t))
  end
  o[#o + 1] = format('<text x="%d" y="%d" class="axis">step</text>', W - MR, H - 3)
  return o, sx, sy, pw, ph
end

function M.line_plot(p)
  local x0, x1, y0, y1, any = ranges(p.series)
  if p.x0 and p.x1 and p.x0 < p.x1 then x0, x1 = p.x0, p.x1 end
  local o, sx, sy, pw, ph = frame(p.title, 'plot', x0, x1, y0, y1)
  for _, m in ipairs(p.markers or {}) do
    if m.x >= x0 and m.x <= x1 then
      o[#o + 1] = format('<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" class="marker %s" stroke="%s"><title>%s</title></line>',
        sx(m.x), sx(m.x), MT, H - MB, m.cls or '', m.color or '#c00', esc(m.label or ''))
    end
  end
  for _, s in ipairs(p.series) do
    local pts = thin(s.points, 600)
    local d, pen = {}, false
    local bad = {}
    for _, q in ipairs(pts) do
      if finite(q[2]) then
        d[#d + 1] = format('%s%.1f %.1f', pen and 'L' or 'M', sx(q[1]), sy(q[2]))
        pen = true
      else
        pen = false
        bad[#bad + 1] = q
      end
    end
    o[#o + 1] = format('<g class="series %s">', s.cls or '')
    if #d > 0 then o[#o + 1] = format('<path d="%s" fill="none" stroke="%s" stroke-width="1.6"/>', concat(d, ''), s.color) end
    if #s.points <= 40 then
      for _, q in ipairs(s.points) do
        if finite(q[2]) then
          o[#o + 1] = format('<circle cx="%.1f" cy="%.1f" r="2.6" fill="%s"><title>%s step %s: %s</title></circle>',
            sx(q[1]), sy(q[2]), s.color, esc(s.name), fmt(q[1]), fmt(q[2]))
        end
      end
    end
    for _, q in ipairs(bad) do
      local x, y = sx(q[1]), (q[2] == -huge) and (H - MB) or MT
      local dy = (q[2] == -huge) and -7 or 7
      o[#o + 1] = format('<path d="M%.1f %.1fl-4 %dh8z" fill="%s" class="nonfinite"><title>%s step %s: %s</title></path>',
        x, y, dy, s.color, esc(s.name), fmt(q[1]), fmt(q[2]))
    end
    o[#o + 1] = '</g>'
  end
  if not any then
    o[#o + 1] = format('<text x="%.1f" y="%.1f" class="empty">no finite values</text>', ML + pw / 2, MT + ph / 2)
  end
  o[#o + 1] = '</svg>'
  return concat(o, '\n')
end

-- Stacked bars: one bar per step (or per bin of steps when there are many: their means), one
-- segment per part.
function M.stacked_bars(p)
  local steps = p.steps
  local bin = math.max(1, math.ceil(#steps / 300))
  local bars = {} -- { x0, x1, label, { value per part } }
  for b = 1, #steps, bin do
    local last = math.min(b + bin - 1, #steps)
    local vals = {}
    for j, part in ipairs(p.parts) do
      local sum, n = 0, 0
      for i = b, last do
        local v = part.values[steps[i]]
        if v and finite(v) and v > 0 then sum = sum + v end
        n = n + 1
      end
      vals[j] = sum / n
    end
    bars[#bars + 1] = { steps[b], steps[last], vals }
  end
  local top = p.top or 0
  for _, bar in ipairs(bars) do
    local t = 0
    for _, v in ipairs(bar[3]) do t = t + v end
    if t > top then top = t end
  end
  if top <= 0 then top = 1 end
  local x0, x1 = steps[1] - 0.5, steps[#steps] + 0.5
  local y0, y1 = 0, top * 1.05
  local o, sx, sy, pw = frame(p.title, 'plot bars', x0, x1, y0, y1)
  o[#o + 1] = format('<text x="4" y="%d" class="axis">s</text>', MT + 8)
  local bw = math.max(1, pw / #bars * 0.85)
  for _, bar in ipairs(bars) do
    local cx = sx((bar[1] + bar[2]) / 2)
    local label = bar[1] == bar[2] and ('step ' .. fmt(bar[1])) or format('steps %s-%s (mean)', fmt(bar[1]), fmt(bar[2]))
    local acc = 0
    for j, v in ipairs(bar[3]) do
      if v > 0 then
        local ya, yb = sy(acc), sy(acc + v)
        o[#o + 1] = format('<rect x="%.1f" y="%.1f" width="%.1f" height="%.2f" fill="%s"><title>%s: %s %s s</title></rect>',
          cx - bw / 2, yb, bw, math.max(ya - yb, 0.3), p.parts[j].color, label, esc(p.parts[j].name), fmt(v))
        acc = acc + v
      end
    end
  end
  o[#o + 1] = '</svg>'
  return concat(o, '\n')
end

return M
