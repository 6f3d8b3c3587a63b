"""libmoonrl's model through ctypes, for the Python reference tests (tests/model/model_ref.py,
ref_moe.py, hf_check.py, ref_gguf_moe.py) and the benchmark (bench/train/train_bench.py): the
declarations generated from the C headers (tests/lib/capi.py), and a model wrapper over them."""
import ctypes as C
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import capi  # noqa: E402

lib = None  # set by load()
api = None  # the generated module (structs, constants)
Batch = None  # api.mrl_batch


def load(path):
    global lib, api, Batch
    api = capi.module(path)
    lib = api.load(path)
    Batch = api.mrl_batch
    return lib


def check(status):
    if status != 0:
        raise RuntimeError(lib.mrl_last_error().decode())


def ptr(a):
    return a.ctypes.data_as(C.c_void_p) if a is not None else None


class Moonrl:
    def __init__(self, cfg, seed=1):
        text = json.dumps(cfg).encode()
        c = api.mrl_model_config()
        check(lib.mrl_model_config_parse(text, len(text), b"test", C.byref(c)))
        self.h = C.c_void_p()
        check(lib.mrl_model_create(C.byref(c), seed, C.byref(self.h)))
        n = lib.mrl_model_num_params(self.h)
        self.params = np.ctypeslib.as_array(lib.mrl_model_params(self.h), (n,))
        self.grads = np.ctypeslib.as_array(lib.mrl_model_grads(self.h), (n,))
        self.views = views(self.h, lib.mrl_model_num_views, lib.mrl_model_view)

    def tensor(self, buf, name):
        for n, off, shape, _ in self.views:
            if n == name:
                return buf[off: off + int(np.prod(shape))].reshape(shape)
        raise KeyError(name)

    def forward(self, tokens, targets, cu, temperature=1.0, values=False, prefix=None, routing=None):
        T = len(tokens)
        self.b = Batch(tokens.ctypes.data_as(C.POINTER(C.c_int32)), targets.ctypes.data_as(C.POINTER(C.c_int32)),
                       cu.ctypes.data_as(C.POINTER(C.c_int32)), T, len(cu) - 1,
                       prefix.ctypes.data_as(C.POINTER(C.c_int32)) if prefix is not None else None,
                       routing.ctypes.data_as(C.POINTER(C.c_int16)) if routing is not None else None)
        self.keep = (tokens, targets, cu, prefix, routing)
        lp, ent = np.zeros(T, np.float32), np.zeros(T, np.float32)
        val = np.zeros(T, np.float32) if values else None
        check(lib.mrl_model_forward(self.h, C.byref(self.b), C.c_float(temperature), ptr(lp), ptr(ent), ptr(val)))
        return lp, ent, val

    def backward(self, a, b, c):
        check(lib.mrl_model_backward(self.h, ptr(a), ptr(b), ptr(c)))


def randomize(m, rng):
    """Random weights written into m's buffer: norms near 1, biases and matrices small, a router's
    rows large enough that its picks stay far from ties."""
    for n, off, shape, _ in m.views:
        size = int(np.prod(shape))
        if "norm" in n:
            m.params[off:off + size] = 1 + 0.2 * rng.standard_normal(size)
        elif n.endswith("mlp.gate.weight"):
            m.params[off:off + size] = 0.5 * rng.standard_normal(size)
        else:
            m.params[off:off + size] = (0.1 if n.endswith("bias") else 0.08) * rng.standard_normal(size)


def batch(cfg, lens, rng):
    """A packed batch of random tokens of the given lengths: (tokens, targets: the next token, -1
    last, cu_seqlens)."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    tokens = rng.integers(0, cfg["vocab_size"], cu[-1]).astype(np.int32)
    targets = np.full(cu[-1], -1, np.int32)
    for s in range(len(lens)):
        targets[cu[s]:cu[s + 1] - 1] = tokens[cu[s] + 1:cu[s + 1]]
    return tokens, targets, cu


def views(h, count, view):
    """[(name, offset, shape, weight_decay)] of model h's parameters (count, view: mrl_model_num_views,
    mrl_model_view) or of its LoRA adapters' (mrl_model_lora_num_views, mrl_model_lora_view)."""
    out = []
    for i in range(count(h)):
        v = api.mrl_param_view()
        check(view(h, i, C.byref(v)))
        out.append((v.name.decode(), v.offset, tuple(v.shape[: v.ndim]), v.weight_decay))
    return out


def lora(h):
    """Model h's LoRA adapters (mrl_model_set_lora): their parameters and gradients as numpy arrays
    over moonrl's buffers, and their views."""
    n = lib.mrl_model_lora_num_params(h)
    return (np.ctypeslib.as_array(lib.mrl_model_lora_params(h), (n,)), np.ctypeslib.as_array(lib.mrl_model_lora_grads(h), (n,)),
            views(h, lib.mrl_model_lora_num_views, lib.mrl_model_lora_view))


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.abs(b).max()
    return np.abs(a - b).max() / scale if scale > 0 else np.abs(a).max()
