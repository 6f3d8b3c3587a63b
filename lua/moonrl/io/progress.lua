-- moonrl.io.progress: how far a long piece of work is, on the terminal and in the run directory.
--
--   local progress = require('moonrl.io.progress')
--   local p = progress.new('sft', 1500, { unit = 'step' })  -- total nil: a count without an end
--   for i = 1, 1500 do ...; p:update(i, 'loss 0.41') end    -- throttled: cheap to call often
--   p:finish()
--   local model = progress.task('loading model ' .. dir, function() return load(dir) end)
--
-- Where it goes (stderr, so that stdout keeps the results and the step lines):
--   live   one line rewritten in place with \r: "sft [####....] 120/1500 8% | 30.1 step/s | 0:04<0:46 | loss 0.41"
--          (redrawn at most 10 times a second; erased when a short piece of work ends)
--   plain  a line every `seconds` (default 10): "sft 120/1500 (8%) | 30.1 step/s | elapsed 0:04 | ETA 0:46 | loss 0.41",
--          and a last "done" line for work that lasted that long
--   off    nothing
--   auto   live when stderr is a terminal (TERM is not dumb), else plain (the default)
-- The mode and the interval come from MOONRL_PROGRESS and MOONRL_PROGRESS_SECONDS, and in a run
-- from run.progress and run.progress_seconds (their defaults are those variables), set with
-- progress.configure{ mode =, seconds = }. A rank other than 0 of a job of several shows nothing.
-- Before printing a line of its own while a live line is drawn, a caller clears it (p:clear(),
-- or progress.clear()); the next update draws it again.
--
-- The run's heartbeat files (moonrl status reads them):
--   local w = progress.status_writer(run_dir, rank, { recipe = 'grpo', world_size = 2 })
--   w:set({ loop = 'grpo', step = 12, total = 100, phase = 'train' }); w:write(force)
-- RUN_DIR/status/rank-<R>.json, one JSON object replaced atomically (temporary file + rename; not
-- fsync'ed, it is only a view): rank, world_size, recipe, pid, host, state (running, finished,
-- stopped, error), loop (the loop's phase: sft, grpo, main), step and total (of the loop),
-- global_step, loop_since, phase (the timed phase in progress: generate, train, checkpoint;
-- absent between them) and phase_since, rate (steps/s) and eta (s) when known, loss when known, message (why it
-- ended), started and time (wall-clock seconds since 1970), rss_mb and rss_peak_mb (the process's
-- resident memory at the write and its peak since it began, MiB). w:write() writes at most once
-- a second unless forced (at each phase change, at the end).
local ffi = require('ffi')
local moonrl = require('moonrl')
local json = require('moonrl.io.json')

pcall(ffi.cdef, [[
int isatty(int fd);
int gethostname(char *name, size_t len);
typedef struct { long tv_sec; long tv_usec; } mrl_progress_timeval;
int gettimeofday(mrl_progress_timeval *tv, void *tz);
typedef struct { unsigned short rows, cols, xpixel, ypixel; } mrl_progress_winsize;
int ioctl(int fd, unsigned long request, ...);
]])

local M = {}

M.MODES = { auto = true, live = true, plain = true, off = true }

local tv = ffi.new('mrl_progress_timeval')
-- Wall-clock seconds since 1970 (what another process compares with its own clock).
function M.wall()
  ffi.C.gettimeofday(tv, nil)
  return tonumber(tv.tv_sec) + tonumber(tv.tv_usec) * 1e-6
end

function M.hostname()
  local buf = ffi.new('char[256]')
  if ffi.C.gethostname(buf, 255) ~= 0 then return '?' end
  return ffi.string(buf)
end

local function isatty(fd)
  local ok, r = pcall(function() return ffi.C.isatty(fd) end)
  return ok and r == 1
end
M.isatty = isatty

-- The rank of this process in a job started by mpirun / srun (0 alone).
local function launcher_rank()
  for _, k in ipairs({ 'OMPI_COMM_WORLD_RANK', 'PMI_RANK', 'PMIX_RANK', 'SLURM_PROCID' }) do
    local v = tonumber(os.getenv(k) or '')
    if v then return v end
  end
  return 0
end

local settings = {}

local function check_mode(mode, where)
  if not M.MODES[mode] then
    moonrl.usage_error(string.format("%s must be one of auto, live, plain, off; got '%s'", where, tostring(mode)))
  end
end

-- opts.mode ('auto', 'live', 'plain', 'off'), opts.seconds (between plain lines, >= 0).
function M.configure(opts)
  opts = opts or {}
  local mode = opts.mode or os.getenv('MOONRL_PROGRESS') or 'auto'
  local env = os.getenv('MOONRL_PROGRESS')
  check_mode(mode, (not opts.mode or opts.mode == env) and 'MOONRL_PROGRESS' or "config key 'run.progress'")
  local seconds = opts.seconds or tonumber(os.getenv('MOONRL_PROGRESS_SECONDS') or '') or 10
  if not (seconds >= 0) then
    moonrl.usage_error(string.format("config key 'run.progress_seconds' must be >= 0, got %s", tostring(seconds)))
  end
  if mode == 'auto' then mode = (isatty(2) and os.getenv('TERM') ~= 'dumb') and 'live' or 'plain' end
  if launcher_rank() > 0 then mode = 'off' end
  settings.mode, settings.seconds = mode, seconds
end

local function ensure()
  if not settings.mode then
    local ok, err = pcall(M.configure)
    if not ok then -- a bad MOONRL_PROGRESS outside a run: said once, then the default
      io.stderr:write('moonrl: warning: ', moonrl.error_text(err), ' (using auto)\n')
      settings.mode = nil
      M.configure({ mode = 'auto' })
    end
  end
  return settings
end
function M.mode() return ensure().mode end

-- ---- formatting ---------------------------------------------------------------------------

function M.duration(s)
  if not s or s ~= s or s < 0 or s == math.huge then return '?' end
  s = math.floor(s + 0.5)
  if s >= 3600 then return string.format('%d:%02d:%02d', math.floor(s / 3600), math.floor(s / 60) % 60, s % 60) end
  return string.format('%d:%02d', math.floor(s / 60), s % 60)
end

local function num(x)
  if x >= 100 then return string.format('%.0f', x) end
  if x >= 10 then return string.format('%.1f', x) end
  return string.format('%.2f', x)
end

function M.bytes(n)
  local units = { 'B', 'kB', 'MB', 'GB', 'TB' }
  local i = 1
  while n >= 1000 and i < #units do n, i = n / 1000, i + 1 end
  return (i == 1 and string.format('%d', n) or num(n)) .. ' ' .. units[i]
end

local function columns()
  local ws = ffi.new('mrl_progress_winsize')
  local ok, r = pcall(function() return ffi.C.ioctl(2, 0x5413, ws) end) -- TIOCGWINSZ
  if ok and r == 0 and ws.cols > 0 then return ws.cols end
  return tonumber(os.getenv('COLUMNS') or '') or 80
end

-- ---- a progress ---------------------------------------------------------------------------

local P = {}
P.__index = P

local stack = {} -- the live progresses, innermost last: it owns the terminal line

-- opts: unit ('step'; 'B' counts bytes), start (done when it starts: a resumed loop), silent
-- (computes rate and ETA, shows nothing).
function M.new(label, total, opts)
  opts = opts or {}
  local s = ensure()
  local now = moonrl.now()
  local start = opts.start or 0
  local p = setmetatable({ label = label, total = total, unit = opts.unit or 'step', done = start,
    mode = opts.silent and 'off' or s.mode, seconds = s.seconds, t0 = now, last_draw = -math.huge, last_plain = now,
    start = start, plain_done = start, plain_lines = 0, anchors = { { t = now, done = start }, { t = now, done = start } } }, P)
  if p.mode == 'live' then
    if not M.hooked then -- a line left by an error is erased before the error prints
      M.hooked = true
      moonrl.on_exit(function() for i = #stack, 1, -1 do stack[i]:cancel() end end)
    end
    stack[#stack + 1] = p
    p:render(true)
  end
  return p
end

-- Steps per second over the last 5 to 10 seconds (since the start before that).
function P:rate()
  local a = self.anchors[1]
  local dt = moonrl.now() - a.t
  if dt <= 0 then return nil end
  if self.done == a.done and dt < 1 then return nil end
  return (self.done - a.done) / dt
end

function P:eta()
  local r = self:rate()
  if not self.total or not r or r <= 0 then return nil end
  return math.max(self.total - self.done, 0) / r
end

function P:elapsed() return moonrl.now() - self.t0 end

local function count(self, n)
  if self.unit == 'B' then return M.bytes(n) end
  return tostring(math.floor(n))
end

-- The text of the line (live: with a bar).
function P:text(live, final)
  local parts = {}
  local total, done = self.total, self.done
  if total and total > 0 then
    local frac = math.min(done / total, 1)
    local head = self.label
    if live then
      local w = 20
      local k = math.floor(frac * w + 0.5)
      head = head .. ' [' .. string.rep('#', k) .. string.rep('.', w - k) .. ']'
    end
    parts[1] = string.format(live and '%s %s/%s %d%%' or '%s %s/%s (%d%%)', head, count(self, done), count(self, total),
      math.floor(100 * frac))
  elseif done > 0 then
    parts[1] = self.label .. ' ' .. count(self, done) .. (self.unit == 'B' and '' or (' ' .. self.unit .. 's'))
  else
    parts[1] = self.label .. (final and '' or ' ...')
  end
  local elapsed = self:elapsed()
  local rate = final and (elapsed > 0 and (done - self.start) / elapsed) or self:rate()
  if rate and done > 0 then
    parts[#parts + 1] = self.unit == 'B' and (M.bytes(rate) .. '/s') or (num(rate) .. ' ' .. self.unit .. '/s')
  end
  if final then
    parts[#parts + 1] = 'done in ' .. M.duration(elapsed)
  elseif live then
    local eta = self:eta()
    parts[#parts + 1] = M.duration(elapsed) .. (eta and ('<' .. M.duration(eta)) or '')
  else
    parts[#parts + 1] = 'elapsed ' .. M.duration(elapsed)
    local eta = self:eta()
    if eta then parts[#parts + 1] = 'ETA ' .. M.duration(eta) end
  end
  if self.extra and self.extra ~= '' then parts[#parts + 1] = self.extra end
  return table.concat(parts, ' | ')
end

local function draw_live(text)
  local w = columns() - 1
  if #text > w then text = text:sub(1, w) end
  io.stderr:write('\r\27[K', text)
end

-- Draw now if due (force: now).
function P:render(force)
  if self.mode == 'off' or self.finished then return end
  local now = moonrl.now()
  if self.mode == 'live' then
    if stack[#stack] ~= self then return end
    if not force and now - self.last_draw < 0.1 then return end
    self.last_draw = now
    draw_live(self:text(true))
  elseif self.mode == 'plain' then
    if now - self.last_plain < self.seconds or self.done == self.plain_done then return end
    self.last_plain, self.plain_done = now, self.done
    self.plain_lines = self.plain_lines + 1
    io.stderr:write(self:text(false), '\n')
  end
end

-- Would an update now draw anything? (To skip computing what update would be given.)
function P:due()
  if self.mode == 'off' or self.finished then return false end
  local now = moonrl.now()
  if self.mode == 'live' then return now - self.last_draw >= 0.1 end
  return now - self.last_plain >= self.seconds
end

-- done: how much is done (of total); extra: a short text after the numbers (nil keeps the last).
function P:update(done, extra, force)
  if done then self.done = done end
  if extra then self.extra = extra end
  local now = moonrl.now()
  local b = self.anchors[2]
  if now - b.t >= 5 then self.anchors = { b, { t = now, done = self.done } } end
  self:render(force)
end

-- Erase the live line (before printing something else); the next update draws it again.
function P:clear()
  if self.mode == 'live' and stack[#stack] == self and not self.finished then
    io.stderr:write('\r\27[K')
    self.last_draw = -math.huge
  end
end
function M.clear() if stack[#stack] then stack[#stack]:clear() end end

-- The end: the live line erased (kept, with its totals, when it lasted a second or more or
-- opts.keep), a last plain line when the work lasted `seconds` or printed lines before.
function P:finish(extra, opts)
  if self.finished then return end
  if extra then self.extra = extra end
  local elapsed = self:elapsed()
  if self.mode == 'live' then
    local top = stack[#stack] == self
    for i = #stack, 1, -1 do if stack[i] == self then table.remove(stack, i) end end
    if top then
      if elapsed >= 1 or (opts and opts.keep) then
        draw_live(self:text(true, true))
        io.stderr:write('\n')
      else
        io.stderr:write('\r\27[K')
      end
      if stack[#stack] then stack[#stack]:render(true) end
    end
  elseif self.mode == 'plain' and (self.plain_lines > 0 or elapsed >= self.seconds) then
    io.stderr:write(self:text(false, true), '\n')
  end
  self.finished = true
end

-- The end without a last line (a loop left by an error or a stop): the live line erased.
function P:cancel()
  if self.finished then return end
  self:clear()
  self.finished = true
  for i = #stack, 1, -1 do if stack[i] == self then table.remove(stack, i) end end
  if stack[#stack] then stack[#stack]:render(true) end
end

-- Run fn(p, ...) inside a progress without a total (work in one C call: loading a model,
-- indexing a file); finished however fn ends. Returns fn's results.
function M.task(label, fn, ...)
  local p = M.new(label, nil)
  local res = { pcall(fn, p, ...) }
  if not res[1] then p:cancel(); error(res[2], 0) end
  p:finish()
  return unpack(res, 2, table.maxn(res))
end

-- Close every live line (the process is ending).
function M.finish_all()
  for i = #stack, 1, -1 do stack[i]:finish() end
end

-- ---- the run's heartbeat files ------------------------------------------------------------

local W = {}
W.__index = W

function M.status_path(dir, rank) return string.format('%s/status/rank-%d.json', dir, rank or 0) end

-- dir: the run directory; rank; fields: more constant fields (recipe, world_size).
function M.status_writer(dir, rank, fields)
  local w = setmetatable({ dir = dir, path = M.status_path(dir, rank), last = -math.huge,
    fields = { rank = rank or 0, pid = tonumber(moonrl.C.mrl_process_id()), host = M.hostname(), started = M.wall(),
      state = 'running' } }, W)
  for k, v in pairs(fields or {}) do w.fields[k] = v end
  pcall(require('moonrl.io.fs').mkdirs, dir .. '/status')
  return w
end

-- Fields to change (json.null, or false, removes one).
function W:set(t)
  for k, v in pairs(t) do
    if v == false or v == json.null then self.fields[k] = nil else self.fields[k] = v end
  end
end

-- The phase in progress (nil: none), since now.
function W:phase(name)
  if self.fields.phase == name then return end
  self:set({ phase = name or false, phase_since = M.wall() })
  self:write(true)
end

-- Write the file (at most once a second unless force). Never raises: a heartbeat that cannot be
-- written must not stop a run.
function W:write(force)
  local now = moonrl.now()
  if not force and now - self.last < 1 then return end
  self.last = now
  local f = self.fields
  f.time = M.wall()
  -- the rank's memory, read at each write (two reads of /proc/self/status, at most a few a second)
  local function mib(bytes) bytes = tonumber(bytes); return bytes >= 0 and math.floor(bytes / 2 ^ 20 * 10 + 0.5) / 10 or nil end
  f.rss_mb, f.rss_peak_mb = mib(moonrl.C.mrl_mem_rss()), mib(moonrl.C.mrl_mem_rss_peak_lifetime())
  local keys = {}
  for k in pairs(f) do keys[#keys + 1] = k end
  table.sort(keys)
  local obj = json.object()
  for _, k in ipairs(keys) do obj[k] = f[k] end
  pcall(function()
    local tmp = self.path .. '.tmp'
    local fh = io.open(tmp, 'w')
    if not fh then return end
    local ok = fh:write(json.encode(obj, { tostring = tostring }), '\n')
    ok = fh:close() and ok
    if ok then os.rename(tmp, self.path) else os.remove(tmp) end -- a full disk: the last one kept
  end)
end

return M
