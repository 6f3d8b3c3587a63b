-- moonrl doctor: what this machine gives a run, and what is missing or slow, in a few lines.
--   moonrl doctor [--dir RUN_DIR_PARENT]
-- Each line is "ok", "warn" (works, but slower or without a feature) or "FAIL" (a run that
-- needs it will not start); the exit status is 1 when a line failed, else 0.
local ffi = require('ffi')
local moonrl = require('moonrl')
local fs = require('moonrl.io.fs')
local proc = require('moonrl.io.proc')

local M = {}

local USAGE = [[
usage: moonrl doctor [--dir DIR]
  checks the CPU and the kernels chosen, threads, BLAS, oneDNN, MPI and the launcher, CUDA and
  NCCL, the sandbox (namespaces, seccomp, cgroups), free memory, and free disk where runs will
  write (DIR, default the current directory)]]

local read = fs.read -- the text of a file, or nil

local function gib(bytes) return string.format('%.1f GiB', bytes / 2 ^ 30) end

-- The directory libmoonrl.so was loaded from (the MPI plugin lives next to it).
local function library_dir()
  for line in (read('/proc/self/maps') or ''):gmatch('[^\n]+') do
    local path = line:match('(/%S*libmoonrl%.so[%.%d]*)$')
    if path then return path:match('^(.*)/[^/]+$') end
  end
  return nil
end

local function which(name)
  for d in (os.getenv('PATH') or ''):gmatch('[^:]+') do
    if fs.stat(d .. '/' .. name) then return d .. '/' .. name end
  end
  return nil
end

-- OpenBLAS's own report of the kernels it picked (libmoonrl links it: its symbols are in reach).
pcall(ffi.cdef, 'char *openblas_get_corename(void); char *openblas_get_config(void); int openblas_get_num_threads(void);')
local function openblas()
  local ok, core = pcall(function() return ffi.string(ffi.C.openblas_get_corename()) end)
  if not ok then return nil end
  local _, config = pcall(function() return ffi.string(ffi.C.openblas_get_config()) end)
  return core, config
end

