"""``python -m reader batches --show``: the rows decoded in the terminal, document starts, padding and colours."""

import os

import numpy as np
import pytest

from reader import ReadOptions, Reader
from reader.cli import report as report_cli
from reader.cli.main import main
from reader.tokenizers import tokenizer_lib

import cachegen

TEXTS = ["Hello world.", "A cache of chunks.", "Short"]


@pytest.fixture(scope="module")
def tok():
    return tokenizer_lib.resolve("tiktoken:cl100k_base")


@pytest.fixture
def tiny(tmp_path, tok):
    """Three documents of cl100k ids, each ending with EOS, in one chunk."""
    docs = [tok.encode(t) + [tok.eos.id] for t in TEXTS]
    root = str(tmp_path / "c")
    cachegen.write_synthetic_cache(root, [docs], tokenizer=tok.identity())
    return root, docs


def test_packed_rows_decoded_with_document_starts(tiny, tok, capsys):
    root, docs = tiny
    assert main(["batches", root, "--seq_len", "6", "--batch_size", "2", "--ideal_readers", "1", "--show"]) == 0
    flat = [t for d in docs for t in d]
    starts = set(np.cumsum([0] + [len(d) for d in docs]).tolist())
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "batch 0 row 0 (example 0, epoch 0)" and out[2] == "batch 0 row 1 (example 1, epoch 0)"
    for row, (lo, hi) in enumerate([(0, 6), (6, 12)]):  # each row: its documents' pieces, | where one starts
        cuts = [lo] + [c for c in sorted(starts) if lo < c < hi] + [hi]
        want = "" if lo in starts else "…"
        want += "|".join(tok.decode(flat[a:b]) for a, b in zip(cuts, cuts[1:]))
        assert out[2 * row + 1] == want
    assert out[1].startswith("Hello world.<|endoftext|>|A") and out[3].startswith("…") and "|" in out[3]


def test_unpacked_rows_show_padding(tiny, tok, capsys):
    root, docs = tiny
    assert main(["batches", root, "--seq_len", "8", "--batch_size", "3", "--ideal_readers", "1", "--unpacked",
                 "--show"]) == 0
    out = capsys.readouterr().out.splitlines()
    for i, d in enumerate(docs):  # one document per row, padded with · to 8 tokens
        assert out[2 * i] == f"batch 0 row {i} (example {i}, epoch 0)"
        assert out[2 * i + 1] == tok.decode(d) + "·" * (8 - len(d))


def test_show_and_out_together_and_neither(tiny, tmp_path, capsys):
    root, _ = tiny
    npz = str(tmp_path / "b.npz")
    assert main(["batches", root, "--seq_len", "6", "--batch_size", "2", "--ideal_readers", "1", "--show",
                 "--out", npz]) == 0
    out = capsys.readouterr().out
    assert out.startswith("batch 0 row 0") and f"wrote {npz}" in out and os.path.exists(npz)
    assert main(["batches", root, "--seq_len", "6", "--batch_size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: give --out FILE.npz (the arrays), --show (the rows decoded) or both"


def test_colours_on_a_terminal(tiny, tok):
    root, docs = tiny
    master, slave = os.openpty()  # a real terminal: colours on
    chunks = []
    try:
        with Reader(root, ReadOptions(seq_len=6, batch_size=2, ideal_readers=1)) as r, \
                open(slave, "w", closefd=False) as tty:
            report_cli.show_rows(r, r.iter_batches(0, 1), None, out=tty)
        os.close(slave)
        slave = None
        while True:  # one read may return only the first line: read until the closed terminal says EIO
            try:
                data = os.read(master, 1 << 16)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        if slave is not None:
            os.close(slave)
    got = b"".join(chunks).decode()
    assert "\x1b[1mbatch 0 row 0 (example 0, epoch 0)\x1b[0m" in got
    assert "\x1b[36m" + tok.decode(docs[0]) + "\x1b[0m|\x1b[33m" in got  # one colour per document


def test_ids_when_the_cache_records_no_usable_tokenizer(tmp_path, capsys):
    root = str(tmp_path / "syn")
    cachegen.write_synthetic_cache(root, [[np.array([5, 6, 7])]])
    assert main(["batches", root, "--seq_len", "3", "--batch_size", "1", "--ideal_readers", "1", "--show"]) == 0
    got = capsys.readouterr()
    assert got.out.splitlines()[1] == "<5 6 7>" and got.err.startswith("note: showing token ids: ")
