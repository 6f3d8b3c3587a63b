#!/usr/bin/env python3
"""Render every template in TEMPLATE_DIR on every conversation in CASES_JSON
the way transformers does (ImmutableSandboxedEnvironment with trim_blocks and
lstrip_blocks, loop controls, its tojson filter, raise_exception and
strftime_now globals) and write the outputs to OUT_JSON.

usage: /usr/bin/python3 ref_chat.py TEMPLATE_DIR[:DIR...] CASES_JSON OUT_JSON
Each case: {"name", "vars": {messages, tools?, add_generation_prompt, ...}, "now"?}.
"now" (seconds since the epoch) fixes the clock strftime_now reads (UTC).
"""
import json
import os
import sys
from datetime import datetime, timezone

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateRaised(Exception):
    pass


def make_env(now):
    def raise_exception(message):
        raise TemplateRaised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.fromtimestamp(now, timezone.utc).strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def main():
    tdirs, cases_path, out_path = sys.argv[1:4]
    cases = json.load(open(cases_path, encoding="utf-8"))
    results = []
    paths = []
    for tdir in tdirs.split(":"):
        paths += [os.path.join(tdir, f) for f in sorted(os.listdir(tdir)) if f.endswith(".jinja")]
    for path in paths:
        fname = os.path.relpath(path, os.path.dirname(cases_path))
        src = open(path, encoding="utf-8").read()
        for case in cases:
            now = case.get("now", 1750000000)
            env = make_env(now)
            tpl = env.from_string(src)
            r = {"template": fname, "case": case["name"]}
            try:
                r["output"] = tpl.render(**case["vars"])
            except TemplateRaised as e:
                r["raised"] = str(e)
            except Exception as e:  # any other failure: the Lua side must fail too
                r["error"] = "%s: %s" % (type(e).__name__, e)
            results.append(r)
    json.dump(results, open(out_path, "w", encoding="utf-8"), ensure_ascii=False, indent=1)


main()
