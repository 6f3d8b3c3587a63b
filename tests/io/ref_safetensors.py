"""Safetensors against the Python `safetensors` package and PyTorch.

Python writes files in F32, BF16 and F16 (one file, and a sharded
directory with model.safetensors.index.json); the C reader reads each
tensor as fp32 (checked bit-exactly against torch's .float()) and the C
writer writes them back as F32 / BF16 / F16 / sharded BF16; Python loads
those and compares bit-exactly: fp32 values unchanged, BF16/F16 equal to
torch's .to(dtype) rounding of the same fp32 values, and the F32 file
byte-identical to safetensors.torch.save_file's."""
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import checks  # noqa: E402
from checks import check  # noqa: E402

checks.QUIET = True
MOONRL = os.environ.get("MOONRL_EXE", "build/moonrl")


def same_bits(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return torch.equal(a.view(view), b.view(view))


def tensors(dtype):
    g = torch.Generator().manual_seed(1234)
    t = {
        "model.embed.weight": torch.randn(37, 16, generator=g) * 3,
        "model.layers.0.attn.q.weight": torch.randn(16, 16, generator=g),
        "model.layers.0.attn.q.bias": torch.randn(16, generator=g) * 1e-3,
        "model.layers.0.norm.weight": torch.ones(16),
        "model.layers.1.mlp.w": torch.randn(4, 5, 6, generator=g) * 100,
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        # edge values: subnormals of f16 / bf16, large, ties
        "edge": torch.tensor([1e-7, -6e-8, 6.1e-5, 65504.0, 1e-40, -0.0, 3.0e38, 1.0 + 2 ** -9, 1.0 + 3 * 2 ** -8,
                              float("inf"), -float("inf")]),
    }
    return {k: v.to(dtype).contiguous() for k, v in t.items()}


def run_c(src, out):
    env = dict(os.environ, ST_SRC=src, ST_OUT=out)
    r = subprocess.run([MOONRL, "run", "tests/io/st_roundtrip.lua"], capture_output=True, text=True, env=env)
    check(r.returncode == 0, "moonrl st_roundtrip on %s: %s%s" % (src, r.stdout, r.stderr))
    return r.returncode == 0


def compare_raw(src, out, what):
    """The raw copy of a single Python-written file is byte-identical to it."""
    a = open(src, "rb").read()
    b = open(os.path.join(out, "c_raw.safetensors"), "rb").read()
    check(a == b, what + ": C raw copy differs from the Python file's bytes")


def compare_outputs(ref, out, what):
    as_f32 = {k: v.float() for k, v in ref.items()}
    c32 = load_file(os.path.join(out, "c_F32.safetensors"))
    check(sorted(c32) == sorted(ref), what + ": tensor names")
    for k, v in as_f32.items():
        check(same_bits(c32[k], v), "%s: C read of %s as fp32" % (what, k))
    for name, dt in (("BF16", torch.bfloat16), ("F16", torch.float16)):
        c = load_file(os.path.join(out, "c_%s.safetensors" % name))
        for k, v in as_f32.items():
            check(same_bits(c[k], v.to(dt)), "%s: C write of %s as %s" % (what, k, name))
    # the F32 file is byte-identical to what the Python library writes
    py = os.path.join(out, "py_F32.safetensors")
    save_file(as_f32, py, metadata={"format": "pt"})
    check(open(py, "rb").read() == open(os.path.join(out, "c_F32.safetensors"), "rb").read(),
          what + ": C F32 file differs from safetensors.torch.save_file's bytes")
    # sharded: every shard loads; the index names each tensor's shard
    sd = os.path.join(out, "c_sharded")
    index = json.load(open(os.path.join(sd, "model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    check(len(shards) > 1, what + ": sharded write made one shard")
    total = 0
    for s in shards:
        part = load_file(os.path.join(sd, s))
        for k, v in part.items():
            check(index["weight_map"][k] == s, "%s: index names the shard of %s" % (what, k))
            check(same_bits(v, as_f32[k].to(torch.bfloat16)), "%s: sharded %s" % (what, k))
            total += v.numel() * v.element_size()
    check(total == index["metadata"]["total_size"], what + ": total_size")
    check(sorted(index["weight_map"]) == sorted(ref), what + ": weight_map names")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        for name, dt in (("F32", torch.float32), ("BF16", torch.bfloat16), ("F16", torch.float16)):
            ref = tensors(dt)
            src = os.path.join(tmp, "py_%s.safetensors" % name)
            save_file(ref, src, metadata={"format": "pt"})
            out = os.path.join(tmp, "out_" + name)
            os.mkdir(out)
            if run_c(src, out):
                compare_outputs(ref, out, "python %s file" % name)
                compare_raw(src, out, "python %s file" % name)
        # every dtype in one file: layout (dtype order, names, padding) as the library's
        g = torch.Generator().manual_seed(5)
        mixed = {"f64": torch.randn(3, generator=g, dtype=torch.float64), "i64": torch.arange(-3, 4),
                 "i32": torch.arange(5, dtype=torch.int32), "i16": torch.arange(3, dtype=torch.int16),
                 "i8": torch.arange(-2, 5, dtype=torch.int8), "u8": torch.arange(9, dtype=torch.uint8),
                 "mask": torch.tensor([True, False, True]), "bf": torch.randn(7, generator=g).bfloat16(),
                 "h": torch.randn(2, 3, generator=g).half(), "f": torch.randn(5, generator=g),
                 "a.f": torch.randn(1, generator=g)}
        src = os.path.join(tmp, "py_mixed.safetensors")
        save_file(mixed, src, metadata={"format": "pt"})
        out = os.path.join(tmp, "out_mixed")
        os.mkdir(out)
        if run_c(src, out):
            compare_raw(src, out, "python mixed-dtype file")
            back = load_file(os.path.join(out, "c_raw.safetensors"))
            for k, v in mixed.items():
                check(torch.equal(back[k], v), "mixed: %s loads back equal" % k)
        # a sharded directory written by Python (as transformers does)
        ref = tensors(torch.bfloat16)
        sd = os.path.join(tmp, "py_sharded")
        os.mkdir(sd)
        names = sorted(ref)
        parts = [names[:3], names[3:6], names[6:]]
        weight_map = {}
        for i, part in enumerate(parts):
            fname = "model-%05d-of-%05d.safetensors" % (i + 1, len(parts))
            save_file({k: ref[k] for k in part}, os.path.join(sd, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in part})
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map},
                  open(os.path.join(sd, "model.safetensors.index.json"), "w"))
        out = os.path.join(tmp, "out_sharded")
        os.mkdir(out)
        if run_c(sd, out):
            compare_outputs(ref, out, "python sharded dir")
    checks.done()


if __name__ == "__main__":
    main()
