#!/usr/bin/env python3
"""Reference test: moonrl's tokenizer (libmoonrl through ctypes) against the
Python `tokenizers` package on every fixture in tests/tok/fixtures/: ids with
and without add_special / special-token parsing, decoded text with and without
skip_special, the streaming decoder against DecodeStream, and invalid UTF-8
(compared with the str that errors='replace' makes, see core/include/moonrl/tok.h).

usage: ref_tokenizers.py LIBMOONRL [FIXTURE_DIR]"""
import ctypes
import os
import random
import sys

try:
    from tokenizers import Tokenizer
except ImportError:  # meson reads 77 as "skipped"
    print("the Python package `tokenizers` is not installed (./dev.sh deps installs it)")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import capi  # noqa: E402
import corpus  # noqa: E402

ADD_SPECIAL, PARSE_SPECIAL, SKIP_SPECIAL = 1, 2, 4


class CTok:
    def __init__(self, lib, path):
        self.lib = lib
        self.h = ctypes.c_void_p()
        st = lib.mrl_tok_load(path.encode(), ctypes.byref(self.h))
        if st:
            raise RuntimeError(lib.mrl_last_error().decode())

    def encode(self, data, flags):
        n = ctypes.c_size_t()
        st = self.lib.mrl_tok_encode(self.h, data, len(data), flags, None, 0, ctypes.byref(n))
        assert st == 0, self.lib.mrl_last_error()
        buf = (ctypes.c_int32 * max(1, n.value))()
        st = self.lib.mrl_tok_encode(self.h, data, len(data), flags, buf, n.value, ctypes.byref(n))
        assert st == 0, self.lib.mrl_last_error()
        return list(buf[:n.value])

    def decode(self, ids, flags):
        arr = (ctypes.c_int32 * max(1, len(ids)))(*ids)
        n = ctypes.c_size_t()
        assert self.lib.mrl_tok_decode(self.h, arr, len(ids), flags, None, 0, ctypes.byref(n)) == 0
        buf = ctypes.create_string_buffer(max(1, n.value))
        assert self.lib.mrl_tok_decode(self.h, arr, len(ids), flags, buf, n.value, ctypes.byref(n)) == 0
        return buf.raw[:n.value]

    def stream(self, ids, flags):
        s = ctypes.c_void_p()
        assert self.lib.mrl_tok_stream_new(self.h, flags, ctypes.byref(s)) == 0
        out = []
        text, n = ctypes.c_char_p(), ctypes.c_size_t()
        for i in ids:
            assert self.lib.mrl_tok_stream_step(s, i, ctypes.byref(text), ctypes.byref(n)) == 0, self.lib.mrl_last_error()
            out.append(ctypes.string_at(text, n.value) if n.value else None)
        self.lib.mrl_tok_stream_free(s)
        return out

    def free(self):
        self.lib.mrl_tok_free(self.h)


def setup(lib):
    """Declares the C API on lib (a ctypes.CDLL of libmoonrl): tests/lib/capi.py."""
    capi.declare(lib)


def hf_stream(tok, ids, skip, strict=True):
    """DecodeStream's output per id; None when the package has no DecodeStream,
    or (strict=False) when it fails on these ids (moonrl restarts instead)."""
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    ds = DecodeStream(skip_special_tokens=skip)
    out = []
    for i in ids:
        try:
            s = ds.step(tok, i)
        except Exception:
            if strict:
                raise
            return None
        out.append(s.encode() if s else None)
    return out


