#!/usr/bin/env python3
"""Train the default example's tokenizer (examples/default/tokenizer.json).

The default run (examples/default.lua) learns 2-digit addition, "37+48=" -> "85".
Its tokenizer is a BPE trained with the Hugging Face `tokenizers` package on
text of that task; the pre-tokenizer splits every digit into its own token, so
the vocabulary is one token per character plus three special tokens
(<|pad|> 0, <|bos|> 1, <|eos|> 2). Per-digit tokens let a small model learn the
column-wise arithmetic.

    /usr/bin/python3 examples/default/make_tokenizer.py   # rewrites tokenizer.json and tokenizer_config.json

The output is committed; rerunning this script gives the same files.
"""
import json
import os
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>"]


def corpus(n=5000, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        yield f"{a}+{b}={a + b}"


def main():
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    tok.decoder = decoders.Fuse()
    # only single characters: the vocabulary is the alphabet of the corpus
    trainer = trainers.BpeTrainer(vocab_size=len(SPECIAL) + 12, special_tokens=SPECIAL,
                                  initial_alphabet=list("0123456789+="), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tok.token_to_id("<|bos|>"))])
    tok.save(os.path.join(HERE, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
        "model_max_length": 64, "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(HERE, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    enc = tok.encode("37+48=85")
    print("vocab", tok.get_vocab_size(), "tokens", enc.tokens, "ids", enc.ids, "decoded", tok.decode(enc.ids))


if __name__ == "__main__":
    main()
