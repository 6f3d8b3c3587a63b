-- The sandbox (moonrl.sandbox, core/sandbox) attacked: each attack must be contained and
-- reported as the limit it hit, the host unaffected: a fork bomb, a memory bomb, an infinite
-- loop (CPU and wall), children left behind with setsid and a double fork, writes outside the
-- work directory, reads of /etc/shadow, of a host directory and of the parent's environment (a
-- planted secret), a TCP connection to a listener on the host's 127.0.0.1, a full tmpfs, a file
-- past its size, gigabytes on stdout, kill -9 -1, a test harness the program tries to change,
-- the calls the seccomp filter refuses; and what a program needs still works (stdin, files,
-- env, exit status, signals, its own loopback); the warm pool's runs under the same attacks; an
-- unprivileged user's sandbox (rlimits, said aloud).
-- Skipped (77) where the machine gives no namespaces, which `moonrl doctor` reports.
local t = require('moonrl.testing')
local moonrl = require('moonrl')
local ffi = require('ffi')
local sandbox = require('moonrl.sandbox')
local proc = require('moonrl.io.proc')
local fs = require('moonrl.io.fs')

local caps = sandbox.probe()
print('  ' .. caps.detail)
if not caps.namespaces then
  print('skip: no namespaces here')
  os.exit(77)
end

local function sh(script, opts) return sandbox.run({ 'sh', '-c', script }, opts) end
local function py(code, opts) return sandbox.run({ 'python3', '-c', code }, opts) end

-- processes of the host whose command line matches pattern (pgrep -f), as a string
local function alive(pattern)
  return proc.run({ 'sh', '-c', 'pgrep -af "' .. pattern .. '" | grep -v pgrep || true' }, { timeout = 10 }).stdout
end

t.test('a program runs: stdin, files in /tmp, a clean environment plus its own, exit status, signal, limits reported none', function()
  local r = py('import sys, os; print(sys.stdin.read().upper(), open("data.txt").read(), os.getcwd(), ' ..
    'sorted(os.environ)); sys.exit(3)', { stdin = 'abc', files = { ['data.txt'] = 'xyz' }, env = { EXTRA = '1' } })
  t.eq(r.exited, true)
  t.eq(r.status, 3)
  t.eq(r.limit, 'none')
  t.eq(r.stdout, "ABC xyz /tmp ['EXTRA', 'HOME', 'LANG', 'PATH', 'TMPDIR']\n")
  t.truthy(r.wall_s > 0 and r.cpu_s > 0 and r.peak_memory_bytes > 0, 'times and memory measured')
  local k = sh('kill -TERM $$')
  t.eq(k.exited, false)
  t.eq(k.signal, 15)
  t.eq(k.ok, false)
end)

t.test('a fork bomb: refused at the process limit, reported as procs, nothing left', function()
  local r = sh('b(){ b|b& }; b; sleep 1', { limits = { procs = 32, wall_s = 10 } })
  t.eq(r.limit, 'procs')
  t.truthy(r.wall_s < 8, 'ended well before its deadline: ' .. r.wall_s)
end)

t.test('a memory bomb: killed at the memory limit, reported as memory', function()
  local r = py('a = []\nwhile True: a.append(bytearray(1 << 20))', { limits = { memory_mb = 64 } })
  t.eq(r.limit, 'memory')
  t.eq(r.signal, 9)
  t.truthy(r.peak_memory_bytes <= 64 * 2 ^ 20 + 2 ^ 20, 'its peak within the limit: ' .. r.peak_memory_bytes)
end)

t.test('an infinite loop: killed at its CPU time (of all its processes), or at the wall clock when it sleeps', function()
  local r = sh('while :; do :; done & while :; do :; done', { limits = { cpu_s = 0.5, wall_s = 20 } })
  t.eq(r.limit, 'cpu')
  t.truthy(r.cpu_s >= 0.5 and r.wall_s < 10, string.format('cpu %.2f s, wall %.2f s', r.cpu_s, r.wall_s))
  local w = sh('sleep 30', { limits = { wall_s = 0.5 } })
  t.eq(w.limit, 'wall')
  t.truthy(w.wall_s >= 0.5 and w.wall_s < 5, 'wall ' .. w.wall_s)
end)

t.test('children left behind (setsid, a double fork, busy or asleep) die with the run', function()
  local r = sh('setsid sh -c "while :; do :; done; : moonrl_sb_busy_7391" & (setsid sleep 7392 &) & ' ..
    '(sh -c "sleep 7393" &); sleep 0.2; echo started', { limits = { wall_s = 10 } })
  t.eq(r.stdout, 'started\n')
  t.eq(r.limit, 'none')
  t.eq(alive('moonrl_sb_busy_7391|sleep 739[23]'), '', 'nothing of it on the host')
  local k = sh('setsid sleep 7394 & sleep 30', { limits = { wall_s = 0.3 } })
  t.eq(k.limit, 'wall')
  t.eq(alive('sleep 7394'), '', 'nor when it is killed at its deadline')
end)

