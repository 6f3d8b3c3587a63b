"""GGUF reading against the `gguf` Python package (llama.cpp's own gguf-py).

Python writes a GGUF file with gguf.GGUFWriter: metadata of every value type
(integers, floats, bool, strings, arrays of numbers and of strings) and one
tensor of every type moonrl reads: F32, F16, BF16 and Q8_0, Q4_0, Q4_1
(quantized by gguf-py) and Q4_K, Q5_K, Q6_K (random blocks with finite
scales: gguf-py dequantizes but does not quantize those). moonrl (through
moonrl.io.gguf) dumps the metadata as JSON and every tensor dequantized to fp32;
Python checks the metadata equal and the floats bit-identical to
gguf.quants.dequantize. Then corrupt files (cut short at many points, a count,
a string length, a dimension, a type, an offset or the alignment made wrong,
bad magic and version): moonrl must fail with an error naming the file,
never crash, hang or allocate without bound."""
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import checks  # noqa: E402
from checks import check  # noqa: E402

checks.QUIET = True
MOONRL = os.environ.get("MOONRL_EXE", "build/moonrl")


rng = np.random.default_rng(7)


def k_blocks(qtype, n_blocks):
    """Random K-quant blocks whose fp16 scales are finite (the rest random bytes)."""
    size = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}[qtype]
    b = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    scales = rng.standard_normal((n_blocks, 2)).astype(np.float16).view(np.uint8).reshape(n_blocks, 4)
    if qtype == Q.Q6_K:
        b[:, 208:210] = scales[:, 0:2]  # d at the end
    else:
        b[:, 0:4] = scales  # d, dmin
    return b


