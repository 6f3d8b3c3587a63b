"""libmoonrl through ctypes, for the Python tests: the C API's declarations are those that
tools/gen_ctypes.py generates from core/include/moonrl/*.h at build time (moonrl_capi.py in
the build directory), never written by hand.

The generated module is found at $MOONRL_CAPI (the meson tests set it), else beside the library
(build/moonrl_capi.py next to build/libmoonrl.so).

    import capi                      # tests/lib on sys.path
    lib = capi.load(path)            # a ctypes.CDLL of libmoonrl, every function declared
    api = capi.module(path)          # the generated module: constants, structs (api.mrl_batch, ...)
    capi.declare(ctypes.CDLL(path))  # the same declarations on a CDLL made elsewhere
"""
import ctypes
import importlib.util
import os
import sys


def module(lib_path):
    """The generated module for the libmoonrl at lib_path (imported once)."""
    if "moonrl_capi" in sys.modules:
        return sys.modules["moonrl_capi"]
    path = os.environ.get("MOONRL_CAPI") or os.path.join(os.path.dirname(os.path.abspath(lib_path)), "moonrl_capi.py")
    if not os.path.exists(path):
        raise RuntimeError("%s: no such file (the build generates it: ninja -C BUILD moonrl_capi.py)" % path)
    spec = importlib.util.spec_from_file_location("moonrl_capi", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["moonrl_capi"] = mod
    return mod


def declare(lib):
    """Declares every function of the C API on lib, a ctypes.CDLL of libmoonrl; returns lib."""
    return module(lib._name).declare(lib)


def load(lib_path):
    """libmoonrl at lib_path with every function declared."""
    return declare(ctypes.CDLL(lib_path))
