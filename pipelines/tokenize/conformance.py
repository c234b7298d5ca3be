"""The conformance set: texts a fast tokenizer backend must encode exactly like the reference library.

A worker runs it once per process and tokenizer before it trusts a fast backend
(:func:`pipelines.tokenize.fast_tokenizer.load_fast`). It aims at what tokenizer reimplementations get wrong:
pre-tokenizer regex corners (contractions in both cases, digit runs, whitespace runs before words and at
the end, ``\\r\\n``, Unicode letter/number/mark classes), byte-level BPE on multi-byte characters, special
tokens written as plain text, and the cutting of long documents into pieces.

It holds real snippets in many scripts (``conformance_snippets.jsonl``, shipped with the package) and
deterministic generated texts (fixed seeds, no dependence on the machine): about 1 MB of text, most of
it in six documents longer than ``PIECE_CHARS``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from typing import Sequence

from reader.storage import files

from pipelines.tokenize.tokenizer import MAX_PIECE_CHARS, PIECE_CHARS

import numpy as np

SNIPPETS_FILE = os.path.join(os.path.dirname(__file__), "conformance_snippets.jsonl")

# Special-token strings of common tokenizers; each tokenizer's own are added by the caller.
COMMON_SPECIALS = ("<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|endofprompt|>",
                   "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>",
                   "<|start_header_id|>", "<s>", "</s>", "<unk>", "<pad>", "<mask>", "[CLS]", "[SEP]", "[MASK]")

# Character pools by class: (first, last) code point ranges, inclusive.
SCRIPTS = {
    "cjk": [(0x4E00, 0x9FFF)], "cjk_ext_b": [(0x20000, 0x2A6DF)], "hiragana": [(0x3041, 0x3096)],
    "katakana": [(0x30A1, 0x30FA)], "hangul": [(0xAC00, 0xD7A3)], "hangul_jamo": [(0x1100, 0x11FF)],
    "arabic": [(0x0621, 0x064A), (0x064B, 0x0652), (0x0660, 0x0669)], "hebrew": [(0x05D0, 0x05EA), (0x05B0, 0x05BD)],
    "devanagari": [(0x0905, 0x0939), (0x093E, 0x094D), (0x0966, 0x096F)],
    "bengali": [(0x0985, 0x09B9), (0x09BE, 0x09CD)],
    "tamil": [(0x0B85, 0x0BB9), (0x0BBE, 0x0BCD)], "thai": [(0x0E01, 0x0E3A), (0x0E40, 0x0E4E), (0x0E50, 0x0E59)],
    "cyrillic": [(0x0410, 0x044F), (0x0400, 0x040F)], "greek": [(0x0391, 0x03C9), (0x1F00, 0x1FBC)],
    "latin_ext": [(0x00C0, 0x024F), (0x1E00, 0x1EFF)], "armenian": [(0x0531, 0x0556), (0x0561, 0x0587)],
    "georgian": [(0x10D0, 0x10FA)], "ethiopic": [(0x1200, 0x135A)], "fullwidth": [(0xFF01, 0xFF5E)],
    "math_alnum": [(0x1D400, 0x1D7FF)], "symbols": [(0x2190, 0x23FF), (0x2500, 0x257F), (0x2600, 0x26FF)],
}
COMBINING = [chr(c) for c in range(0x0300, 0x0370)] + ["\u0483", "\u0591", "\u05BF", "\u0610", "\u093C",
                                                        "\u0E31", "\u20D7", "\u3099", "\uFE20"]
DIGITS = ["0123456789", "٠١٢٣٤٥٦٧٨٩", "۰۱۲۳۴۵۶۷۸۹", "०१२३४५६७८९", "০১২৩৪৫৬৭৮৯", "๐๑๒๓๔๕๖๗๘๙", "０１２３４５６７８９",
          "²³¹⁰⁴", "½¼¾⅓", "ⅠⅡⅢⅣⅫ", "①②③", "𝟎𝟏𝟐𝟑"]
SPACES = [" ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u2000", "\u2003", "\u2009", "\u202f", "\u205f", "\u3000",
          "\u2028", "\u2029", "\u0085", "\x0b", "\x0c", "\u1680", "\u180e", "\u200b"]
MARKS = ["\u200e", "\u200f", "\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068",
         "\u2069", "\u061c", "\u200c", "\u200d", "\ufeff", "\u00ad", "\u034f", "\ufe0f", "\ufe0e"]
EMOJI = ["👍", "👍🏻", "👍🏽", "👍🏿", "👨‍👩‍👧‍👦", "👩🏾‍🤝‍👩🏼", "🧑‍💻", "🏳️‍🌈", "🏴‍☠️", "🇯🇵", "🇫🇷", "🏴󠁧󠁢󠁳󠁣󠁴󠁿",
         "1️⃣", "#️⃣", "❤️", "❤", "☺︎", "🙂", "🎉", "😀😃😄", "🤷‍♀️", "👁️‍🗨️", "🫶🏼"]
CONTRACTIONS = ["'s", "'S", "'t", "'T", "'re", "'RE", "'Re", "'rE", "'ve", "'VE", "'Ve", "'m", "'M", "'ll",
                "'LL", "'Ll", "'lL", "'d", "'D", "’s", "’ll", "'", "''", "'x"]
WORDS = ["the", "of", "and", "token", "I", "you", "WE", "They", "don", "can", "won", "it", "O", "a", "Rock",
         "naïve", "café", "über", "Straße", "東京", "서울", "Москва", "Αθήνα", "القاهرة", "मुंबई", "กรุงเทพ"]
PUNCT = list(".,;:!?-_()[]{}<>/\\|@#$%^&*+=~`\"'") + ["...", "—", "–", "«", "»", "“", "”", "‘", "’", "。", "、",
                                                      "！", "？", "،", "؟", "।", "॥", "¿", "¡"]


@dataclasses.dataclass(frozen=True)
class Difference:
    """The first conformance text on which two encoders disagree."""

    label: str
    text: str
    position: int  # first differing token index
    fast: int | None  # token there (None: the sequence ended)
    reference: int | None

    def describe(self) -> str:
        excerpt = self.text if len(self.text) <= 120 else self.text[:117] + "..."
        return (f"conformance text {self.label!r} ({len(self.text)} characters, {excerpt!r}): first difference "
                f"at token {self.position} (fast {self.fast}, reference {self.reference})")


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    """Index of the first position where two token arrays differ (or one ends), None if equal."""
    n = min(len(a), len(b))
    ne = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    if len(ne):
        return int(ne[0])
    return None if len(a) == len(b) else n


def _pool(rng: random.Random, ranges) -> str:
    lo, hi = rng.choice(ranges)
    return chr(rng.randint(lo, hi))


def _word(rng: random.Random, script: str, n: int) -> str:
    return "".join(_pool(rng, SCRIPTS[script]) for _ in range(n))


def _random_text(rng: random.Random, n_parts: int) -> str:
    """A mixture of every class above, glued with random separators."""
    parts = []
    for _ in range(n_parts):
        k = rng.random()
        if k < 0.3:
            parts.append(_word(rng, rng.choice(sorted(SCRIPTS)), rng.randint(1, 8)))
        elif k < 0.4:
            parts.append(rng.choice(WORDS) + rng.choice(CONTRACTIONS))
        elif k < 0.5:
            d = rng.choice(DIGITS)
            parts.append("".join(rng.choice(d) for _ in range(rng.randint(1, 12))))
        elif k < 0.6:
            parts.append(rng.choice(EMOJI) * rng.randint(1, 3))
        elif k < 0.67:
            parts.append(rng.choice(WORDS) + "".join(rng.choice(COMBINING) for _ in range(rng.randint(1, 4))))
        elif k < 0.74:
            parts.append(rng.choice(MARKS))
        elif k < 0.84:
            parts.append("".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 4))))
        elif k < 0.9:
            parts.append(chr(rng.choice([rng.randint(0x20, 0xD7FF), rng.randint(0xE000, 0xFFFD),
                                         rng.randint(0x10000, 0x10FFFF)])))
        else:
            parts.append(rng.choice(WORDS))
        parts.append(rng.choice(SPACES) * rng.choice([1, 1, 1, 2, 3, 7]) if rng.random() < 0.7 else "")
    return "".join(parts)


def _snippets() -> list[tuple[str, str]]:
    text = files.read_local(SNIPPETS_FILE).decode("utf-8")
    return [(f"snippet:{d['label']}", d["text"]) for d in map(json.loads, filter(None, text.split("\n")))]


def _special_texts(s: str) -> list[tuple[str, str]]:
    """A special-token string in the contexts a backend could treat differently from the reference: alone, at
    the start and end, between spaces, tabs and newlines, glued to letters, digits, CJK, emoji, an apostrophe
    and itself, cut short, and nested in its own brackets."""
    return [(f"special:{s}", f"a {s} b{s}c\n{s}{s} {s[:-1]} {s[1:]}"),
            (f"special-alone:{s}", s),
            (f"special-contexts:{s}", f"{s}x\n\n{s}  \t{s}'s 1{s}2 東{s}京 👍{s}\r\n {s}\u00a0{s[0]}{s}{s[-1]} "
                                      f"{s[:len(s) // 2]} {s[len(s) // 2:]} it'{s}s  {s}")]


def _focused() -> list[tuple[str, str]]:
    """Short texts, one corner each."""
    out = []
    for c in CONTRACTIONS:
        out.append((f"contraction:{c}", f"it{c} IT{c} {c} x{c}y {c}{c}"))
    out.append(("mongolian-vowel-separator", "x\u180e\u094d\u0937 \u180ex '\u180eS"))  # whitespace before Unicode 6.3
    out.append(("contractions:caps", "I'M HERE, YOU'LL SEE, WE'VE DONE, HE'D GO, SHE'S, THEY'RE, IT'S, DON'T"))
    for d in DIGITS:
        out.append((f"digits:{d[:3]}", " ".join(d * k for k in (1, 2, 3)) + f" a{d}b {d[:1]}"))
    for n in (1, 2, 3, 4, 5, 6, 7, 10, 16, 31, 64):
        out.append((f"digit-run:{n}", "x" + "7" * n + " " + "1234567890"[:min(n, 10)] * (n // 10 + 1) + "."))
    for name, sp in (("space", " "), ("tab", "\t"), ("newline", "\n"), ("crlf", "\r\n"), ("cr", "\r"),
                     ("nbsp", "\u00a0"), ("ideographic", "\u3000"), ("mixed", " \t"), ("nl-space", "\n ")):
        for n in (1, 2, 3, 8, 33):
            out.append((f"whitespace:{name}x{n}", f"a{sp * n}b{sp * n}!{sp * n}"))
            out.append((f"whitespace-end:{name}x{n}", f"word{sp * n}"))
            out.append((f"whitespace-start:{name}x{n}", f"{sp * n}word"))
    for s in COMMON_SPECIALS:
        out.extend(_special_texts(s))
    out.append(("specials:adjacent", "".join(COMMON_SPECIALS) + " " + "\n".join(COMMON_SPECIALS)))
    for e in EMOJI:
        out.append((f"emoji:{e}", f"{e}{e} x{e} {e}!"))
    for m in MARKS:
        out.append((f"mark:U+{ord(m):04X}", f"abc{m}def {m}ghi{m} جمل{m}ة 123{m}456"))
    for name in sorted(SCRIPTS):
        rng = random.Random(f"script:{name}")
        words = [_word(rng, name, rng.randint(1, 9)) for _ in range(40)]
        out.append((f"script:{name}", " ".join(words) + "\n" + "".join(words[:10])))
    rng = random.Random("combining")
    out.append(("combining-marks", " ".join(rng.choice(WORDS[:10]) + "".join(
        rng.choice(COMBINING) for _ in range(rng.randint(1, 6))) for _ in range(60))))
    return out


def _fuzz(n: int = 400) -> list[tuple[str, str]]:
    rng = random.Random(20240611)
    return [(f"fuzz:{i}", _random_text(rng, rng.randint(5, 60))) for i in range(n)]


def _long() -> list[tuple[str, str]]:
    """Documents longer than PIECE_CHARS: with safe cuts, and degenerate ones without any."""
    rng = random.Random("long")
    prose = " ".join(t for _, t in _snippets())
    paragraphs = []
    size = 0
    while size < PIECE_CHARS * 2 + 5000:
        p = prose[rng.randrange(len(prose) // 2):][: rng.randint(200, 3000)]
        p += rng.choice(["\n\n", "\n", "\r\n", "\n    ", "\t", " "]) + _random_text(rng, 20)
        paragraphs.append(p)
        size += len(p)
    n = MAX_PIECE_CHARS + 1000
    return [
        ("long:prose", "".join(paragraphs)),
        ("long:letters", "a" * n),
        ("long:spaces", " " * n + "x"),
        ("long:newlines-then-word", "\n" * n + "end"),
        ("long:cjk", "東京都庁" * (n // 4)),
        ("long:word-space-at-limit", "x" * (PIECE_CHARS - 1) + " y" + "z" * PIECE_CHARS),
    ]


def conformance_texts(specials: Sequence[str] = ()) -> list[tuple[str, str]]:
    """Every ``(label, text)`` of the set; ``specials`` are the tokenizer's own special-token strings."""
    out = _snippets() + _focused()
    for s in specials:
        if s not in COMMON_SPECIALS:
            out.extend(_special_texts(s))
    return out + _fuzz() + _long()


def check(fast, reference, texts: Sequence[tuple[str, str]]) -> Difference | None:
    """The first text two encoders (``encode_many``) tokenize differently, or None.

    The texts go through each encoder's ``encode_many`` in batches, as a build would send them.
    """
    labels = [label for label, _ in texts]
    strings = [text for _, text in texts]
    for i in range(0, len(strings), 256):
        a = fast.encode_many(strings[i:i + 256])
        b = reference.encode_many(strings[i:i + 256])
        for j, (x, y) in enumerate(zip(a, b)):
            pos = first_difference(x, y)
            if pos is not None:
                k = i + j
                return Difference(labels[k], strings[k], pos,
                                  int(x[pos]) if pos < len(x) else None, int(y[pos]) if pos < len(y) else None)
    return None
