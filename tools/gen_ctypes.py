#!/usr/bin/env python3
"""Generate Python's ctypes declarations of libmoonrl from moonrl's public C headers.

Input: the headers in core/include/moonrl/ (every *.h), read as tools/gen_ffi.py reads them
(the same order, comments and preprocessor lines dropped). Output: a Python module
(build/moonrl_capi.py) holding
  - every enum constant (MRL_OK, MRL_DTYPE_BF16, ...) as an int;
  - every struct as a ctypes.Structure of the same name (mrl_model_config, mrl_batch, ...),
    its fields typed as in C;
  - every function-pointer typedef as a ctypes.CFUNCTYPE (mrl_grad_hook);
  - FUNCTIONS, name -> (restype, argtypes) of every function, and declare(lib) / load(path),
    which set them on a ctypes.CDLL of libmoonrl.

The Python reference tests reach the C API through it (tests/lib/capi.py finds it), so no
declaration is written by hand a second time. Argument types: a pointer crosses as
c_void_p (a numpy array's .ctypes.data or `ptr(a)`, a ctypes array, byref(x) and None all
pass), but a `char *` as c_char_p (bytes, a create_string_buffer); numbers, enums (c_int),
structs by value and callbacks as declared. Results keep their C type (float * is
POINTER(c_float), for numpy.ctypeslib.as_array; const char * is bytes), but a string returned
with its length (a `size_t *len` argument) is a c_void_p, read with ctypes.string_at(p, len).

usage: gen_ctypes.py HEADER_DIR OUTPUT.py
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_ffi import declarations, header_order  # noqa: E402

SCALARS = {
    "void": None, "char": "C.c_char", "int": "C.c_int", "unsigned": "C.c_uint", "long": "C.c_long",
    "float": "C.c_float", "double": "C.c_double", "size_t": "C.c_size_t",
    "int8_t": "C.c_int8", "uint8_t": "C.c_uint8", "int16_t": "C.c_int16", "uint16_t": "C.c_uint16",
    "int32_t": "C.c_int32", "uint32_t": "C.c_uint32", "int64_t": "C.c_int64", "uint64_t": "C.c_uint64",
}


def fail(msg):
    sys.exit("gen_ctypes.py: " + msg)


def split_top(text, sep):
    """text split at each sep outside (), [] and {}."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


def statements(decls):
    """The top-level statements, whitespace collapsed."""
    *stmts, rest = split_top(decls, ";")
    if rest.strip():
        fail("a declaration without its ';': %r" % rest.strip())
    return [" ".join(st.split()) for st in stmts if st.strip()]


def split_commas(text):
    return [x.strip() for x in split_top(text, ",")]


class Types:
    def __init__(self):
        self.enums, self.structs, self.opaque, self.callbacks = set(), set(), set(), set()
        self.constants = {}

    def declarator(self, text, named=True):
        """'const char *const *argv' -> ('char', 2, 'argv', None); 'int64_t shape[8]' -> (.., '8')."""
        m = re.match(r"^(.*?)\s*\[\s*([^\]]*)\s*\]$", text)
        dim = None
        if m:
            text, dim = m.group(1), m.group(2)
        nptr = text.count("*")
        words = [w for w in text.replace("*", " ").split() if w not in ("const", "struct", "enum", "volatile")]
        name = None
        if named and len(words) > 1:
            name = words.pop()
        if len(words) != 1:
            fail("cannot read the declaration %r" % text)
        return words[0], nptr, name, dim

    def base(self, base):
        if base in SCALARS:
            return SCALARS[base]
        if base in self.enums:
            return "C.c_int"
        if base in self.structs or base in self.callbacks:
            return base
        if base in self.opaque:
            return "opaque"
        fail("unknown type %s" % base)

    def ctype(self, base, nptr, where):
        """The ctypes expression of base with nptr '*'s, as a field, a param or a ret."""
        b = self.base(base)
        if nptr == 0:
            if b == "opaque":
                fail("%s used by value" % base)
            return b if b is not None else "None"
        if base == "char" and nptr == 1:
            return "C.c_char_p"
        if where == "param":
            return "C.c_void_p"
        if b in (None, "opaque"):
            t, nptr = "C.c_void_p", nptr - 1
        else:
            t = b
        for _ in range(nptr):
            t = "C.POINTER(%s)" % t
        return t

    def enum_values(self, body, lines):
        value = -1
        for item in split_commas(body):
            if not item:
                continue
            name, _, expr = item.partition("=")
            name = name.strip()
            if expr.strip():
                value = self.evaluate(expr.strip())
            else:
                value += 1
            self.constants[name] = value
            lines.append("%s = %d" % (name, value))

    def evaluate(self, expr):
        if not re.match(r"^[A-Za-z0-9_\s()+\-*/<>|&~x]+$", expr):
            fail("cannot evaluate the constant %r" % expr)
        try:
            return int(eval(expr, {"__builtins__": {}}, dict(self.constants)))
        except Exception as e:  # noqa: BLE001
            fail("cannot evaluate the constant %r: %s" % (expr, e))

    def params(self, text):
        text = text.strip()
        if text in ("", "void"):
            return []
        out = []
        for p in split_commas(text):
            base, nptr, name, dim = self.declarator(p)
            out.append((self.ctype(base, nptr + (1 if dim is not None else 0), "param"), base, nptr, name))
        return out


