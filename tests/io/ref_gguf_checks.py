#!/usr/bin/env python3
"""What `moonrl convert` refuses, and what the conversion cache is keyed on, on the tiny llama
of ref_gguf_convert.py (blk.0.ffn_up.weight stored as Q4_1) with bytes of its header or data
changed:
  - two tensor infos on the same bytes, the Q4_1 tensor relabelled F16, an offset other than the
    running size, a NaN in an F32 tensor, an infinity as a Q4_1 block's scale: exit status 2
    and an error naming the tensor(s), no directory written;
  - llama.attention.head_count 0: an error naming the key (not "head_dim must be an integer");
    tokenizer.ggml.eos_token_id past the vocabulary: an error naming the key, at convert;
  - the cache (moonrl.io.gguf.resolve into MOONRL_CACHE): two files of one name, size and mtime
    with different weights (cp -p) each give their own weights; an edit that keeps the size and
    the mtime (touch -r) gives the new weights; an unchanged file is found again, its entry
    named by its sha256sum.

usage: ref_gguf_checks.py path/to/moonrl"""
import hashlib
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

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


RESOLVE = "print(require('moonrl.io.gguf').resolve(arg_path))\n"


def resolve(tmp, path, cache):
    script = os.path.join(tmp, "resolve.lua")
    with open(script, "w") as f:
        f.write("local arg_path = %r\n" % path + RESOLVE)
    r = subprocess.run([MOONRL, "run", script], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, MOONRL_CACHE=cache))
    check(r.returncode == 0, "resolve %s: %s" % (path, r.stderr.strip()[-300:]))
    return r.stdout.strip().splitlines()[-1] if r.returncode == 0 else ""


def embedding(dir):
    return load_file(os.path.join(dir, "model.safetensors"))["model.embed_tokens.weight"] if dir else None


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


def cache(tmp, rng):
    cache = os.path.join(tmp, "cache")
    a, b = os.path.join(tmp, "a.gguf"), os.path.join(tmp, "b.gguf")
    ha, _, _ = make("llama", a, True, "gpt2", rng)
    hb, _, _ = make("llama", b, True, "gpt2", rng)
    check(os.path.getsize(a) == os.path.getsize(b), "two files of one size")
    st = os.stat(a)
    os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns))
    # two fine-tunes of one base, copied with their times (cp -p): one name, size and mtime
    d1, d2 = os.path.join(tmp, "d1"), os.path.join(tmp, "d2")
    os.makedirs(d1)
    os.makedirs(d2)
    p1, p2 = os.path.join(d1, "model.gguf"), os.path.join(d2, "model.gguf")
    shutil.copy2(a, p1)
    shutil.copy2(b, p2)
    check(os.stat(p1).st_mtime_ns == os.stat(p2).st_mtime_ns, "cp -p: the same mtime")
    r1, r2 = resolve(tmp, p1, cache), resolve(tmp, p2, cache)
    e1, e2 = embedding(r1), embedding(r2)
    check(r1 != r2, "same name, size and mtime, other content: another cache entry (%s, %s)" % (r1, r2))
    check(e1 is not None and np.array_equal(e1, ha["model.embed_tokens.weight"]), "the first file's weights")
    check(e2 is not None and np.array_equal(e2, hb["model.embed_tokens.weight"]), "the second file's weights")
    check(os.path.basename(r1) == hashlib.sha256(open(a, "rb").read()).hexdigest(),
          "the entry is named by the file's sha256sum: " + r1)
    check(resolve(tmp, p1, cache) == r1, "an unchanged file: its cache entry again")
    check(len(os.listdir(os.path.join(cache, "gguf", "sums"))) == 2, "one remembered sum per file")
    # an edit that keeps the size, then the old mtime put back (touch -r)
    emb_at = int({t.name: t for t in gguf.GGUFReader(p1).tensors}["token_embd.weight"].data_offset)
    with open(p1, "r+b") as f:
        f.seek(emb_at)
        f.write(struct.pack("<f", 42.0))
    shutil.copystat(a, p1)
    check(os.stat(p1).st_mtime_ns == os.stat(a).st_mtime_ns and os.path.getsize(p1) == os.path.getsize(a),
          "touch -r: the old mtime and size")
    r3 = resolve(tmp, p1, cache)
    e3 = embedding(r3)
    want = ha["model.embed_tokens.weight"].copy()
    want.reshape(-1)[0] = 42.0
    check(r3 not in (r1, r2) and e3 is not None and np.array_equal(e3, want),
          "an edit that keeps the mtime: converted again, with the new weight (%s)" % r3)


def main():
    rng = np.random.default_rng(11)
    with tempfile.TemporaryDirectory() as tmp:
        refusals(tmp, rng)
        cache(tmp, rng)
    checks.done()


if __name__ == "__main__":
    main()