function M.main(args)
  local dir = '.'
  local i = 1
  while i <= #args do
    if args[i] == '--dir' and args[i + 1] then dir = args[i + 1]; i = i + 1
    elseif args[i] == '-h' or args[i] == '--help' then print(USAGE); return 0
    else moonrl.usage_error('doctor: unknown argument ' .. args[i] .. '\n' .. USAGE) end
    i = i + 1
  end
  local failed = false
  local function line(kind, what, text)
    if kind == 'FAIL' then failed = true end
    print(string.format('%-4s  %-10s %s', kind, what, text))
  end
  local v = moonrl.version()
  print(string.format('moonrl %s (git %s), home %s', v.version, v.git, moonrl.home))

  -- the CPU and the kernels chosen for it
  local cpu = (read('/proc/cpuinfo') or ''):match('model name%s*:%s*([^\n]+)') or 'unknown CPU'
  local has = function(f) return moonrl.C.mrl_cpu_has(f) ~= 0 end
  local isa = v.kernels
  local best = has('avx512f') and 'avx512' or has('avx2') and 'avx2' or 'sse'
  line(isa == best and 'ok' or 'warn', 'cpu', string.format('%s; kernels: %s (built: %s)%s', cpu, isa, v.kernels_built,
    isa == best and '' or ', below what the CPU has (' .. best .. ')'))
  local bf16 = has('avx512bf16') and 'AVX512-BF16' or nil
  if has('amx_bf16') then bf16 = (bf16 and bf16 .. ' and ' or '') .. 'AMX-BF16' end
  local products = ffi.string(moonrl.C.mrl_bf16_products())
  -- AMX that moonrl does not use: Linux did not grant the tile state, or MOONRL_AMX=0
  local amx_unused = bf16 and bf16:find('AMX', 1, true) and not products:find('amx (', 1, true)
  line(bf16 and not amx_unused and 'ok' or 'warn', 'bf16', bf16 and string.format('the CPU has %s; products: %s%s', bf16,
    products, amx_unused and (os.getenv('MOONRL_AMX') == '0' and ' (our AMX tiles off: MOONRL_AMX=0)'
      or ' (our AMX tiles off: Linux did not grant this process the tile state)') or '')
    or 'no AVX512-BF16 or AMX: products stay fp32')

  -- threads
  local cores = 0
  for _ in (read('/proc/cpuinfo') or ''):gmatch('\nprocessor%s*:') do cores = cores + 1 end
  if (read('/proc/cpuinfo') or ''):match('^processor') then cores = cores + 1 end
  local t = v.threads
  line(t <= math.max(cores, 1) and 'ok' or 'warn', 'threads', string.format('%d kernel threads on %d CPUs%s%s', t, cores,
    os.getenv('MOONRL_THREADS') and (' (MOONRL_THREADS=' .. os.getenv('MOONRL_THREADS') .. ')') or '',
    t > cores and ': more threads than CPUs oversubscribes them' or ''))

  -- BLAS
  local core, config = openblas()
  -- the library the fp32 products take, and whether OpenBLAS's kernels are below the CPU's set
  -- (kernels/cpu/blas.h: then oneDNN computes them where it is built in)
  local fp32 = ffi.string(moonrl.C.mrl_fp32_products())
  local below, onednn = fp32:find('below') ~= nil, fp32:find('^oneDNN') ~= nil
  if core then
    line(below and not onednn and 'warn' or 'ok', 'blas', string.format('OpenBLAS, %s kernels (%s)%s', core,
      config or '?', below and (onednn and ': below the CPU\'s instruction set, so the fp32 products use oneDNN' or
        ': below the CPU\'s instruction set (OPENBLAS_CORETYPE picks others)') or ''))
  else
    line('warn', 'blas', 'the BLAS library does not say which kernels it uses (not OpenBLAS?)')
  end
  line('ok', 'fp32', 'products: ' .. fp32)
  local dnnl = pcall(ffi.load, 'libdnnl.so.2') or pcall(ffi.load, 'libdnnl.so')
  line(dnnl and 'ok' or 'warn', 'onednn', dnnl and 'libdnnl found' or 'libdnnl not found (Debian libdnnl-dev): no oneDNN products')

  -- MPI and the launcher
  local lib = library_dir()
  local plugin = os.getenv('MOONRL_MPI_PLUGIN') or (lib and lib .. '/libmoonrl_mpi.so')
  local mpirun = which('mpirun')
  if plugin and fs.stat(plugin) then
    local ver = mpirun and proc.run({ mpirun, '--version' }, { timeout = 10 }).stdout:match('[^\n]+') or nil
    line(mpirun and 'ok' or 'warn', 'mpi', string.format('plugin %s; %s', plugin,
      mpirun and ('launcher ' .. mpirun .. ' (' .. (ver or '?') .. ')') or 'no mpirun on PATH: use srun, or install openmpi-bin'))
  else
    line('warn', 'mpi', 'moonrl was built without MPI (libopenmpi-dev): one process only')
  end
  if os.getenv('SLURM_JOB_ID') then line('ok', 'slurm', 'inside Slurm job ' .. os.getenv('SLURM_JOB_ID')) end

  -- CUDA
  if v.backends:find('cuda', 1, true) then
    line(v.cuda_devices > 0 and 'ok' or 'warn', 'cuda', string.format('built; %d device(s) visible%s', v.cuda_devices,
      v.cuda_devices == 0 and ' (no GPU, or CUDA_VISIBLE_DEVICES hides them)' or ''))
    local nccl = pcall(ffi.load, 'libnccl.so.2') or pcall(ffi.load, 'libnccl.so')
    line(nccl and 'ok' or 'warn', 'nccl', nccl and 'libnccl found' or 'libnccl not found')
  else
    line('ok', 'cuda', 'not built (CPU only)')
  end

  -- the sandbox (model-written code: reward=code, tools): namespaces, seccomp, and cgroup limits
  -- or rlimits (never a silent fallback: a run that needs the sandbox stops where it has no
  -- namespaces)
  local sb = require('moonrl.sandbox').probe()
  line(not sb.namespaces and 'warn' or (sb.seccomp and sb.cgroup > 0) and 'ok' or 'warn', 'sandbox',
    (sb.namespaces and '' or 'unavailable (code rewards and tools will not run): ') .. sb.detail ..
    ((sb.namespaces and sb.cgroup == 0) and ' (weaker: memory as address space, processes counted per user)' or ''))

  -- memory and disk
  local meminfo = read('/proc/meminfo') or ''
  local total, avail = meminfo:match('MemTotal:%s*(%d+)'), meminfo:match('MemAvailable:%s*(%d+)')
  if avail then
    avail, total = tonumber(avail) * 1024, tonumber(total) * 1024
    line(avail > 2 ^ 31 and 'ok' or 'warn', 'memory', string.format('%s available of %s', gib(avail), gib(total)))
  end
  local okd, free = pcall(fs.free_bytes, dir)
  if okd and free then
    line(free > 5 * 2 ^ 30 and 'ok' or free > 2 ^ 30 and 'warn' or 'FAIL', 'disk',
      string.format('%s free in %s (checkpoints of a 135M model take ~1.3 GB each)', gib(free), dir))
  else
    line('FAIL', 'disk', dir .. ': ' .. tostring(free))
  end
  return failed and 1 or 0
end

return M
