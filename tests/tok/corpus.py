"""The texts the tokenizer reference test encodes (tests/tok/ref_tokenizers.py)
and the fixture tokenizers are trained on (tests/tok/make_fixtures.py)."""
import unicodedata

ENGLISH = (
    "The quick brown fox jumps over the lazy dog. It's a well-known pangram; we'll use it, "
    "they've said, and I'd agree. Reinforcement learning from human feedback (RLHF) trains a "
    "policy against a reward model, and GRPO drops the critic by normalising rewards in a group.\n"
    "Mr. O'Neil paid $1,234.56 on 2024-03-15 at 10:45pm -- that's 15% more than last year's 1073 dollars!\n"
)
RUSSIAN = (
    "Съешь же ещё этих мягких французских булок, да выпей чаю. Обучение с подкреплением "
    "использует награду, чтобы улучшить политику модели. Москва — столица России.\n"
)
CHINESE = (
    "我能吞下玻璃而不伤身体。强化学习通过奖励信号来优化策略模型，大语言模型的后训练越来越重要。"
    "今天天气很好，我们去公园散步吧！\n"
)
CODE = (
    "def fib(n: int) -> int:\n"
    "    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    "    a, b = 0, 1\n"
    "    for _ in range(n):\n"
    "        a, b = b, a + b\n"
    "    return a\n\n"
    "int main(void) {\n\tprintf(\"%d\\n\", fib(10));\n\treturn 0;\n}\n"
    "local t = { x = 1, y = 2 } -- Lua\r\n"
)
EMOJI = "Emoji: 😀😃🎉 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ and ✨sparkles✨.\n"
WHITESPACE = ("spaces:      six\n\n\n\nnewlines\t\t\ttabs   \u00a0nbsp \u3000ideographic   \n   \n  trailing   "
              "\x0b\x0c\x1c\x1f\x85 a\u1680\u180e\u2000\u200b\u2028\u2029\u202f\u205f\ufeff b\r\n")
DIGITS = "digits 1 12 123 1234 12345 123456789012345 3.14159 0x1F 1e-9 ١٢٣ ½ ²\n"
MIXED = "Mixing Latin, Кириллица and 汉字 in one line: naïve café façade résumé Ægir Øresund straße İstanbul ſ K.\n"

CORPUS = [ENGLISH, RUSSIAN, CHINESE, CODE, EMOJI, WHITESPACE, DIGITS, MIXED]


def cases(specials):
    """(name, text) pairs: each corpus text, edge cases, and texts with the
    tokenizer's special tokens inside them."""
    out = [("text%d" % i, t) for i, t in enumerate(CORPUS)]
    out += [
        ("empty", ""),
        ("space", " "),
        ("spaces", "     "),
        ("newline", "\n"),
        ("one_char", "a"),
        ("all", "".join(CORPUS)),
        ("long_space_run", "x" + " " * 300 + "y" + "\n" * 50 + "z"),
        ("long_digits", "7" * 500),
        ("long_word", "abc" * 400),
        ("apostrophes", "I'M YOU'RE he's they'LL we'VE 'd 's"),
        # decomposed text and stacked marks (the NFC normalizer composes and reorders them)
        ("nfd", unicodedata.normalize("NFD", "Tiếng Việt có dấu, naïve café, Ωμέγα, 한국어 텍스트, Å Ǆ")),
        ("marks", "q\u0323\u0307 s\u0307\u0323 e\u0301\u0301 \u0301x \u212b \u1100\u1161\u11a8 \u0f73 \u304b\u3099"),
    ]
    for k, s in enumerate(specials[:4]):
        out += [
            ("special%d_alone" % k, s),
            ("special%d_inside" % k, "Hello%sworld %s again\n%s" % (s, s, s)),
            ("special%d_spaced" % k, "before  %s  after" % s),
            ("special%d_twice" % k, s + s),
        ]
    if specials:
        out.append(("specials_only", "".join(specials[:4])))
    return out


# pieces that random texts are made of: every kind of character class the
# pre-tokenizer regexes care about, marks, joiners, rare spaces, and
# fragments of the fixtures' added tokens
PIECES = (list("abcXYZ019 _-.,'!?\"()[]{}<>|/\\@#$%^&*+=~`;:\t\n\r") + [" "] * 8 + ["  ", "\n\n", "'s", "'LL", "'ve"]
          + list("éßçñøåÆÄЖжщЁ汉字中文かなカナ한국ŉǅǈ١٢٣½²Ⅻⅻ")
          + ["\u0301", "\u0308", "\u200d", "\u200b", "\ufeff", "\u00a0", "\u3000", "\u2028", "\u180e", "\u1680",
             "\u0085", "\x0b", "\x1f", "😀", "👍🏽", "🇫🇷", "❤️", "✨", "𝔸", "𝟘"]
          + ["<|endoftext|>", "<|im_start|>", "<s>", "</s>", "<unk>", "<tool>", "[[L]]", "{R}", "▁", "<0x41>",
             "<|eot_id|>", "<|user|>", "fox jumps", "<|", "|>"])


def random_texts(seed, count, max_pieces=40):
    import random
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, max_pieces))) for _ in range(count)]


def invalid_utf8():
    """Byte strings that are not valid UTF-8 (the test compares with the
    Python str that errors='replace' makes of them)."""
    return [
        b"abc\xffdef",
        b"\xe4\xbd\xa0\xe5\xa5",  # a truncated 3-byte character
        b"caf\xc3",
        b"\xed\xa0\x80 surrogate",
        b"\xf0\x9f\x98 emoji cut \x80\x80",
        b"\xc0\xafover-long",
    ]