t.test('the file system: the runtime read-only, the host\'s files out of sight, /etc/shadow absent', function()
  local host = os.getenv('TMPDIR') or '/tmp'
  local dir = host .. '/moonrl_sandbox_secret_' .. tostring(os.time())
  fs.mkdirs(dir)
  local f = assert(io.open(dir .. '/secret.txt', 'w'))
  f:write('hunter2')
  f:close()
  local r = sh('echo x > /usr/pwned; echo x > /etc/pwned; echo x > /pwned; cat /etc/shadow; cat ' .. dir ..
    '/secret.txt; ls /root /home /work /var; echo ok > /tmp/mine; cat /tmp/mine')
  t.eq(r.stdout, 'ok\n')
  t.truthy(r.stderr:find("cannot access '/root': No such file", 1, true), 'the host\'s other directories absent')
  for _, want in ipairs({ '/usr/pwned: Read-only file system', '/etc/pwned: Read-only file system',
    '/pwned: Read-only file system', '/etc/shadow: No such file', 'secret.txt: No such file' }) do
    t.truthy(r.stderr:find(want, 1, true), 'refused: ' .. want .. ' in ' .. r.stderr)
  end
  t.truthy(not fs.exists('/usr/pwned') and not fs.exists('/etc/pwned'), 'nothing written on the host')
  os.remove(dir .. '/secret.txt')
  os.remove(dir)
end)

t.test('the parent\'s environment stays out: a planted secret is not in the program\'s nor readable from /proc/1', function()
  ffi.cdef('int setenv(const char *name, const char *value, int overwrite);')
  ffi.C.setenv('MOONRL_SANDBOX_PLANTED', 'hunter2-planted', 1)
  local r = sh('env; cat /proc/1/environ; tr "\\0" "\\n" < /proc/self/environ; cat /proc/1/mem')
  t.truthy(not (r.stdout .. r.stderr):find('hunter2%-planted'), 'the secret is not visible')
  t.truthy(r.stderr:find('/proc/1/environ: Permission denied', 1, true), r.stderr)
end)

t.test('no network: a connection to a listener on the host\'s 127.0.0.1 fails, with or without the sandbox\'s own loopback', function()
  local port_file = os.tmpname()
  os.remove(port_file)
  local listener = proc.spawn({ 'python3', '-c', 'import socket, sys, time\ns = socket.socket()\n' ..
    's.bind(("127.0.0.1", 0)); s.listen()\nopen(sys.argv[1] + ".part", "w").write(str(s.getsockname()[1]))\n' ..
    'import os; os.rename(sys.argv[1] + ".part", sys.argv[1]); time.sleep(60)', port_file }, { timeout = 60 })
  for _ = 1, 200 do -- (its port, once it listens)
    if fs.exists(port_file) then break end
    moonrl.sleep(0.05)
  end
  local port = tonumber(fs.read(port_file))
  os.remove(port_file)
  t.truthy(port, 'the listener started')
  port = port or 1
  local code = string.format('import socket\ntry:\n    socket.create_connection(("127.0.0.1", %d), timeout=2)\n' ..
    '    print("connected")\nexcept OSError as e:\n    print("refused", e.errno)', port)
  local host = proc.run({ 'python3', '-c', code }, { timeout = 10 })
  for _, net in ipairs({ 'none', 'loopback' }) do
    local r = py(code, { network = net })
    t.truthy(r.stdout:find('^refused'), net .. ': ' .. r.stdout .. r.stderr)
  end
  local own = py('import socket\ns = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()\n' ..
    'socket.create_connection(s.getsockname()); print("own loopback")', { network = 'loopback' })
  t.eq(own.stdout, 'own loopback\n')
  listener:kill()
  t.truthy(host.stdout:find('^connected'), 'the host itself reaches the listener: ' .. host.stdout)
end)

t.test('filling the tmpfs: reported as disk; a file past its size: as file', function()
  local r = sh('dd if=/dev/zero of=/tmp/fill bs=1M count=64 2>&1; echo rc=$?', { limits = { tmpfs_mb = 8 } })
  t.eq(r.limit, 'disk')
  t.truthy(r.stdout:find('No space left', 1, true), r.stdout)
  local f = sandbox.run({ 'dd', 'if=/dev/zero', 'of=/tmp/big', 'bs=1M', 'count=8' }, { limits = { file_mb = 1 } })
  t.eq(f.limit, 'file')
  t.eq(f.signal, 25) -- SIGXFSZ
end)