def generate(header_dir):
    names = [n for n in os.listdir(header_dir) if n.endswith(".h")]
    T = Types()
    lines, functions = [], []
    for header in header_order(header_dir, names):
        lines.append("\n# %s" % header)
        for s in statements(declarations(os.path.join(header_dir, header))):
            m = re.match(r"^typedef enum(?:\s+\w+)?\s*\{(.*)\}\s*(\w+)$", s)
            if m:
                T.enum_values(m.group(1), lines)
                T.enums.add(m.group(2))
                continue
            m = re.match(r"^enum(?:\s+\w+)?\s*\{(.*)\}$", s)
            if m:
                T.enum_values(m.group(1), lines)
                continue
            m = re.match(r"^typedef struct\s+(\w+)\s+(\w+)$", s)
            if m:
                if m.group(2) not in T.structs:
                    T.opaque.add(m.group(2))
                continue
            m = re.match(r"^typedef struct(?:\s+\w+)?\s*\{(.*)\}\s*(\w+)$", s)
            if m:
                fields = []
                for decl in statements(m.group(1) + ";"):
                    first, *rest = split_commas(decl)  # int running, waiting, finished
                    name = T.declarator(first)[2]
                    prefix = first[: first.rindex(name)].rstrip("* ")
                    for d in [first] + [prefix + " " + r for r in rest]:
                        b, n, fname, fdim = T.declarator(d)
                        t = T.ctype(b, n, "field")
                        if fdim is not None:
                            t = "%s * %d" % (t, T.evaluate(fdim))
                        fields.append('("%s", %s)' % (fname, t))
                struct = m.group(2)
                T.opaque.discard(struct)
                T.structs.add(struct)
                lines.append("\n\nclass %s(C.Structure):\n    _fields_ = [\n%s\n    ]\n" % (
                    struct, "\n".join("        %s," % f for f in fields)))
                continue
            m = re.match(r"^typedef (.+?)\(\s*\*\s*(\w+)\s*\)\s*\((.*)\)$", s)
            if m:
                rb, rn, _, _ = T.declarator(m.group(1), named=False)
                args = [T.ctype(b, n, "field") for _, b, n, _ in T.params(m.group(3))]
                lines.append("%s = C.CFUNCTYPE(%s)" % (m.group(2), ", ".join([T.ctype(rb, rn, "ret")] + args)))
                T.callbacks.add(m.group(2))
                continue
            m = re.match(r"^(.+?)\b(\w+)\s*\((.*)\)$", s)
            if m and not s.startswith("typedef"):
                rb, rn, _, _ = T.declarator(m.group(1), named=False)
                ps = T.params(m.group(3))
                ret = T.ctype(rb, rn, "ret")
                if ret == "C.c_char_p" and any(b == "size_t" and n == 1 and name == "len" for _, b, n, name in ps):
                    ret = "C.c_void_p"  # a counted string: ctypes.string_at(p, len)
                functions.append((m.group(2), ret, [p[0] for p in ps]))
                continue
            fail("%s: cannot read %r" % (header, s))
    seen = set()
    for f, _, _ in functions:
        if f in seen:
            fail("function %s declared twice" % f)
        seen.add(f)
    out = [
        "# generated by tools/gen_ctypes.py from core/include/moonrl/*.h; do not edit",
        '"""libmoonrl\'s C API for ctypes: constants, structs, callbacks and every function\'s',
        'restype and argtypes (FUNCTIONS), set on a CDLL by declare(lib) or load(path)."""',
        "import ctypes as C",
    ]
    out += lines
    out.append("\n\nFUNCTIONS = {")
    for name, ret, args in functions:
        out.append('    "%s": (%s, [%s]),' % (name, ret, ", ".join(args)))
    out.append("}")
    out.append('''

def declare(lib):
    """Sets every function's restype and argtypes on lib (a ctypes.CDLL of libmoonrl)."""
    for name, (restype, argtypes) in FUNCTIONS.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = restype, argtypes
    return lib


def load(path):
    """libmoonrl at path, declared."""
    return declare(C.CDLL(path))''')
    return "\n".join(out) + "\n"


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: gen_ctypes.py HEADER_DIR OUTPUT.py")
    text = generate(sys.argv[1])
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