def write_file(path):
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4000000000)
    w.add_int32("t.i32", -2000000000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**40 + 3)
    w.add_int64("t.i64", -(2**40) - 5)
    w.add_float64("t.f64", 1.0 / 3.0)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo wörld")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.strs", ["a", "", "ünï", "x" * 300])
    w.add_array("t.floats", [0.5, -1.25])
    tensors = {}
    shape = (3, 512)  # numpy [rows, ne0]
    x = rng.standard_normal(shape).astype(np.float32)
    tensors["f32"] = (x, Q.F32)
    tensors["f16"] = (x.astype(np.float16), Q.F16)
    for name, t in (("bf16", Q.BF16), ("q8_0", Q.Q8_0), ("q4_0", Q.Q4_0), ("q4_1", Q.Q4_1)):
        tensors[name] = (gguf.quants.quantize(x, t), t)
    for name, t in (("q4_k", Q.Q4_K), ("q5_k", Q.Q5_K), ("q6_k", Q.Q6_K)):
        tensors[name] = (k_blocks(t, 6).reshape(3, -1), t)
    tensors["vec"] = (rng.standard_normal((64,)).astype(np.float32), Q.F32)
    tensors["cube"] = (rng.standard_normal((2, 3, 32)).astype(np.float32), Q.F32)
    for name, (data, t) in tensors.items():
        if t in (Q.F32, Q.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


DUMP = r"""
local g = require('moonrl.io.gguf').open(arg_path)
local json = require('moonrl.io.json')
local meta = json.object()
for k, v in pairs(g.metadata) do meta[k] = v end
local out = { metadata = meta, tensors = {} }
for _, t in ipairs(g.tensors) do
  local buf, n = g:read(t.name)
  local f = assert(io.open(arg_dir .. '/' .. t.name .. '.f32', 'wb'))
  f:write(require('ffi').string(buf, 4 * n))
  f:close()
  out.tensors[#out.tensors + 1] = { name = t.name, type = t.type, shape = t.shape, numel = t.numel }
end
print(json.encode(out))
"""


def moonrl_script(tmp, body, path):
    script = os.path.join(tmp, "dump.lua")
    with open(script, "w") as f:
        f.write("local arg_path, arg_dir = %s, %s\n" % (json.dumps(path), json.dumps(tmp)) + body)
    return subprocess.run([MOONRL, "run", script], capture_output=True, text=True, timeout=120)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.gguf")
        tensors = write_file(path)
        r = moonrl_script(tmp, DUMP, path)
        check(r.returncode == 0, "moonrl reads the file: " + r.stderr)
        if r.returncode != 0:
            return
        out = json.loads(r.stdout)
        meta = out["metadata"]
        want = {"t.u8": 200, "t.i8": -100, "t.u16": 60000, "t.i16": -30000, "t.u32": 4000000000,
                "t.i32": -2000000000, "t.u64": 2**40 + 3, "t.i64": -(2**40) - 5, "t.bool": True,
                "t.str": "héllo wörld", "t.ints": [1, -2, 3], "t.strs": ["a", "", "ünï", "x" * 300],
                "t.floats": [0.5, -1.25], "general.architecture": "llama"}
        for k, v in want.items():
            check(meta.get(k) == v, "metadata %s: %r, want %r" % (k, meta.get(k), v))
        check(meta.get("t.f32") == float(np.float32(0.1)), "float32 metadata exact")
        check(meta.get("t.f64") == 1.0 / 3.0, "float64 metadata exact")
        seen = {t["name"]: t for t in out["tensors"]}
        for name, (data, t) in tensors.items():
            info = seen.get(name)
            check(info is not None, "tensor %s listed" % name)
            if not info:
                continue
            check(info["type"] == t.name, "%s type %s" % (name, info["type"]))
            if t in (Q.F32, Q.F16):
                ref = data.astype(np.float32)
            else:
                ref = gguf.quants.dequantize(data, t).astype(np.float32)
            check(info["shape"] == list(reversed(ref.shape)), "%s shape %s (ne0 first) for %s" % (name, info["shape"], ref.shape))
            got = np.fromfile(os.path.join(tmp, name + ".f32"), dtype=np.float32)
            check(got.size == ref.size and np.array_equal(got.view(np.uint32), ref.reshape(-1).view(np.uint32)),
                  "%s dequantized bit-identical to gguf-py (max |d| %s)" % (
                      name, np.abs(got - ref.reshape(-1)).max() if got.size == ref.size else "size"))

        # corrupt files: every one an error naming the file, in bounded time and memory
        good = open(path, "rb").read()
        reader = gguf.GGUFReader(path)
        fields = {f.name: f for f in reader.fields.values()}
        cases = {}
        for cut in sorted(set([0, 3, 4, 8, 16, 23, 24, 40, 100, 300, len(good) // 2, len(good) - 1])):
            cases["cut at %d" % cut] = good[:cut]
        cases["bad magic"] = b"GGUX" + good[4:]
        cases["version 1"] = good[:4] + struct.pack("<I", 1) + good[8:]
        cases["version 9"] = good[:4] + struct.pack("<I", 9) + good[8:]
        cases["2^60 tensors"] = good[:8] + struct.pack("<Q", 2**60) + good[16:]
        cases["2^60 pairs"] = good[:16] + struct.pack("<Q", 2**60) + good[24:]
        key0 = 24  # the first key's length
        cases["key length 2^62"] = good[:key0] + struct.pack("<Q", 2**62) + good[key0 + 8:]
        strs = fields["t.strs"]
        at = int(strs.offset) if hasattr(strs, "offset") else None
        if at is not None:
            # the array's count: after the key (8 + len) and the type (4) and the element type (4)
            klen = len("t.strs")
            count_at = at + 8 + klen + 4 + 4
            cases["string array count 2^61"] = good[:count_at] + struct.pack("<Q", 2**61) + good[count_at + 8:]
        for t in reader.tensors:
            if t.name == "q4_k":
                # the tensor's info: name (8 + len), n_dims (4), dims (8 each), type (4), offset (8)
                info_at = good.find(struct.pack("<Q", len("q4_k")) + b"q4_k")
                dims_at = info_at + 8 + 4 + 4
                type_at = dims_at + 8 * 2
                off_at = type_at + 4
                cases["dimension 0"] = good[:dims_at] + struct.pack("<Q", 0) + good[dims_at + 8:]
                cases["dimension 2^45"] = good[:dims_at] + struct.pack("<Q", 2**45) + good[dims_at + 8:]
                cases["row not a multiple of the block"] = good[:dims_at] + struct.pack("<Q", 255) + good[dims_at + 8:]
                cases["ggml type 99"] = good[:type_at] + struct.pack("<I", 99) + good[type_at + 4:]
                cases["n_dims 7"] = good[:info_at + 8 + 4] + struct.pack("<I", 7) + good[info_at + 8 + 4 + 4:]
                cases["offset past the end"] = good[:off_at] + struct.pack("<Q", 2**40) + good[off_at + 8:]
                cases["offset misaligned"] = good[:off_at] + struct.pack("<Q", 1) + good[off_at + 8:]
        OPEN = r"""
local ok, err = pcall(require('moonrl.io.gguf').open, arg_path)
if ok then
  for _, t in ipairs(err.tensors) do err:read(t.name) end
  print('OPENED')
else
  print('ERROR ' .. tostring(err))
end
"""
        check(len(cases) >= 24, "all the corrupt cases were made: %d" % len(cases))
        for name, data in cases.items():
            bad = os.path.join(tmp, "bad.gguf")
            with open(bad, "wb") as f:
                f.write(data)
            r = moonrl_script(tmp, OPEN, bad)
            text = r.stdout + r.stderr
            check(r.returncode == 0 and "ERROR" in r.stdout and bad in r.stdout,
                  "%s: a clear error naming the file, got rc %d: %s" % (name, r.returncode, text.strip()[-300:]))
    checks.done()


if __name__ == "__main__":
    main()
