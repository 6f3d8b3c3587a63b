#!/usr/bin/env python3
"""The ctypes declarations generated from the C headers (build/moonrl_capi.py, by
tools/gen_ctypes.py; the Python reference tests reach libmoonrl through them) against the same
headers as LuaJIT's FFI lays them out (moonrl.cdef, by tools/gen_ffi.py): every function is
declared on libmoonrl (capi.load resolves each), and every struct has C's size and each field
its offset.

usage: test_capi.py LIBMOONRL MOONRL"""
import ctypes
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import capi  # noqa: E402

LUA = """
local ffi = require('ffi')
require('moonrl')
local json = require('moonrl.io.json')
local out = {}
for name, fields in pairs(json.read_file(os.getenv('CAPI_STRUCTS'))) do
  local offsets = {}
  for _, f in ipairs(fields) do offsets[f] = ffi.offsetof(name, f) end
  out[name] = { size = ffi.sizeof(name), offsets = offsets }
end
print(json.encode(out))
"""

lib = capi.load(sys.argv[1])
api = capi.module(sys.argv[1])
structs = {n: c for n, c in vars(api).items() if isinstance(c, type) and issubclass(c, ctypes.Structure)}
failures = 0
with tempfile.TemporaryDirectory() as d:
    with open(os.path.join(d, "structs.json"), "w") as f:
        json.dump({n: [name for name, _ in c._fields_] for n, c in structs.items()}, f)
    with open(os.path.join(d, "layout.lua"), "w") as f:
        f.write(LUA)
    r = subprocess.run([sys.argv[2], "run", os.path.join(d, "layout.lua")], capture_output=True, text=True,
                       env=dict(os.environ, CAPI_STRUCTS=os.path.join(d, "structs.json")))
    if r.returncode != 0:
        sys.exit("moonrl run: %s%s" % (r.stdout, r.stderr))
    luajit = json.loads(r.stdout.strip().splitlines()[-1])
for name, c in sorted(structs.items()):
    want = luajit[name]
    got = {"size": ctypes.sizeof(c), "offsets": {f: getattr(c, f).offset for f, _ in c._fields_}}
    if got != want:
        failures += 1
        print("FAIL %s: ctypes %s, LuaJIT %s" % (name, got, want))
print("%d functions declared, %d structs laid out as C: %d differ" % (len(api.FUNCTIONS), len(structs), failures))
sys.exit(1 if failures else 0)
