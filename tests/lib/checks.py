"""The checks of the Python reference tests: check(cond, what) prints a line for it ("ok   what",
"FAIL what"; with QUIET set, only the failures) and counts it; done() prints the counts and
exits, non-zero when a check failed.

    sys.path.insert(0, ".../tests/lib")
    from checks import check, done
"""
import sys

QUIET = False  # print the failed checks only
failed = []  # what each failed check said
count = 0


def check(cond, what):
    global count
    count += 1
    if not cond:
        failed.append(what)
    if not cond or not QUIET:
        print(("ok   " if cond else "FAIL ") + what)
        sys.stdout.flush()
    return cond


def done():
    print("%d checks, %d failed" % (count, len(failed)))
    sys.exit(1 if failed else 0)
