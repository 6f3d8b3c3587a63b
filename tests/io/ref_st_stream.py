"""The streamed safetensors writer (mrl_st_stream_*) against the real format.

A small model (embeddings, 12 layers of F32 / BF16 / F16 weights, an I64 buffer, a scalar,
an empty tensor) is declared, then streamed one tensor at a time through libmoonrl (ctypes),
each from one reused buffer, with max_shard_bytes forcing several shards. Python then loads the
directory as transformers does: model.safetensors.index.json read with json (written exactly as
transformers writes it: json.dumps(indent=2, sort_keys=True)), each shard with
safetensors.safe_open; every tensor equals the source bit for bit (BF16 / F16 as torch's
.to(dtype) rounds), each shard holds the tensors the index names, shards are filled in
declaration order within the limit, the files are named model-0000K-of-0000N.safetensors, and
metadata.total_size is the sum of the tensors' bytes. Skipped (exit 77) where the Python
packages safetensors or torch are missing.

usage: ref_st_stream.py LIBMOONRL"""
import ctypes
import json
import os
import sys
import tempfile

try:
    import torch
    from safetensors import safe_open
except ImportError as e:  # meson reads 77 as "skipped"
    print("skipped: %s" % e)
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import capi  # noqa: E402
import checks  # noqa: E402
from checks import check  # noqa: E402

checks.QUIET = True
MAX_SHARD = 6000


def same_bits(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.int64: torch.int64}[a.dtype]
    return torch.equal(a.view(view), b.view(view))


def model():
    """(name, dtype name, fp32 values or int64 tensor) in declaration (state-dict) order."""
    g = torch.Generator().manual_seed(33)
    out = [("model.embed_tokens.weight", "BF16", torch.randn(40, 16, generator=g))]
    for i in range(12):  # "layers.10" sorts before "layers.2": declaration order is not name order
        p = "model.layers.%d." % i
        out += [(p + "self_attn.q_proj.weight", "BF16", torch.randn(16, 16, generator=g) * 0.1),
                (p + "mlp.down_proj.weight", "F32", torch.randn(16, 24, generator=g)),
                (p + "input_layernorm.weight", "F16", 1 + torch.randn(15, generator=g) * 1e-2)]
    out += [("model.norm.weight", "F32", torch.ones(16)),
            ("model.rotary.inv_freq", "F32", torch.tensor(0.5)),  # a scalar
            ("model.position_ids", "I64", torch.arange(-3, 9, dtype=torch.int64)),
            ("model.empty", "BF16", torch.zeros(0, 4)),
            ("lm_head.weight", "BF16", torch.randn(40, 16, generator=g))]
    return out


TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}


def stream(lib, api, d, tensors):
    st = ctypes.c_void_p()
    ok = lambda s, what: check(s == 0, "%s: %s" % (what, lib.mrl_last_error().decode()))  # noqa: E731
    ok(lib.mrl_st_stream_open(d.encode(), MAX_SHARD, ctypes.byref(st)), "stream_open")
    ok(lib.mrl_st_stream_set_metadata(st, b"format", b"pt"), "set_metadata")  # transformers requires it
    for name, dt, v in tensors:
        shape = (ctypes.c_int64 * max(1, v.dim()))(*v.shape)
        ok(lib.mrl_st_stream_declare(st, name.encode(), getattr(api, "MRL_DTYPE_" + dt), v.dim(), shape), "declare " + name)
    buf = torch.empty(1024, dtype=torch.float32)  # the one buffer every tensor is produced into
    for name, dt, v in tensors:
        if dt == "I64":
            raw = v.contiguous()
            ok(lib.mrl_st_stream_write_raw(st, name.encode(), raw.data_ptr(), raw.numel() * 8), "write_raw " + name)
            continue
        buf[:v.numel()] = v.reshape(-1)
        ok(lib.mrl_st_stream_write(st, name.encode(), buf.data_ptr(), v.numel()), "write " + name)
        buf.fill_(float("nan"))  # the stream keeps no pointer to it
    ok(lib.mrl_st_stream_finish(st), "finish")
    lib.mrl_st_stream_free(st)


def main():
    lib = capi.load(sys.argv[1] if len(sys.argv) > 1 else "build/libmoonrl.so")
    api = capi.module(lib._name)
    tensors = model()
    with tempfile.TemporaryDirectory() as tmp:
        d = os.path.join(tmp, "hf")
        stream(lib, api, d, tensors)
        index_path = os.path.join(d, "model.safetensors.index.json")
        text = open(index_path).read()
        index = json.loads(text)
        check(text == json.dumps(index, indent=2, sort_keys=True) + "\n", "index as transformers writes it")
        wm = index["weight_map"]
        check(sorted(wm) == sorted(n for n, _, _ in tensors), "weight_map names every tensor")
        files = sorted(set(wm.values()))
        n = len(files)
        check(n >= 3, "%d shards (at least 3)" % n)
        check(files == ["model-%05d-of-%05d.safetensors" % (k + 1, n) for k in range(n)], "shard names: %s" % files)
        check(sorted(os.listdir(d)) == sorted(files + ["model.safetensors.index.json"]), "no other file: %s" % os.listdir(d))
        order = [files.index(wm[name]) for name, _, _ in tensors]
        check(order == sorted(order), "shards filled in declaration order")
        total = 0
        for f in files:
            with safe_open(os.path.join(d, f), framework="pt") as sf:
                check(sf.metadata() == {"format": "pt"}, f + ": metadata")
                check(sorted(sf.keys()) == sorted(k for k, v in wm.items() if v == f), f + ": the tensors the index names")
                size = 0
                for name, dt, v in tensors:
                    if wm[name] != f:
                        continue
                    got = sf.get_tensor(name)
                    want = v if dt == "I64" else v.to(TORCH[dt])
                    check(same_bits(got, want), "%s: %s %s equals the source" % (f, name, dt))
                    size += got.numel() * got.element_size()
                check(size <= MAX_SHARD, "%s: %d bytes of data, at most %d" % (f, size, MAX_SHARD))
                total += size
        check(index["metadata"]["total_size"] == total, "metadata.total_size %d" % total)
    checks.done()


if __name__ == "__main__":
    main()
