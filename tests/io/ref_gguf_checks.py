#!/usr/bin/env python3
"""What `moonrl convert` refuses, and what the conversion cache is keyed on, on the tiny llama
of ref_gguf_convert.py (blk.0.ffn_up.weight stored as Q4_1) with bytes of its header or data
changed:
  - two tensor infos on the same bytes, the Q4_1 tensor relabelled F16, an offset other than the
    running size, a NaN in an F32 tensor, an infinity as a Q4_1 block's scale: exit status 2
    and an error naming the tensor(s), no directory written;
  - llama.attention.head_count 0: an error naming the key (not "head_dim must be an integer");
    tokenizer.ggml.eos_token_id past the vocabulary: an error naming the key, at convert.

usage: ref_gguf_checks.py path/to/moonrl"""
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import checks  # noqa: E402
from checks import check  # noqa: E402
from ref_gguf_convert import make  # noqa: E402

MOONRL = sys.argv[1] if len(sys.argv) > 1 else "build/moonrl"
Q41 = "blk.0.ffn_up.weight"


def info_at(data, name):
    """Offsets of tensor `name`'s type and data offset fields in the header."""
    at = data.find(struct.pack("<Q", len(name)) + name.encode())
    nd_at = at + 8 + len(name)
    (nd,) = struct.unpack_from("<I", data, nd_at)
    type_at = nd_at + 4 + 8 * nd
    return type_at, type_at + 4


def value_at(data, key):
    """Offset of the value of scalar metadata `key`."""
    at = data.find(struct.pack("<Q", len(key)) + key.encode())
    return at + 8 + len(key) + 4


def patched(data, at, fmt, value):
    return data[:at] + struct.pack(fmt, value) + data[at + struct.calcsize(fmt):]


def convert(path, out):
    return subprocess.run([MOONRL, "convert", path, out], capture_output=True, text=True, timeout=120)


def refusals(tmp, rng):
    path = os.path.join(tmp, "good.gguf")
    make("llama", path, True, "gpt2", rng, quant={Q41: Q.Q4_1})
    r = convert(path, os.path.join(tmp, "good"))
    check(r.returncode == 0, "the unchanged file converts: " + r.stderr.strip()[-300:])
    good = open(path, "rb").read()
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    names = [t.name for t in reader.tensors]
    after = names[names.index(Q41) + 1]  # the tensor after the Q4_1 one
    v_type, v_off = info_at(good, "blk.1.attn_v.weight")
    q_type, _ = info_at(good, Q41)
    _, a_off = info_at(good, after)
    (a_offset,) = struct.unpack_from("<Q", good, a_off)
    (v_offset,) = struct.unpack_from("<Q", good, v_off)
    nan_at = int(tensors["blk.1.attn_v.weight"].data_offset) + 4 * 7
    inf_at = int(tensors[Q41].data_offset) + 20 * 2  # the scale d of the third block
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    cases = [
        ("two tensor infos on the same bytes", patched(good, v_off, "<Q", a_offset), ["'%s'" % after,
         "'blk.1.attn_v.weight'", "overlap"]),
        ("a Q4_1 tensor relabelled F16", patched(good, q_type, "<I", int(Q.F16)),
         ["'%s' (F16" % Q41, "'%s'" % after, "overlap"]),
        ("an offset past the running size", patched(good, v_off, "<Q", v_offset + 32),
         ["tensor 'blk.1.attn_v.weight' is at data offset %d, expected %d" % (v_offset + 32, v_offset)]),
        ("a NaN in an F32 tensor", good[:nan_at] + struct.pack("<f", float("nan")) + good[nan_at + 4:],
         ["tensor 'blk.1.attn_v.weight' (F32) holds a NaN at element 7"]),
        ("an infinity as a Q4_1 block's scale", good[:inf_at] + struct.pack("<H", 0x7C00) + good[inf_at + 2:],
         ["tensor '%s' (Q4_1) holds" % Q41, "at element 64"]),
        ("head_count 0", patched(good, value_at(good, "llama.attention.head_count"), "<I", 0),
         ["GGUF metadata llama.attention.head_count is 0: expected a whole number >= 1"]),
        ("an eos id past the vocabulary", patched(good, value_at(good, "tokenizer.ggml.eos_token_id"), "<I", vocab + 5),
         ["GGUF metadata tokenizer.ggml.eos_token_id is %d, not a token of the vocabulary (ids 0 to %d)" % (
             vocab + 5, vocab - 1)]),
    ]
    for what, data, want in cases:
        bad = os.path.join(tmp, "bad.gguf")
        with open(bad, "wb") as f:
            f.write(data)
        out = os.path.join(tmp, "out-bad")
        r = convert(bad, out)
        err = r.stderr.strip()
        check(r.returncode == 2 and bad in err and all(w in err for w in want) and "traceback" not in err,
              "%s: exit 2 and an error naming it (%s), got rc %d: %s" % (what, want, r.returncode, err[-400:]))
        check(not os.path.exists(out), "%s: no directory written" % what)


def main():
    rng = np.random.default_rng(11)
    with tempfile.TemporaryDirectory() as tmp:
        refusals(tmp, rng)
    checks.done()


if __name__ == "__main__":
    main()
