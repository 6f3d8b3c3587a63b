#!/usr/bin/env python3
"""Train the character tokenizers of the tiny examples.

examples/default/tokenizer.json: the default run (examples/default.lua) learns 2-digit
addition, "37+48=" -> "85"; its alphabet is the digits, '+' and '='.
examples/agent/tokenizer.json: the agent examples (examples/agent_calculator.lua,
examples/agent_guess.lua) add '*' (products), '?' (a call to the calculator), '<' and '>'
(the number game's answers).

Each is a BPE trained with the Hugging Face `tokenizers` package on text of its task; the
pre-tokenizer splits every digit into its own token and the vocabulary is one token per
character of the alphabet plus three special tokens (<|pad|> 0, <|bos|> 1, <|eos|> 2): no merges.
Per-digit tokens let a small model learn column-wise arithmetic and copy numbers.

    /usr/bin/python3 examples/default/make_tokenizer.py   # rewrites both tokenizer.json and tokenizer_config.json

The output is committed; rerunning this script gives the same files.
"""
import json
import os
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>"]


def addition(n=5000, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        yield f"{a}+{b}={a + b}"


def agent(n=5000, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
        yield f"{a}*{b}={a}*{b}?{a * b}={a * b}"
        yield f"?{rng.randrange(1, 101)}<{rng.randrange(1, 101)}>"


def make(out_dir, alphabet, corpus, sample):
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    tok.decoder = decoders.Fuse()
    # only single characters: the vocabulary is the alphabet of the corpus
    trainer = trainers.BpeTrainer(vocab_size=len(SPECIAL) + len(alphabet), special_tokens=SPECIAL,
                                  initial_alphabet=list(alphabet), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tok.token_to_id("<|bos|>"))])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
        "model_max_length": 64, "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    enc = tok.encode(sample)
    print(out_dir, "vocab", tok.get_vocab_size(), "tokens", enc.tokens, "ids", enc.ids, "decoded", tok.decode(enc.ids))


def main():
    make(HERE, "0123456789+=", addition, "37+48=85")
    make(os.path.join(os.path.dirname(HERE), "agent"), "0123456789+*=?<>", agent, "347*812=347*812?281764=281764")


if __name__ == "__main__":
    main()