def main():
    lib = capi.load(sys.argv[1])
    root = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
    failures = checks = 0

    def fail(msg):
        nonlocal failures
        failures += 1
        if failures <= 40:
            print("FAIL", msg)

    for name in sorted(os.listdir(root)):
        d = os.path.join(root, name)
        if not os.path.isdir(d):
            continue
        hf = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        hf.no_truncation()  # moonrl leaves truncation and padding to the caller
        hf.no_padding()
        ct = CTok(lib, d)
        specials = [t.content for t in hf.get_added_tokens_decoder().values() if t.special]
        added = [t.content for t in hf.get_added_tokens_decoder().values() if not t.special]
        cases = corpus.cases(specials + added)
        cases += [("added%d" % k, "x %s y%s.%s" % (a, a, a)) for k, a in enumerate(added[:6])]
        # neighbours that make or do not make a word (single_word), whitespace (lstrip / rstrip)
        around = ["é%s", "%s\u0301", "½%s²", "_%s_", "%s😀", "1%s", "\u3000%s\u3000 \n", "%s%s", "  %s  x"]
        cases += [("around%d_%d" % (k, j), f.replace("%s", a)) for k, a in enumerate((added + specials)[:8])
                  for j, f in enumerate(around)]
        before = failures
        # vocabulary and lookups
        checks += 1
        if lib.mrl_tok_vocab_size(ct.h) != hf.get_vocab_size():
            fail("%s: vocab size %d, tokenizers %d" % (name, lib.mrl_tok_vocab_size(ct.h), hf.get_vocab_size()))
        vocab = sorted(hf.get_vocab().items(), key=lambda kv: kv[1])
        for tokstr, tid in vocab[:2000] + vocab[-300:]:
            b = tokstr.encode()
            checks += 1
            if lib.mrl_tok_token_to_id(ct.h, b, len(b)) != tid:
                fail("%s: token_to_id(%r)" % (name, tokstr))
            n = ctypes.c_size_t()
            p = lib.mrl_tok_id_to_token(ct.h, tid, ctypes.byref(n))
            if ctypes.string_at(p, n.value).decode() != hf.id_to_token(tid):
                fail("%s: id_to_token(%d)" % (name, tid))
        for cname, text in cases:
            data = text.encode()
            for flags in (PARSE_SPECIAL, PARSE_SPECIAL | ADD_SPECIAL, ADD_SPECIAL, 0):
                hf.encode_special_tokens = not (flags & PARSE_SPECIAL)
                want = hf.encode(text, add_special_tokens=bool(flags & ADD_SPECIAL)).ids
                got = ct.encode(data, flags)
                checks += 1
                if got != want:
                    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                    fail("%s/%s flags=%d: ids differ from index %d\n  text %r\n  got  %s\n  want %s" % (
                        name, cname, flags, k, text[:80], got[max(0, k - 5):k + 15], want[max(0, k - 5):k + 15]))
                    continue
                for skip in (False, True):
                    dwant = hf.decode(want, skip_special_tokens=skip).encode()
                    dgot = ct.decode(want, SKIP_SPECIAL if skip else 0)
                    checks += 1
                    if dgot != dwant:
                        fail("%s/%s: decode(skip=%s) differs\n  got  %r\n  want %r" % (name, cname, skip, dgot[:120], dwant[:120]))
                if flags == PARSE_SPECIAL | ADD_SPECIAL:
                    for skip in (False, True):
                        swant = hf_stream(hf, want, skip)
                        if swant is None:
                            continue
                        sgot = ct.stream(want, SKIP_SPECIAL if skip else 0)
                        checks += 1
                        if sgot != swant:
                            fail("%s/%s: stream(skip=%s) differs\n  got  %r\n  want %r" % (name, cname, skip, sgot[:20], swant[:20]))
        # the whole corpus as one parallel batch gives the same ids
        hf.encode_special_tokens = False
        texts = [c[1].encode() for c in cases]
        arr = (ctypes.c_char_p * len(texts))(*texts)
        lens = (ctypes.c_size_t * len(texts))(*[len(x) for x in texts])
        offs = (ctypes.c_size_t * (len(texts) + 1))()
        assert lib.mrl_tok_encode_batch(ct.h, arr, lens, len(texts), ADD_SPECIAL | PARSE_SPECIAL, None, 0, offs) == 0
        buf = (ctypes.c_int32 * max(1, offs[len(texts)]))()
        assert lib.mrl_tok_encode_batch(ct.h, arr, lens, len(texts), ADD_SPECIAL | PARSE_SPECIAL, buf, offs[len(texts)], offs) == 0
        want = [e.ids for e in hf.encode_batch([c[1] for c in cases], add_special_tokens=True)]
        checks += 1
        if [list(buf[offs[i]:offs[i + 1]]) for i in range(len(texts))] != want:
            fail("%s: encode_batch differs from tokenizers' encode_batch" % name)
        # random texts, every flag combination in turn
        for k, text in enumerate(corpus.random_texts(len(name), 400)):
            flags = k % 4
            hf.encode_special_tokens = not (flags & PARSE_SPECIAL)
            want = hf.encode(text, add_special_tokens=bool(flags & ADD_SPECIAL)).ids
            got = ct.encode(text.encode(), flags)
            checks += 2
            if got != want:
                fail("%s/random%d flags=%d: ids differ\n  text %r\n  got  %s\n  want %s" % (name, k, flags, text, got, want))
            elif ct.decode(want, SKIP_SPECIAL) != hf.decode(want, skip_special_tokens=True).encode():
                fail("%s/random%d: decode differs" % (name, k))
        # the streaming decoder on random id sequences (where DecodeStream does not fail)
        rng = random.Random(len(name))
        for k in range(100):
            ids = [rng.randrange(hf.get_vocab_size()) for _ in range(rng.randint(1, 30))]
            want = hf_stream(hf, ids, k % 2 == 1, strict=False)
            if want is None:
                continue
            checks += 1
            if ct.stream(ids, SKIP_SPECIAL if k % 2 else 0) != want:
                fail("%s: stream of random ids %s differs" % (name, ids))
        hf.encode_special_tokens = False
        for k, raw in enumerate(corpus.invalid_utf8()):
            want = hf.encode(raw.decode("utf-8", errors="replace"), add_special_tokens=False).ids
            got = ct.encode(raw, PARSE_SPECIAL)
            checks += 1
            if got != want:
                fail("%s/invalid%d: ids differ: got %s want %s" % (name, k, got, want))
        # decoding arbitrary id sequences (bytes split across tokens, unknown ids)
        vs = hf.get_vocab_size()
        seq = [(i * 7919 + 13) % (vs + 5) for i in range(400)]
        for skip in (False, True):
            want = hf.decode(seq, skip_special_tokens=skip).encode()
            got = ct.decode(seq, SKIP_SPECIAL if skip else 0)
            checks += 1
            if got != want:
                fail("%s/random ids: decode(skip=%s) differs\n  got  %r\n  want %r" % (name, skip, got[:200], want[:200]))
        ct.free()
        print("%-28s %s" % (name, "ok" if failures == before else "%d failures" % (failures - before)))
    print("%d checks, %d failed" % (checks, failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
