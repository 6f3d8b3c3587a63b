#!/usr/bin/env python3
"""Tokenizer speed: moonrl (libmoonrl through ctypes, one C call per document)
against the Python `tokenizers` package (Tokenizer.encode, one document at a
time, single-threaded), on the same documents in one process. Prints MB/s of
each and the ratio moonrl / tokenizers, and checks that the ids agree.

usage: /usr/bin/python3 bench/tokenizer/tokenizer_bench.py build/libmoonrl.so [MB]"""
import ctypes
import os
import random
import sys
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from tokenizers import Tokenizer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "tok"))
import corpus  # noqa: E402
from ref_tokenizers import CTok, setup  # noqa: E402

FIXTURES = os.path.join(HERE, "..", "..", "tests", "tok", "fixtures")


def documents(mb):
    """Documents of ~2 KB made of shuffled words of the corpus, numbers and
    punctuation, so that caches see a realistic mix of repeats and new words."""
    rng = random.Random(1)
    words = " ".join(corpus.CORPUS).split()
    docs, total = [], 0
    while total < mb * 1e6:
        parts = []
        for _ in range(300):
            r = rng.random()
            if r < 0.08:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 7))))
            elif r < 0.12:
                parts.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 12))))
            else:
                parts.append(rng.choice(words))
            parts.append(rng.choice([" ", " ", " ", " ", ", ", ". ", "\n", "  "]))
        d = "".join(parts)
        docs.append(d)
        total += len(d.encode())
    return docs, total


def best_of(fn, repeats=5):
    best = 1e30
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    lib = ctypes.CDLL(sys.argv[1])
    setup(lib)
    mb = float(sys.argv[2]) if len(sys.argv) > 2 else 4
    docs, total = documents(mb)
    data = [d.encode() for d in docs]
    print("%d documents, %.1f MB of text; best of 5 runs each" % (len(docs), total / 1e6))
    print("%-28s %12s %12s %8s" % ("tokenizer", "moonrl MB/s", "HF MB/s", "ratio"))
    for name in ("gpt2", "openllama", "bora", "gpt2_bytelevel", "llama3_split", "qwen2_split"):
        path = os.path.join(FIXTURES, name)
        hf = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        hf.no_truncation()
        ct = CTok(lib, path)
        # the same ids first (this also warms both caches the same way)
        for d, b in zip(docs[:50], data[:50]):
            assert ct.encode(b, 2) == hf.encode(d, add_special_tokens=False).ids, name
        cap = 1 << 16
        buf = (ctypes.c_int32 * cap)()
        n = ctypes.c_size_t()

        def run_c():
            for b in data:
                lib.mrl_tok_encode(ct.h, b, len(b), 2, buf, cap, ctypes.byref(n))

        def run_hf():
            for d in docs:
                hf.encode(d, add_special_tokens=False)

        tc, th = best_of(run_c), best_of(run_hf)
        print("%-28s %12.2f %12.2f %8.2f" % (name, total / tc / 1e6, total / th / 1e6, th / tc))
        ct.free()


if __name__ == "__main__":
    main()
