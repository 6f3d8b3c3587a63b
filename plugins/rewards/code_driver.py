# The code reward's driver (plugins/rewards/code.lua), run inside the sandbox as
# `python3 /box/driver.py` (or outside it as `python3 driver.py DIR`, for the tests' comparison):
# it runs a program against its test cases and writes the verdict as one JSON line on its standard
# output. /box (read-only) holds this file, the program (solution.py or solution.c) and cases.json:
#   {"mode": "stdio", "cases": [{"input": "...", "output": "..."}], "timeout_s": 2}
#   {"mode": "assert", "cases": ["assert f(1) == 2", ...], "timeout_s": 2}   (Python only)
# Each case runs in a process of its own, forked from this one (a Python program) or started from
# the compiled binary (C, compiled once with the system's gcc); its standard streams are pipes of
# this driver, which alone judges: the program never holds the verdict's channel, and this process
# is not dumpable, so the program cannot reach it through /proc. A case passes when it ends with
# status 0 within timeout_s and (stdio) its output equals the expected one, line by line with
# trailing whitespace and trailing blank lines ignored; (assert) when it ran its assertion to the
# end. The verdict: {"passed": [true, false, ...], "reasons": ["ok", "wrong", "timeout", "error",
# ...], "compile": "ok" | message}.
import ctypes
import gc
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

OUTPUT_CAP = 1 << 20


def not_dumpable():
    try:
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    except OSError:
        pass


def normalize(text):
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def run_case(start, stdin_bytes, timeout_s):
    """start(stdin_fd, stdout_fd) -> pid; returns (status or None on timeout, output bytes)"""
    r_in, w_in = os.pipe()
    r_out, w_out = os.pipe()
    pid = start(r_in, w_out)
    os.close(r_in)
    os.close(w_out)
    out, deadline, fed = [], time.monotonic() + timeout_s, 0
    size = 0
    os.set_blocking(w_in, False)
    if not stdin_bytes:
        os.close(w_in)
        w_in = -1
    open_out = True
    while open_out:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        rs, ws, _ = select.select([r_out], [w_in] if w_in >= 0 else [], [], left)
        if ws:
            try:
                fed += os.write(w_in, stdin_bytes[fed:fed + 65536])
            except BlockingIOError:
                pass
            except BrokenPipeError:  # (it stopped reading: the rest is not its)
                fed = len(stdin_bytes)
            if fed >= len(stdin_bytes):
                os.close(w_in)
                w_in = -1
        if rs:
            chunk = os.read(r_out, 65536)
            if not chunk:
                open_out = False
            elif size < OUTPUT_CAP:
                out.append(chunk)
                size += len(chunk)
    timed_out = open_out
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    if w_in >= 0:
        os.close(w_in)
    os.close(r_out)
    # its end, within what is left of its time (a pidfd is readable once it has exited)
    pidfd = os.pidfd_open(pid)
    if not select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))[0]:
        os.kill(pid, signal.SIGKILL)
        timed_out = True
    os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    return (None if timed_out else status), b"".join(out)


def python_starter(code):
    def start(stdin_fd, stdout_fd):
        pid = os.fork()
        if pid:
            return pid
        try:
            os.dup2(stdin_fd, 0)
            os.dup2(stdout_fd, 1)
            null = os.open("/dev/null", os.O_WRONLY)
            os.dup2(null, 2)
            os.closerange(3, 1 << 16)
            sys.stdin = open(0, "r", closefd=False)
            sys.stdout = open(1, "w", closefd=False)
            status = 0
            try:
                exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
            except SystemExit as e:
                status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                status = 1
            sys.stdout.flush()
            os._exit(status)
        finally:
            os._exit(1)
    return start


STARTED = []  # (the binary's processes: this driver reaps them itself)


def binary_starter(path):
    def start(stdin_fd, stdout_fd):
        null = os.open("/dev/null", os.O_WRONLY)
        p = subprocess.Popen([path], stdin=stdin_fd, stdout=stdout_fd, stderr=null, close_fds=True)
        os.close(null)
        p.returncode = 0  # (reaped here: Popen must not wait for it again)
        STARTED.append(p)
        return p.pid
    return start


def main():
    not_dumpable()
    box = sys.argv[1] if len(sys.argv) > 1 else "/box"
    spec = json.load(open(box + "/cases.json"))
    mode, cases, timeout_s = spec["mode"], spec["cases"], float(spec.get("timeout_s", 2))
    verdict = {"passed": [], "reasons": [], "compile": "ok"}
    out = os.fdopen(os.dup(1), "w")  # the verdict's channel: this process's own
    devnull = os.open("/dev/null", os.O_WRONLY)
    os.dup2(devnull, 1)  # (nothing the cases inherit reaches it)
    if os.path.exists(box + "/solution.c"):
        binary = tempfile.mkdtemp() + "/solution"
        r = subprocess.run(["gcc", "-O2", "-std=gnu11", "-o", binary, box + "/solution.c", "-lm"],
                           capture_output=True, text=True, timeout=max(10.0, timeout_s))
        if r.returncode != 0:
            verdict["compile"] = r.stderr[-2000:] or "gcc failed"
            cases = []
        start_for = lambda case: binary_starter(binary)
    else:
        source = open(box + "/solution.py").read()
        try:
            program = compile(source, "solution.py", "exec")
        except (SyntaxError, ValueError) as e:
            verdict["compile"] = "%s: %s" % (type(e).__name__, e)
            cases = []
        if mode == "assert":
            def start_for(case):
                try:
                    test = compile(source + "\n\n" + case + "\n", "solution.py", "exec")
                except (SyntaxError, ValueError):
                    test = compile("raise SystemExit(1)", "test", "exec")
                return python_starter(test)
        else:
            start_for = lambda case: python_starter(program)
    gc.collect()
    gc.freeze()  # (each case's fork copies fewer pages: the collector leaves this process's objects alone)
    for case in cases:
        stdin = case["input"].encode() if mode == "stdio" else b""
        status, output = run_case(start_for(case), stdin, timeout_s)
        if status is None:
            reason = "timeout"
        elif status != 0:
            reason = "error"
        elif mode == "stdio" and normalize(output.decode("utf-8", "replace")) != normalize(case["output"]):
            reason = "wrong"
        else:
            reason = "ok"
        verdict["passed"].append(reason == "ok")
        verdict["reasons"].append(reason)
    out.write(json.dumps(verdict) + "\n")
    out.flush()


main()