t.test('gigabytes on stdout: killed at the output limit, the output truncated and marked', function()
  local r = sandbox.run({ 'yes', 'moonrl' }, { limits = { output_kb = 64 } })
  t.eq(r.limit, 'output')
  t.eq(#r.stdout, 64 * 1024)
  t.eq(r.stdout_truncated, true)
  t.truthy(r.wall_s < 5, 'at once: ' .. r.wall_s)
end)

t.test('kill -9 -1 inside reaches only the sandbox\'s own processes', function()
  local r = sh('sleep 100 & kill -9 -1; echo survived', { limits = { wall_s = 10 } })
  t.eq(r.stdout, 'survived\n')
  t.truthy(r.ok and r.wall_s < 5, 'the run went on: ' .. r.wall_s)
end)

t.test('a test harness in /box: the program cannot change it', function()
  local harness = 'print("harness intact")\n'
  local r = sh('echo "print(1)" > /box/harness.py; rm -f /box/harness.py; chmod 777 /box/harness.py; ' ..
    'mv /box/harness.py /tmp/; python3 /box/harness.py', { files = { ['harness.py'] = { data = harness, read_only = true } } })
  t.eq(r.stdout, 'harness intact\n')
  t.truthy(r.stderr:find('Read-only file system', 1, true), r.stderr)
end)

t.test('seccomp, capabilities and no_new_privs: the calls untrusted code never needs are refused', function()
  local r = py([[
import ctypes, os, errno
libc = ctypes.CDLL(None, use_errno=True)
for name, args in [("unshare", (0x10000000,)), ("mount", (b"none", b"/tmp", b"tmpfs", 0, None)),
                   ("ptrace", (16, 1, 0, 0)), ("setns", (0, 0))]:
    rc = getattr(libc, name)(*args)
    print(name, rc, errno.errorcode.get(ctypes.get_errno()))
status = open("/proc/self/status").read()
print([l for l in status.splitlines() if l.startswith(("CapEff", "CapBnd", "NoNewPrivs", "Seccomp:"))])
]])
  t.eq(r.stdout, 'unshare -1 EPERM\nmount -1 EPERM\nptrace -1 EPERM\nsetns -1 EPERM\n' ..
    "['CapEff:\\t0000000000000000', 'CapBnd:\\t0000000000000000', 'NoNewPrivs:\\t1', 'Seccomp:\\t2']\n", r.stderr)
end)

t.test('bad input is an error naming the field; a missing program the sandbox\'s error, not a result', function()
  t.raises(function() sandbox.run({ 'true' }, { files = { ['../x'] = 'y' } }) end, "files[0].name '../x'")
  t.raises(function() sandbox.run({ 'true' }, { limits = { memory_mb = -1 } }) end, 'limits.memory_mb is -1')
  t.raises(function() sandbox.run({ 'true' }, { limits = { walltime = 1 } }) end, "unknown limit 'walltime'")
  t.raises(function() sandbox.run({ 'true' }, { network = 'host' }) end, "network 'host'")
  t.raises(function() sandbox.run({ 'true' }, { ro_paths = { '/tmp' } }) end, "ro_paths[0] '/tmp' is under /tmp")
  t.raises(function() sandbox.run({}) end, 'argv')
  t.raises(function() sandbox.run({ 'no-such-program-xyz' }) end, "program 'no-such-program-xyz' is not in the sandbox's PATH")
  t.raises(function() sandbox.run({ '/tmp/absent' }) end, 'execve /tmp/absent: No such file')
end)

t.test('the warm pool: a run forked from a started interpreter, contained as a cold run is', function()
  local pool = sandbox.pool('python')
  local function run(code, opts)
    opts = opts or {}
    opts.pool = pool
    return sandbox.run({ 'python3', '-c', code }, opts)
  end
  local r = run('import sys, os\nprint(sys.stdin.read().upper(), open("data.txt").read(), open("/box/h.py").read(), ' ..
    'os.getcwd(), sorted(os.environ), sys.argv)\nsys.exit(3)', { stdin = 'abc', env = { EXTRA = 1 },
    files = { ['data.txt'] = 'xyz', ['h.py'] = { data = 'ro', read_only = true } } })
  t.eq(r.stdout, "ABC xyz ro /tmp ['EXTRA', 'HOME', 'LANG', 'PATH', 'TMPDIR'] ['-c']\n", r.stderr)
  t.eq(r.status, 3)
  -- its own namespaces: only its own processes in /proc, nothing of the zygote or another run
  local ps = run('import os\nprint(sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))')
  t.eq(ps.stdout, '[1, 2]\n', 'its first process and itself')
  local file = sandbox.run({ 'python3', 'main.py', 'x' }, { pool = pool, files = { ['main.py'] = 'import sys\nprint(sys.argv)' } })
  t.eq(file.stdout, "['main.py', 'x']\n")
  -- the limits, each its own run's
  t.eq(run('def b():\n    import os\n    while True: os.fork()\nb()', { limits = { procs = 16, wall_s = 5 } }).limit, 'procs')
  local m = run('a = []\nwhile True: a.append(bytearray(1 << 20))', { limits = { memory_mb = 64 } })
  t.eq(m.limit, 'memory')
  t.eq(run('while True: pass', { limits = { cpu_s = 0.3, wall_s = 10 } }).limit, 'cpu')
  t.eq(run('import time\ntime.sleep(30)', { limits = { wall_s = 0.3 } }).limit, 'wall')
  t.eq(run('import sys\nwhile True: sys.stdout.write("y" * 4096)', { limits = { output_kb = 64 } }).limit, 'output')
  local left = run('import os, subprocess\nsubprocess.Popen(["setsid", "sleep", "7395"])\n' ..
    'os.system("(sleep 7396 &)")\nos.kill(-1, 9)\nprint("survived")')
  t.eq(left.stdout, 'survived\n', left.stderr)
  t.eq(alive('sleep 739[56]'), '', 'nothing of it left on the host')
  -- no capabilities, the filter, no_new_privs; the environment clean of the parent's
  local caps = run('import ctypes\nprint(ctypes.CDLL(None, use_errno=True).unshare(0x20000), ' ..
    '[l for l in open("/proc/self/status").read().splitlines() if l.startswith(("CapEff", "NoNewPrivs", "Seccomp:"))])')
  t.eq(caps.stdout, "-1 ['CapEff:\\t0000000000000000', 'NoNewPrivs:\\t1', 'Seccomp:\\t2']\n", caps.stderr)
  -- runs side by side on the pool (a batch), each its own
  local runs = {}
  for i = 1, 8 do runs[i] = { { 'python3', '-c', 'print(' .. i .. ' * 3)' }, { pool = pool } } end
  for i, x in ipairs(sandbox.run_batch(runs, { concurrency = 4 })) do t.eq(x.stdout, (i * 3) .. '\n') end
  -- what a pool does not run: an error naming it
  t.raises(function() sandbox.run({ 'sh', '-c', 'true' }, { pool = pool }) end, 'a run is `python3 FILE ARGS`')
  t.raises(function() sandbox.run({ 'python3', '-c', '1' }, { pool = pool, network = 'loopback' }) end,
    'the run asks network 1, the pool has 0')
  t.raises(function() sandbox.run({ 'python3', 'absent.py' }, { pool = pool }) end, 'absent.py')
  pool:close()
end)

t.test('an unprivileged user: its own id mapped, rlimits where no cgroup is writable, said aloud', function()
  local exe = rawget(_G, 'MOONRL_EXE')
  ffi.cdef('unsigned int geteuid(void);')
  if not exe or ffi.C.geteuid() ~= 0 or proc.run({ 'sh', '-c', 'command -v setpriv' }, { timeout = 10 }).stdout == '' then
    print('  (skipped: needs root to become nobody, and setpriv)')
    return
  end
  local r = proc.run({ 'setpriv', '--reuid=65534', '--regid=65534', '--clear-groups', exe, 'sandbox', '--memory', '64', '--',
    'python3', '-c', 'import os\nprint(os.getuid(), open("/etc/passwd").read().count(":"))\na = bytearray(200 << 20)' },
    { timeout = 60 })
  t.eq(r.exit_status, 1)
  t.truthy(r.stdout:find('^0 '), 'uid 0 inside: ' .. r.stdout .. r.stderr)
  t.truthy(r.stderr:find('MemoryError', 1, true), 'the memory limit as address space: ' .. r.stderr)
  t.truthy(r.stderr:find('sandbox: no usable cgroup', 1, true) and r.stderr:find('weaker', 1, true), 'said aloud')
end)

t.test('the host unaffected: no cgroup of a run is left', function()
  ffi.cdef('int getpid(void);')
  local left = proc.run({ 'sh', '-c', 'find /sys/fs/cgroup -maxdepth 4 -name "moonrl-sandbox-' .. ffi.C.getpid() ..
    '-*" 2>/dev/null' }, { timeout = 30 }).stdout
  t.eq(left, '')
end)

t.done()
