# The warm pool's zygote (core/sandbox/pool.c): a Python interpreter started once in a sandbox,
# its common modules imported, that forks one execution a request, so that a Python program costs a
# fork instead of an interpreter's start. It is moonrl's own program (from the C library, read-only
# in /box), the sandbox's only process with its capabilities (within the sandbox's user namespace):
# each execution drops them before a line of the program runs.
#
# A request (fd 4, a stream socket): b"MRLZ", its length, then the body (pool.c's request()), with
# the run's descriptors attached: stdin, stdout, stderr, the report's pipe, and the run's cgroup.procs
# files. For each request:
#   C2 (cloned into new PID, mount and IPC namespaces, reaped by the kernel: the zygote never waits
#      on a run), the run's first process: moves itself into the run's cgroups, mounts its /proc, a fresh size-capped /tmp with the
#      run's files, /box with its read-only ones, /dev/shm; forks C3, reaps until C3 has ended,
#      writes the report (sandbox_internal.h's sb_report) and exits, and the kernel kills whatever
#      is left in the namespace;
#   C3: its streams, rlimits, no capabilities (SECBIT_NOROOT, the bounding set emptied),
#      no_new_privs and the seccomp filter (/box/seccomp.bpf, the C library's), then the program:
#      `python3 FILE ARGS` or `python3 -c CODE ARGS` run in this interpreter.
# A failure of a run's setup is reported (SB_REPORT_FAIL with its stage and errno) and ends that run
# only; the zygote goes on.
import atexit
import ctypes
import errno
import gc
import os
import runpy
import signal
import socket
import struct
import sys
import traceback
import types

# imported once, so that the programs that use them start at once
import bisect, collections, copy, dataclasses, decimal, fractions, functools, heapq, io, itertools  # noqa: E401,F401
import select, subprocess, tempfile  # noqa: E401,F401
import json, math, operator, random, re, resource, statistics, string, time, typing  # noqa: E401,F401

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
libc.syscall.restype = ctypes.c_long

# the stages of sandbox_internal.h (SB_STAGE_*) a failure names, and its report's layout
STAGE_PROC, STAGE_TMP, STAGE_FILE, STAGE_BOX = 8, 9, 10, 11
STAGE_FORK, STAGE_STDIO, STAGE_LIMITS, STAGE_CAPS, STAGE_SECCOMP, STAGE_EXEC = 17, 18, 19, 20, 21, 22
REPORT = struct.Struct("=6i3q")  # kind, stage, err, status, disk_full, op; utime_us, stime_us, maxrss_kb
FAIL, DONE = 1, 2
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_RDONLY, MS_REMOUNT, MS_REC, MS_PRIVATE = 2, 4, 8, 1, 32, 16384, 1 << 18
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID = 0x20000, 0x08000000, 0x20000000
PR_SET_SECUREBITS, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 28, 24, 38, 22
SECBITS = 0x1 | 0x2 | 0x4 | 0x8 | 0x20 | 0x40 | 0x80  # NOROOT, NO_SETUID_FIXUP (each locked), KEEP_CAPS_LOCKED, NO_CAP_AMBIENT_RAISE+LOCKED
SYS_CAPSET, SYS_CLONE = {"x86_64": (126, 56), "aarch64": (91, 220)}[os.uname().machine]

with open("/box/seccomp.bpf", "rb") as f:
    FILTER = f.read()
filter_buf = ctypes.create_string_buffer(FILTER, len(FILTER))


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


