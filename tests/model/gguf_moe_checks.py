"""What ref_gguf_moe.py and ref_gguf_deepseek.py check of a converted mixture-of-experts GGUF:
`moonrl convert`, its tensors against the original Hugging Face ones bit for bit, and the
converted directory's log-probs and entropies (libmoonrl) against the float64 reference
(torch_ref_moe.py) on the original weights."""
import ctypes as C
import os
import subprocess

import numpy as np
import torch
from safetensors.numpy import load_file

import moonrl_ctypes
from moonrl_ctypes import rel
from checks import check
from torch_ref_moe import reference

torch.set_default_dtype(torch.float64)  # (the reference is float64)


def convert(moonrl, path, out, tag):
    """moonrl convert path out: True when it worked (a failed check otherwise)."""
    r = subprocess.run([moonrl, "convert", path, out], capture_output=True, text=True, timeout=120)
    check(r.returncode == 0, "%s: moonrl convert: %s" % (tag, r.stderr.strip()[-300:]))
    return r.returncode == 0


def same_tensors(out, hf, tag):
    """Every tensor of out's model.safetensors is hf's (name, shape, bits); the ones that differ listed."""
    got = load_file(os.path.join(out, "model.safetensors"))
    same = set(got) == set(hf) and all(got[k].shape == hf[k].shape and
                                       np.array_equal(got[k].view(np.uint32), hf[k].view(np.uint32)) for k in hf)
    check(same, "%s (%d tensors)" % (tag, len(hf)))
    if not same:
        for k in sorted(set(hf) | set(got)):
            if k not in got or k not in hf or not np.array_equal(got[k], hf[k]):
                print("   differs:", k)


def against_reference(lib, out, cfg, hf, rng, lens, tag):
    """The converted directory's log-probs and entropies of random sequences of lens, against the float64
    reference of cfg on the original weights hf: relative error < 1e-5."""
    h = C.c_void_p()
    moonrl_ctypes.check(lib.mrl_model_load_dir(out.encode(), C.byref(h)))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    tokens = rng.integers(0, cfg["vocab_size"], cu[-1]).astype(np.int32)
    targets = np.full(cu[-1], -1, np.int32)
    for s in range(len(lens)):
        targets[cu[s]:cu[s + 1] - 1] = tokens[cu[s] + 1:cu[s + 1]]
    b = moonrl_ctypes.Batch(tokens.ctypes.data_as(C.POINTER(C.c_int32)), targets.ctypes.data_as(C.POINTER(C.c_int32)),
                            cu.ctypes.data_as(C.POINTER(C.c_int32)), int(cu[-1]), len(lens), None)
    lp, ent = np.zeros(cu[-1], np.float32), np.zeros(cu[-1], np.float32)
    moonrl_ctypes.check(lib.mrl_model_forward(h, C.byref(b), C.c_float(1.0), moonrl_ctypes.ptr(lp),
                                              moonrl_ctypes.ptr(ent), None))
    lib.mrl_model_free(h)
    P = {k: torch.tensor(v.astype(np.float64)) for k, v in hf.items()}
    rlp, rent, _ = reference(cfg, P, tokens, targets, cu)
    e_lp, e_ent = rel(lp, rlp.numpy()), rel(ent, rent.numpy())
    check(e_lp < 1e-5 and e_ent < 1e-5, "%s: the converted model against the float64 reference on the original "
          "weights: log-prob %.1e, entropy %.1e" % (tag, e_lp, e_ent))
