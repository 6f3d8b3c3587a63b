#!/usr/bin/env python3
"""Train the small fixture tokenizers of the tokenizer reference test with the
`tokenizers` package. The outputs are committed (tests/tok/fixtures/*/);
rerun this only to regenerate them:

    /usr/bin/python3 tests/tok/make_fixtures.py tests/tok/fixtures

Training takes a second. It is not bit-reproducible for the two tokenizers
trained with limit_alphabet (the package breaks ties in the alphabet in hash
order), which is why the generated files are committed: they are the fixtures,
this script is how they were made."""
import json
import os
import sys

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def texts():
    base = corpus.CORPUS
    return [t for _ in range(3) for t in base] + [" ".join(base)]


def save(tok, out, name, config=None):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    if config:
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=1)


def gpt2(out):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tr = trainers.BpeTrainer(vocab_size=1200, special_tokens=["<|endoftext|>"], show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), tr)
    tok.add_special_tokens([AddedToken("<|im_start|>", normalized=False), AddedToken("<|im_end|>", normalized=False)])
    tok.add_tokens([AddedToken("<tool>", single_word=True), AddedToken("[[L]]", lstrip=True),
                    AddedToken("{R}", rstrip=True, normalized=False), AddedToken("fox jumps", normalized=True)])
    save(tok, out, "gpt2_bytelevel", {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"})


def llama3(out):
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=1500, special_tokens=["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
                             show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), tr)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", 0)])])
    save(tok, out, "llama3_split", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})


def qwen2(out):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tr = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                             show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), tr)
    save(tok, out, "qwen2_split", {"bos_token": None, "eos_token": "<|im_end|>"})


def sentencepiece(out):
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tr = trainers.BpeTrainer(vocab_size=900, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                             limit_alphabet=120)
    tok.train_from_iterator(texts(), tr)
    # the 256 byte tokens of byte_fallback, appended to the model's vocabulary
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    n = max(vocab.values()) + 1
    for b in range(256):
        vocab.setdefault("<0x%02X>" % b, n + b)
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    spec["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                       {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    # merges written as "a b" strings (the older format)
    spec["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    tok = Tokenizer.from_str(json.dumps(spec))
    save(tok, out, "sentencepiece_bytefallback", {"bos_token": {"content": "<s>"}, "eos_token": {"content": "</s>"}})


def metaspace(out):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True),
        pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tr = trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                             limit_alphabet=100)
    tok.train_from_iterator(texts(), tr)
    tok.add_special_tokens(["<|user|>"])
    save(tok, out, "metaspace_digits", {"bos_token": "<s>", "eos_token": "</s>"})


def variants(out):
    """Options the trained tokenizers do not use, on copies of them: ByteLevel
    add_prefix_space, Split behaviours and invert, Digits in runs, the other
    Metaspace prepend schemes, a Replace normalizer over a ByteLevel model."""
    def edit(src, name, fn, config=None):
        with open(os.path.join(out, src, "tokenizer.json")) as f:
            spec = json.load(f)
        fn(spec)
        save(Tokenizer.from_str(json.dumps(spec)), out, name, config)

    def prefix_space(spec):
        spec["pre_tokenizer"]["add_prefix_space"] = True
        spec["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Replace", "pattern": {"String": "\t"}, "content": "    "}]}
    edit("gpt2_bytelevel", "var_prefix_space", prefix_space)

    def splits(spec):
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"String": ","}, "behavior": "Removed", "invert": False},
            {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "MergedWithNext", "invert": False},
            {"type": "Split", "pattern": {"Regex": "[.!?]"}, "behavior": "MergedWithPrevious", "invert": False},
            {"type": "Split", "pattern": {"Regex": "\\p{Han}"}, "behavior": "Contiguous", "invert": False},
            {"type": "Split", "pattern": {"Regex": "[a-z]+"}, "behavior": "Isolated", "invert": True},
            {"type": "Digits", "individual_digits": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    edit("llama3_split", "var_splits", splits)

    def metaspace_always(spec):
        spec["pre_tokenizer"]["pretokenizers"][0]["prepend_scheme"] = "always"
        spec["pre_tokenizer"]["pretokenizers"][0]["split"] = False
        spec["decoder"]["prepend_scheme"] = "always"
    edit("metaspace_digits", "var_metaspace_always", metaspace_always)

    def metaspace_never(spec):
        spec["pre_tokenizer"]["pretokenizers"][0]["prepend_scheme"] = "never"
        spec["decoder"]["prepend_scheme"] = "never"
    edit("metaspace_digits", "var_metaspace_never", metaspace_never)

    def punctuation(spec):
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "WhitespaceSplit"}, {"type": "Punctuation", "behavior": "Contiguous"}, {"type": "Whitespace"},
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": False}]}
    edit("gpt2_bytelevel", "var_punctuation", punctuation)

    def roberta(spec):
        im_end = [t["id"] for t in spec["added_tokens"] if t["content"] == "<|im_end|>"][0]
        spec["post_processor"] = {"type": "RobertaProcessing", "sep": ["<|im_end|>", im_end],
                                  "cls": ["<|endoftext|>", 0], "trim_offsets": False, "add_prefix_space": False}
    edit("gpt2_bytelevel", "var_roberta", roberta)

    def ignore_merges(spec):
        # whole words that the merges split: with ignore_merges they become one id
        tok = Tokenizer.from_str(json.dumps(spec))
        vocab = spec["model"]["vocab"]
        n, added = max(vocab.values()) + 1, 0
        for text in corpus.CORPUS:
            for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text):
                if added < 12 and piece not in vocab and len(tok.model.tokenize(piece)) > 1:
                    vocab[piece] = n
                    n, added = n + 1, added + 1
    edit("llama3_split", "var_ignore_merges", ignore_merges)


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
    for fn in (gpt2, llama3, qwen2, sentencepiece, metaspace, variants):
        fn(out)
    print("fixtures written to", out)
