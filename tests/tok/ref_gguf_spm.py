#!/usr/bin/env python3
"""GGUF files with a SentencePiece vocabulary (tokenizer.ggml.model = llama: tokens,
scores, token types, <0xNN> byte tokens, the ▁ space marker) against the
`sentencepiece` package itself. Here, per case:
  - sentencepiece trains a small BPE model (byte_fallback, identity normalization,
    as Llama's) on text generated here;
  - gguf-py writes a tiny llama GGUF carrying that vocabulary (and a chat template);
  - `moonrl convert` turns it into a Hugging Face directory;
  - moonrl's tokenizer (libmoonrl through ctypes, and `moonrl tokenize`) must give
    sentencepiece's ids on a varied set of strings (spaces leading, trailing and
    repeated, newlines and tabs, digits, accents, CJK, emoji and other characters
    outside the vocabulary, which fall back to bytes), decode them back to
    sentencepiece's text, and agree with the `tokenizers` library on the
    tokenizer.json it wrote (also on user-defined and control tokens in the text,
    where sentencepiece, which never matches them, is not the reference);
  - BOS / EOS per tokenizer.ggml.add_bos_token / add_eos_token, and the chat
    template in tokenizer_config.json;
  - inconsistent metadata (scores or token types of another length, an unknown
    token type, a byte token that is not <0xNN>) is a usage error naming the file
    and the key.
Skipped (exit 77) where sentencepiece, tokenizers or gguf is not installed.

usage: ref_gguf_spm.py LIBMOONRL MOONRL"""
import ctypes
import io
import json
import os
import random
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import sentencepiece as spm
    import gguf
    from tokenizers import Tokenizer
except ImportError as e:  # meson reads 77 as "skipped"
    print("a Python package is missing (%s); ./dev.sh deps installs it" % e)
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import checks  # noqa: E402
from checks import check  # noqa: E402
from ref_tokenizers import CTok, setup, PARSE_SPECIAL, ADD_SPECIAL  # noqa: E402

LIB, MOONRL = (sys.argv[1:3] if len(sys.argv) >= 3 else ["build/libmoonrl.so", "build/moonrl"])
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"


WORDS = ["the", "cat", "sat", "on", "mat", "hello", "world", "token", "ization", "naïve", "café", "東京", "日本語",
         "数字", "über", "straße", "pre", "un", "believ", "able", "ing", "ed", "==", "...", "---", "aaa", "aba", "abab",
         "2024", "3.14", "x=1", "(a)", "don't", "😀", "ünï"]


def corpus(rng):
    def sent():
        ws = [rng.choice(WORDS) + rng.choice(["", "", "s", "er", "ly"]) for _ in range(rng.randint(3, 14))]
        return rng.choice(["", "", "  "]).join([" ".join(ws[:5]), " ".join(ws[5:])])
    return [sent() for _ in range(4000)]


