# The python tool's interpreter (plugins/tools/python.lua), run in a sandbox session: cells of code
# come on its standard input ("MRLCELL <bytes>\n" then the code), each runs in the same globals
# (state kept across an episode's turns, as a notebook's), its output (print, stderr, the repr of
# a last expression, and what its child processes write) captured in a file of its /tmp, and its
# result goes out as one JSON line on this interpreter's standard output, which no cell writes to:
#   {"output": "...", "error": "Traceback ..." | null, "timed_out": false, "truncated": false}
# A cell past its time (the header's timeout_s) is interrupted (TimeoutError, by SIGALRM).
import ast
import json
import os
import signal
import sys
import traceback

OUTPUT_CAP = 64 << 10
results = os.fdopen(os.dup(1), "w")  # (the results' channel: fd 1 and 2 are the cells')
stdin = os.fdopen(os.dup(0), "rb")
devnull = os.open("/dev/null", os.O_RDONLY)
os.dup2(devnull, 0)  # (a cell reading its stdin gets nothing, not the next cell)
scope = {"__name__": "__main__", "__builtins__": __builtins__}
sys.stdout.reconfigure(line_buffering=True)  # (a cell's prints in order with its child processes' output)


class CellTimeout(BaseException):
    pass


def alarm(signum, frame):
    raise CellTimeout()


signal.signal(signal.SIGALRM, alarm)


def run(code, timeout_s):
    out = os.open("/tmp/.cell_output", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(out, 1), os.dup2(out, 2)
    error, timed_out = None, False
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        tree = ast.parse(code, "<cell>", "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<cell>", "exec"), scope)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), scope)
            if value is not None:
                print(repr(value))
    except CellTimeout:
        timed_out = True
        error = "TimeoutError: the cell ran past %g s" % timeout_s
    except SystemExit as e:
        error = "SystemExit: %s" % (e.code,)
    except BaseException:
        kind, value, tb = sys.exc_info()
        while tb is not None and tb.tb_frame.f_code.co_filename != "<cell>":  # (the cell's frames only)
            tb = tb.tb_next
        error = "".join(traceback.format_exception(kind, value, tb))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            sys.stdout.flush(), sys.stderr.flush()
        except BaseException:
            pass
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        os.close(saved[0]), os.close(saved[1])
    os.lseek(out, 0, os.SEEK_SET)
    text = os.read(out, OUTPUT_CAP + 1)
    os.close(out)
    return {"output": text[:OUTPUT_CAP].decode("utf-8", "replace"), "error": error, "timed_out": timed_out,
            "truncated": len(text) > OUTPUT_CAP}


while True:
    header = stdin.readline()
    if not header:
        break
    parts = header.split()
    if len(parts) != 3 or parts[0] != b"MRLCELL":
        break
    n, timeout_s = int(parts[1]), float(parts[2])
    code = stdin.read(n).decode("utf-8", "replace")
    results.write(json.dumps(run(code, timeout_s)) + "\n")
    results.flush()
