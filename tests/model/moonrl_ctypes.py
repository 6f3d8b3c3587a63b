"""ctypes access to libmoonrl's model API, for the Python reference test
(tests/model/model_ref.py) and the benchmark (bench/train/train_bench.py)."""
import ctypes as C
import json

import numpy as np

lib = None  # set by load()


def load(path):
    global lib
    lib = C.CDLL(path)
    _declare(lib)
    return lib


class View(C.Structure):
    _fields_ = [("name", C.c_char_p), ("offset", C.c_int64), ("numel", C.c_int64), ("ndim", C.c_int),
                ("shape", C.c_int64 * 2), ("weight_decay", C.c_int)]


class Batch(C.Structure):
    _fields_ = [("tokens", C.POINTER(C.c_int32)), ("targets", C.POINTER(C.c_int32)),
                ("cu_seqlens", C.POINTER(C.c_int32)), ("n_tokens", C.c_int64), ("n_seqs", C.c_int32),
                ("prefix", C.POINTER(C.c_int32)),  # NULL: no shared prompts
                ("routing", C.POINTER(C.c_int16))]  # NULL: no routing replay (qwen3_moe)


def _declare(lib):
    lib.mrl_last_error.restype = C.c_char_p
    lib.mrl_model_params.restype = C.POINTER(C.c_float)
    lib.mrl_model_grads.restype = C.POINTER(C.c_float)
    lib.mrl_model_num_params.restype = C.c_int64
    lib.mrl_model_create.argtypes = [C.c_void_p, C.c_uint64, C.POINTER(C.c_void_p)]
    lib.mrl_model_forward.argtypes = [C.c_void_p, C.POINTER(Batch), C.c_float, C.c_void_p, C.c_void_p, C.c_void_p]
    lib.mrl_model_backward.argtypes = [C.c_void_p, C.c_void_p, C.c_void_p, C.c_void_p]
    for f in ("mrl_model_params", "mrl_model_grads", "mrl_model_num_params", "mrl_model_num_views",
              "mrl_model_zero_grad", "mrl_model_free"):
        getattr(lib, f).argtypes = [C.c_void_p]
    lib.mrl_model_view.argtypes = [C.c_void_p, C.c_int, C.POINTER(View)]
    lib.mrl_model_set_recompute.argtypes = [C.c_void_p, C.c_int]
    lib.mrl_model_set_kernels.argtypes = [C.c_void_p, C.c_int]
    lib.mrl_model_set_head_chunk.argtypes = [C.c_void_p, C.c_int64]
    lib.mrl_mem_get_stats.argtypes = [C.c_void_p]
    lib.mrl_model_activation_bytes.restype = C.c_int64
    lib.mrl_model_activation_bytes.argtypes = [C.c_void_p, C.c_int64]


def check(status):
    if status != 0:
        raise RuntimeError(lib.mrl_last_error().decode())


def ptr(a):
    return a.ctypes.data_as(C.c_void_p) if a is not None else None


class Moonrl:
    def __init__(self, cfg, seed=1):
        text = json.dumps(cfg).encode()
        c = C.create_string_buffer(512)  # mrl_model_config is far smaller
        check(lib.mrl_model_config_parse(text, C.c_size_t(len(text)), b"test", c))
        self.h = C.c_void_p()
        check(lib.mrl_model_create(c, seed, C.byref(self.h)))
        n = lib.mrl_model_num_params(self.h)
        self.params = np.ctypeslib.as_array(lib.mrl_model_params(self.h), (n,))
        self.grads = np.ctypeslib.as_array(lib.mrl_model_grads(self.h), (n,))
        self.views = []
        for i in range(lib.mrl_model_num_views(self.h)):
            v = View()
            check(lib.mrl_model_view(self.h, i, C.byref(v)))
            shape = tuple(v.shape[: v.ndim])
            self.views.append((v.name.decode(), v.offset, shape, v.weight_decay))

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


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.abs(b).max()
    return np.abs(a - b).max() / scale if scale > 0 else np.abs(a).max()