def train(rng, vocab_size, dummy_prefix):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus(rng)), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, character_coverage=0.995, normalization_rule_name="identity",
        add_dummy_prefix=dummy_prefix, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        split_digits=True, user_defined_symbols=["<|im_start|>"], num_threads=1, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def vocab_of(sp):
    """tokens, scores and llama.cpp token types, as llama.cpp's converter takes them from the model."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_byte(i):
            types.append(6)
        elif sp.is_unused(i):
            types.append(5)
        elif tokens[-1] == "<|im_start|>":
            types.append(4)
        else:
            types.append(1)
    return tokens, scores, types


def write_gguf(path, tokens, scores, types, meta, rng=None):
    """A tiny random llama model (the weights do not matter here) with this vocabulary."""
    rng = rng or np.random.default_rng(0)
    D, F, H, V = 16, 24, 2, len(tokens)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(H)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    if scores is not None:
        w.add_token_scores(scores)
    if types is not None:
        w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if "add_bos" in meta:
        w.add_add_bos_token(meta["add_bos"])
    if "add_eos" in meta:
        w.add_add_eos_token(meta["add_eos"])
    if "add_space_prefix" in meta:
        w.add_add_space_prefix(meta["add_space_prefix"])
    w.add_chat_template(TEMPLATE)

    def t(*shape):
        return rng.standard_normal(shape).astype(np.float32)
    w.add_tensor("token_embd.weight", t(V, D))
    w.add_tensor("output_norm.weight", t(D))
    for name, shape in (("attn_norm", (D,)), ("ffn_norm", (D,)), ("attn_q", (D, D)), ("attn_k", (D, D)),
                        ("attn_v", (D, D)), ("attn_output", (D, D)), ("ffn_gate", (F, D)), ("ffn_up", (F, D)),
                        ("ffn_down", (D, F))):
        w.add_tensor("blk.0.%s.weight" % name, t(*shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def convert(path, out):
    return subprocess.run([MOONRL, "convert", path, out], capture_output=True, text=True, timeout=120)


def strings(rng):
    fixed = ["", " ", "  ", "   ", "hello world", " hello", "hello ", "  hello  world  ", "a  b   c    d",
             "\n", "line one\nline two\n\nthree", "tab\there", " \n ", "1234567890", "pi is 3.14159, e 2.71828",
             "naïve café über straße", "東京の日本語と数字", "emoji 😀🚀 and 🤖", "€uro £ ¥ ₹", "Ünïcödé ÀÉÎÕÜ",
             "ǅ ﬁ Å Å", "κόσμε мир עולם عالم", "\u00a0nbsp\u2003em", "==...---aaa abab aba",
             "don't stop (a) x=1", "the cat sat on the mat " * 6, "\u0000\u0001\u007f", "\u200b\u200d"]
    pool = list("abcthe ") + ["  ", "\n", "\t", "1", "0", "é", "東", "😀", "ß", "€", "♞", "ﬀ"] + WORDS
    rand = ["".join(rng.choice(pool) for _ in range(rng.randint(1, 14))) for _ in range(400)]
    return fixed + rand


def compare(tag, sp, out, rng, add_bos, add_eos):
    lib = ctypes.CDLL(LIB)
    setup(lib)
    tok = CTok(lib, out)
    hf = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    texts = strings(rng)
    bad_ids, bad_hf, bad_dec, bad_hfdec = [], [], [], []
    for s in texts:
        want = sp.encode(s)
        got = tok.encode(s.encode(), 0)
        if got != want:
            bad_ids.append((s, got, want))
        if hf.encode(s, add_special_tokens=False).ids != got:
            bad_hf.append(s)
        dec = tok.decode(want, 0).decode("utf-8", "replace")
        if dec != sp.decode(want):
            bad_dec.append((s, dec, sp.decode(want)))
        if hf.decode(want) != dec:
            bad_hfdec.append(s)
    for s, got, want in bad_ids[:5]:
        print("   %r: moonrl %s %s\n   sentencepiece %s %s" % (s, got, [sp.id_to_piece(i) for i in got], want,
                                                               [sp.id_to_piece(i) for i in want]))
    for s, got, want in bad_dec[:5]:
        print("   decode of %r: moonrl %r sentencepiece %r" % (s, got, want))
    n = len(texts)
    check(not bad_ids, "%s: ids equal to sentencepiece's on %d strings (%d differ)" % (tag, n, len(bad_ids)))
    check(not bad_dec, "%s: decoded text equal to sentencepiece's on %d strings (%d differ)" % (tag, n, len(bad_dec)))
    check(not bad_hf, "%s: tokenizers on the written tokenizer.json gives the same ids (%d differ: %r)"
          % (tag, len(bad_hf), bad_hf[:3]))
    check(not bad_hfdec, "%s: tokenizers decodes the same (%d differ)" % (tag, len(bad_hfdec)))
    fallback = sp.encode("♞ 🤖")
    check(any(sp.is_byte(i) for i in fallback) and tok.encode("♞ 🤖".encode(), 0) == fallback,
          "%s: characters outside the vocabulary fall back to byte tokens %s" % (tag, fallback))
    # added tokens in the text: tokenizers is the reference (sentencepiece never matches them)
    for s in ["<|im_start|>user\nhi</s>", "a<s>b <|im_start|> c", "<unk>x"]:
        got, want = tok.encode(s.encode(), PARSE_SPECIAL), hf.encode(s, add_special_tokens=False).ids
        check(got == want, "%s: special / user-defined tokens in %r: %s vs tokenizers %s" % (tag, s, got, want))
    got = tok.encode(b"hello world", ADD_SPECIAL)
    want = ([1] if add_bos else []) + sp.encode("hello world") + ([2] if add_eos else [])
    check(got == want and hf.encode("hello world").ids == want,
          "%s: with add_special, BOS %s / EOS %s: %s (want %s)" % (tag, add_bos, add_eos, got, want))
    check(tok.decode(want, 4).decode() == "hello world", "%s: skip_special leaves BOS / EOS out" % tag)
    tok.free()
    cfg = json.load(open(os.path.join(out, "tokenizer_config.json")))
    check(cfg.get("chat_template") == TEMPLATE and cfg.get("add_bos_token") == add_bos
          and cfg.get("add_eos_token") == add_eos and cfg.get("bos_token") == "<s>" and cfg.get("eos_token") == "</s>",
          "%s: tokenizer_config.json: the chat template, add_bos %s, add_eos %s, <s>, </s>" % (tag, add_bos, add_eos))
    # the command line, end to end
    s = "  Tokens, 東京 😀\n  x"
    r = subprocess.run([MOONRL, "tokenize", "--tokenizer", out], input=s.encode(), capture_output=True)
    ids = [int(x) for x in r.stdout.split()]
    check(ids == sp.encode(s), "%s: moonrl tokenize %r: %s" % (tag, s, ids))
    r = subprocess.run([MOONRL, "tokenize", "--tokenizer", out, "--decode"], input=" ".join(map(str, ids)).encode(),
                       capture_output=True)
    check(r.stdout.decode() == s, "%s: moonrl tokenize --decode round trip: %r" % (tag, r.stdout.decode()))


def bad_input(tmp, tokens, scores, types):
    cases = [
        ("scores", tokens, scores[:-3], types, "tokenizer.ggml.scores has %d entries, tokenizer.ggml.tokens %d"
         % (len(tokens) - 3, len(tokens))),
        ("types", tokens, scores, types[:-1], "tokenizer.ggml.token_type has %d entries" % (len(tokens) - 1)),
        ("type9", tokens, scores, [9] + types[1:], "tokenizer.ggml.token_type[0] (token \"<unk>\"): unknown token type 9"),
        ("noscores", tokens, None, types, "tokenizer.ggml.scores is missing"),
    ]
    i = types.index(1)  # a byte token type on a normal piece
    cases.append(("byte", tokens, scores, types[:i] + [6] + types[i + 1:], "is not <0xNN>"))
    for name, tk, sc, ty, want in cases:
        path = os.path.join(tmp, "bad-%s.gguf" % name)
        write_gguf(path, tk, sc, ty, {})
        r = convert(path, os.path.join(tmp, "bad-%s" % name))
        check(r.returncode == 2 and path in r.stderr and want in r.stderr,
              "inconsistent metadata (%s): a usage error naming the file: %s" % (name, r.stderr.strip()[-300:]))


def main():
    rng = random.Random(7)
    with tempfile.TemporaryDirectory() as tmp:
        first = None
        for tag, vocab_size, prefix, meta, bos, eos in (
                ("vocab 600, defaults", 600, True, {}, True, False),
                ("vocab 1000, add_eos", 1000, True, {"add_bos": True, "add_eos": True}, True, True),
                ("vocab 400, no space prefix, no BOS", 400, False, {"add_bos": False, "add_space_prefix": False},
                 False, False)):
            sp = train(rng, vocab_size, prefix)
            tokens, scores, types = vocab_of(sp)
            first = first or (tokens, scores, types)
            path = os.path.join(tmp, "spm-%d.gguf" % vocab_size)
            write_gguf(path, tokens, scores, types, meta)
            out = os.path.join(tmp, "hf-%d" % vocab_size)
            r = convert(path, out)
            check(r.returncode == 0, "%s: moonrl convert: %s" % (tag, r.stderr.strip()[-300:]))
            if r.returncode == 0:
                compare(tag, sp, out, rng, bos, eos)
        # --model FILE.gguf (converted into MOONRL_CACHE) with its chat template, end to end
        env = dict(os.environ, MOONRL_CACHE=os.path.join(tmp, "cache"))
        r = subprocess.run([MOONRL, "generate", "--model", path, "--prompt", "hi there", "--chat", "--max-tokens", "4",
                            "--temperature", "0"], capture_output=True, text=True, timeout=120, env=env)
        check(r.returncode == 0 and os.path.isdir(os.path.join(tmp, "cache", "gguf")),
              "moonrl generate --chat --model FILE.gguf: %s" % (r.stderr.strip()[-300:] or r.stdout.strip()[-100:]))
        bad_input(tmp, *first)
    checks.done()


if __name__ == "__main__":
    main()