FPROG = SockFprog(len(FILTER) // 8, ctypes.cast(filter_buf, ctypes.c_void_p))


class Fail(Exception):
    def __init__(self, stage, err):
        super().__init__(stage, err)
        self.stage, self.err = stage, err


def check(rc, stage):
    if rc != 0:
        raise Fail(stage, ctypes.get_errno() or errno.EIO)


def report(fd, kind, stage=0, err=0, status=0, disk_full=0, ru=None):
    times = (0, 0, 0) if ru is None else (int(ru.ru_utime * 1e6), int(ru.ru_stime * 1e6), ru.ru_maxrss)
    try:
        os.write(fd, REPORT.pack(kind, stage, err, status, disk_full, -1, *times))
    except OSError:
        pass


def recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


class Reader:
    def __init__(self, body):
        self.body, self.at = body, 0

    def take(self, fmt):
        v = struct.unpack_from(fmt, self.body, self.at)
        self.at += struct.calcsize(fmt)
        return v

    def blob(self):
        (n,) = self.take("=Q")
        b = self.body[self.at:self.at + n]
        self.at += n
        return b


def parse(body):
    r = Reader(body)
    argv = [r.blob().decode() for _ in range(r.take("=I")[0])]
    env = [r.blob().decode() for _ in range(r.take("=I")[0])]
    files = []
    for _ in range(r.take("=I")[0]):
        name, data = r.blob().decode(), r.blob()
        (flags,) = r.take("=I")
        files.append((name, data, flags))
    cpu_s, as_bytes, nproc, nofile, fsize, tmpfs = r.take("=dqiiqq")
    return argv, env, files, cpu_s, as_bytes, nproc, nofile, fsize, tmpfs


def mount(src, target, fstype, flags, data):
    return libc.mount(src and src.encode(), target.encode(), fstype and fstype.encode(), flags, data and data.encode())


def write_files(files, directory, read_only):
    for name, data, flags in files:
        if bool(flags & 2) != read_only:
            continue
        fd = os.open(directory + "/" + name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o755 if flags & 1 else 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)


def drop_privileges(cpu_s, as_bytes, nproc, nofile, fsize):
    try:
        cpu = int(cpu_s) + (1 if cpu_s > int(cpu_s) else 0)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if as_bytes > 0:
            resource.setrlimit(resource.RLIMIT_AS, (as_bytes, as_bytes))
        if nproc > 0:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    except (OSError, ValueError) as e:
        raise Fail(STAGE_LIMITS, getattr(e, "errno", None) or errno.EINVAL)
    check(libc.prctl(PR_SET_SECUREBITS, SECBITS, 0, 0, 0), STAGE_CAPS)
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # (EINVAL past the last)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    check(libc.syscall(SYS_CAPSET, header, data), STAGE_CAPS)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), STAGE_SECCOMP)
    check(libc.prctl(PR_SET_SECCOMP, 2, ctypes.addressof(FPROG), 0, 0), STAGE_SECCOMP)


def run_program(argv, env):
    """C3, privileges dropped: the program as `python3 ARGS` would run it; never returns"""
    os.environ.clear()
    for kv in env:
        k, _, v = kv.partition("=")
        os.environ[k] = v
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False, buffering=1)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    random.seed()
    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    status = 0
    try:
        if argv[1] == "-c":
            sys.argv = ["-c"] + argv[3:]
            sys.path[0] = ""
            exec(compile(argv[2], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = argv[1:]
            sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))
            runpy.run_path(argv[1], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            status = 0
        elif isinstance(e.code, int):
            status = e.code & 0xFF
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:
        traceback.print_exc()
        status = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(status)


def execution(fds, body):
    """C2, the run's first process (cloned into its PID, mount and IPC namespaces): never returns"""
    stdin, stdout, stderr, rep = fds[:4]
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        argv, env, files, cpu_s, as_bytes, nproc, nofile, fsize, tmpfs = parse(body)
        for fd in fds[4:]:  # into the run's cgroups, before anything forks
            os.write(fd, b"0")
            os.close(fd)
        # its own /proc, /tmp, /box and /dev/shm
        check(mount(None, "/", None, MS_REC | MS_PRIVATE, None), STAGE_PROC)
        check(mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), STAGE_PROC)
        size = "size=%d,mode=0755" % tmpfs
        check(mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, size), STAGE_TMP)
        check(mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=%d,mode=1777" % tmpfs), STAGE_TMP)
        box = any(flags & 2 for _, _, flags in files)  # (without read-only files /box stays the pool's)
        if box:
            check(mount("tmpfs", "/box", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755"), STAGE_BOX)
        try:
            write_files(files, "/tmp", False)
            write_files(files, "/box", True)
        except OSError as e:
            raise Fail(STAGE_FILE, e.errno or errno.EIO)
        if box:
            check(mount(None, "/box", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None), STAGE_BOX)
        if argv[1] != "-c" and not os.path.exists(os.path.join("/tmp", argv[1])):
            raise Fail(STAGE_EXEC, errno.ENOENT)
        pid = os.fork()
        if pid == 0:  # C3
            try:
                os.dup2(stdin, 0)
                os.dup2(stdout, 1)
                os.dup2(stderr, 2)
                os.chdir("/tmp")
                drop_privileges(cpu_s, as_bytes, nproc, nofile, fsize)
            except Fail as f:
                report(rep, FAIL, f.stage, f.err)
                os._exit(127)
            except OSError as e:
                report(rep, FAIL, STAGE_STDIO, e.errno or errno.EIO)
                os._exit(127)
            os.closerange(3, 65536)  # (the report's pipe too: the program never holds it)
            run_program(argv, env)
        for fd in (stdin, stdout, stderr):
            os.close(fd)
        while True:
            try:
                got, status, _ = os.wait4(-1, 0)
            except ChildProcessError:
                status = 0x7F00
                break
            except InterruptedError:
                continue
            if got == pid:
                break
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        st = os.statvfs("/tmp")
        report(rep, DONE, status=status, disk_full=int(st.f_bavail == 0), ru=ru)
        os._exit(0)
    except Fail as f:
        report(rep, FAIL, f.stage, f.err)
    except BaseException:  # (a bug of this file: its traceback on the zygote's stderr, which pool.c reads)
        traceback.print_exc()
        sys.stderr.flush()
        report(rep, FAIL, STAGE_FORK, errno.EIO)
    os._exit(127)


def main():
    ctl = socket.socket(fileno=4)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # (the runs' first processes are reaped by the kernel)
    gc.collect()
    gc.freeze()  # (the collector leaves the imported objects alone: a run copies fewer of their pages)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        try:
            head, fds, _, _ = socket.recv_fds(ctl, 8, 8)
        except (EOFError, ConnectionError):
            return
        if len(head) == 0:
            return
        if len(head) < 8:
            head += recv_exact(ctl, 8 - len(head))
        magic, n = struct.unpack("=4sI", head)
        body = recv_exact(ctl, n)
        if magic != b"MRLZ" or len(fds) < 4:
            for fd in fds:
                os.close(fd)
            continue
        # the run's first process, in its own PID, mount and IPC namespaces: a raw clone (this
        # interpreter has no other thread, so os.fork's bookkeeping is not needed), whose end
        # the kernel reaps (SIGCHLD ignored)
        pid = libc.syscall(SYS_CLONE, CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC | signal.SIGCHLD, 0, 0, 0, 0)
        if pid == 0:
            ctl.close()
            execution(fds, body)
        if pid < 0:
            report(fds[3], FAIL, STAGE_FORK, ctypes.get_errno() or errno.EIO)
        for fd in fds:
            os.close(fd)


main()
